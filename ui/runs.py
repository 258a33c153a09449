"""Engine requests started by UI handlers: streaming their steps, and stopping them.

manager.generate blocks until the worker answers, so each request runs in a thread while the
handler (a generator) streams its StepProgress to gr.Progress and to its outputs.

Two things stop a run, both between steps:
- Gradio closes the handler's generator: a Cancel button (`cancels=[event]`), gradio_client's
  job.cancel(), a closed browser tab. Gradio can only close a generator at a yield, so `stream`
  yields a heartbeat at least every HEARTBEAT_S, also while the engine loads or the request waits
  in its queue; closing it cancels the engine request, or, not submitted yet, cancels it the
  moment it is submitted.
- the /cancel API: gradio_client callers name no event, so the session's runs are registered
  here; the engine request is cancelled and the handler returns the cancelled result. A /cancel can
  overtake the run it means (both wait in Gradio's queue; /cancel never waits long), or even reach
  the server before it (gradio_client's submit() sends its join from a thread): the session's last
  cancel time is kept, and a run whose event joined the queue before it, or at most CANCEL_AHEAD_S
  after a cancel that found nothing to stop, starts cancelled (such a cancel stops one run only).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.config.request import ImageRequest
from engine.errors import Cancelled, EngineBusy
from engine.serving.gate import Admitted
from ui import waiting

HEARTBEAT_S = 0.5  # about the longest a handler goes without a yield, i.e. without a chance to be closed
POLL_S = 0.25  # how often a waiting run's progress text is refreshed
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


@dataclass(eq=False)
class Run:
    """One handler call's engine requests (compare makes several, one after another)."""

    request_id: str | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def submitted(self, manager, request_id: str) -> None:
        with self.lock:
            self.request_id = request_id
            cancel_now = self.cancelled
        if cancel_now:  # stopped while its engine was still loading
            manager.cancel(request_id)

    def stop(self, manager) -> str | None:
        """Mark the run cancelled and cancel its engine request; returns that request's id if one ran."""
        with self.lock:
            self.cancelled = True
            request_id = self.request_id
        return request_id if request_id and manager.cancel(request_id) else None


class RunRegistry:
    def __init__(self, manager):
        self.manager = manager
        self._sessions: dict[str, set[Run]] = {}
        # session -> (its last /cancel, whether that cancel found nothing to stop)
        self._cancelled_at: OrderedDict[str, tuple[float, bool]] = OrderedDict()
        self._lock = threading.Lock()

    @contextmanager
    def open(self, session: str, exclusive: bool = False, joined_at: float | None = None) -> Iterator[Run]:
        """A run registered under the caller's session for as long as its handler runs. `exclusive`
        (public mode): one running request per session, a second is refused at once. `joined_at`
        (time.monotonic() when its event joined the queue): a /cancel since then cancels it already."""
        run = Run()
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
        stopped = [request_id for run in runs if (request_id := run.stop(self.manager))]
        return f"cancelling {', '.join(stopped)}" if stopped else "cancel requested"

    def stream(self, run: Run, key, spec: ImageRequest, bar: ProgressBar, ticket=None):
        """Run manager.generate(spec) on engine `key` (the spec's) in a thread; yield ("started", None) as soon
        as that thread runs, ("step", StepProgress), ("wait", None) heartbeats, then ("done", GenerateResult).
        Raises the run's exception. `ticket`: the Compare's admission it runs on.

        Closing this generator (GeneratorExit at a yield) stops the engine request.
        """
        events: queue.Queue = queue.Queue()
        watch = _Watch(self.manager, run, key, bar, events.put)
        watch.start(spec, ticket)  # the run's thread starts or finds the engine (manager.generate)
        try:
            yield "started", None  # the caller may tell the page now: the request is already on its way
            while True:
                try:
                    kind, payload = events.get(timeout=POLL_S)
                except queue.Empty:
                    if watch.idle():
                        yield "wait", None
                    continue
                yield watch.event(kind, payload)
                if kind == "done":
                    return
        finally:
            watch.close()

    async def astream(self, run: Run, key, spec: ImageRequest, bar: ProgressBar):
        """stream() for an async handler: the same items, awaited on the event loop instead of a handler
        thread (Gradio runs each step of a sync generator in a worker thread: a hop per item). No "wait"
        heartbeats: an async handler can be cancelled at any await. Cancelling it stops the engine request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:  # from the request's thread
            with contextlib.suppress(RuntimeError):  # the loop closed (the app is stopping)
                loop.call_soon_threadsafe(events.put_nowait, item)

        watch = _Watch(self.manager, run, key, bar, put)
        watch.start(spec)  # the run's thread starts or finds the engine (manager.generate): not the event loop
        try:
            yield "started", None
            while True:
                try:
                    # not asyncio.wait_for: on Python 3.11 it returns an item that arrived as the task was
                    # cancelled and drops the cancel (job.cancel() would not stop the run)
                    async with asyncio.timeout(POLL_S):
                        kind, payload = await events.get()
                except TimeoutError:
                    watch.idle()
                    continue
                yield watch.event(kind, payload)
                if kind == "done":
                    return
        finally:
            watch.close()


class _Watch:
    """One engine request of a stream: the thread that makes it, and what each of its events means for the
    progress bar (shared by RunRegistry.stream and astream). `put((kind, payload))` hands an event over."""

    def __init__(self, manager, run: Run, key, bar: ProgressBar, put):
        if run.cancelled:  # a /cancel came after this run's event joined the queue
            raise Cancelled("cancelled before it started")
        self.manager, self.run, self.key, self.bar, self.put = manager, run, key, bar, put
        self.stepping = self.answered = False
        self.since = self.last_yield = time.monotonic()
        self.steps: int | None = None  # the run's steps, where the request names them (a Compare's bar)
        self.last_progress = 0.0

    def start(self, spec: ImageRequest | Admitted, ticket=None) -> None:
        steps = spec.request.steps if isinstance(spec, Admitted) else spec.steps
        self.steps = int(steps) if str(steps or "").isdigit() else None
        manager, run, put = self.manager, self.run, self.put

        def work() -> None:
            try:
                result = manager.generate(spec, on_progress=lambda p: put(("step", p)), ticket=ticket,
                                          on_submit=lambda request_id: run.submitted(manager, request_id))
                put(("done", result))
            except BaseException as exc:  # noqa: BLE001 - handed to the handler
                put(("error", exc))

        threading.Thread(target=work, name=f"ui-run-{self.key}", daemon=True).start()

    def idle(self) -> bool:
        """No event for POLL_S: refresh the waiting text; True when a heartbeat is due."""
        if not self.stepping:
            desc, share = self.waiting()
            bar = self.bar
            if bar.grand_total:  # a Compare's bar: this image's share of it moves with the wait
                done = bar.offset + (share or 0.0) * (self.steps or 0)
                bar.progress((round(done, 1), bar.grand_total), desc=bar.desc_prefix + desc)
            else:
                bar.progress(share or 0.0, desc=bar.desc_prefix + desc)
        if time.monotonic() - self.last_yield >= HEARTBEAT_S:
            self.last_yield = time.monotonic()
            return True
        return False

    def waiting(self) -> tuple[str, float | None]:
        """What the run waits for before its first step, and the share of that wait done (an estimate from
        what this host measured: loads, compiles of the mode)."""
        key, waited = self.key, time.monotonic() - self.since
        engine = self.manager.residency.get(key)  # None until the run's thread has started it
        if engine is None or not engine.ready.is_set():
            loads = [row.get("load_s") for row in self.manager.residency.status_rows() if row.get("load_s")]
            return waiting.loading_text(key, waited, loads)
        if self.run.request_id is None:
            return f"waiting for engine {key}…", None
        scheduler = getattr(self.manager, "scheduler", None)
        snapshot = scheduler.snapshot() if scheduler is not None else {}
        compiling = waiting.compile_wait_text(key, snapshot, engine.buckets(), waited)
        return compiling or (waiting.queued_text(key, engine.pending(), waited), None)

    def event(self, kind: str, payload):
        """The (kind, payload) to hand on; raises the run's error."""
        if kind in ("done", "error"):
            self.answered = True
        if kind == "error":
            raise payload
        if kind == "step":
            self.stepping = True
            bar = self.bar
            total = bar.grand_total or payload.total
            # A single run's bar ends with its result; one bar over several runs (compare) shows each end.
            last = payload.step >= payload.total and bar.grand_total is not None
            if time.monotonic() - self.last_progress >= PROGRESS_EVERY_S or last:
                self.last_progress = time.monotonic()
                bar.progress((bar.offset + payload.step, total),
                             desc=f"{bar.desc_prefix}step {payload.step}/{payload.total}", unit="steps")
        self.last_yield = time.monotonic()
        return kind, payload

    def close(self) -> None:
        if not self.answered:  # closed before the engine answered: stop the request
            self.run.stop(self.manager)
        with self.run.lock:
            self.run.request_id = None
