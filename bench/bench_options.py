"""The `bench` command's flags as one dataclass, read by bench/cli.py (its parser) and bench/plan.py, run.py
and repeat.py (its values). Imports no torch: the parser is built for `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench import flags
from bench.modes import BENCH_MODES
from engine.protocol import Precision
from engine.protocol.flagfields import SWITCH
from engine.protocol.options import MAX_BATCH


@dataclass(frozen=True)
class BenchOptions:
    """`bench`'s flags (the engine flags follow them); bench/plan.py reads them into a BenchPlan."""

    preset: str = flags.preset("tiny-flux")
    device: str = flags.device("auto")
    modes: str = flags.text("eager,compile,regional", f"comma-separated, from {', '.join(BENCH_MODES)} (max-autotune "
                            "= full compile with mode='max-autotune'; cuda-graphs = full compile with mode="
                            "'reduce-overhead'; aot = AOTInductor packages, built once into the cache folder)")
    precisions: str = flags.text("fp32", f"comma-separated: {','.join(Precision.values())}")
    caches: str | None = flags.text(None, "comma-separated step caches (none, first-block:0.2, taylorseer:3:2, "
                                          "magcache, ...): the levers bench, one row per precision x mode x cache "
                                          "with speedups, cached steps, drift and fidelity")
    repeatability: bool = flags.switch("run the same comparison of --configs twice (each warm first, then timed "
                                       "round-robin with eager fp32 until every speedup's spread is known) and print "
                                       "both runs' speedups, their ratio and whether the ranking held")
    configs: str | None = flags.text(None, "--repeatability: mode/precision[/step cache] entries separated by ';' "
                                           "(default: six configurations, the levers one at a time)")
    repeat_budget: float = flags.seconds(60.0, "--repeatability: seconds of timing rounds per run (after the "
                                               "warm-up)")
    repeat_spread: float = flags.number(0.10, 0.0, 10.0, "--repeatability: rounds stop once every paired ratio's "
                                                          "IQR is within this share of its median")
    repeat_max_rounds: int = flags.count(15, "--repeatability: at most this many rounds per run")
    sizes: str | None = flags.sizes(None, "comma-separated WxH buckets (default: the preset's first)")
    steps: int | None = flags.steps(None, "denoising steps per image (default: the preset's)")
    runs: int = flags.count(10, "timed requests (images) per configuration")
    out: str | None = flags.out("artifacts/bench", "folder for bench.json, bench.md, bench.png")
    prompt: str | None = flags.text(None, "prompt of the timed runs (default: the preset's first example)")
    quality_samples: int | None = flags.count(None, "images per configuration for drift against eager fp32 (and "
                                                    "fidelity, for a model with a checker); default 100 for such a "
                                                    "model, else 3; 0 = skip", low=0)
    overhead_runs: int | None = flags.count(None, "interleaved engine/bare pairs for the engine-overhead ratio "
                                                  "(default: 2 x --runs; 0 = skip)", low=0)
    cache_probe: str = flags.text("compile", "mode whose cold vs cached compile is measured in fresh processes (off "
                                  "= skip; the cold compile of a full tiny-flux bucket takes about a minute on 2 CPU "
                                  "cores)", choices=("compile", "regional", "off"))
    probe_timeout: float = flags.seconds(900.0, "seconds per probe process")
    cold_start_probe: str = flags.text("auto", "time until every bucket of the preset is warm in fresh processes: "
                                       "compile with an empty and a filled inductor cache, then aot with packages "
                                       "built by `python -m engine export` (auto: on when --modes has aot; the "
                                       "empty-cache compile and the export take minutes)", choices=("auto", "on", "off"))
    cold_start_runs: int = flags.count(5, "steady requests per bucket in the cold-start probe's aot process")
    random_weights: bool = flags.switch("benchmark the denoiser alone, built from the preset's denoiser_config with "
                                        "random weights (no download; real shapes)")
    denoiser_config_override: str | None = flags.text(None, "JSON object (or @file) merged into denoiser_config, "
                                                            "e.g. a tiny config for tests")
    text_len: int | None = flags.count(None, "text tokens fed to the denoiser (random weights)",
                                       zero="the pipeline's")
    references: str | None = flags.text(None, "random weights, an edit preset: the reference images' sizes, "
                                              "WxH[,WxH] ('none': no reference; default: one at the output size for "
                                              "an edit preset, none otherwise); their tokens join the sequence")
    frames: int | None = flags.count(None, "random weights, a video preset: the clip's frames (default: the "
                                           "preset's first frame bucket)", zero="the preset's")
    images_per_call: int = flags.count(1, "images per denoiser call (random weights): the batch a --max-batch N "
                                          "engine runs", high=MAX_BATCH, metavar="N")
    matmul_roofline: bool = flags.switch("measure the dense matmul rate in the first precision and report each "
                                         "step's share")
    warmup_calls: int = flags.count(2, "denoiser forwards after the compiling one, before timing (random weights)",
                                    low=0)
    time_budget: float | None = flags.seconds(None, "seconds: skip configurations not started by then (random "
                                                    "weights)")
    threads: int | None = flags.threads("torch CPU threads (default: torch's, one per core); on a shared machine 1 "
                                        "avoids OpenMP spin-wait stalls that inflate latency many times")
    force: bool = flags.switch("build the denoiser even if it looks too big for memory")
    no_chart: bool = flags.switch()
    no_progress: bool = flags.switch()
    strict: bool = flags.switch("exit 1 when a target is MISSED")
    _compile_probe: bool = flags.hidden("--_compile-probe", False, kind=SWITCH)
    _cold_start_child: bool = flags.hidden("--_cold-start-child", False, kind=SWITCH)
    _runtime_child: str | None = flags.hidden("--_runtime-child")  # RUNTIME:eager|aot
