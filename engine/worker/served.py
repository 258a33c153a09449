"""What a WorkerLoop (engine/worker/loop.py) is given besides its connection: the facts of the engine it
serves, what that engine reports, and the policy it serves by.

The loop never holds the engine itself: its calls that do work go to an `Executor`
(engine/pipeline/executor.py), what it tells the app about the engine comes from `EngineReports`, and what
it reads once (its key, board, batch sizes) is an `EngineFacts`. How it serves differs by runtime through a
`LoopPolicy` it is given: a worker's by default, a tensor-parallel rank 0's in engine/tp/sidecar.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.pipeline.board import BucketBoard
    from engine.pipeline.faults import Faults
    from engine.protocol import BucketKey, EngineKey, Footprint, LoraInfo


@dataclass(frozen=True)
class EngineFacts:
    """What the loop reads of its engine, fixed once the engine is built (before it loads)."""

    key: EngineKey
    board: BucketBoard  # its buckets' states, shared with the engine that updates them
    faults: Faults  # its test hooks, armed by InjectFault
    max_batch: int = 1  # the most requests one call serves
    batch_sizes: tuple[int, ...] = (1,)  # the batch sizes it compiles
    batch_wait_ms: float = 0.0  # how long a call waits for requests to join it
    shares_host_cores: bool = False  # it computes on the host's CPU cores (requests are ordered by cost)

    @classmethod
    def of(cls, runner) -> EngineFacts:
        """The facts of a PipelineRunner (engine/pipeline/runner.py), or of its tensor-parallel subclass."""
        return cls(key=runner.config.key, board=runner.board, faults=runner.faults, max_batch=runner.max_batch,
                   batch_sizes=tuple(runner.batch_sizes), batch_wait_ms=runner.options.batching.batch_wait_ms,
                   shares_host_cores=runner.spec.host_memory_is_device_memory)


class EngineReports(Protocol):
    """What the loop tells the app about its engine as it changes (a PipelineRunner implements it)."""

    folders_notice: str  # why the compile folders moved ("" until they have)

    def footprint(self) -> Footprint | None: ...

    def folders(self) -> tuple[tuple[str, str], ...]: ...

    def lora_info(self) -> LoraInfo | None: ...

    def buckets_to_warm(self) -> list[BucketKey]: ...


class LoopPolicy:
    """How a loop serves: a worker's. Its compiles step aside while a request runs; where requests share the
    host's cores they are niced by their expected time; nothing stops it but its client; a failure of its
    warm-up thread ends that thread with the error."""

    compile_steps_aside = True  # the warm-up thread waits while a request runs (YieldToRequests)
    orders_by_run_cost = True  # long requests on the host's shared cores run niced (engine/worker/priority.py)

    def stop_reason(self) -> str | None:
        """Why the loop must stop serving now (None or "": it serves on); asked after each call."""
        return None

    def warm_up_failed(self, error: Exception) -> None:
        """The warm-up thread stopped with `error`: raised again, so the thread ends with its traceback."""
        raise error
