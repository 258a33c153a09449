"""Shorter requests first where engines share the host's CPU cores.

On a cpu device every engine's requests are computed by the same few cores, and the kernel shares them
equally: in the soak (4 visitors, 2 cores) bfloat16 and float16 requests cost 150-550 ms each on cpu (no
fast half-precision matmul), float32 ones 25-160 ms, and a short request ran beside the long ones at an
equal share. Each worker therefore runs a request on a thread niced by how long the request is expected
to run: up to `short_ms` at the worker's own priority, then two nice steps lower per doubling (each step is
~1.25 × less CPU weight, so the weight falls roughly as expected time^-0.64), at most `max_extra` steps,
and as a batch thread (no wake-up preemption). The kernel's weighted fair sharing then approximates
shortest-job-first across processes without a host-wide lock: a short request gets most of a contended
core, a long one still always moves (weights, not strict priority), equally long ones share fairly, and
the compile thread stays below every request. Requests of the same expected length are not ordered.
Tried and dropped: long requests as SCHED_IDLE (CPU only when nothing else wants it): a warm 28 ms
request's run-queue wait in the soak did not fall (p95 37 ms vs 24 ms with weights; what it waits for is
the web server and other short work, not long requests), and SCHED_IDLE can starve.

This only works while the workers share one scheduling group with each other and the web server: on
Linux with autogroup scheduling, sessions share the CPU equally first and niceness counts only inside a
session, so workers stay in the app's session (engine.worker.join_own_process_group).

Expected run time: the best (least contended) milliseconds per step seen at the same bucket in the same
variant (the compiled graph, or eager: a compiled mode's bucket that is not warm yet is served eagerly),
times the request's steps; a bucket not seen yet scales the variant's best per-pixel rate by its pixels.
An engine that has run nothing yet gives no estimate: its requests run at the worker's priority.
"""

from __future__ import annotations

import math
import threading

from engine.protocol import Size


class RunCost:
    def __init__(self, short_ms: float, max_extra: int):
        self.short_ms = short_ms
        self.max_extra = max(0, max_extra)
        self._lock = threading.Lock()
        self._per_step: dict[tuple[str, Size], float] = {}  # (variant, size) -> best ms per step
        self._per_pixel_step: dict[str, float] = {}  # variant -> best ms per step per pixel

    def record(self, variant: str, size: Size, steps: int, total_ms: float) -> None:
        """A finished run: its total time over its steps (encode and decode included)."""
        if steps < 1 or total_ms <= 0:
            return
        per_step = total_ms / steps
        with self._lock:
            key = (variant, size)
            self._per_step[key] = min(per_step, self._per_step.get(key, math.inf))
            rate = per_step / size.pixels
            self._per_pixel_step[variant] = min(rate, self._per_pixel_step.get(variant, math.inf))

    def expected_ms(self, variant: str, size: Size, steps: int) -> float | None:
        with self._lock:
            per_step = self._per_step.get((variant, size))
            if per_step is None and variant in self._per_pixel_step:
                per_step = self._per_pixel_step[variant] * size.pixels
        return None if per_step is None else per_step * steps

    def extra_niceness(self, variant: str, size: Size, steps: int) -> int:
        """Nice steps to add for this request: 0 up to short_ms, then 2 per doubling, at most max_extra."""
        expected = self.expected_ms(variant, size, steps)
        if self.short_ms <= 0 or expected is None or expected <= self.short_ms:
            return 0
        doublings = math.ceil(math.log2(expected / self.short_ms))
        return min(self.max_extra, 2 * doublings)
