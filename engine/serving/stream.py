"""One request as one async stream of typed events: what every door (the page, /generate and MCP, /v1,
the CLI) reads of a run, each through a thin adapter of its own.

    async with contextlib.aclosing(request_events(manager, spec, key=key, run=run)) as events:
        async for event in events:
            ...  # Started, then Idle / Submitted / Step / Partial, then one of Finished, Failed, Stopped

EngineManager.generate blocks until the worker answers, so it runs in a thread of its own; its hooks
(on_progress, on_submit) hand events to the stream's event loop. A consumer that goes away (closes the
stream, or its task is cancelled) cancels the request in its worker: at once when it was sent, else the
moment it is sent (`Run`). `blocking()` reads the same stream from synchronous code (a Gradio sync
handler, the CLI): one event loop thread per process runs every such stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from engine.config.request import ImageRequest
from engine.errors import Cancelled
from engine.protocol import EngineKey, GenerateResult, StepProgress

IDLE_S = 0.25  # a started run that hears nothing for this long yields Idle (waiting texts, heartbeats)
CLOSE_S = 10.0  # the longest blocking().close() waits for the stream's own clean-up


# -- the events ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """The request is on its way: its thread runs manager.generate, which starts or finds its engine."""


@dataclass(frozen=True)
class Idle:
    """Nothing happened for IDLE_S: `waited_s` since the stream started, `submitted` whether the engine has
    the request yet (before that it waits for its engine)."""

    waited_s: float
    submitted: bool


@dataclass(frozen=True)
class Submitted:
    request_id: str


@dataclass(frozen=True)
class Step:
    progress: StepProgress


@dataclass(frozen=True)
class Partial:
    """A partial image the request asked for (ImageRequest.previews), right after its Step."""

    png: bytes
    step: int
    total: int


@dataclass(frozen=True)
class Finished:
    result: GenerateResult


@dataclass(frozen=True)
class Failed:
    """The request failed; `error` says why (a ShowcaseError naming what to change, for bad input)."""

    error: BaseException


@dataclass(frozen=True)
class Stopped:
    """The request was cancelled (a /cancel, a closed stream elsewhere, a timeout): `error` is its Cancelled."""

    error: BaseException


Event = Started | Idle | Submitted | Step | Partial | Finished | Failed | Stopped
ENDS = (Finished, Failed, Stopped)


# -- the cancel handle ---------------------------------------------------------------------------------
@dataclass(eq=False)
class Run:
    """A handle on one caller's engine requests (a Compare makes several, one after another): what stops
    them. `cancel(request_id)` cancels a sent request (EngineManager.cancel)."""

    cancel: Callable[[str], bool]
    request_id: str | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admitted(self, request_id: str) -> None:
        """Its request was admitted: a stop from now on cancels it, whether it was sent yet or not."""
        with self.lock:
            self.request_id = request_id
            cancel_now = self.cancelled
        if cancel_now:  # stopped between its start and its admission
            self.cancel(request_id)

    def stop(self) -> str | None:
        """Mark the run cancelled and cancel its engine request; returns that request's id if one ran."""
        with self.lock:
            self.cancelled = True
            request_id = self.request_id
        return request_id if request_id and self.cancel(request_id) else None

    def ended(self) -> None:
        """Its request answered: a later stop() has nothing to cancel."""
        with self.lock:
            self.request_id = None


# -- the stream ----------------------------------------------------------------------------------------
async def request_events(manager, spec: ImageRequest, *, key: EngineKey | None = None, run: Run | None = None,
                         ticket=None, idle_s: float = IDLE_S) -> AsyncIterator[Event]:
    """The events of one manager.generate(spec): `spec` an ImageRequest, or what the gate admitted
    (engine/serving/gate.py) where the caller admitted it itself; `key`: its engine (for the thread's name); `run`: the caller's cancel handle (one of its own otherwise); `ticket`: the Compare's
    admission it runs on. Ends with Finished, Failed or Stopped; closed before that, it stops the request."""
    run = run if run is not None else Run(manager.cancel)
    if run.cancelled:  # a /cancel came after its caller's event joined the queue
        yield Stopped(Cancelled("cancelled before it started"))
        return
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def put(event) -> None:  # from the request's thread
        with contextlib.suppress(RuntimeError):  # the loop closed (the app is stopping)
            loop.call_soon_threadsafe(events.put_nowait, event)

    def submitted(request_id: str) -> None:
        run.admitted(request_id)  # said again once sent (a manager that does not say when it admits)
        put(Submitted(request_id))

    def work() -> None:
        try:
            put(Started())  # manager.generate may spawn the engine's worker process: here, not on the loop
            put(Finished(manager.generate(spec, on_progress=lambda p: put(Step(p)), on_submit=submitted,
                                          ticket=ticket, on_admitted=run.admitted)))
        except Cancelled as exc:
            put(Stopped(exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(Failed(exc))

    threading.Thread(target=work, name=f"run-{key or getattr(spec, 'key', None) or spec.preset}",
                     daemon=True).start()
    since, started, ended = time.monotonic(), False, False
    try:
        while not ended:
            try:
                # not asyncio.wait_for: on Python 3.11 it returns an item that arrived as the task was
                # cancelled and drops the cancel (the request would not be stopped)
                async with asyncio.timeout(idle_s if started else None):
                    event = await events.get()
            except TimeoutError:
                yield Idle(time.monotonic() - since, run.request_id is not None)
                continue
            started = started or isinstance(event, Started)
            ended = isinstance(event, ENDS)
            yield event
            if isinstance(event, Step) and event.progress.previews:
                p = event.progress
                yield Partial(p.previews[0], p.step, p.total)
    finally:
        if not ended:  # the consumer went away before the engine answered: stop the request
            run.stop()
        run.ended()


def result_of(event: Event) -> GenerateResult | None:
    """Finished's result; raises a Failed or Stopped event's error; None for the others."""
    if isinstance(event, (Failed, Stopped)):
        raise event.error
    return event.result if isinstance(event, Finished) else None


# -- for synchronous callers ---------------------------------------------------------------------------
_bridge: asyncio.AbstractEventLoop | None = None
_bridge_lock = threading.Lock()


def _bridge_loop() -> asyncio.AbstractEventLoop:
    """The event loop that runs every stream a synchronous caller reads (a daemon thread, started once)."""
    global _bridge
    with _bridge_lock:
        if _bridge is None:
            _bridge = asyncio.new_event_loop()
            threading.Thread(target=_bridge.run_forever, name="event-streams", daemon=True).start()
        return _bridge


class _Pull:
    """Steps an async iterator from another thread; close() stops a step in flight first (an interrupted
    reader, e.g. Ctrl-C in the CLI), then closes it."""

    def __init__(self, events: AsyncIterator):
        self.events, self.task = events, None

    async def next(self):
        self.task = asyncio.current_task()
        return await anext(self.events)

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        await self.events.aclose()


def blocking(events: AsyncIterator[Event]) -> Iterator[Event]:
    """The stream for synchronous code: each event as it comes (a started run yields at least every IDLE_S,
    so its reader can be closed that often). Closing this generator closes the stream, which stops its
    request; it may be closed from any thread, an event loop's included."""
    loop, pull = _bridge_loop(), _Pull(events)
    try:
        while True:
            try:
                event = asyncio.run_coroutine_threadsafe(pull.next(), loop).result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        asyncio.run_coroutine_threadsafe(pull.close(), loop).result(CLOSE_S)


def generate(manager, spec: ImageRequest) -> GenerateResult:
    """One request for synchronous code (the CLI): its result, or its error raised."""
    with contextlib.closing(blocking(request_events(manager, spec))) as events:
        for event in events:
            if (result := result_of(event)) is not None:
                return result
    raise RuntimeError("the engine ended the request without a result")
