"""The `bench` sub-command: its parser, registered by bench/commands.py's COMMANDS table.

bench/commands.py imports this whenever it builds the parser of every command (`python -m bench --help`), so
this module imports no torch: `cmd_bench` hands over to bench/run.py, which does, only when
`bench` actually runs.
"""

from __future__ import annotations

import argparse

from bench.modes import BENCH_MODES
from engine.config.flags import add_engine_arguments
from engine.protocol import Precision

DESCRIPTION = "Benchmark: what each mode and precision buys, measured side by side in one run."


def cmd_bench(args) -> int:
    # Imported here, not at the top: it imports torch, which building the parser must not.
    from bench import run

    return run.main(args)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the CLI's subparsers (bench/commands.py calls this)."""
    b = subparsers.add_parser(
        "bench",
        help="measure every mode x precision x size side by side; print ratios against targets",
        description=DESCRIPTION,
    )
    b.add_argument("--preset", default="tiny-flux")
    b.add_argument("--device", default="auto")
    b.add_argument("--modes", default="eager,compile,regional",
                   help=f"comma-separated, from {', '.join(BENCH_MODES)} (max-autotune = full compile "
                        "with mode='max-autotune'; cuda-graphs = full compile with mode='reduce-overhead'; aot = "
                        "AOTInductor packages, built once into the cache folder)")
    b.add_argument("--precisions", default="fp32", help=f"comma-separated: {','.join(Precision.values())}")
    b.add_argument("--caches", default=None,
                   help="comma-separated step caches (none, first-block:0.2, taylorseer:3:2, magcache, ...): the levers "
                        "bench, one row per precision x mode x cache with speedups, cached steps, drift and fidelity")
    b.add_argument("--repeatability", action="store_true",
                   help="run the same comparison of --configs twice (each warm first, then timed round-robin with "
                        "eager fp32 until every speedup's spread is known) and print both runs' speedups, their "
                        "ratio and whether the ranking held")
    b.add_argument("--configs", default=None,
                   help="--repeatability: mode/precision[/step cache] entries separated by ';' (default: six "
                        "configurations, the levers one at a time)")
    b.add_argument("--repeat-budget", type=float, default=60.0,
                   help="--repeatability: seconds of timing rounds per run (after the warm-up)")
    b.add_argument("--repeat-spread", type=float, default=0.10,
                   help="--repeatability: rounds stop once every paired ratio's IQR is within this share of its median")
    b.add_argument("--repeat-max-rounds", type=int, default=15, help="--repeatability: at most this many rounds per run")
    b.add_argument("--sizes", default=None, help="comma-separated WxH buckets (default: the preset's first)")
    b.add_argument("--steps", type=int, default=None, help="denoising steps per image (default: the preset's)")
    b.add_argument("--runs", type=int, default=10, help="timed requests (images) per configuration")
    b.add_argument("--out", default="artifacts/bench", help="folder for bench.json, bench.md, bench.png")
    b.add_argument("--prompt", default=None, help="prompt of the timed runs (default: the preset's first example)")
    b.add_argument("--quality-samples", type=int, default=None,
                   help="images per configuration for drift against eager fp32 (and fidelity, for a model "
                        "with a checker); default 100 for such a model, else 3; 0 = skip")
    b.add_argument("--overhead-runs", type=int, default=None,
                   help="interleaved engine/bare pairs for the engine-overhead ratio (default: 2 x --runs; 0 = skip)")
    b.add_argument("--cache-probe", default="compile", choices=("compile", "regional", "off"),
                   help="mode whose cold vs cached compile is measured in fresh processes (off = skip; the "
                        "cold compile of a full tiny-flux bucket takes about a minute on 2 CPU cores)")
    b.add_argument("--probe-timeout", type=float, default=900.0, help="seconds per probe process")
    b.add_argument("--cold-start-probe", default="auto", choices=("auto", "on", "off"),
                   help="time until every bucket of the preset is warm in fresh processes: compile with an empty "
                        "and a filled inductor cache, then aot with packages built by `python -m engine export` "
                        "(auto: on when --modes has aot; the empty-cache compile and the export take minutes)")
    b.add_argument("--cold-start-runs", type=int, default=5,
                   help="steady requests per bucket in the cold-start probe's aot process")
    b.add_argument("--random-weights", action="store_true",
                   help="benchmark the denoiser alone, built from the preset's denoiser_config with random "
                        "weights (no download; real shapes)")
    b.add_argument("--denoiser-config-override", default=None,
                   help="JSON object (or @file) merged into denoiser_config, e.g. a tiny config for tests")
    b.add_argument("--text-len", type=int, default=None, help="text tokens fed to the denoiser (random weights)")
    b.add_argument("--images-per-call", type=int, default=1, metavar="N",
                   help="images per denoiser call (random weights): the batch a --max-batch N engine runs")
    b.add_argument("--matmul-roofline", action="store_true",
                   help="measure the dense matmul rate in the first precision and report each step's share")
    b.add_argument("--warmup-calls", type=int, default=2,
                   help="denoiser forwards after the compiling one, before timing (random weights)")
    b.add_argument("--time-budget", type=float, default=None,
                   help="seconds: skip configurations not started by then (random weights)")
    b.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core); on a shared machine 1 avoids "
                        "OpenMP spin-wait stalls that inflate latency many times")
    b.add_argument("--force", action="store_true", help="build the denoiser even if it looks too big for memory")
    b.add_argument("--no-chart", action="store_true")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--strict", action="store_true", help="exit 1 when a target is MISSED")
    b.add_argument("--_compile-probe", action="store_true", help=argparse.SUPPRESS)
    b.add_argument("--_cold-start-child", action="store_true", help=argparse.SUPPRESS)
    b.add_argument("--_runtime-child", default=None, help=argparse.SUPPRESS)  # RUNTIME:eager|aot
    add_engine_arguments(b)
    b.set_defaults(func=cmd_bench)
    return b
