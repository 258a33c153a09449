"""The worker process that owns one engine's pipeline (one per (model, device, precision)).

Why a process: compiling holds the GIL for seconds (7 s stalls were measured on a 2-core machine),
and a crash in a device backend must not take the web server down. The worker speaks the typed
message protocol of engine/protocol.py (`Generate`, `Cancel`, `Warm`, `Shutdown`, `InjectFault` in;
`Ready`, `Fatal`, `BucketChanged`, `Progress`, `Result`, `RequestFailed` out) over a
`multiprocessing` Connection; the tensor-parallel sidecar's rank 0 runs this same loop behind an
authenticated loopback socket, so clients cannot tell the two apart.

Inside the worker, the serve loop (main thread) owns the request queue and runs one request at a
time; a warm-up thread compiles queued buckets so that requests keep being served (eagerly at cold
buckets) while a bucket compiles. A receiver thread takes cancel and warm at any time.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback

from engine.errors import Cancelled, EngineBusy, InvalidRequest, ShowcaseError
from engine.protocol import (
    BucketChanged,
    BucketKey,
    BucketState,
    Fatal,
    Fault,
    Generate,
    GenerateRequest,
    InjectFault,
    Progress,
    RankExit,
    Ready,
    RequestFailed,
    Result,
    ToEngine,
    dispatch,
)

log = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(self, conn, runner, max_queue: int = 16):
        self.conn = conn
        self.runner = runner
        self.max_queue = max_queue
        self._send_lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._cancels: dict[str, threading.Event] = {}
        self._warm_list: list[BucketKey] = []
        self._warm_cv = threading.Condition()
        self._size_hits: dict = {}
        self._stop = threading.Event()

    def send(self, message) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):
                self._stop.set()

    # -- receiving (its own thread, so cancel and warm arrive while a request runs) ---------------
    def _handlers(self) -> dict:
        return {
            ToEngine.GENERATE: self._on_generate,
            ToEngine.CANCEL: lambda m: self._cancels.setdefault(m.request_id, threading.Event()).set(),
            ToEngine.WARM: lambda m: self.queue_warm(m.bucket),
            ToEngine.SHUTDOWN: lambda m: self._stop.set(),
            ToEngine.INJECT_FAULT: self._on_inject_fault,
        }

    def _receive(self) -> None:
        handlers = self._handlers()
        peer = f"the client of {self.runner.config.key}"
        while not self._stop.is_set():
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break  # the client is gone
            except Exception as exc:  # a message we cannot unpickle: answer, keep reading
                log.error("unreadable message from %s: %s", peer, exc)
                self.send(RequestFailed(None, ShowcaseError(f"unreadable message: {exc}")))
                continue
            if not dispatch(message, handlers, log, peer):
                self.send(RequestFailed(getattr(message, "request_id", None),
                                        ShowcaseError(f"unknown message {type(message).__name__!r}")))
        self._stop.set()
        self._requests.put(None)
        with self._warm_cv:
            self._warm_cv.notify_all()

    def _on_generate(self, message: Generate) -> None:
        request = message.request
        if self._requests.qsize() >= self.max_queue:
            self.send(RequestFailed(request.request_id, EngineBusy(
                f"engine {self.runner.config.key} has {self.max_queue} requests waiting; retry in a few seconds")))
            return
        self._cancels[request.request_id] = threading.Event()
        self._size_hits[request.size] = self._size_hits.get(request.size, 0) + 1
        self._requests.put(request)

    def _on_inject_fault(self, message: InjectFault) -> None:
        if not self.runner.options.fault_injection:
            self.send(RequestFailed(None, InvalidRequest("fault injection is off in this engine")))
            return
        self.runner.faults.arm(message.fault)

    # -- warm-up ---------------------------------------------------------------------------------
    def queue_warm(self, bucket: BucketKey | None) -> None:
        buckets = self.runner.buckets_to_warm() if bucket is None else [bucket]
        with self._warm_cv:
            for b in buckets:
                info = self.runner.board.get(b)
                if b in self._warm_list or (info and info.state in (BucketState.WARM, BucketState.COMPILING)):
                    continue
                self.runner.board.update(b, state=BucketState.QUEUED, error=None)
                self._warm_list.append(b)
            self._warm_cv.notify()

    def _next_warm(self) -> BucketKey | None:
        with self._warm_cv:
            while not self._warm_list and not self._stop.is_set():
                self._warm_cv.wait(0.5)
            if self._stop.is_set():
                return None
            # Most-requested size first; ties keep the configured (preset) order.
            best = max(self._warm_list, key=lambda b: (self._size_hits.get(b.size, 0), -self._warm_list.index(b)))
            self._warm_list.remove(best)
            return best

    def _warm_forever(self) -> None:
        while (bucket := self._next_warm()) is not None:
            info = self.runner.board.get(bucket)
            if info and info.state == BucketState.WARM:
                continue
            self.runner.warm_bucket(bucket)

    # -- serving ---------------------------------------------------------------------------------
    def _serve_one(self, request: GenerateRequest) -> None:
        cancel = self._cancels.setdefault(request.request_id, threading.Event())
        crash = self.runner.faults.take(Fault.CRASH)

        def on_step(progress):
            self.send(Progress(progress))
            if crash:
                os._exit(RankExit.INJECTED_CRASH)  # armed by a test: the worker dies mid-request

        try:
            if cancel.is_set():
                raise Cancelled(f"request {request.request_id} cancelled before it started")
            result = self.runner.generate(request, on_step=on_step, cancel=cancel)
            self.send(Result(result))
        except ShowcaseError as exc:
            self.send(RequestFailed(request.request_id, exc))
        except Exception as exc:  # never let one request kill the worker
            log.exception("request %s failed", request.request_id)
            self.send(RequestFailed(request.request_id, ShowcaseError(f"{type(exc).__name__}: {exc}")))
        finally:
            self._cancels.pop(request.request_id, None)

    def run(self) -> None:
        receiver = threading.Thread(target=self._receive, name="worker-receive", daemon=True)
        receiver.start()
        warmer = threading.Thread(target=self._warm_forever, name="worker-warm", daemon=True)
        warmer.start()
        while not self._stop.is_set():
            request = self._requests.get()
            if request is None:
                break
            self._serve_one(request)


def worker_main(config, conn, env: dict[str, str]) -> None:
    """Entry point of the spawned worker process."""
    os.environ.update(env)  # before torch is imported: TORCHINDUCTOR_CACHE_DIR, TORCH_TPU_DEFER_AND_FUSE ...
    logging.basicConfig(level=os.environ.get("SHOWCASE_LOG_LEVEL", "WARNING"),
                        format=f"[worker {config.key}] %(levelname)s %(name)s: %(message)s")
    from engine.runner import PipelineRunner

    loop = None
    try:
        runner = PipelineRunner(config, listener=lambda info: loop and loop.send(BucketChanged(info)))
        loop = WorkerLoop(conn, runner, max_queue=config.options.max_queue)
        runner.load()
        loop.send(Ready(runner.ready_info()))
    except Exception as exc:
        err = exc if isinstance(exc, ShowcaseError) else ShowcaseError(f"{type(exc).__name__}: {exc}")
        log.error("worker failed to start: %s\n%s", exc, traceback.format_exc())
        try:
            conn.send(Fatal(err))
        finally:
            conn.close()
        return
    loop.queue_warm(None)
    loop.run()
    conn.close()
