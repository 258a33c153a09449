"""Serving one pipeline call in a worker: one request, or requests sharing one call (a batch), answered
each on its own. To the host's CPU rules the call is one run (engine/worker/priority.py): a long one steps
aside before each (shared) step while another engine runs a short one (ShortRuns); a short one tells the
others it runs."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import ShowcaseError
from engine.pipeline.batching import AllSet
from engine.pipeline.faults import Faults
from engine.protocol import Fault, GenerateRequest, GenerateResult, Progress, RequestFailed, Result
from engine.worker import logs
from engine.worker.priority import RunCost, ShortRuns, YieldToRequests, lower_this_thread_priority

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """One request's state in its worker, from its arrival (or a cancel that overtook it) to its answer."""

    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    received_at: float | None = None  # perf_counter when it arrived: its queue time starts there

    def queued_ms(self, now: float) -> float:
        return (now - self.received_at) * 1000 if self.received_at is not None else 0.0


@dataclass(frozen=True)
class CallRules:
    """The host's CPU rules a call follows (engine/worker/priority.py): the compile thread steps aside while
    it runs, its time teaches the expected cost (`run_cost`; None: no ordering here), and its short-run slot
    (`short_runs`; None: none)."""

    compile_yield: YieldToRequests
    run_cost: RunCost | None = None
    short_runs: ShortRuns | None = None


class ServeCall:
    """One call's requests served by `executor` (engine/pipeline/executor.py): a request alone, or a batch
    whose outcomes are each one's GenerateResult, the exception it failed with, or None when it was already
    answered through on_leave or on_result. Messages go to `send`; `faults` are the engine's test hooks;
    `rules` the CPU rules; `report_lora()` runs before each result is sent (the LoRA slot it changed goes
    first); `long`: the call runs niced, as a long one."""

    def __init__(self, group: list[GenerateRequest], records: list[RequestRecord], send: Callable, faults: Faults,
                 rules: CallRules, report_lora: Callable[[], None], executor, long: bool = False):
        self.group, self.executor = group, executor
        self.send, self.faults, self.rules, self.report_lora = send, faults, rules, report_lora
        self.cancels = [record.cancel for record in records]
        self.long = long
        self.crash = faults.take(Fault.CRASH)
        short_runs = rules.short_runs
        self.short_runs = short_runs if short_runs is not None and not long else None  # a short run announces
        self.step_aside = short_runs.step_aside if short_runs is not None and long else None
        self.everyone = AllSet(self.cancels)
        self.stepped = 0  # the last shared step this run stepped aside at
        start = time.perf_counter()
        self.queued_ms = {r.request_id: record.queued_ms(start) for r, record in zip(group, records, strict=True)}
        self.answered: list[GenerateResult] = []

    def serve(self) -> None:
        """The call, with the compile thread stepping aside and the short-run slot held; then each outcome."""
        logged_as = logs.REQUEST_ID.set(",".join(r.request_id for r in self.group))  # this thread's log lines
        log.debug("serving %d request(s) at %s", len(self.group), self.group[0].bucket)
        try:
            with self.rules.compile_yield.request(), self._short_run():
                if self.step_aside is not None:
                    self.step_aside(self.everyone)  # before its first step too
                if len(self.group) > 1:
                    outcomes = self.executor.generate_batch(self.group, on_step=self.on_step, cancels=self.cancels,
                                                            on_leave=self.on_leave, on_result=self.on_result)
                else:
                    try:
                        outcomes = [self.executor.generate(self.group[0], on_step=self.on_step, cancel=self.cancels[0])]
                    except Exception as exc:  # noqa: BLE001 - its outcome
                        outcomes = [exc]
            self._deliver(outcomes)
            self._record_cost()
        except Exception as exc:  # never let one request or batch kill the worker
            log.exception("serving %s failed", ", ".join(r.request_id for r in self.group))
            self._fail_unanswered(exc)
        finally:
            logs.REQUEST_ID.reset(logged_as)

    # -- the phases -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _short_run(self):
        """A short call holds this engine's short-run slot while it runs (long ones elsewhere step aside)."""
        if self.short_runs is None:
            yield
            return
        self.short_runs.set_running(True)
        try:
            yield
        finally:
            self.short_runs.set_running(False)

    def _deliver(self, outcomes: list) -> None:
        """Each outcome not answered yet: its result, or its failure."""
        for index, (request, outcome) in enumerate(zip(self.group, outcomes, strict=True)):
            if outcome is None:
                continue
            if isinstance(outcome, GenerateResult):
                self.on_result(index, outcome)
            elif isinstance(outcome, ShowcaseError):
                self.send(RequestFailed(request.request_id, outcome))
            else:
                log.error("request %s failed", request.request_id, exc_info=outcome)
                self.send(RequestFailed(request.request_id, ShowcaseError(f"{type(outcome).__name__}: {outcome}")))

    def _record_cost(self) -> None:
        """The call's time, for the next requests' expected cost: its last result came at its end."""
        run_cost = self.rules.run_cost
        if run_cost is None or not self.answered:
            return
        last = max(self.answered, key=lambda result: result.timings.total_ms)
        run_cost.record(run_variant(last.bucket.mode, last.warm, last.batch_size), last.bucket.size, last.steps,
                        last.timings.total_ms)

    def _fail_unanswered(self, exc: Exception) -> None:
        done = {result.request_id for result in self.answered}
        for request in self.group:
            if request.request_id not in done:
                self.send(RequestFailed(request.request_id, ShowcaseError(f"{type(exc).__name__}: {exc}")))

    # -- what the runner calls back ---------------------------------------------------------------
    def on_step(self, progress) -> None:
        self.send(Progress(progress))
        if self.crash:
            self.faults.crash()  # armed by a test: the worker dies mid-request
        if self.step_aside is not None and self.stepped < progress.step < progress.total:
            self.stepped = progress.step  # once per shared step
            self.step_aside(self.everyone)

    def on_leave(self, index: int, error: ShowcaseError) -> None:
        self.send(RequestFailed(self.group[index].request_id, error))

    def on_result(self, index: int, result: GenerateResult) -> None:
        self.answered.append(result)
        self.report_lora()
        timings = dataclasses.replace(result.timings, queued_ms=self.queued_ms[self.group[index].request_id])
        self.send(Result(dataclasses.replace(result, timings=timings)))


def run_variant(mode, warm: bool, batch: int = 1) -> str:
    """RunCost's key for a call of `batch` requests: what computes it (its mode's compiled graph, or eager:
    eager mode, or not warm yet), and the batch size beyond one."""
    variant = str(mode) if mode.compiled and warm else "eager"
    return variant if batch <= 1 else f"{variant}/b{batch}"


def serve_niced(extra: int, serve, name: str) -> None:
    """serve() on a fresh thread `extra` nice steps lower, waited for (a thread cannot raise its own priority
    again without privileges; a new thread starts at this one's)."""

    def serve_lowered():
        lower_this_thread_priority(extra)
        serve()

    thread = threading.Thread(target=serve_lowered, name=f"{name}-nice{extra}", daemon=True)
    thread.start()
    thread.join()
