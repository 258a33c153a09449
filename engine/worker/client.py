"""Clients of an engine. One protocol, several implementations (vLLM's EngineCoreClient idea).

`ConnectionClient` speaks the worker protocol (engine/worker/loop.py) over any multiprocessing
Connection: `ProcessClient` spawns a worker process per engine; the tensor-parallel sidecar client
(engine/tp/client.py) connects to torchrun's rank 0 over an authenticated loopback socket. The UI,
the bucket board, the CLI and the bench only ever use this interface.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

from engine.errors import EngineCrashed, ShowcaseError
from engine.protocol import (
    BucketChanged,
    BucketInfo,
    BucketKey,
    Cancel,
    CompileFinished,
    CompileGranted,
    CompileWanted,
    EngineKey,
    EngineReady,
    Fatal,
    Fault,
    FoldersChanged,
    Footprint,
    FootprintChanged,
    Generate,
    GenerateRequest,
    GenerateResult,
    InjectFault,
    LoraChanged,
    LoraInfo,
    Progress,
    Ready,
    RequestFailed,
    Result,
    Shutdown,
    StepProgress,
    Warm,
    dispatch,
)

log = logging.getLogger(__name__)


class EngineEvents:
    """What an engine client tells whoever serves it (the manager's residency), registered at construction
    or with `subscribe`. This base hears nothing and grants every compile at once (no host scheduler)."""

    def engine_ready(self, engine: EngineClient) -> None:
        """It loaded: `engine.info` and `engine.footprint` are set."""

    def engine_down(self, engine: EngineClient) -> None:
        """It stopped without being closed (crash, lost connection); `engine.error` says why."""

    def footprint_changed(self, engine: EngineClient) -> None:
        """It measured a new footprint (compiled graphs, their code)."""

    def compile_wanted(self, engine: EngineClient, wish: CompileWanted) -> None:
        """It asks to compile a bucket; answer with `engine.grant_compile(bucket)` when it may."""
        engine.grant_compile(wish.bucket)

    def compile_finished(self, engine: EngineClient, bucket: BucketKey) -> None:
        """A compile it was granted ended (warm or failed)."""


class EngineClient(Protocol):
    """What the manager, the UI, the CLI and the bench use of an engine, whatever runs it: a worker process,
    a tensor-parallel sidecar or the in-process runtime. `make_client` (engine/serving/launch.py) builds one."""

    kind: str
    ready: threading.Event
    info: EngineReady | None
    error: ShowcaseError | None
    footprint: Footprint | None
    last_used: float
    evictable: bool

    @property
    def key(self) -> EngineKey: ...
    @property
    def alive(self) -> bool: ...
    def subscribe(self, events: EngineEvents) -> None: ...
    def wait_ready(self, timeout: float | None = None) -> bool: ...
    def submit(self, request: GenerateRequest, on_progress: Callable | None = None) -> Future: ...
    def cancel(self, request_id: str) -> None: ...
    def warm(self, bucket: BucketKey | None = None) -> None: ...
    def grant_compile(self, bucket: BucketKey) -> None: ...
    def buckets(self) -> list[BucketInfo]: ...
    def pending(self) -> int: ...
    def busy(self) -> bool: ...
    def status(self) -> dict: ...
    def close(self) -> None: ...


class ConnectionClient:
    """An engine behind a Connection: submit requests, stream progress, mirror bucket states."""

    kind = "process"
    evictable = True  # False: an engine the app attached to but does not own

    def __init__(self, key: EngineKey, events: EngineEvents | None = None):
        self._key = key
        self.events = events or EngineEvents()
        self.conn = None
        self.ready = threading.Event()
        self.info: EngineReady | None = None
        self.error: ShowcaseError | None = None  # why it is down (load failure, crash)
        self.started_at = time.time()
        self._buckets: dict[BucketKey, BucketInfo] = {}
        self.bucket_events: deque[BucketInfo] = deque(maxlen=500)  # recent state changes, oldest first
        self._pending: dict[str, tuple[Future, Callable | None]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader: threading.Thread | None = None  # the one thread that reads, and closes, `conn`
        self.footprint: Footprint | None = None
        self.moved_folders: dict[str, str] | None = None  # where the worker compiles since a FoldersChanged
        self.late_notices: list[str] = []  # notices the engine gave after it was ready
        self.lora: LoraInfo | None = None  # its LoRA slot, as the worker last reported it
        self.last_used = time.monotonic()  # for least-recently-used eviction
        self.last_heard = time.monotonic()  # the last message from the worker (stalled())

    @property
    def key(self) -> EngineKey:
        return self._key

    def subscribe(self, events: EngineEvents) -> None:
        """Tell `events` (instead of whoever listened before) what happens to this engine from now on."""
        self.events = events

    # -- connection ------------------------------------------------------------------------------
    def attach(self, conn) -> None:
        self.conn = conn
        self._reader = threading.Thread(target=self._read, name=f"engine-read-{self.key}", daemon=True)
        self._reader.start()

    def hang_up(self) -> None:
        """End the connection now. Only the reader thread closes the handle: closing it under a read in flight
        frees its descriptor number, the next socket this process opens gets that number, and the old read
        then takes the new socket's bytes (a handshake elsewhere fails with "bad message length"). Shutting
        the socket down wakes the reader with end-of-file, and the reader closes it on its way out."""
        from engine.worker.wire import shut_down

        if self.conn is None:
            return
        shut_down(self.conn)
        if self._reader is None:
            self.conn.close()

    def _handlers(self) -> dict:
        return {
            BucketChanged: self._on_bucket,
            Progress: self._on_progress,
            Result: lambda m: self._finish(m.result.request_id, result=m.result),
            RequestFailed: self._on_error,
            Ready: self._on_ready,
            Fatal: self._on_fatal,
            CompileWanted: self._on_compile_wanted,
            CompileFinished: self._on_compile_finished,
            FootprintChanged: self._on_footprint,
            FoldersChanged: self._on_folders,
            LoraChanged: self._on_lora,
        }

    def _read(self) -> None:
        handlers = self._handlers()
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError, ConnectionResetError):
                break
            except Exception as exc:  # a message we cannot unpickle: report, keep reading
                log.error("bad message from %s: %s", self.key, exc)
                continue
            self.last_heard = time.monotonic()
            dispatch(message, handlers, log, f"engine {self.key}")  # unknown kinds are logged there
        try:
            self.conn.close()  # here and nowhere else while this thread runs: see hang_up
        except OSError:
            pass
        self._went_down()

    def _on_bucket(self, message: BucketChanged) -> None:
        with self._lock:
            self._buckets[message.info.bucket] = message.info
            self.bucket_events.append(message.info)

    def _on_progress(self, message: Progress) -> None:
        entry = self._pending.get(message.progress.request_id)
        if entry and entry[1]:
            try:
                entry[1](message.progress)
            except Exception:
                log.exception("progress callback failed")

    def _on_error(self, message: RequestFailed) -> None:
        if message.request_id is None:  # the engine could not handle a message that was not a request
            log.error("engine %s refused a message: %s", self.key, message.error)
            return
        self._finish(message.request_id, error=message.error)

    def _on_ready(self, message: Ready) -> None:
        self.info = message.ready
        self.footprint = message.ready.footprint
        self.lora = message.ready.lora
        with self._lock:
            for info in self.info.buckets:
                self._buckets[info.bucket] = info
        self.ready.set()
        self.events.engine_ready(self)

    def _on_lora(self, message: LoraChanged) -> None:
        self.lora = message.info

    def _on_compile_wanted(self, message: CompileWanted) -> None:
        self.events.compile_wanted(self, message)

    def _on_compile_finished(self, message: CompileFinished) -> None:
        self.events.compile_finished(self, message.bucket)

    def _on_folders(self, message: FoldersChanged) -> None:
        self.moved_folders = dict(message.folders)
        if message.notice and message.notice not in self.late_notices:
            self.late_notices.append(message.notice)

    def folders(self) -> dict[str, str]:
        """Where its worker compiles and writes temporary files, as the worker reported it ({}: not ready)."""
        if self.moved_folders is not None:
            return dict(self.moved_folders)
        return dict(self.info.folders) if self.info else {}

    def _on_footprint(self, message: FootprintChanged) -> None:
        self.footprint = message.footprint
        self.events.footprint_changed(self)

    def grant_compile(self, bucket: BucketKey) -> None:
        """The scheduler's answer: the engine may compile `bucket` now."""
        self.send(CompileGranted(bucket))

    def _on_fatal(self, message: Fatal) -> None:
        self.error = message.error
        self.ready.set()

    def _finish(self, request_id: str, result=None, error=None) -> None:
        self.last_used = time.monotonic()
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        if error is not None:
            entry[0].set_exception(error)
        else:
            entry[0].set_result(result)

    def describe_exit(self) -> str:
        return "the engine connection closed"

    def _went_down(self) -> None:
        if self.error is None and not self._closed:
            self.error = EngineCrashed(f"engine {self.key} stopped: {self.describe_exit()}")
        self.ready.set()
        with self._lock:
            pending, self._pending = self._pending, {}
        for request_id, (future, _) in pending.items():
            if not future.done():
                future.set_exception(EngineCrashed(
                    f"request {request_id} failed: engine {self.key} stopped while running it "
                    f"({self.describe_exit()}); it is being restarted, please retry"))
        if not self._closed:
            self.events.engine_down(self)

    def send(self, message) -> None:
        if self.conn is None or not self.alive:
            raise self.error or EngineCrashed(f"engine {self.key} is not running")
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, BrokenPipeError) as exc:
                raise EngineCrashed(f"engine {self.key} is not reachable: {exc}") from None

    # -- the engine interface --------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed

    def wait_ready(self, timeout: float | None = None) -> bool:
        if not self.ready.wait(timeout):
            return False
        if self.error is not None:
            raise self.error
        return True

    def submit(self, request: GenerateRequest, on_progress: Callable[[StepProgress], None] | None = None) -> Future:
        future: Future = Future()
        self.last_used = time.monotonic()
        with self._lock:
            self._pending[request.request_id] = (future, on_progress)
        try:
            self.send(Generate(request))
        except ShowcaseError as exc:
            self._finish(request.request_id, error=exc)
        return future

    def generate(self, request: GenerateRequest, on_progress=None, timeout: float | None = None) -> GenerateResult:
        future = self.submit(request, on_progress)
        try:
            return future.result(timeout)
        except FutureTimeout:
            self.cancel(request.request_id)
            raise EngineCrashed(f"request {request.request_id} took longer than {timeout}s and was cancelled") from None

    def cancel(self, request_id: str) -> None:
        try:
            self.send(Cancel(request_id))
        except ShowcaseError:
            pass

    def warm(self, bucket: BucketKey | None = None) -> None:
        self.send(Warm(bucket))

    def inject_fault(self, fault: Fault) -> None:
        """Tests: arm a one-shot fault (the engine must have been started with TestingOptions(inject_faults=True))."""
        self.send(InjectFault(Fault(fault)))

    def buckets(self) -> list[BucketInfo]:
        with self._lock:
            return sorted(self._buckets.values(), key=lambda i: (i.bucket.mode, i.bucket.size))

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def busy(self) -> bool:
        """A request is running or queued in it, or someone waits for it to load: never evict it now."""
        return self.pending() > 0 or not self.ready.is_set()

    def status(self) -> dict:
        state = "down" if self.error else ("ready" if self.ready.is_set() else "loading")
        return {
            "engine": str(self.key),
            "kind": self.kind,
            "state": state,
            "error": str(self.error) if self.error else None,
            "load_s": self.info.load_s if self.info else None,
            "notices": (list(self.info.notices) if self.info else []) + self.late_notices,
            "modes": [str(m) for m in self.info.modes] if self.info else [],
            "pending": self.pending(),
            "buckets": [b.as_dict() for b in self.buckets()],
            "batching": self.batching(),
            "lora": self.lora.as_dict() if self.lora is not None else None,
        }

    def batching(self) -> dict:
        """Its batch sizes and the pipeline calls served per batch size (every bucket together)."""
        calls: dict[int, dict] = {}
        for info in self.buckets():
            if info.batches_served:
                row = calls.setdefault(info.bucket.batch, {"calls": 0, "requests": 0})
                row["calls"] += info.batches_served
                row["requests"] += info.requests_served
        sizes = list(self.info.batch_sizes) if self.info else [1]
        return {"max_batch": max(sizes), "batch_sizes": sizes,
                "served": {str(b): calls[b] for b in sorted(calls)}}

    def close(self) -> None:
        self._closed = True
        try:
            if self.conn is not None:
                with self._send_lock:
                    self.conn.send(Shutdown())
        except Exception:
            pass


class ProcessClient(ConnectionClient):
    """One worker process per engine (spawned, so CUDA/Neuron/TPU initialise cleanly in it)."""

    def __init__(self, config, env: dict[str, str] | None = None, events: EngineEvents | None = None):
        super().__init__(config.key, events)
        self.config = config
        self.env = env or {}
        self.process = None
        self._cpu_seen: tuple[float, float] | None = None  # (CPU seconds of its processes, when they last grew)
        self.stall: str | None = None  # why it was killed as stuck (stop_stalled)

    def start(self) -> ProcessClient:
        from engine.worker.loop import worker_main

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=worker_main, args=(self.config, child, self.env), name=f"engine-{self.key}", daemon=True
        )
        self.process.start()
        child.close()
        self.attach(parent)
        return self

    @property
    def alive(self) -> bool:
        return super().alive and self.process is not None and self.process.is_alive()

    def stalled(self, stall_s: float) -> str | None:
        """Why the worker is stuck, or None: it has requests, has said nothing for `stall_s`, and its process
        (with the compilers it started) is stopped or has used no CPU time since. A long step or a compile
        uses CPU, so only a stopped, frozen or deadlocked worker is named."""
        import psutil

        if not self.pending() or not self.alive:
            self._cpu_seen = None
            return None
        try:
            root = psutil.Process(self.pid)
            stopped = root.status() == psutil.STATUS_STOPPED
            # Reaped children count too (children_user/system): a compiler that exits took its CPU time out of the
            # live processes' sum, which then looked quiet while the next one ran (an edit bucket's C++ kernels,
            # at nice 15 on a loaded host).
            cpu = sum(sum(p.cpu_times()[:4]) for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return None
        now = time.monotonic()
        seen = self._cpu_seen
        if seen is None or cpu > seen[0]:
            self._cpu_seen = seen = (cpu, now)
        quiet = now - max(self.last_heard, seen[1])
        if stopped and now - self.last_heard >= stall_s:
            return f"its process was stopped (e.g. SIGSTOP) with {self.pending()} requests for {stall_s:.0f} s"
        if quiet >= stall_s:
            return f"no progress and no CPU time for {quiet:.0f} s with {self.pending()} requests"
        return None

    def stop_stalled(self, reason: str) -> None:
        """Kill a stuck worker: its requests fail naming `reason`, and the engine restarts (bounded)."""
        self.stall = reason
        log.error("engine %s is stuck (%s): killing its worker", self.key, reason)
        try:
            os.killpg(self.pid, signal.SIGKILL)  # a stopped process still dies of SIGKILL
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def describe_exit(self) -> str:
        if self.stall:
            return f"the worker was stuck and was killed: {self.stall}"
        if self.process is None:
            return "never started"
        self.process.join(timeout=2)
        code = self.process.exitcode
        if code is None:
            return "connection lost"
        return f"worker process exited with code {code}" + (" (killed by a signal)" if code < 0 else "")

    def close(self, timeout: float = 3.0) -> None:
        """Ask the worker to shut down; after `timeout`, kill its process group (the worker made itself a
        group leader, so its compiler processes go with it)."""
        super().close()
        if self.process is None:
            return
        self.process.join(timeout)
        pgid = self.process.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)  # also whatever it started (inductor's compile workers, gcc)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.join(1.0)
            if not self.process.is_alive():
                break
