"""One engine's compile wishes and its warm-up: which buckets are wanted (a `BucketDemand` each), asking the
host's compile scheduler for them (`CompileWanted`), and compiling each bucket the scheduler grants
(`CompileGranted` -> `CompileFinished`), stepping aside while a request runs (`YieldToRequests`).

The worker loop (engine/worker/loop.py) runs `run` on its warm-up thread and asks here whether a bucket is
warm, for a compile a request waits for, and for the start-up list."""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import Cancelled
from engine.protocol import BucketKey, BucketState, CompileFinished, CompileWanted, GenerateRequest
from engine.worker.priority import YieldToRequests

if TYPE_CHECKING:
    from engine.pipeline.executor import Executor


@dataclass
class BucketDemand:
    """What this worker knows of one bucket's demand: requests that asked for it, requests waiting for its
    compile, and whether its compile is asked for (at a start-up rank, or None: asked for by a request)."""

    hits: int = 0
    waiting: int = 0
    asked: bool = False
    startup_rank: int | None = None


class BucketWarmer:
    """Compile wishes and compiles of one engine's buckets. `board`: the engine's bucket states; `executor`
    compiles and warms one (engine/pipeline/executor.py); `send` tells the app; `stop` is the loop's stop event;
    `steps_aside`: a compile pauses while a request runs (not on a tensor-parallel rank, whose peers compute
    in step with it)."""

    def __init__(self, board, executor: Executor, send: Callable[[object], None], stop: threading.Event,
                 steps_aside: bool = True):
        self.board = board
        self.executor = executor
        self.send = send
        self.stop = stop
        self.steps_aside = steps_aside
        self.compile_yield = YieldToRequests()
        self._lock = threading.Lock()
        self._demand: dict[BucketKey, BucketDemand] = {}
        self.grants: queue.Queue = queue.Queue()  # buckets the scheduler granted (None: stop the warm-up thread)

    def _bucket_demand(self, bucket: BucketKey) -> BucketDemand:
        """Under self._lock."""
        return self._demand.setdefault(bucket, BucketDemand())

    def is_warm(self, bucket: BucketKey) -> bool:
        info = self.board.get(bucket)
        return info is not None and info.state == BucketState.WARM

    def asked_for(self, bucket: BucketKey) -> None:
        """A request asked for `bucket` (its priority at the scheduler counts the hits)."""
        with self._lock:
            self._bucket_demand(bucket).hits += 1

    def want_batch_size(self, request: GenerateRequest, batch: int) -> None:
        """A group ran as smaller calls because `batch` is not warm at its bucket: ask for that compile."""
        if request.mode.compiled and self.is_warm(request.bucket):
            bucket = request.bucket.batched(batch)
            self.asked_for(bucket)
            self.want(bucket, retry_failed=False)

    def want(self, bucket: BucketKey, startup_rank: int | None = None, retry_failed: bool = True) -> None:
        """Ask the host's scheduler for a compile of `bucket` (again: updates its priority)."""
        if not bucket.mode.compiled:
            return
        info = self.board.get(bucket)
        skip = {BucketState.WARM, BucketState.COMPILING} | (set() if retry_failed else {BucketState.FAILED})
        if info is not None and info.state in skip:
            return
        with self._lock:
            demand = self._bucket_demand(bucket)
            new = not demand.asked
            if new or demand.startup_rank is None:  # a start-up rank, once given, stays
                demand.startup_rank = startup_rank
            demand.asked = True
            wish = CompileWanted(bucket, waiting=demand.waiting, hits=demand.hits, startup_rank=demand.startup_rank)
        if new:
            self.board.update(bucket, state=BucketState.QUEUED, error=None)
        self.send(wish)

    def run(self, warmed: Callable[[], None]) -> None:
        """The warm-up thread: compile each granted bucket still wanted and cold; `warmed()` runs after each
        compile (the engine's footprint and folders are reported there). A compile set aside for a request
        goes back in the scheduler's queue."""
        while not self.stop.is_set():
            bucket = self.grants.get()
            if bucket is None or self.stop.is_set():
                return
            with self._lock:
                demand = self._bucket_demand(bucket)
                wanted, demand.asked, startup_rank, demand.startup_rank = demand.asked, False, demand.startup_rank, None
            try:
                with self.compile_yield.compiling_of(bucket, self.steps_aside) as compile_run:
                    if wanted and not self.is_warm(bucket):
                        self.executor.warm_bucket(bucket)
                        warmed()
                        self._collect_garbage()
            finally:
                self.send(CompileFinished(bucket))
            if compile_run.set_aside and not self.is_warm(bucket):  # back in the queue (stopped once warm: stays)
                self.board.update(bucket, state=BucketState.QUEUED, error=None)
                self.want(bucket, startup_rank=startup_rank)

    def _collect_garbage(self) -> None:
        """A compile leaves many objects; the garbage collector's full passes over them (and over the model)
        held the GIL in whichever thread allocated last: a request's (docs/hosting.md). Collect now, when
        no request runs, and freeze what survives (the compiled graphs stay for the engine's life), so
        later full passes only walk what is new."""
        self.compile_yield.idle.wait(timeout=5.0)
        gc.collect()
        gc.freeze()

    def await_compile(self, request: GenerateRequest, cancel: threading.Event) -> None:
        """on_cold=wait at a bucket that is not warm: ask for its compile first in line, then wait."""
        bucket = request.bucket
        with self._lock:
            self._bucket_demand(bucket).waiting += 1
        try:
            info = self.board.get(bucket)
            if info is not None and info.state == BucketState.FAILED:
                return  # it already failed: the runner serves eagerly with the reason
            self.want(bucket, retry_failed=False)
            if self.steps_aside:  # one compile at a time here: a background one is stopped
                self.compile_yield.set_aside_unless_waited(bucket, lambda b: self._bucket_demand(b).waiting > 0)
            event = self.board.event(bucket)
            while not event.wait(0.2):
                if cancel.is_set() or self.stop.is_set():
                    raise Cancelled(f"request {request.request_id} cancelled while waiting for {bucket} to compile")
        finally:
            with self._lock:
                self._bucket_demand(bucket).waiting -= 1
