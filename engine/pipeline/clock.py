"""What a run measures: its clock (start, denoise loop start, each step's end), the graphs the calling
thread compiled, and the compile caches' hits and misses."""

from __future__ import annotations

import threading
import time

from engine import devices
from engine.protocol import Timings

# Dynamo's compile-start callback runs in the compiling thread, so counting per thread tells a
# request how many graphs *it* compiled, even while the warm-up thread compiles other buckets.
_compiles_by_thread: dict[int, int] = {}
_compile_counter_installed = False


def install_compile_counter() -> None:
    global _compile_counter_installed
    if _compile_counter_installed:
        return
    from torch._dynamo.callback import on_compile_start

    @on_compile_start
    def _count(_args) -> None:
        tid = threading.get_ident()
        _compiles_by_thread[tid] = _compiles_by_thread.get(tid, 0) + 1

    _compile_counter_installed = True


def compiles_in_this_thread() -> int:
    return _compiles_by_thread.get(threading.get_ident(), 0)


def cache_counters() -> tuple[int, int]:
    """Compile-cache hits and misses so far in this process (AOTAutograd + inductor FX-graph caches)."""
    from torch._dynamo.utils import counters

    aot, inductor = counters["aot_autograd"], counters["inductor"]
    hits = aot["autograd_cache_hit"] + inductor["fxgraph_cache_hit"]
    misses = aot["autograd_cache_miss"] + inductor["fxgraph_cache_miss"]
    return hits, misses


class RunClock:
    """Marks of one run: start, denoise loop start (the pipeline opens its progress bar), each step end
    (callback_on_step_end)."""

    def __init__(self, spec: devices.DeviceSpec):
        self.spec = spec
        self.start = time.perf_counter()
        self.loop_start: float | None = None
        self.step_ends: list[float] = []

    def mark_loop_start(self) -> None:
        if self.loop_start is not None:
            return
        self.spec.synchronize()
        self.loop_start = time.perf_counter()

    def mark_step_end(self) -> float:
        self.spec.synchronize()  # device-synchronised per-step latency
        now = time.perf_counter()
        prev = self.step_ends[-1] if self.step_ends else (self.loop_start or self.start)
        self.step_ends.append(now)
        return (now - prev) * 1000

    def exclude(self, seconds: float) -> None:
        """Keep `seconds` of work done at the last step's end (a partial image's decode) out of the next step's
        time; the run's total keeps it."""
        if self.step_ends:
            self.step_ends[-1] += seconds

    def timings(self, end: float) -> Timings:
        loop_start = self.loop_start or self.start
        edges = [loop_start, *self.step_ends]
        steps = tuple((b - a) * 1000 for a, b in zip(edges, edges[1:], strict=False))
        last = self.step_ends[-1] if self.step_ends else loop_start
        return Timings(
            step_ms=steps,
            encode_ms=(loop_start - self.start) * 1000,
            denoise_ms=(last - loop_start) * 1000,
            decode_ms=(end - last) * 1000,
            total_ms=(end - self.start) * 1000,
        )
