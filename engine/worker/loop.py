"""The worker process that owns one engine's pipeline (one per (model, device, precision)).

Why a process: compiling holds the GIL for seconds, and a crash in a device backend must not take the
web server down. The worker speaks the typed
message protocol of engine/protocol.py over a `multiprocessing` Connection; the tensor-parallel
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

import dataclasses
import gc
import logging
import os
import queue
import sys
import threading
import time
import traceback

from engine import settings
from engine.errors import Cancelled, EngineBusy, InvalidRequest, ShowcaseError
from engine.pipeline.batching import AllSet, Gatherer
from engine.protocol import (
    BucketChanged,
    BucketKey,
    BucketState,
    Cancel,
    CompileFinished,
    CompileGranted,
    CompileWanted,
    Fatal,
    Fault,
    FoldersChanged,
    FootprintChanged,
    Generate,
    GenerateRequest,
    GenerateResult,
    InjectFault,
    OnCold,
    Progress,
    Ready,
    RequestFailed,
    Result,
    Shutdown,
    Warm,
    dispatch,
)
from engine.worker import logs
from engine.worker.priority import RunCost, ShortRuns

EARLY_CANCELS_KEPT = 256  # cancels for requests not received yet (a cancel overtaking its request)
log = logging.getLogger(__name__)

# A request thread needs the GIL back after every torch op, and behind a compiling thread each hand-off
# waits up to the switch interval: the worker shortens it (settings.switch_interval_s(); docs/hosting.md).


def lower_this_thread_priority(by: int | None = None) -> bool:
    """Linux: nice only the calling thread (and the compiler processes it starts, which inherit it),
    `by` steps below the process (settings.compile_niceness()), and mark it a batch thread
    (SCHED_BATCH: the kernel no longer lets it preempt others when it wakes, so the short requests and
    the web server it shares cores with get the CPU as soon as they wake)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        by = settings.compile_niceness() if by is None else by
        niceness = min(19, os.getpriority(os.PRIO_PROCESS, tid) + by)
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError:
        return False
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, niceness)  # keep the niceness across the policy change
    except (OSError, AttributeError):
        pass  # the niceness alone still holds
    return True


def run_on_lowered_thread(fn, by: int, name: str):
    """fn() on a new thread `by` nice steps below this one (Linux; elsewhere at this priority): its
    result, or its exception raised here."""
    outcome: dict = {}

    def target() -> None:
        lower_this_thread_priority(by)
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def join_own_process_group() -> None:
    """Make this process the leader of a new process group, so the app stops the worker *and* its compiler
    processes at once (killpg), in the app's session.

    Not a new session (setsid): Linux's autogroup scheduling (on by default in most desktop and VM kernels,
    /proc/sys/kernel/sched_autogroup_enabled) shares the CPU equally between sessions first and honours
    niceness only inside one. A worker in a session of its own got as much CPU as the web server and
    every other worker whatever its niceness: a long bf16 request took as much of the cores as a short
    warm one, and four busy workers left the web server a fifth."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


def fx_tracing() -> bool:
    """Whether some thread is inside a torch.fx symbolic trace (torch not imported: no)."""
    fx = sys.modules.get("torch.fx._symbolic_trace")  # its flag: is_fx_tracing() warns on every process's first call
    return bool(fx is not None and getattr(fx, "_is_fx_tracing_flag", False))


class YieldToRequests:
    """Lets the compile thread step aside while a request runs in the same worker.

    Compiling holds the GIL most of the time, partly in C calls the switch interval cannot cut short
    (fake-tensor propagation, pattern matching, garbage collection). A request re-acquires the GIL after
    every torch op, so a 66 ms request at a warm bucket took up to 0.54 s (p95) while its worker compiled.
    The compile thread installs `hook` as its profile function: at every Python function call, while a
    request runs, it waits (without the GIL) for the request to end. It waits at most `max_wait_s` per
    request: a request that needs something the compile thread holds (a lock, the import lock) then
    gets it, so this can delay a request but never deadlock it."""

    def __init__(self, max_wait_s: float = 0.5):
        self.max_wait_s = max_wait_s
        self._idle = threading.Event()
        self._idle.set()
        self._request = 0  # the running (or last) request's number
        self._gave_up_on = -1  # the request whose wait ran out: the compile thread runs beside it

    def request_started(self) -> None:
        self._request += 1
        self._idle.clear()
        # The compile thread may be inside a torch.fx symbolic trace, which patches torch.nn.Module.__call__
        # for every thread until it ends: a request run then fails ("module is not installed as a
        # submodule"). The hook lets a trace under way finish (it never pauses inside one, and pauses
        # before the next); the request starts after it.
        deadline = time.monotonic() + 10 * self.max_wait_s
        while fx_tracing() and time.monotonic() < deadline:
            time.sleep(0.001)

    def request_ended(self) -> None:
        self._idle.set()

    def wait_idle(self, timeout: float) -> bool:
        return self._idle.wait(timeout)

    def hook(self, frame, event, arg) -> None:
        if event != "call" or self._idle.is_set() or self._gave_up_on == self._request or fx_tracing():
            return
        request = self._request
        if not self._idle.wait(self.max_wait_s):
            self._gave_up_on = request


class WorkerLoop:
    compile_steps_aside = True  # the compile thread waits while a request runs (YieldToRequests)

    def __init__(self, conn, runner, max_queue: int = 16):
        self.conn = conn
        self.runner = runner
        self.max_queue = max_queue
        self._send_lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._cancels: dict[str, threading.Event] = {}
        self._early_cancels: dict[str, bool] = {}  # cancels of requests not received yet (insertion order)
        self._lock = threading.Lock()
        self._wanted: dict[BucketKey, int | None] = {}  # bucket -> start-up rank (None: asked for by a request)
        self._granted: queue.Queue = queue.Queue()
        self._hits: dict[BucketKey, int] = {}
        self._waiting: dict[BucketKey, int] = {}
        self._stop = threading.Event()
        self._received: dict[str, float] = {}  # request id -> when it arrived (its queue time)
        self._folders_sent: tuple | None = None  # the folders the app was last told (Ready, FoldersChanged)
        self.compile_yield = YieldToRequests()
        # Only where the engines compute on the host's shared cores (an accelerator does the work elsewhere).
        self.run_cost = RunCost(settings.short_request_ms(), max_extra=settings.compile_niceness() - 2) \
            if runner.spec.host_memory_is_device_memory else None
        # This engine's short-run slot: which engines run a short request (set by the manager for cpu engines)
        self.short_runs = ShortRuns.from_env(os.environ.get("SHOWCASE_SHORT_RUNS")) \
            if self.run_cost is not None and settings.long_requests_step_aside() else None
        # Queued requests that can share a denoiser call are served by one pipeline call (engine/pipeline/batching.py).
        batching = getattr(getattr(runner, "options", None), "batching", None)
        self.batcher = Gatherer(self._requests, getattr(runner, "max_batch", 1),
                                getattr(batching, "batch_wait_ms", 0.0), arrived=lambda r: self._received.get(r.request_id),
                                sizes_for=self._batch_sizes_for, on_split=self._want_batch_size)

    def learn_from_measuring_run(self) -> None:
        """The load's one eager step at the largest bucket is a first estimate of eager requests' cost, so an
        engine's first requests are not taken for short ones (encode and decode counted as that step's: an
        overestimate, which later runs replace; RunCost keeps the least)."""
        if self.run_cost is not None and self.runner.measured_run is not None:
            size, ms = self.runner.measured_run
            self.run_cost.record("eager", size, 1, ms)

    def send(self, message) -> None:
        if isinstance(message, Ready):
            self._folders_sent = message.ready.folders
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):
                self._stop.set()

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
        self._granted.put(None)

    def _on_generate(self, message: Generate) -> None:
        request = message.request
        if self.batcher.pending() >= self.max_queue:
            self.send(RequestFailed(request.request_id, EngineBusy(
                f"engine {self.runner.config.key} has {self.max_queue} requests waiting; retry in a few seconds")))
            return
        self._cancels[request.request_id] = event = threading.Event()
        if self._early_cancels.pop(request.request_id, None):  # its cancel was sent before it
            event.set()
        self._received[request.request_id] = time.perf_counter()
        bucket = request.bucket
        with self._lock:
            self._hits[bucket] = self._hits.get(bucket, 0) + 1
        if request.mode.compiled and not self._is_warm(bucket):
            # Served eagerly now (or it waits), compiled for the next request. A failed bucket is retried
            # only when someone asks to warm it, not on every request.
            self.want(bucket, retry_failed=False)
        self._requests.put(request)

    def _on_shutdown(self, message) -> None:
        """Stop now: the running request stops at its next step (its client is going away too)."""
        self._stop.set()
        for event in list(self._cancels.values()):
            event.set()

    def _on_cancel(self, message: Cancel) -> None:
        event = self._cancels.get(message.request_id)
        if event is not None:
            event.set()
            return
        # Not received yet (or long finished): kept, bounded, in case its Generate follows.
        self._early_cancels[message.request_id] = True
        while len(self._early_cancels) > EARLY_CANCELS_KEPT:
            self._early_cancels.pop(next(iter(self._early_cancels)))

    def _on_warm(self, message: Warm) -> None:
        if message.bucket is None:
            self.queue_startup_warm()
        else:
            self.want(message.bucket)

    def _on_inject_fault(self, message: InjectFault) -> None:
        try:
            self.runner.faults.arm(message.fault)
        except InvalidRequest as exc:  # an engine not started for tests
            self.send(RequestFailed(None, exc))

    def _on_granted(self, message: CompileGranted) -> None:
        self._granted.put(message.bucket)

    # -- compile wishes ---------------------------------------------------------------------------
    def _is_warm(self, bucket: BucketKey) -> bool:
        info = self.runner.board.get(bucket)
        return info is not None and info.state == BucketState.WARM

    def _batch_sizes_for(self, request: GenerateRequest) -> tuple[int, ...]:
        """The batch sizes `request` may run at now: any up to the engine's largest in eager (and when served
        eagerly because its bucket is not warm yet), else the warm ones of its bucket."""
        runner = self.runner
        if not request.mode.compiled:
            return tuple(range(1, runner.max_batch + 1))
        bucket = request.bucket
        if not self._is_warm(bucket):
            return (1,) if request.on_cold is OnCold.WAIT else tuple(range(1, runner.max_batch + 1))
        return tuple(b for b in runner.batch_sizes if b == 1 or self._is_warm(bucket.batched(b)))

    def _want_batch_size(self, request: GenerateRequest, batch: int) -> None:
        """A group ran as smaller calls because `batch` is not warm at its bucket: ask for that compile."""
        if request.mode.compiled and self._is_warm(request.bucket):
            bucket = request.bucket.batched(batch)
            with self._lock:
                self._hits[bucket] = self._hits.get(bucket, 0) + 1
            self.want(bucket, retry_failed=False)

    def queue_startup_warm(self) -> None:
        for rank, bucket in enumerate(self.runner.buckets_to_warm()):
            self.want(bucket, startup_rank=rank)

    def want(self, bucket: BucketKey, startup_rank: int | None = None, retry_failed: bool = True) -> None:
        """Ask the host's scheduler for a compile of `bucket` (again: updates its priority)."""
        if not bucket.mode.compiled:
            return
        info = self.runner.board.get(bucket)
        skip = {BucketState.WARM, BucketState.COMPILING} | (set() if retry_failed else {BucketState.FAILED})
        if info is not None and info.state in skip:
            return
        with self._lock:
            new = bucket not in self._wanted
            if new or startup_rank is not None:
                self._wanted[bucket] = startup_rank if new else (self._wanted[bucket] if self._wanted[bucket]
                                                                  is not None else startup_rank)
            wish = CompileWanted(bucket, waiting=self._waiting.get(bucket, 0), hits=self._hits.get(bucket, 0),
                                 startup_rank=self._wanted[bucket])
        if new:
            self.runner.board.update(bucket, state=BucketState.QUEUED, error=None)
        self.send(wish)

    # -- warm-up ---------------------------------------------------------------------------------
    def _warm_forever(self) -> None:
        lower_this_thread_priority()
        if self.compile_steps_aside and settings.compile_yields():
            sys.setprofile(self.compile_yield.hook)  # this thread only
        while not self._stop.is_set():
            bucket = self._granted.get()
            if bucket is None or self._stop.is_set():
                return
            with self._lock:
                wanted = self._wanted.pop(bucket, "not wanted") != "not wanted"
            try:
                if wanted and not self._is_warm(bucket):
                    self.runner.warm_bucket(bucket)
                    self.send(FootprintChanged(self.runner.footprint()))
                    self._report_folders()
                    self._collect_garbage()
            finally:
                self.send(CompileFinished(bucket))

    def _report_folders(self) -> None:
        """A compile that found the cache disk full or read-only moved this worker's compile and temporary
        folders: tell the app where they are now, and why."""
        folders = self.runner.folders() if hasattr(self.runner, "folders") else None
        if folders is None or folders == self._folders_sent:
            return
        self.send(FoldersChanged(folders, getattr(self.runner, "folders_notice", "")))
        self._folders_sent = folders

    def _collect_garbage(self) -> None:
        """A compile leaves many objects; the garbage collector's full passes over them (and over the model)
        held the GIL for up to 0.5 s, in whichever thread allocated last: a request's. Collect now, when
        no request runs, and freeze what survives (the compiled graphs stay for the engine's life), so
        later full passes only walk what is new."""
        self.compile_yield.wait_idle(timeout=5.0)
        gc.collect()
        gc.freeze()

    # -- serving ---------------------------------------------------------------------------------
    def _await_compile(self, request: GenerateRequest, cancel: threading.Event) -> None:
        """on_cold=wait at a bucket that is not warm: ask for its compile first in line, then wait."""
        bucket = request.bucket
        with self._lock:
            self._waiting[bucket] = self._waiting.get(bucket, 0) + 1
        try:
            info = self.runner.board.get(bucket)
            if info is not None and info.state == BucketState.FAILED:
                return  # it already failed: the runner serves eagerly with the reason
            self.want(bucket, retry_failed=False)
            event = self.runner.board.event(bucket)
            while not event.wait(0.2):
                if cancel.is_set() or self._stop.is_set():
                    raise Cancelled(f"request {request.request_id} cancelled while waiting for {bucket} to compile")
        finally:
            with self._lock:
                self._waiting[bucket] -= 1

    def _serve_one(self, request: GenerateRequest, long: bool = False) -> None:
        """Serve one request (as _serve_now does); with on_cold=wait at a bucket not warm yet, once compiled."""
        cancel = self._cancels.setdefault(request.request_id, threading.Event())
        try:
            if cancel.is_set():
                raise Cancelled(f"request {request.request_id} cancelled before it started")
            if request.mode.compiled and request.on_cold is OnCold.WAIT and not self._is_warm(request.bucket):
                self._await_compile(request, cancel)
        except Cancelled as exc:
            self.send(RequestFailed(request.request_id, exc))
            self._forget(request)
            return

        def call(on_step, cancels, on_leave, on_result) -> list:
            try:
                return [self.runner.generate(request, on_step=on_step, cancel=cancels[0])]
            except Exception as exc:  # noqa: BLE001 - its outcome
                return [exc]

        self._serve_now([request], call, long=long)

    def _serve_batch(self, group: list[GenerateRequest]) -> None:
        """Serve requests sharing one pipeline call. To the host's CPU rules it is one run: niced by its own
        expected time (per batch size), one short run in the short-run slots, stepping aside once per step."""
        live = []
        for request in group:
            cancel = self._cancels.setdefault(request.request_id, threading.Event())
            if cancel.is_set():
                self.send(RequestFailed(request.request_id, Cancelled(
                    f"request {request.request_id} cancelled before it started")))
                self._forget(request)
            else:
                live.append(request)
        if len(live) <= 1:
            for request in live:
                self._serve(request)
            return
        extra = 0
        if self.run_cost is not None:
            lead = live[0]
            warm = self._is_warm(lead.bucket.batched(len(live))) or not lead.mode.compiled
            extra = self.run_cost.extra_niceness(self._batch_variant(lead.mode, warm, len(live)), lead.bucket.size,
                                                 lead.steps)

        def call(on_step, cancels, on_leave, on_result) -> list:
            return self.runner.generate_batch(live, on_step=on_step, cancels=cancels, on_leave=on_leave,
                                              on_result=on_result)

        self._serve_niced(extra, lambda **kw: self._serve_now(live, call, **kw), "worker-serve-batch")

    def _serve_now(self, group: list[GenerateRequest], call, long: bool = False) -> None:
        """Serve one request, or requests sharing one pipeline call: `call(on_step, cancels, on_leave, on_result)`
        returns each one's outcome (its GenerateResult, the exception it failed with, or None when it was
        already answered through on_leave or on_result). To the host's CPU rules it is one run: a `long` one
        steps aside before each (shared) step while another engine runs a short one (ShortRuns), a short one
        tells the others it runs."""
        cancels = [self._cancels.setdefault(r.request_id, threading.Event()) for r in group]
        logged_as = logs.REQUEST_ID.set(",".join(r.request_id for r in group))  # this thread's log lines
        crash = self.runner.faults.take(Fault.CRASH)
        short_runs = self.short_runs
        step_aside = short_runs.step_aside if short_runs is not None and long else None
        everyone = AllSet(cancels)
        stepped = [0]

        def on_step(progress):
            self.send(Progress(progress))
            if crash:
                self.runner.faults.crash()  # armed by a test: the worker dies mid-request
            if step_aside is not None and stepped[0] < progress.step < progress.total:
                stepped[0] = progress.step  # once per shared step
                step_aside(everyone)

        def on_leave(index: int, error: ShowcaseError) -> None:
            self.send(RequestFailed(group[index].request_id, error))

        start = time.perf_counter()
        queued_ms = {}
        for r in group:
            received = self._received.pop(r.request_id, None)
            queued_ms[r.request_id] = (start - received) * 1000 if received is not None else 0.0
        answered: list[GenerateResult] = []

        def on_result(index: int, result: GenerateResult) -> None:
            answered.append(result)
            timings = dataclasses.replace(result.timings, queued_ms=queued_ms[group[index].request_id])
            self.send(Result(dataclasses.replace(result, timings=timings)))

        try:
            self.compile_yield.request_started()
            announce = short_runs is not None and not long
            if announce:
                short_runs.set_running(True)
            try:
                if step_aside is not None:
                    step_aside(everyone)  # before its first step too
                outcomes = call(on_step, cancels, on_leave, on_result)
            finally:
                if announce:
                    short_runs.set_running(False)
                self.compile_yield.request_ended()
            for index, (request, outcome) in enumerate(zip(group, outcomes, strict=True)):
                if outcome is None:
                    continue
                if isinstance(outcome, GenerateResult):
                    on_result(index, outcome)
                elif isinstance(outcome, ShowcaseError):
                    self.send(RequestFailed(request.request_id, outcome))
                else:
                    log.error("request %s failed", request.request_id, exc_info=outcome)
                    self.send(RequestFailed(request.request_id,
                                            ShowcaseError(f"{type(outcome).__name__}: {outcome}")))
            if self.run_cost is not None and answered:  # the call's time: its last result came at its end
                last = max(answered, key=lambda result: result.timings.total_ms)
                self.run_cost.record(self._batch_variant(last.bucket.mode, last.warm, last.batch_size),
                                     last.bucket.size, last.steps, last.timings.total_ms)
        except Exception as exc:  # never let one request or batch kill the worker
            log.exception("serving %s failed", ", ".join(r.request_id for r in group))
            done = {result.request_id for result in answered}
            for request in group:
                if request.request_id not in done:
                    self.send(RequestFailed(request.request_id, ShowcaseError(f"{type(exc).__name__}: {exc}")))
        finally:
            for request in group:
                self._forget(request)
            logs.REQUEST_ID.reset(logged_as)

    def _forget(self, request: GenerateRequest) -> None:
        self._cancels.pop(request.request_id, None)
        self._received.pop(request.request_id, None)

    @classmethod
    def _batch_variant(cls, mode, warm: bool, batch: int) -> str:
        """RunCost's key for a call of `batch` requests: the variant, and the batch size beyond one."""
        variant = cls._variant(mode, warm)
        return variant if batch <= 1 else f"{variant}/b{batch}"

    @staticmethod
    def _variant(mode, warm: bool) -> str:
        """What computes a request: its mode's compiled graph, or eager (eager mode, or not warm yet)."""
        return str(mode) if mode.compiled and warm else "eager"

    def _extra_niceness(self, request: GenerateRequest) -> int:
        if self.run_cost is None:
            return 0
        warm = self._is_warm(request.bucket) or (request.mode.compiled and request.on_cold is OnCold.WAIT)
        return self.run_cost.extra_niceness(self._variant(request.mode, warm), request.bucket.size, request.steps)

    def _serve(self, request: GenerateRequest) -> None:
        self._serve_niced(self._extra_niceness(request), lambda **kw: self._serve_one(request, **kw), "worker-serve")

    @staticmethod
    def _serve_niced(extra: int, serve, name: str) -> None:
        """serve() on this thread, or serve(long=True) on a fresh one `extra` nice steps lower (a thread
        cannot raise its own priority again without privileges; a new thread starts at this one's). The TP
        sidecar's loop never nices, and its _serve_one takes no `long`."""
        if extra == 0:
            serve()
            return

        def serve_niced():
            lower_this_thread_priority(extra)
            serve(long=True)

        thread = threading.Thread(target=serve_niced, name=f"{name}-nice{extra}", daemon=True)
        thread.start()
        thread.join()

    thread_prefix = "worker"

    def switch_interval_s(self) -> float | None:
        """The interpreter's thread switch interval for this process (None: leave it)."""
        return settings.switch_interval_s()

    def run(self) -> None:
        if (interval := self.switch_interval_s()) is not None:
            sys.setswitchinterval(interval)
        receiver = threading.Thread(target=self._receive, name=f"{self.thread_prefix}-receive", daemon=True)
        receiver.start()
        warmer = threading.Thread(target=self._warm_forever, name=f"{self.thread_prefix}-warm", daemon=True)
        warmer.start()
        while not self._stop.is_set():
            group = self.batcher.next_batch()
            if group is None:
                break
            if len(group) == 1:
                self._serve(group[0])
            else:
                self._serve_batch(group)


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
        _serve_engine(config, conn, env)
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


def _serve_engine(config, conn, env: dict[str, str]) -> None:
    sys.stdout, sys.stderr = BestEffortOutput(sys.stdout), BestEffortOutput(sys.stderr)
    os.environ.update(env)  # before torch is imported: TORCHINDUCTOR_CACHE_DIR, TORCH_TPU_DEFER_AND_FUSE ...
    join_own_process_group()
    try:
        os.nice(settings.worker_niceness())  # below the web server: it answers first under full load
    except OSError:
        pass
    logs.configure(os.environ.get("SHOWCASE_LOG_LEVEL", "WARNING"), process=f"worker {config.key}",
                   prefix=f"[worker {config.key}] ")
    made: dict = {}

    def load() -> WorkerLoop:
        from engine.pipeline.runner import PipelineRunner

        runner = PipelineRunner(config, listener=lambda info: made.get("loop") and made["loop"].send(BucketChanged(info)))
        made["loop"] = WorkerLoop(conn, runner, max_queue=config.options.batching.max_queue)
        runner.load()
        runner.measure_peak()  # the footprint it reports counts a real run, not just the weights
        made["loop"].learn_from_measuring_run()
        gc.collect()
        gc.freeze()  # the model and libraries live as long as the worker: later collections skip them
        return made["loop"]

    try:
        # Loading (imports, weights, one measuring run: seconds of CPU) is background work like a compile:
        # on a thread as far below this worker's requests as its compiles, so engines loading for new
        # visitors do not slow the warm requests of loaded ones (in the soak, the probe's first ~20
        # requests, while three engines loaded, were its slowest: p50 0.12-0.16 s against 0.09 s).
        # The serving thread (this one) keeps the worker's priority.
        loop = run_on_lowered_thread(load, settings.compile_niceness(), name="worker-load")
        loop.send(Ready(loop.runner.ready_info()))
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
