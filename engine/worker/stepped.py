"""A worker serving requests a denoising step at a time (the engine's StepRunner, engine/pipeline/stepping.py).

A session starts with the requests of the call the worker took and lasts while any of its requests runs.
Before each step it admits what waits in the queue (requests a step function covers join the session; one
that runs whole is served as one pipeline call right there, every session request paused meanwhile), lets
requests whose cancel is set leave, and picks the step's batch:

- requests that can share a denoiser call (the same variant, bucket and token counts) form a group; the
  group whose requests stepped longest ago runs next, so requests at different buckets take steps in turn
  and a newcomer's first step comes at the next step boundary;
- within a group, up to the largest batch size the bucket may run at now (any in eager, the warm compiled
  ones otherwise, so a warm bucket never recompiles); requests that do not fit wait a step, the ones that
  stepped longest ago first.

A request not in the step is paused: its StepState (latents, scheduler, timesteps) stays as it is, and its
result says how long and for how many requests (StepState.pauses). Each finished request is decoded and
answered at once, and leaves; the others go on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import Cancelled, ShowcaseError
from engine.pipeline.batching import chunk
from engine.protocol import GenerateRequest, Progress, RequestFailed, Result, StepProgress
from engine.worker import logs

log = logging.getLogger(__name__)


@dataclass
class Member:
    """A request of the session: its state between steps, its record (cancel, arrival) and when it last stepped."""

    request: GenerateRequest
    record: object
    state: object
    queued_ms: float
    last_turn: int = -1


@dataclass(frozen=True)
class SessionParts:
    """What a step session uses of its worker loop (engine/worker/loop.py): the queue it takes from, the answers
    it sends, the records of its requests and the whole-call path for requests no step function covers."""

    max_queue: int
    take_waiting: Callable  # (room) -> the requests waiting at the engine
    serve_whole: Callable  # (group) -> serves them as one pipeline call
    send: Callable  # (message) -> to the web process
    record: Callable  # (request_id) -> its RequestRecord
    cancelled_before_start: Callable  # (request) -> answers it cancelled
    forget: Callable  # (request) -> drops its record
    batch_sizes_for: Callable  # (request) -> the batch sizes its bucket may run at
    report_lora: Callable  # () -> reports the adapter state
    compile_yield: object  # the warmer's CompileYield: compiles step aside while a session runs


class StepSession:
    """Requests served a step at a time by one engine's `stepper` (the engine's StepRunner)."""

    def __init__(self, parts: SessionParts, stepper):
        self.parts, self.stepper = parts, stepper
        self.members: list[Member] = []
        self.turn = 0

    def serve(self, group: list[GenerateRequest]) -> None:
        logged_as = logs.REQUEST_ID.set(",".join(r.request_id for r in group))
        try:
            with self.parts.compile_yield.request():
                for request in group:
                    self._join(request)
                while self.members:
                    self._admit()
                    self._leave_cancelled()
                    if self.members:
                        self._step(self._choose())
        finally:
            logs.REQUEST_ID.reset(logged_as)
            for member in self.members:  # what a failure left unanswered
                self._fail(member, ShowcaseError("the step-level session serving it stopped"))

    # -- who is in the session ----------------------------------------------------------------------
    def _join(self, request: GenerateRequest) -> None:
        record = self.parts.record(request.request_id)
        if record.cancel.is_set():
            self.parts.cancelled_before_start(request)
            return
        queued_ms = record.queued_ms(time.perf_counter())
        try:
            state = self.stepper.start(request)
        except Exception as exc:  # noqa: BLE001 - its own outcome
            self._answer_failure(request, exc)
            return
        self.members.append(Member(request, record, state, queued_ms))

    def _admit(self) -> None:
        """What waits joins at this step boundary; a request that runs whole is served now, as one call."""
        parts = self.parts
        room = max(0, parts.max_queue - len(self.members))
        for request in parts.take_waiting(room):
            if self.stepper.why_whole(request):
                now = time.perf_counter()
                for member in self.members:
                    member.state.pause(now)
                parts.serve_whole([request])
                for member in self.members:
                    member.state.waited_for([request.request_id])
            else:
                self._join(request)

    def _leave_cancelled(self) -> None:
        for member in [m for m in self.members if m.record.cancel.is_set()]:
            state = member.state
            self._fail(member, Cancelled(f"request {member.request.request_id} cancelled after step {state.index} "
                                         f"of {len(state.timesteps)}"))

    def _choose(self) -> list[Member]:
        """The next step's batch: the group that stepped longest ago, as many of it as one warm call takes."""
        groups: dict[tuple, list[Member]] = {}
        for member in self.members:
            groups.setdefault(member.state.key, []).append(member)
        group = min(groups.values(), key=lambda ms: min(m.last_turn for m in ms))
        group.sort(key=lambda m: m.last_turn)  # stable: arrival order among equals
        size = chunk(len(group), self.parts.batch_sizes_for(group[0].request))
        return group[:size]

    # -- one step ----------------------------------------------------------------------------------
    def _step(self, batch: list[Member]) -> None:
        now = time.perf_counter()
        stepping = {id(m) for m in batch}
        for member in self.members:
            (member.state.resume if id(member) in stepping else member.state.pause)(now)
        self.turn += 1
        for member in batch:
            member.last_turn = self.turn
        try:
            step_ms = self.stepper.step([m.state for m in batch])
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the others go on
            log.exception("a step of %s failed", ", ".join(m.request.request_id for m in batch))
            for member in batch:
                self._fail(member, exc)
            return
        ids = [m.request.request_id for m in batch]
        for member in self.members:
            if id(member) not in stepping:
                member.state.waited_for(ids)
        for member in batch:
            state = member.state
            self.parts.send(Progress(StepProgress(member.request.request_id, state.index, len(state.timesteps),
                                                 step_ms, batch_size=len(batch))))
        for member in batch:
            if member.state.done:
                self._finish(member)

    def _finish(self, member: Member) -> None:
        self.members.remove(member)
        try:
            result = self.stepper.finish(member.state)
        except Exception as exc:  # noqa: BLE001 - its own outcome
            self._answer_failure(member.request, exc)
            return
        self.parts.report_lora()
        timings = dataclasses.replace(result.timings, queued_ms=member.queued_ms)
        self.parts.send(Result(dataclasses.replace(result, timings=timings)))
        self.parts.forget(member.request)

    def _fail(self, member: Member, exc: Exception) -> None:
        if member in self.members:
            self.members.remove(member)
        self._answer_failure(member.request, exc)

    def _answer_failure(self, request: GenerateRequest, exc: Exception) -> None:
        error = exc if isinstance(exc, ShowcaseError) else ShowcaseError(f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, ShowcaseError):
            log.error("request %s failed", request.request_id, exc_info=exc)
        self.parts.send(RequestFailed(request.request_id, error))
        self.parts.forget(request)
