"""A batch run: requests that can share a denoiser call (engine/pipeline/batching.py's key) as one pipeline
call of a runner (engine/pipeline/runner.py), each member answered on its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.errors import Cancelled
from engine.pipeline import batching
from engine.pipeline.board import describe_failure
from engine.pipeline.callrun import CallRun, RequestPrep, generate_here
from engine.pipeline.calls import CallOutcome
from engine.protocol import BucketKey, GenerateRequest, GenerateResult, Mode, StepProgress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchHooks:
    """What the caller of a batch hears (see BatchRun): each step, a member's leaving, a member's result, and
    each member's cancel (None: none can be cancelled)."""

    on_step: Callable | None = None
    cancels: list[threading.Event] | None = None
    on_leave: Callable | None = None
    on_result: Callable | None = None


class BatchRun:
    """One `generate_batch` call of an engine's executor (engine/pipeline/executor.py). Its outcomes: per request, its GenerateResult, the exception
    it failed with, or None when it already left through `on_leave(index, Cancelled)` or was answered through
    `on_result(index, result)`. A member whose cancel is set leaves at the next step end, at once, and the
    call goes on for the others (its image is dropped); the call stops when every member has left. Where the
    device decodes a batch's images apart, each member's result goes to `on_result` as soon as its image is
    decoded. `on_step(progress)` gets each member's StepProgress (its own request id; the step is shared:
    batch_size). A member that cannot run (mode, step cache, size) fails alone first; if the shared call
    fails, each member not answered yet runs again alone, so each gets its own outcome.

    The engine's parts it runs (engine/pipeline/callrun.py): `prep` checks each member, `calls` makes the
    shared call (or a member's alone), makes a member's GenerateResult and counts what was served on its board."""

    def __init__(self, requests: list[GenerateRequest], hooks: BatchHooks, prep: RequestPrep, calls: CallRun):
        self.prep, self.calls = prep, calls
        self.requests = requests
        self.on_step, self.on_leave, self.on_result = hooks.on_step, hooks.on_leave, hooks.on_result
        self.cancels = hooks.cancels or [threading.Event() for _ in requests]
        self.outcomes: list = [None] * len(requests)
        self.answered: set[int] = set()  # indexes answered through on_result
        # The shared call's members (the requests that passed their checks), set by `run`
        self.indexes: list[int] = []
        self.members: list[GenerateRequest] = []
        self.notices: list[list[str]] = []
        self.left: list[bool] = []
        self.call_notices: list[str] = []  # what the shared call itself says (eager fallback, step cache, aot)

    def run(self) -> list:
        self._prepare_each()
        if len(self.members) < 2:
            for i in self.indexes:
                self.outcomes[i] = self._alone(i)
            return self.outcomes
        try:
            for i, result in zip(self.indexes, self._shared_call(), strict=True):
                self.outcomes[i] = result
        except Cancelled:
            pass  # every member left (each was told)
        except Exception as exc:  # noqa: BLE001 - the shared call failed: each member alone
            log.warning("a batch of %d at %s failed (%s); its requests run alone", len(self.members),
                        self.members[0].bucket, describe_failure(exc, 200))
            self._each_alone()
        return self.outcomes

    def _prepare_each(self) -> None:
        for i, request in enumerate(self.requests):
            try:
                prepared, notices = self.prep.prepare(request)
            except Exception as exc:  # noqa: BLE001 - its own outcome
                self.outcomes[i] = exc
                continue
            self.indexes.append(i)
            self.members.append(prepared)
            self.notices.append(notices)
        self.left = [False] * len(self.members)

    def _alone(self, i: int):
        try:
            return generate_here(self.prep, self.calls, self.requests[i], on_step=self.on_step, cancel=self.cancels[i])
        except Exception as exc:  # noqa: BLE001 - its own outcome
            return exc

    def _each_alone(self) -> None:
        for i in self.indexes:
            if i in self.answered:
                continue
            if not self.cancels[i].is_set():
                self.outcomes[i] = self._alone(i)
            elif self.outcomes[i] is None and self.on_leave is not None:
                self.on_leave(i, Cancelled(f"request {self.requests[i].request_id} cancelled"))

    # -- the shared call --------------------------------------------------------------------------
    def _shared_call(self) -> list:
        lead, k = self.members[0], len(self.members)
        bucket = lead.bucket.batched(k)
        everyone = batching.AllSet([self.cancels[i] for i in self.indexes])
        run = self.calls.run_call(bucket, lead, self.call_notices, self._member_steps, everyone, members=self.members,
                                  on_image=self._image_ready if self.on_result is not None else None)
        if run.cancelled_at is not None:
            raise Cancelled(f"every request of a batch of {k} cancelled after step {run.cancelled_at}")
        results = [None if self.left[j] or self.indexes[j] in self.answered else self._result(j, image, run)
                   for j, image in enumerate(run.images)]
        # Counted where it ran: an eager batch (eager mode, or a batch size not warm yet) on the eager row
        ran = bucket if not run.eager_fallback else BucketKey(Mode.EAGER, bucket.size, k)
        answered = sum(self.indexes[j] in self.answered for j in range(k))
        self.calls.board.served(ran, requests=sum(r is not None for r in results) + answered)
        return results

    def _result(self, j: int, image, run: CallOutcome) -> GenerateResult:
        return self.calls.result(self.members[j], image, run, self.notices[j] + self.call_notices,
                                 batch_size=len(self.members))

    def _member_left(self, j: int, step: int) -> bool:
        """Whether member j has left; one whose cancel is set leaves now (told through on_leave)."""
        i = self.indexes[j]
        if not self.left[j] and self.cancels[i].is_set():
            self.left[j] = True
            if self.on_leave is not None:
                member = self.members[j]
                self.on_leave(i, Cancelled(
                    f"request {member.request_id} cancelled after step {step} of {member.steps} "
                    f"(the batch of {len(self.members)} it shared went on without it)"))
        return self.left[j]

    def _member_steps(self, progress: StepProgress) -> None:
        for j, member in enumerate(self.members):
            if not self._member_left(j, progress.step) and self.on_step is not None:
                own = progress.previews[j:j + 1] if progress.previews else ()  # the call's partial images, in order
                self.on_step(replace(progress, request_id=member.request_id, previews=own))

    def _image_ready(self, j: int, image, run_so_far: CallOutcome) -> None:
        # Its own result at once: the web server delivers it while the others decode.
        if not self._member_left(j, self.members[0].steps):
            self.answered.add(self.indexes[j])
            self.on_result(self.indexes[j], self._result(j, image, run_so_far))
