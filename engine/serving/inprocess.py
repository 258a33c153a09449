"""The in-process runtime: an engine's PipelineRunner in the app's own process, device work in GPU calls.

Where long-lived device workers cannot run (a ZeroGPU Space: no CUDA in the app's process, each
`spaces.GPU` call in a process forked for it), and on plain CPU or single-GPU hosts that want one process.

The manager sees the same client as for a worker engine: `InProcessClient` is a `ConnectionClient` whose
connection is an in-memory pipe to a `WorkerLoop` running on threads of this process, so the board,
timings, cancel between steps, compile scheduling, footprints, budgets and public-mode rules are the
worker runtime's code. What differs:

- every request runs as one GPU call (engine/serving/gpu.py), whose `duration` is the bucket's measured time per
  step x steps with a margin (a first request asks for the documented default);
- modes `compile` and `regional` are refused: ZeroGPU does not support torch.compile, and elsewhere a
  compile in the app's process holds the interpreter lock for seconds at a time and stalls the web server.
  `aot` is the compiled mode here: a bucket's packages (engine/pipeline/aot.py format and keys) are loaded, or built
  inside a GPU call, and applied with the engine's weights shared. Where the call ran in another process
  the app installs the committed packages lazily: they load on their first call, inside the next GPU call;
- tensor parallel and multi-node engines are refused (they need torchrun's long-lived ranks).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING

from engine import settings
from engine.errors import ShowcaseError, UnsupportedCombination
from engine.pipeline import aot
from engine.pipeline.callrun import generate_here
from engine.pipeline.runner import PipelineRunner
from engine.protocol import (
    BucketChanged,
    BucketInfo,
    BucketKey,
    BucketState,
    EngineReady,
    Fatal,
    GenerateRequest,
    GenerateResult,
    Mode,
    Ready,
    Size,
)
from engine.serving.gpu import Durations, GpuCalls, make_gpu_calls
from engine.worker.client import ConnectionClient, EngineEvents
from engine.worker.loop import WorkerLoop
from engine.worker.priority import run_on_lowered_thread
from engine.worker.served import EngineFacts

if TYPE_CHECKING:
    from engine.pipeline.board import BucketBoard
    from engine.pipeline.callrun import RequestPrep
    from engine.pipeline.calls import PipelineCaller
    from engine.pipeline.executor import Executor, ModeRules
    from engine.pipeline.modes import VariantSet
    from engine.pipeline.warmup import WarmRequests

log = logging.getLogger(__name__)

REFUSED_MODES = {
    Mode.COMPILE: "the in-process runtime does not run torch.compile: ZeroGPU does not support it, and in the "
                  "app's process a compile holds the interpreter lock and stalls the web server; use mode aot "
                  "(packages built once, loaded in seconds) or --runtime workers",
}
REFUSED_MODES[Mode.REGIONAL] = REFUSED_MODES[Mode.COMPILE]
TP_REFUSED = ("tensor parallel needs torchrun's long-lived ranks, which the in-process runtime (and ZeroGPU) "
              "cannot run: use --runtime workers on a multi-GPU host")
CLOSE_TIMEOUT_S = 5.0
PACKAGES_PRESENT_DURATION_S = 30  # a warm-up that only loads packages


def check_inprocess_key(key) -> None:
    if key.tp > 1:
        raise UnsupportedCombination(f"{key}: {TP_REFUSED}")


class _Closed:
    pass


_CLOSED = _Closed()


class LocalConnection:
    """One end of an in-memory duplex pipe with multiprocessing.Connection's send/recv/close: messages go by
    reference (nothing is pickled; results stay in this process)."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self._inbox, self._outbox = inbox, outbox
        self.closed = False

    @classmethod
    def pair(cls) -> tuple[LocalConnection, LocalConnection]:
        a, b = queue.Queue(), queue.Queue()
        return cls(a, b), cls(b, a)

    def send(self, message) -> None:
        if self.closed:
            raise OSError("connection closed")
        self._outbox.put(message)

    def recv(self):
        message = self._inbox.get()
        if message is _CLOSED:
            self._inbox.put(_CLOSED)  # every later recv ends too
            raise EOFError
        return message

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._outbox.put(_CLOSED)  # the peer reads end-of-file
            self._inbox.put(_CLOSED)  # a read of our own in flight ends


def inprocess_runner(config, listener=None) -> PipelineRunner:
    """The engine's PipelineRunner in the app's process: without compile and regional (REFUSED_MODES), one
    request per call, its footprint its own (the app's resident memory is not the engine's)."""
    return PipelineRunner(config, listener=listener, refused=lambda mode: REFUSED_MODES.get(mode, ""), max_batch=1,
                          in_app_process=True)


class InProcessExecutor:
    """The executor (engine/pipeline/executor.py) of an in-process engine: its `generate` and `warm_bucket` are
    GPU calls (`gpu`), each request its own, whose duration is asked for from that request's steps. The
    device work runs in `_gpu_task`: a request as `generate_here(prep, calls, request)` (the engine's request
    parts; a frame fewer than the runner's own generate), a warm-up as the `local` executor's (the engine's
    PipelineRunner, on the device the call holds). It reads the engine's `board`, its mode `rules` (refused modes answer before a GPU is asked
    for), and installs aot packages into its `variants` (one per guidance of `warm_requests`)."""

    def __init__(self, local: Executor, prep: RequestPrep, calls: PipelineCaller, board: BucketBoard,
                 rules: ModeRules, variants: VariantSet, warm_requests: WarmRequests, gpu: GpuCalls):
        self.local = local
        self.prep, self.calls = prep, calls
        self.board = board
        self.rules = rules
        self.variants = variants
        self.warm_requests = warm_requests
        self.gpu = gpu
        self.durations = Durations()
        self._owner = os.getpid()
        self._installed: set[Size] = set()  # aot sizes whose packages this process's runner holds
        # Wrapped once, before any GPU call forks: ZeroGPU finds its functions at start-up.
        self._task = gpu.wrap(self._gpu_task)

    # -- inside the GPU call ---------------------------------------------------------------------------
    def _gpu_task(self, duration_s, op, payload, owner):
        """The device work. Runs where the GPU is (a forked process on ZeroGPU): everything it needs comes
        from memory inherited at the fork and its arguments; everything the app must learn it yields."""
        remote = os.getpid() != owner
        changes: dict[BucketKey, BucketInfo] = {}
        if remote:  # the app's board is not this process's: collect what changes, send it back
            self.board.listener = lambda info: changes.__setitem__(info.bucket, info)
        try:
            if op == "generate":
                request, cancel, info, *on_step = payload
                self._take_view(remote, request, info)
                if not remote and on_step:
                    # Same process: on the calling thread, progress straight to the caller. A thread per request
                    # would give each its own OpenMP pool on cpu (pools of finished threads kept spinning).
                    yield "result", generate_here(self.prep, self.calls, request, on_step=on_step[0], cancel=cancel)
                else:
                    yield from self._generate_on_thread(request, cancel)
            else:
                info = self.local.warm_bucket(payload)  # the device work itself
                if info.state == BucketState.WARM and payload.mode is Mode.AOT:
                    self._installed.add(payload.size)
                yield "warmed", info
        except ShowcaseError as exc:
            yield "error", exc
        except Exception as exc:  # what the app can show; the traceback stays in this process's log
            log.error("GPU call %s failed:\n%s", op, traceback.format_exc())
            yield "error", ShowcaseError(f"{type(exc).__name__}: {exc}")
        for info in changes.values():
            yield "bucket", info

    def _take_view(self, remote: bool, request: GenerateRequest, info: BucketInfo | None) -> None:
        """The app's view of the request's bucket (a reused ZeroGPU process may lag behind), and its aot
        packages installed where the app has them and this process not yet."""
        if remote and info is not None:
            apply_info(self.board, info)
        if (request.mode is Mode.AOT and info is not None and info.state == BucketState.WARM
                and info.bucket.size not in self._installed):
            self.variants.get(Mode.AOT)
            if self._install_committed(info.bucket.size):
                self._installed.add(info.bucket.size)

    def _generate_on_thread(self, request: GenerateRequest, cancel):
        """The request on a thread of its own, its progress and result yielded as they come."""
        events: queue.Queue = queue.Queue()

        def run():
            try:
                events.put(("result", generate_here(self.prep, self.calls, request,
                                                    on_step=lambda p: events.put(("progress", p)), cancel=cancel)))
            except BaseException as exc:  # noqa: BLE001 - handed to the generator, raised there
                events.put(("raise", exc))

        threading.Thread(target=run, name=f"gpu-call-{request.request_id}", daemon=True).start()
        while True:
            kind, value = events.get()
            if kind == "raise":
                raise value
            yield kind, value
            if kind == "result":
                return

    # -- in the app --------------------------------------------------------------------------------
    def _variant(self, request: GenerateRequest) -> str:
        info = self.board.get(request.bucket)
        warm = request.mode.compiled and info is not None and info.state == BucketState.WARM
        return str(request.mode) if warm else "eager"

    def duration_for(self, request: GenerateRequest) -> int:
        return self.durations.for_request(self._variant(request), request.bucket.shape, request.steps)

    def generate(self, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None
                 ) -> GenerateResult:
        self.rules.check_mode(request.mode)  # refused modes answer here, before a GPU is asked for
        cancel = cancel or threading.Event()
        flag = self.gpu.cancel_flag(request.request_id, cancel)
        done = threading.Event()
        self.gpu.watch_cancel(flag, cancel, done)
        info = self.board.get(request.bucket)
        result = None
        payload = (request, flag, info) if self.gpu.forks else (request, flag, info, on_step or (lambda p: None))
        try:
            events = self.gpu.call(self._task, f"generate {request.bucket}", self.duration_for(request),
                                   "generate", payload, self._owner)
            for kind, value in events:
                if kind == "progress" and on_step is not None:
                    on_step(value)
                elif kind == "result":
                    result = value
                elif kind == "bucket" and self.gpu.forks:
                    apply_info(self.board, value)
                elif kind == "error":
                    raise value
        finally:
            done.set()
            self.gpu.clear(flag)
        if result is None:
            raise ShowcaseError(f"request {request.request_id}: the GPU call ended without a result")
        variant = str(result.bucket.mode) if result.warm and result.bucket.mode.compiled else "eager"
        self.durations.record(variant, result.bucket.shape, result.steps, result.timings.step_ms)
        return result

    def generate_batch(self, requests: list[GenerateRequest], on_step=None,
                       cancels: list[threading.Event] | None = None, on_leave=None, on_result=None) -> list:
        """Each request its own GPU call (an in-process engine's batches are of one)."""
        outcomes = []
        for i, request in enumerate(requests):
            try:
                outcomes.append(self.generate(request, on_step=on_step, cancel=cancels[i] if cancels else None))
            except Exception as exc:  # noqa: BLE001 - its own outcome
                outcomes.append(exc)
        return outcomes

    def warm_bucket(self, bucket: BucketKey) -> BucketInfo:
        if bucket.mode is not Mode.AOT:  # eager: nothing to do; compile/regional: refused with the reason
            return self.local.warm_bucket(bucket)
        try:
            self.rules.check_mode(bucket.mode)
            self.variants.get(Mode.AOT)  # keys and store, no device work
            present = self._install_committed(bucket.size) if self.gpu.forks else False
        except Exception as exc:
            return self.board.update(bucket, state=BucketState.FAILED, error=str(exc))
        duration = PACKAGES_PRESENT_DURATION_S if present else int(settings.gpu_build_duration_s())
        self.board.update(bucket, state=BucketState.COMPILING, error=None, origin=None)
        final = None
        for kind, value in self.gpu.call(self._task, f"aot {bucket}", duration, "warm", bucket, self._owner):
            if kind == "warmed":
                final = value
            elif kind == "error":
                return self.board.update(bucket, state=BucketState.FAILED, error=str(value))
        if final is None:
            return self.board.update(bucket, state=BucketState.FAILED, error="the GPU call ended without a result")
        if self.gpu.forks:  # built or loaded over there: install what was committed here, loaded on first use
            if final.state == BucketState.WARM and not self._install_committed(bucket.size):
                return self.board.update(bucket, state=BucketState.FAILED,
                                         error="the GPU call warmed the bucket but its packages are not in the store")
            self._installed.add(bucket.size)
            apply_info(self.board, final)
        elif final.state == BucketState.WARM:
            self._installed.add(bucket.size)
        return self.board.get(bucket)

    def _install_committed(self, size: Size) -> bool:
        return install_committed(self.variants.aot, self.warm_requests, size)


class LazyPackage:
    """An aot package the app knows is committed but has not loaded: loaded (checksum, constants pointed
    at the engine's tensors) on its first call, in whichever process makes it (ZeroGPU: the GPU call's)."""

    def __init__(self, folder, constants):
        self.folder = folder
        self._constants = constants
        self._package = None
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        if self._package is None:
            with self._lock:
                if self._package is None:
                    self._package, _ = aot.load_package(self.folder, self._constants())
        return self._package(*args, **kwargs)


def install_committed(engine: aot.AotEngine, warm_requests: WarmRequests, size: Size) -> bool:
    """Install every committed package of a size into the engine's aot variant (`engine`) lazily, one per
    guidance the warm-up runs; False when one is missing (nothing installed)."""
    planned = []
    for i, guidance in enumerate(warm_requests.guidances()):
        kinds = [aot.DENOISER] + ([aot.VAE] if engine.decoder is not None and i == 0 else [])
        for kind in kinds:
            batch = engine.batch(guidance) if kind == aot.DENOISER else 1
            found = engine.store.find(engine.package_key(kind, size, batch))
            if found.state != "present":
                return False
            try:
                manifest = json.loads((found.folder / aot.MANIFEST).read_text())
            except (OSError, ValueError):
                return False
            planned.append((kind, found.folder, manifest))
    for kind, folder, manifest in planned:
        engine._install(kind, LazyPackage(folder, lambda k=kind: engine.constants(k)), manifest)
    return True


_INFO_FIELDS = ("state", "error", "compile_s", "warmup_s", "requests_served", "cache_hits", "cache_misses", "origin")


def apply_info(board: BucketBoard, info: BucketInfo) -> None:
    board.update(info.bucket, **{name: getattr(info, name) for name in _INFO_FIELDS})


class InProcessClient(ConnectionClient):
    """An engine whose runner lives in this process (see the module's docstring)."""

    kind = "inprocess"

    def __init__(self, config, gpu: GpuCalls | None = None, threads: int | None = None,
                 events: EngineEvents | None = None):
        check_inprocess_key(config.key)
        super().__init__(config.key, events)
        self.config = config
        self.threads = threads  # cpu: compute threads, as a worker gets (the manager's share of the cores)
        self.gpu = gpu or make_gpu_calls()
        self.runner: PipelineRunner | None = None
        self.executor: InProcessExecutor | None = None
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return os.getpid()

    def start(self) -> InProcessClient:
        ours, theirs = LocalConnection.pair()
        self.attach(ours)
        self._engine_conn = theirs
        self._thread = threading.Thread(target=self._serve, name=f"inprocess-{self.key}", daemon=True)
        self._thread.start()
        return self

    def hang_up(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def _serve(self) -> None:
        conn = self._engine_conn
        made: dict = {}

        def listener(info):
            if "loop" in made:
                made["loop"].send(BucketChanged(info))

        def load() -> tuple[WorkerLoop, EngineReady]:
            if self.threads:
                import torch

                # Process-wide, as OMP_NUM_THREADS is for a worker: more compute threads than this share
                # spin against the web server and each other (docs/spaces.md).
                torch.set_num_threads(self.threads)
            self.runner = runner = inprocess_runner(self.config, listener=listener)
            self.executor = executor = InProcessExecutor(runner, runner.prep, runner.calls, runner.board,
                                                         runner.rules, runner.variants, runner.warm_requests,
                                                         self.gpu)
            # The worker's shorter thread switch interval would be the web server's too: left as it is.
            # Its calls go through the executor (GPU calls); the runner reports on the engine.
            made["loop"] = loop = WorkerLoop(conn, EngineFacts.of(runner), executor, runner,
                                             max_queue=self.config.options.batching.max_queue,
                                             thread_prefix="inprocess", switch_interval=False)
            runner.load()
            if not self.gpu.forks:  # the measuring step runs device work: only where this process has the device
                runner.measure_peak()
                loop.learn_from_measuring_run(runner.measured_run)
                size, ms = runner.measured_run
                executor.durations.record("eager", size, 1, (ms,))  # an overestimate of one step: safe
            return loop, runner.ready_info()

        try:
            loop, ready = run_on_lowered_thread(load, settings.compile_niceness(), name=f"inprocess-load-{self.key}")
            loop.send(Ready(ready))
        except Exception as exc:
            err = exc if isinstance(exc, ShowcaseError) else ShowcaseError(f"{type(exc).__name__}: {exc}")
            log.error("in-process engine %s failed to load: %s", self.key, exc)
            try:
                conn.send(Fatal(err))
            except OSError:
                pass
            return
        loop.queue_startup_warm()
        try:
            loop.run()
        finally:
            conn.close()

    def describe_exit(self) -> str:
        return "the in-process engine stopped"

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop: the running request stops at its next step (in a forked GPU call too, through its cancel
        flag), the loop's threads end, the connection closes. Nothing outlives `timeout` but daemon threads
        parked in a GPU call, which the process's exit ends."""
        super().close()
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + 1.0
        while self._reader is not None and self._reader.is_alive() and time.monotonic() < deadline:
            self.hang_up()
            self._reader.join(0.1)
        self.gpu.close()

    def status(self) -> dict:
        status = super().status()
        status["gpu_calls"] = self.gpu.name
        if self.gpu.calls:
            status["last_gpu_duration_s"] = self.gpu.calls[-1][1]
        return status
