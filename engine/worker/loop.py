"""The worker process that owns one engine's pipeline (one per (model, device, precision)).

Why a process: compiling holds the GIL for seconds, and a crash in a device backend must not take the
web server down. The worker speaks the typed
message protocol of engine/protocol/ over a `multiprocessing` Connection; the tensor-parallel
sidecar's rank 0 runs this same loop behind an authenticated loopback socket, so clients cannot tell
the two apart.

Inside the worker:
- the serve loop (main thread) owns the request queue and runs one request at a time; on a cpu device a
  request expected to run long runs on a thread niced by its expected time (engine/worker/priority.py), so
  short requests of other engines sharing the cores go first;
- a receiver thread takes cancel, warm and compile grants at any time;
- a warm-up thread compiles buckets, one at a time and only when the host's compile scheduler grants
  it (`CompileWanted` -> `CompileGranted` -> `CompileFinished`), so a host compiles at most
  `--compile-jobs` buckets at once. It runs at the lowest CPU priority (its compiler subprocesses
  inherit it), steps aside while a request runs (`YieldToRequests`) and the interpreter switches
  threads often, so requests at warm buckets keep their latency while it compiles.

Which buckets it wants compiled: the start-up warm list (the default engine's), any bucket a request
asked for in a compiled mode (served eagerly meanwhile, or waiting for it with on_cold=wait), and
what a Warm message names.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine import settings
from engine.errors import Cancelled, EngineBusy, InvalidRequest, ShowcaseError
from engine.pipeline.batching import Gatherer
from engine.protocol import (
    BucketChanged,
    BucketKey,
    Cancel,
    CompileGranted,
    Fatal,
    FoldersChanged,
    FootprintChanged,
    Generate,
    GenerateRequest,
    InjectFault,
    LoraChanged,
    OnCold,
    Ready,
    RequestFailed,
    Shutdown,
    Warm,
    dispatch,
)
from engine.worker import logs
from engine.worker.priority import (
    RunCost,
    ShortRuns,
    YieldToRequests,
    join_own_process_group,
    lower_this_thread_priority,
    run_on_lowered_thread,
)
from engine.worker.served import EngineFacts, EngineReports, LoopPolicy
from engine.worker.serving import CallRules, RequestRecord, ServeCall, run_variant, serve_niced
from engine.worker.stepped import SessionParts, StepSession
from engine.worker.warming import BucketWarmer

if TYPE_CHECKING:
    from engine.pipeline.executor import Executor
    from engine.protocol import EngineReady, Size

EARLY_CANCELS_KEPT = 256  # cancels for requests not received yet (a cancel overtaking its request)
log = logging.getLogger(__name__)

# A request thread needs the GIL back after every torch op, and behind a compiling thread each hand-off
# waits up to the switch interval: the worker shortens it (settings.switch_interval_s(); docs/hosting.md).

# What other modules import from here (priority.py defines them).
__all__ = ["WorkerLoop", "YieldToRequests", "join_own_process_group", "lower_this_thread_priority",
           "run_on_lowered_thread", "worker_main"]


class WorkerLoop:
    """One engine's serving loop: a receiver thread takes messages, a warm-up thread compiles granted buckets,
    and the serving thread (`run`) serves the next call's requests until told to stop."""

    def __init__(self, conn, facts: EngineFacts, executor: Executor, reports: EngineReports,
                 policy: LoopPolicy | None = None, max_queue: int = 16, thread_prefix: str = "worker",
                 switch_interval: bool = True):
        """`facts`: the engine's key, board and batch sizes; `executor` runs its requests and warm-ups
        (engine/pipeline/executor.py); `reports`: what is told of it as it changes (engine/worker/served.py);
        `policy`: how it is served (a worker's by default). In the app's process (`switch_interval` False) the
        interpreter's thread switch interval is left as it is."""
        self.conn = conn
        self.facts = facts
        self.executor = executor
        self.reports = reports
        self.policy = policy or LoopPolicy()
        self.max_queue = max_queue
        self.thread_prefix = thread_prefix
        self.switch_interval = switch_interval
        self.shutdown_asked = False  # the client asked the engine to stop (not a mere hang-up)
        self._send_lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._records: dict[str, RequestRecord] = {}  # request id -> its state, until it is answered
        self._early_cancels: dict[str, bool] = {}  # cancels of requests not received yet (insertion order)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._folders_sent: tuple | None = None  # the folders the app was last told (Ready, FoldersChanged)
        self._lora_sent = None  # the LoRA slot the app was last told (LoraChanged)
        self.warmer = BucketWarmer(facts.board, executor, self.send, self._stop, self.policy.compile_steps_aside)
        # Only where the engines compute on the host's shared cores (an accelerator does the work elsewhere).
        self.run_cost = RunCost(settings.short_request_ms(), max_extra=settings.compile_niceness() - 2) \
            if facts.shares_host_cores and self.policy.orders_by_run_cost else None
        # This engine's short-run slot: which engines run a short request (set by the manager for cpu engines)
        self.short_runs = ShortRuns.from_env(settings.short_runs()) \
            if self.run_cost is not None and settings.long_requests_step_aside() else None
        # Queued requests that can share a denoiser call are served by one pipeline call (engine/pipeline/batching.py).
        self.batcher = Gatherer(self._requests, facts.max_batch, facts.batch_wait_ms, arrived=self._arrived,
                                sizes_for=self._batch_sizes_for, on_split=self.warmer.want_batch_size)

    def learn_from_measuring_run(self, measured: tuple[Size, float] | None) -> None:
        """The load's one eager step at the largest bucket (`measured`: its size and milliseconds) is a first
        estimate of eager requests' cost, so an engine's first requests are not taken for short ones (encode
        and decode counted as that step's: an overestimate, which later runs replace; RunCost keeps the least)."""
        if self.run_cost is not None and measured is not None:
            size, ms = measured
            self.run_cost.record("eager", size, 1, ms)

    def halt(self) -> None:
        """Stop serving: the serving thread ends after the call it runs."""
        self._stop.set()
        self._requests.put(None)

    def send(self, message) -> None:
        if isinstance(message, Ready):
            self._folders_sent = message.ready.folders
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):
                self._stop.set()

    # -- per-request and per-bucket records -------------------------------------------------------
    def _record(self, request_id: str) -> RequestRecord:
        with self._lock:
            return self._records.setdefault(request_id, RequestRecord())

    def _arrived(self, request: GenerateRequest) -> float | None:
        record = self._records.get(request.request_id)
        return record.received_at if record is not None else None

    def _forget(self, request: GenerateRequest) -> None:
        with self._lock:
            self._records.pop(request.request_id, None)

    # -- receiving (its own thread, so cancel, warm and grants arrive while a request runs) ------
    def _handlers(self) -> dict:
        return {
            Generate: self._on_generate,
            Cancel: self._on_cancel,
            Warm: self._on_warm,
            Shutdown: self._on_shutdown,
            InjectFault: self._on_inject_fault,
            CompileGranted: self._on_granted,
        }

    def _receive(self) -> None:
        handlers = self._handlers()
        peer = f"the client of {self.facts.key}"
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
        self.warmer.grants.put(None)

    def _on_generate(self, message: Generate) -> None:
        request = message.request
        if self.batcher.pending() >= self.max_queue:
            self.send(RequestFailed(request.request_id, EngineBusy(
                f"engine {self.facts.key} has {self.max_queue} requests waiting; retry in a few seconds")))
            return
        record = RequestRecord(received_at=time.perf_counter())
        if self._early_cancels.pop(request.request_id, None):  # its cancel was sent before it
            record.cancel.set()
        bucket = request.bucket
        with self._lock:
            self._records[request.request_id] = record
        self.warmer.asked_for(bucket)
        if request.mode.compiled and not self._is_warm(bucket):
            # Served eagerly now (or it waits), compiled for the next request. A failed bucket is retried
            # only when someone asks to warm it, not on every request.
            self.warmer.want(bucket, retry_failed=False)
        self._requests.put(request)

    def _on_shutdown(self, message) -> None:
        """Stop now: the running request stops at its next step (its client is going away too)."""
        self.shutdown_asked = True
        self._stop.set()
        with self._lock:
            records = list(self._records.values())
        for record in records:
            record.cancel.set()

    def _on_cancel(self, message: Cancel) -> None:
        record = self._records.get(message.request_id)
        if record is not None:
            record.cancel.set()
            if (request := self.batcher.withdraw(message.request_id)) is not None:  # still queued: answered now
                self._cancelled_before_start(request)
            return
        # Not received yet (or long finished): kept, bounded, in case its Generate follows.
        self._early_cancels[message.request_id] = True
        while len(self._early_cancels) > EARLY_CANCELS_KEPT:
            self._early_cancels.pop(next(iter(self._early_cancels)))

    def _on_warm(self, message: Warm) -> None:
        if message.bucket is None:
            self.queue_startup_warm()
        else:
            self.warmer.want(message.bucket)

    def _on_inject_fault(self, message: InjectFault) -> None:
        try:
            self.facts.faults.arm(message.fault)
        except InvalidRequest as exc:  # an engine not started for tests
            self.send(RequestFailed(None, exc))

    def _on_granted(self, message: CompileGranted) -> None:
        self.warmer.grants.put(message.bucket)

    # -- compile wishes ---------------------------------------------------------------------------
    def _is_warm(self, bucket: BucketKey) -> bool:
        return self.warmer.is_warm(bucket)

    def _batch_sizes_for(self, request: GenerateRequest) -> tuple[int, ...]:
        """The batch sizes `request` may run at now: any up to the engine's largest in eager (and when served
        eagerly because its bucket is not warm yet), else the warm ones of its bucket."""
        facts = self.facts
        if not request.mode.compiled:
            return tuple(range(1, facts.max_batch + 1))
        bucket = request.bucket
        if not self._is_warm(bucket):
            return (1,) if request.on_cold is OnCold.WAIT else tuple(range(1, facts.max_batch + 1))
        return tuple(b for b in facts.batch_sizes if b == 1 or self._is_warm(bucket.batched(b)))

    def queue_startup_warm(self) -> None:
        for rank, bucket in enumerate(self.reports.buckets_to_warm()):
            self.warmer.want(bucket, startup_rank=rank)

    # -- warm-up ---------------------------------------------------------------------------------
    def _warm_forever(self) -> None:
        try:
            lower_this_thread_priority()
            self.warmer.compile_yield.yields = settings.compile_yields()
            self.warmer.run(self._warmed)
        except Exception as exc:
            self.policy.warm_up_failed(exc)  # a worker's raises it again: the thread ends with it
            if self.policy.stop_reason():
                self.halt()

    def _warmed(self) -> None:
        """A compile finished: the engine's footprint, and its folders if a full disk moved them."""
        self.send(FootprintChanged(self.reports.footprint()))
        self._report_folders()

    def _report_folders(self) -> None:
        """A compile that found the cache disk full or read-only moved this worker's compile and temporary
        folders: tell the app where they are now, and why."""
        folders = self.reports.folders()
        if folders is None or folders == self._folders_sent:
            return
        self.send(FoldersChanged(folders, self.reports.folders_notice))
        self._folders_sent = folders

    def report_lora(self) -> None:
        """A call changed the LoRA slot (a swap, a scale, a recompile): tell the app before its result goes, so
        a status read after the result shows the swap."""
        info = self.reports.lora_info()
        if info is None or info == self._lora_sent:
            return
        self.send(LoraChanged(info))
        self._lora_sent = info

    # -- serving ---------------------------------------------------------------------------------
    def run(self) -> None:
        """The serving thread: start the receiver and the warm-up thread, then serve call after call."""
        if self.switch_interval:
            sys.setswitchinterval(settings.switch_interval_s())
        for name, target in (("receive", self._receive), ("warm", self._warm_forever)):
            threading.Thread(target=target, name=f"{self.thread_prefix}-{name}", daemon=True).start()
        while not self._stop.is_set():
            group = self.batcher.next_batch()
            if group is None:
                break
            self.server_for(group)(group)
            if self.policy.stop_reason():  # e.g. a tensor-parallel group broke: serve no more
                self.halt()

    def server_for(self, group: list[GenerateRequest]) -> Callable[[list[GenerateRequest]], None]:
        """How to serve what the batcher gathered: a step at a time where the engine has a step function that
        covers every request of the group (engine/worker/stepped.py: requests that arrive meanwhile join or pause
        it between steps), else as one pipeline call (`serve_whole`). Returned, not called: one frame less
        between the loop and the pipeline."""
        stepper = getattr(self.executor, "stepper", None)  # set once the engine loaded
        if stepper is not None and not any(stepper.why_whole(r) or self._waits_for_compile(r) for r in group):
            return StepSession(self._session_parts(), stepper).serve
        return self.serve_whole

    def _session_parts(self) -> SessionParts:
        return SessionParts(self.max_queue, self.batcher.take_waiting, self.serve_whole, self.send, self._record,
                            self._cancelled_before_start, self._forget, self._batch_sizes_for, self.report_lora,
                            self.warmer.compile_yield)

    def _waits_for_compile(self, request: GenerateRequest) -> bool:
        return request.mode.compiled and request.on_cold is OnCold.WAIT and not self._is_warm(request.bucket)

    def serve_whole(self, group: list[GenerateRequest]) -> None:
        """Serve the requests of one pipeline call: one request alone, or a batch.
        To the host's CPU rules a call is one run: niced by its own expected time (per batch size), one short
        run in the short-run slots, stepping aside once per step. A lone request with on_cold=wait at a bucket
        not warm yet waits for its compile first."""
        live = [request for request in group if not self._cancelled_before_start(request)]
        if not live or (len(live) == 1 and not self._compiled_or_cancelled(live[0])):
            return
        lead, size = live[0], len(live)
        waited = size == 1 and lead.mode.compiled and lead.on_cold is OnCold.WAIT
        warm = not lead.mode.compiled or waited or self._is_warm(lead.bucket.batched(size))
        extra = self._extra_niceness(lead, warm, size)
        call = ServeCall(live, [self._record(r.request_id) for r in live], self.send, self.facts.faults,
                         CallRules(self.warmer.compile_yield, self.run_cost, self.short_runs), self.report_lora,
                         self.executor, long=extra > 0)
        try:
            if extra == 0:
                call.serve()
            else:
                serve_niced(extra, call.serve, "worker-serve")
        finally:
            for request in live:
                self._forget(request)

    def _compiled_or_cancelled(self, request: GenerateRequest) -> bool:
        """Whether `request` may run now: with on_cold=wait at a bucket not warm yet, once compiled; False when
        it was cancelled meanwhile (then answered so, and forgotten)."""
        record = self._record(request.request_id)
        try:
            if request.mode.compiled and request.on_cold is OnCold.WAIT and not self._is_warm(request.bucket):
                self.warmer.await_compile(request, record.cancel)
        except Cancelled as exc:
            self.send(RequestFailed(request.request_id, exc))
            self._forget(request)
            return False
        return True

    def _cancelled_before_start(self, request: GenerateRequest) -> bool:
        """Whether `request` was cancelled while queued (then answered so, and forgotten)."""
        if not self._record(request.request_id).cancel.is_set():
            return False
        self.send(RequestFailed(request.request_id, Cancelled(f"request {request.request_id} cancelled before it started")))
        self._forget(request)
        return True

    def _extra_niceness(self, lead: GenerateRequest, warm: bool, batch: int = 1) -> int:
        """How many nice steps lower a call led by `lead` runs (its expected time; 0 where runs are not ordered)."""
        if self.run_cost is None:
            return 0
        return self.run_cost.extra_niceness(run_variant(lead.mode, warm, batch), lead.bucket.size, lead.steps)


class BestEffortOutput:
    """A worker's stdout/stderr: the app's, until a write to it fails (the app's log pipe closed, its
    terminal gone); from then on output is dropped. A worker's output is diagnostics only, and a failed
    write must not fail what wrote it: tqdm's loading bar inside from_pretrained raised BrokenPipeError
    and the engine failed to load."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # broken pipe, closed file
                self._stream = None
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._stream = None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name):  # encoding, errors, fileno ...: what libraries ask of a stream
        return getattr(self._stream if self._stream is not None else sys.__stderr__, name)


def worker_main(config, conn, env: dict[str, str]) -> None:
    """Entry point of the spawned worker process. It never returns: it leaves with os._exit, so the
    interpreter's shutdown never runs here. That shutdown freezes the daemon threads (compile, warm-up,
    loading) wherever they are, and finalisers that then need a lock one of them held wait forever: a
    worker whose load failed hung in tqdm's __del__ and outlived its app."""
    code = 1
    try:
        serve_engine(config, conn, env)
        code = 0
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
    finally:
        try:
            conn.close()
        except OSError:
            pass
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # A compile may still be running in the warm-up thread: leave now rather than wait for it.
        os._exit(code)


def serve_engine(config, conn, env: dict[str, str], *, own_group: bool = True) -> None:
    """Load the engine and serve `conn` until Shutdown or hang-up: a worker process's body, and a Ray
    actor's (engine/fleet/actor.py; `own_group` False: Ray owns that process and its group)."""
    sys.stdout, sys.stderr = BestEffortOutput(sys.stdout), BestEffortOutput(sys.stderr)
    os.environ.update(env)  # before torch is imported: TORCHINDUCTOR_CACHE_DIR, TORCH_TPU_DEFER_AND_FUSE ...
    if own_group:
        join_own_process_group()
    try:
        os.nice(settings.worker_niceness())  # below the web server: it answers first under full load
    except OSError:
        pass
    logs.configure(settings.log_level(), process=f"worker {config.key}",
                   prefix=f"[worker {config.key}] ")
    logs.thread_locks_for_progress_bars()
    made: dict = {}

    def load() -> tuple[WorkerLoop, EngineReady]:
        from engine.pipeline.runner import PipelineRunner

        runner = PipelineRunner(config, listener=lambda info: made.get("loop") and made["loop"].send(BucketChanged(info)))
        # The runner is this process's executor and reports on itself; the loop holds neither as a runner.
        made["loop"] = loop = WorkerLoop(conn, EngineFacts.of(runner), runner, runner,
                                         max_queue=config.options.batching.max_queue)
        runner.load()
        runner.measure_peak()  # the footprint it reports counts a real run, not just the weights
        loop.learn_from_measuring_run(runner.measured_run)
        gc.collect()
        gc.freeze()  # the model and libraries live as long as the worker: later collections skip them
        return loop, runner.ready_info()

    try:
        # Loading (imports, weights, one measuring run: seconds of CPU) is background work like a compile:
        # on a thread as far below this worker's requests as its compiles, so engines loading for new
        # visitors do not slow the warm requests of loaded ones (docs/hosting.md).
        # The serving thread (this one) keeps the worker's priority.
        loop, ready = run_on_lowered_thread(load, settings.compile_niceness(), name="worker-load")
        loop.send(Ready(ready))
    except Exception as exc:
        err = exc if isinstance(exc, ShowcaseError) else ShowcaseError(f"{type(exc).__name__}: {exc}")
        log.error("worker failed to start: %s\n%s", exc, traceback.format_exc())
        try:
            conn.send(Fatal(err))
        except OSError:
            pass  # the app is gone: nobody to tell
        return
    loop.queue_startup_warm()
    loop.run()
