"""`python -m bench cp-bench`: one process against N context-parallel ranks, the same denoiser step.

The preset's denoiser (its `denoiser_config` with random weights, or a tiny/bundled model's own config,
random weights seeded alike) is fed the inputs its pipeline gives it at one step of a size (one text length),
first in this process (the app's single-device engine: every core for one process), then on N torchrun ranks
with `enable_parallelism` in the Ulysses or Ring layout (the engine's own `enable_context_parallel`), per
mode (eager, compile). It prints the median step of each, their ratio and the largest difference between
the two outputs (the same weights and inputs: context parallel must not change the result).

On CPU the ranks share the cores (the single process and each rank get cores / N threads, `--threads`) and
talk over gloo: a correctness harness whose ratio says what the collectives cost, not a speed-up. On N GPUs
it is the real comparison.

This module imports no torch at import time (bench/commands.py builds its parser for every sub-command).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine.config.flags import argv_of, from_args
from engine.metrics import median
from engine.protocol import Size

RESULT_FILE = "cp-bench.json"


@dataclass(frozen=True)
class CpBenchOptions:
    """`cp-bench`'s flags (the launcher passes them on to its ranks: `argv_of`)."""

    preset: str = flags.preset("tiny-flux", "a Flux preset (denoiser_config, or a tiny/bundled model)")
    device: str = flags.device("cpu")
    precision: str = flags.precision("fp32")
    tp: int = flags.count(2, "ranks", high=flags.MAX_THREADS)
    parallel: str = flags.text("ulysses", choices=("ulysses", "ring"))
    attention_backend: str = flags.text("native")
    modes: str = flags.text("eager", "comma-separated: eager, compile")
    sizes: str = flags.sizes("256x256", "comma-separated WxH (any multiple of 16)")
    text_len: int | None = flags.count(None, "text tokens (default: the preset's)", zero="the preset's")
    threads: int | None = flags.threads("CPU threads of the single process and of each rank (default: cores / "
                                        "ranks, at least 1)")
    runs: int = flags.count(10, "timed steps per configuration (after 2 warm-up steps)")
    timeout: float = flags.seconds(540.0, "seconds the ranks may take in all")
    out: Path | None = flags.out(None, f"write {RESULT_FILE} here", check=Path)
    rank_side: Path | None = flags.hidden("--rank-side", check=Path)  # a torchrun rank: its result folder


def add_cp_bench_parser(sub) -> None:
    flags.add_command(sub, "cp-bench", CpBenchOptions, cmd_cp_bench,
                      help="one process vs N context-parallel ranks (Ulysses / Ring): step medians")


# -- shared by the launcher and the ranks ---------------------------------------------------------------
def _setup(opts):
    import torch

    from bench.denoiser import denoiser_class
    from engine import devices
    from engine.config.presets import get_preset

    preset = get_preset(opts.preset)
    if preset.pipeline != "FluxPipeline":
        raise SystemExit(f"cp-bench builds Flux inputs; {preset.name} is a {preset.pipeline}")
    cls = denoiser_class(preset.pipeline)
    cfg = dict(preset.denoiser_config or _model_config(preset, cls))
    spec = devices.get_device(opts.device)
    dtype = devices.plan_precision(spec, opts.precision).dtype
    sizes = [Size.parse(s) for s in opts.sizes.split(",")]
    text_len = opts.text_len or preset.max_sequence_length or 512
    return torch, preset, cls, cfg, spec, dtype, sizes, text_len


def _model_config(preset, cls) -> dict:
    from engine import settings

    if preset.random_tiny:
        from engine.models.tiny import ensure_tiny_pipeline

        folder = ensure_tiny_pipeline(preset.random_tiny, settings.models_dir(settings.cache_dir()))
    elif preset.bundled:
        folder = settings.data_path(preset.bundled)
    else:
        raise SystemExit(f"{preset.name} has no denoiser_config and is not a local model: nothing to build offline")
    return {k: v for k, v in cls.load_config(folder, subfolder=preset.denoiser).items() if not k.startswith("_")}


def _build(torch, cls, cfg, device, dtype, backend: str):
    torch.manual_seed(0)  # every rank and the single process build the same weights
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    if backend != "native":
        model.set_attention_backend(backend)
    return model


def _time(torch, fn, inputs, spec, runs: int) -> tuple[list[float], object]:
    times, out = [], None
    with torch.inference_mode():
        for i in range(2 + runs):
            spec.synchronize()
            start = time.perf_counter()
            out = fn(**inputs)[0]
            spec.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - start) * 1000)
    return times, out


def _variant(torch, model, mode: str):
    return torch.compile(model) if mode == "compile" else model


def _set_threads(torch, opts) -> None:
    # The same count for the single process and each rank: a CPU's cores oversubscribed by spinning OpenMP
    # threads make any ratio meaningless.
    torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // opts.tp))


# -- a torchrun rank ------------------------------------------------------------------------------------
def _rank_main(opts) -> int:
    torch, preset, cls, cfg, spec, dtype, sizes, text_len = _setup(opts)
    import torch.distributed as dist

    from bench.denoiser import DenoiserShape, denoiser_inputs
    from engine.tp.group import init_group
    from engine.tp.runner import enable_context_parallel

    _set_threads(torch, opts)
    group = init_group(spec, 600)
    model = _build(torch, cls, cfg, group.device, dtype, opts.attention_backend)
    enable_context_parallel(model, spec, opts.parallel, group.world_size)
    results = []
    for mode in opts.modes.split(","):
        fn = _variant(torch, model, mode)
        for size in sizes:
            inputs = denoiser_inputs(DenoiserShape(preset.pipeline, cfg, size, text_len), str(group.device), dtype)
            times, out = _time(torch, fn, inputs, spec, opts.runs)
            if group.leader:
                name = f"{mode}-{size}"
                torch.save(out.float().cpu(), opts.rank_side / f"{name}.pt")
                results.append({"mode": mode, "size": str(size), "median_ms": median(times), "step_ms": times})
    if group.leader:
        (opts.rank_side / "ranks.json").write_text(json.dumps(
            {"results": results, "threads_per_rank": torch.get_num_threads(), "backend": spec.dist_backend}))
    dist.barrier(group=group.control)
    dist.destroy_process_group()
    return 0


# -- the launcher ---------------------------------------------------------------------------------------
def _run_ranks(opts, folder: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.tp}",
            "-m", "bench", "cp-bench", *argv_of(CpBenchOptions, opts), "--rank-side", str(folder)]
    proc = subprocess.Popen(argv, process_group=0)
    try:
        rc = proc.wait(opts.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
        raise SystemExit(f"the {opts.tp} ranks did not finish within --timeout {opts.timeout:g} s") from None
    if rc:
        raise SystemExit(f"the {opts.tp} ranks failed (exit {rc}); see the output above")


def cmd_cp_bench(args) -> int:
    opts = from_args(CpBenchOptions, args)
    if opts.rank_side is not None:
        return _rank_main(opts)
    torch, preset, cls, cfg, spec, dtype, sizes, text_len = _setup(opts)
    from bench.denoiser import DenoiserShape, denoiser_inputs
    from engine.tp import plan

    # The same up-front check as the engine (heads, backend; token counts at the benchmarked sizes).
    with tempfile.TemporaryDirectory(prefix="cp-bench-config-") as source:
        _write_config(Path(source), preset, cls, cfg)
        plan.check_context(_plan_preset(preset, sizes, text_len), source, opts.tp, opts.parallel,
                           opts.attention_backend, spec)
    _set_threads(torch, opts)
    single = {}
    model = _build(torch, cls, cfg, spec.torch_device, dtype, opts.attention_backend)
    for mode in opts.modes.split(","):
        fn = _variant(torch, model, mode)
        for size in sizes:
            inputs = denoiser_inputs(DenoiserShape(preset.pipeline, cfg, size, text_len), spec.torch_device, dtype)
            times, out = _time(torch, fn, inputs, spec, opts.runs)
            single[f"{mode}-{size}"] = (median(times), out.float().cpu())
    threads = torch.get_num_threads()
    del model
    with tempfile.TemporaryDirectory(prefix="cp-bench-") as tmp:
        folder = Path(tmp)
        _run_ranks(opts, folder)
        ranks = json.loads((folder / "ranks.json").read_text())
        rows = []
        for r in ranks["results"]:
            name = f"{r['mode']}-{r['size']}"
            median_1, out_1 = single[name]
            diff = float((torch.load(folder / f"{name}.pt") - out_1).abs().max())
            rows.append({**r, "single_ms": median_1, "ratio": median_1 / r["median_ms"], "max_abs_diff": diff})
    layout = f"{opts.parallel}{opts.tp}"
    image_tokens = {str(s): (s.width // 16) * (s.height // 16) for s in sizes}
    print(f"cp-bench {preset.name} {cls.__name__} {opts.precision} on {spec.name}: 1 process ({threads} threads) vs "
          f"{layout} ({ranks['backend']}, {ranks['threads_per_rank']} threads per rank), text {text_len} tokens, "
          f"median of {opts.runs} steps")
    print(f"{'mode':8s} {'size':9s} {'tokens':>6s} {'1 proc ms':>10s} {layout + ' ms':>12s} {'speed-up':>9s} "
          f"{'max diff':>9s}")
    for r in rows:
        print(f"{r['mode']:8s} {r['size']:9s} {image_tokens[r['size']] + text_len:6d} {r['single_ms']:10.2f} "
              f"{r['median_ms']:12.2f} {r['ratio']:8.2f}x {r['max_abs_diff']:9.1e}")
    report = {"preset": preset.name, "device": spec.name, "precision": opts.precision, "parallel": opts.parallel,
              "ranks": opts.tp, "text_len": text_len, "threads_single": threads,
              "threads_per_rank": ranks["threads_per_rank"], "rows": rows}
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / RESULT_FILE).write_text(json.dumps(report, indent=2))
    return 0


def _plan_preset(preset, sizes, text_len):
    """The preset as benchmarked: these sizes, this text length, its weights random (no min_tp)."""
    from dataclasses import replace

    return replace(preset, buckets=tuple(sizes), max_sequence_length=text_len, alignment=16, min_tp=1)


def _write_config(folder: Path, preset, cls, cfg) -> None:
    """The model_index and denoiser config plan.check_context reads (no weights)."""
    (folder / "model_index.json").write_text(json.dumps({preset.denoiser: ["diffusers", cls.__name__]}))
    (folder / preset.denoiser).mkdir()
    (folder / preset.denoiser / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **cfg}))
