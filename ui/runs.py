"""Engine requests started by UI handlers: their sessions (for /cancel and the one-run rule), and what
their event streams (engine/serving/stream.py) show on a handler's progress bar while they run.

Two things stop a run, both between steps:
- Gradio closes the handler: a Cancel button (`cancels=[event]`), gradio_client's job.cancel(), a
  closed browser tab. Gradio can only close a sync generator at a yield, so a sync handler yields a
  heartbeat at least every HEARTBEAT_S (RunFeed says when), also while the engine loads or the request
  waits in its queue; an async handler can be cancelled at any await. Either way its event stream is
  closed, which cancels the engine request, or, not submitted yet, cancels it the moment it is submitted.
- the /cancel API: gradio_client callers name no event, so the session's runs are registered
  here; the engine request is cancelled and the handler returns the cancelled result. A /cancel can
  overtake the run it means (both wait in Gradio's queue; /cancel never waits long), or even reach
  the server before it (gradio_client's submit() sends its join from a thread): the session's last
  cancel time is kept, and a run whose event joined the queue before it, or at most CANCEL_AHEAD_S
  after a cancel that found nothing to stop, starts cancelled (such a cancel stops one run only).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.errors import EngineBusy
from engine.serving.stream import Idle, Run, Step
from ui import waiting

HEARTBEAT_S = 0.5  # about the longest a sync handler goes without a yield, i.e. without a chance to be closed
# A running step's progress bar is updated at most this often: each update is an event-stream message the
# web server sends and the page parses, and a batch of 8 at ~20 ms a step would send 50 a second each.
PROGRESS_EVERY_S = 0.1
CANCELS_KEPT = 1024  # sessions whose last /cancel time is kept (the oldest are forgotten first)
CANCEL_AHEAD_S = 2.0  # a cancel that found nothing still stops a run of its session joining this soon after


@dataclass(frozen=True)
class ProgressBar:
    """Where a request's steps go on a handler's gr.Progress: a single run fills the bar itself; one of several
    (compare) starts `offset` steps into a bar of `grand_total` and names itself with `desc_prefix`."""

    progress: Callable
    desc_prefix: str = ""
    offset: int = 0
    grand_total: int | None = None


class RunRegistry:
    """The runs in flight per session. `cancel(request_id)` cancels a sent engine request."""

    def __init__(self, cancel: Callable[[str], bool]):
        self._cancel = cancel
        self._sessions: dict[str, set[Run]] = {}
        # session -> (its last /cancel, whether that cancel found nothing to stop)
        self._cancelled_at: OrderedDict[str, tuple[float, bool]] = OrderedDict()
        self._lock = threading.Lock()

    @contextmanager
    def open(self, session: str, exclusive: bool = False, joined_at: float | None = None) -> Iterator[Run]:
        """A run registered under the caller's session for as long as its handler runs. `exclusive`
        (public mode): one running request per session, a second is refused at once. `joined_at`
        (time.monotonic() when its event joined the queue): a /cancel since then cancels it already."""
        run = Run(self._cancel)
        with self._lock:
            at, found_nothing = self._cancelled_at.get(session, (None, False))
            if joined_at is not None and at is not None:
                ahead = at < joined_at and found_nothing and joined_at - at <= CANCEL_AHEAD_S
                run.cancelled = at >= joined_at or ahead
                if run.cancelled and found_nothing:  # a cancel that found no run stops one run, not the next ones
                    self._cancelled_at.pop(session, None)
            if exclusive and not run.cancelled and self._sessions.get(session):
                raise EngineBusy("you already have a request running: wait for it to finish or press Cancel "
                                 "(one request per visitor at a time on this server)")
            self._sessions.setdefault(session, set()).add(run)
        try:
            yield run
        finally:
            with self._lock:
                runs = self._sessions.get(session, set())
                runs.discard(run)
                if not runs:
                    self._sessions.pop(session, None)

    def cancel(self, session: str) -> str:
        with self._lock:
            runs = list(self._sessions.get(session, ()))
            self._cancelled_at[session] = (time.monotonic(), not runs)
            self._cancelled_at.move_to_end(session)
            while len(self._cancelled_at) > CANCELS_KEPT:
                self._cancelled_at.popitem(last=False)
        if not runs:
            return "nothing to cancel"
        stopped = [request_id for run in runs if (request_id := run.stop())]
        return f"cancelling {', '.join(stopped)}" if stopped else "cancel requested"


class RunFeed:
    """What a request's events mean for its handler's progress bar: the waiting text (an estimate from what
    this host measured: loads, compiles of the mode) until its first step, then its steps; and, for a sync
    handler, when a heartbeat is due. `status()`: the engines' rows (Residency.status_rows); `compiles()`:
    the compile scheduler's snapshot; `engine_of(key)`: the engine if it was started (a lookup that starts
    nothing); `steps`: the run's steps where the request names them (a Compare's bar); `bucket`: the bucket
    it waits for the compile of (waiting.compile_bucket), so the wait names that compile."""

    def __init__(self, bar: ProgressBar, key, steps: int | None, status: Callable[[], list[dict]],
                 compiles: Callable[[], dict], engine_of: Callable, bucket: str | None = None):
        self.bar, self.key, self.steps, self.status, self.compiles = bar, key, steps, status, compiles
        self.engine_of, self.bucket = engine_of, bucket
        self.stepping = False
        self.last_yield = self.last_progress = 0.0

    def see(self, event) -> bool:
        """Show `event` on the bar; True for an Idle when a sync handler's heartbeat is due."""
        now = time.monotonic()
        if isinstance(event, Idle):
            if not self.stepping:
                self._show_waiting(event)
            if now - self.last_yield < HEARTBEAT_S:
                return False
        elif isinstance(event, Step):
            self._show_step(event.progress, now)
        self.last_yield = now
        return isinstance(event, Idle)

    def _show_waiting(self, idle: Idle) -> None:
        desc, share = self.waiting(idle)
        bar = self.bar
        if bar.grand_total:  # a Compare's bar: this image's share of it moves with the wait
            done = bar.offset + (share or 0.0) * (self.steps or 0)
            bar.progress((round(done, 1), bar.grand_total), desc=bar.desc_prefix + desc)
        else:
            bar.progress(share or 0.0, desc=bar.desc_prefix + desc)

    def waiting(self, idle: Idle) -> tuple[str, float | None]:
        """What the run waits for before its first step, and the share of that wait done."""
        key, waited = self.key, idle.waited_s
        engine = self.engine_of(key)  # None until the run's thread has started it
        if engine is None or not engine.ready.is_set():
            loads = [row.get("load_s") for row in self.status() if row.get("load_s")]
            return waiting.loading_text(key, waited, loads)
        if not idle.submitted:
            return f"waiting for engine {key}…", None
        compiling = waiting.compile_wait_text(key, self.compiles(), engine.buckets(), waited, self.bucket)
        return compiling or (waiting.queued_text(key, engine.pending(), waited), None)

    def _show_step(self, progress, now: float) -> None:
        self.stepping = True
        bar = self.bar
        total = bar.grand_total or progress.total
        # A single run's bar ends with its result; one bar over several runs (compare) shows each end.
        last = progress.step >= progress.total and bar.grand_total is not None
        if now - self.last_progress >= PROGRESS_EVERY_S or last:
            self.last_progress = now
            bar.progress((bar.offset + progress.step, total),
                         desc=f"{bar.desc_prefix}step {progress.step}/{progress.total}", unit="steps")
