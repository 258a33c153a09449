"""`python -m bench contention`: a warm bucket's latency while its own worker compiles other buckets.

One engine (a real worker process, as the app runs it) warms one bucket, measures requests there idle,
then queues compiles of other buckets of the same engine (with an empty compile cache, so they really
compile) and keeps asking for the warm bucket until they are done or `--duration` runs out. By default
it does this twice, side by side in one run: with the compile thread stepping aside while a request runs
(the worker's default) and without (`SHOWCASE_COMPILE_YIELD=0`), each in a fresh compile cache.

Printed per run: idle median and p95, p50/p95 while compiling, p95 ÷ idle median (target ≤ 2), the
compile seconds of each bucket (what stepping aside costs the compiles).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine.config.flags import from_args
from engine.config.request import ImageRequest
from engine.metrics import median
from engine.protocol import EngineOptions

TARGET = 2.0


def _p95(values: list[float]) -> float:
    s = sorted(values)
    return s[round(0.95 * (len(s) - 1))]


def measure(opts, yields: bool) -> dict:
    from engine.serving.manager import EngineManager

    os.environ["SHOWCASE_COMPILE_YIELD"] = "1" if yields else "0"  # the worker reads it when it starts
    cache = tempfile.mkdtemp(prefix="contention-")
    manager = EngineManager(cache_dir=cache, options=EngineOptions(warm_sizes=()))
    request = dict(preset=opts.preset, device=opts.device, precision=opts.precision, prompt="a red circle",
                   steps=opts.steps)
    try:
        manager.generate(ImageRequest(**request, mode=opts.mode, size=opts.size, on_cold="wait"))

        def timed() -> float:
            start = time.perf_counter()
            result = manager.generate(ImageRequest(**request, mode=opts.mode, size=opts.size))
            if not result.warm:
                raise RuntimeError(f"{opts.mode} {opts.size} was not warm")
            return (time.perf_counter() - start) * 1000

        idle = [timed() for _ in range(opts.idle_runs)]
        others = [s for s in manager.catalog.preset(opts.preset).buckets if str(s) != opts.size]
        for size in others:
            manager.warm(opts.preset, opts.device, opts.precision, mode=opts.compile_mode, size=str(size))

        def compiling_rows() -> list[dict]:
            return [b for e in manager.residency.status_rows() for b in e.get("buckets", [])
                    if b["mode"] == opts.compile_mode and b["size"] != opts.size]

        busy: list[float] = []
        start = time.monotonic()
        while time.monotonic() - start < opts.duration:
            if busy and not any(b["state"] in ("queued", "compiling") for b in compiling_rows()):
                break
            busy.append(timed())
            time.sleep(opts.gap_s)
        elapsed = time.monotonic() - start
        compiles = {b["size"]: (b["state"], b["compile_s"], b["cache_hits"], b["cache_misses"])
                    for b in compiling_rows()}
    finally:
        manager.shutdown()
    idle_median = median(idle)
    return {
        "compile_yields": yields,
        "idle_median_ms": idle_median,
        "idle_p95_ms": _p95(idle),
        "compiling_p50_ms": median(busy),
        "compiling_p95_ms": _p95(busy),
        "p95_over_idle": _p95(busy) / idle_median,
        "samples": len(busy),
        "compiling_phase_s": elapsed,
        "compiles": compiles,
    }


def print_run(row: dict) -> None:
    label = "compile thread steps aside" if row["compile_yields"] else "compile thread runs beside requests"
    ratio = row["p95_over_idle"]
    print(f"{label}:")
    print(f"  idle: median {row['idle_median_ms']:.1f} ms, p95 {row['idle_p95_ms']:.1f} ms")
    print(f"  while compiling ({row['samples']} requests over {row['compiling_phase_s']:.0f} s): "
          f"p50 {row['compiling_p50_ms']:.1f} ms, p95 {row['compiling_p95_ms']:.1f} ms = {ratio:.2f} x idle "
          f"(target <= {TARGET:g}: {'met' if ratio <= TARGET else 'MISSED'})")
    for size, (state, seconds, hits, misses) in row["compiles"].items():
        print(f"  compile {size}: {state}" + (f", {seconds:.1f} s (FX graph cache hits/misses {hits}/{misses})"
                                              if seconds else ""))


def main(args) -> int:
    opts = from_args(ContentionOptions, args)
    rows = [measure(opts, yields=True)]
    if opts.compare:
        rows.append(measure(opts, yields=False))
    for row in rows:
        print_run(row)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "contention.json").write_text(json.dumps(rows, indent=2))
    return 0 if rows[0]["p95_over_idle"] <= TARGET or not opts.strict else 1


@dataclass(frozen=True)
class ContentionOptions:
    """`contention`'s flags."""

    preset: str = flags.preset("tiny-flux")
    device: str = flags.device("cpu")
    precision: str = flags.precision("fp32")
    mode: str = flags.mode("regional", "mode of the warm bucket that is measured")
    size: str = flags.size("64x64", "the warm bucket")
    compile_mode: str = flags.mode("compile", "mode of the buckets compiled meanwhile")
    steps: int = flags.steps(2)
    idle_runs: int = flags.count(20)
    gap_s: float = flags.seconds(0.05, "pause between requests")
    duration: float = flags.seconds(240.0, "longest compiling phase (seconds)")
    compare: bool = flags.either(True, "also measure with SHOWCASE_COMPILE_YIELD=0, side by side")
    out: str | None = flags.out("artifacts/contention")
    strict: bool = flags.switch("exit 1 when the target is missed")


def add_contention_parser(sub) -> None:
    flags.add_command(sub, "contention", ContentionOptions, main, description=__doc__.split("\n\n")[0],
                      help="a warm bucket's latency while its worker compiles other buckets")
