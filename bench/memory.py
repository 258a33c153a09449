"""The memory bench (`python -m bench memory-bench`): what each memory lever saves and what it costs, in one run.

1. Layerwise fp8 storage on the embedded model (tiny-shapes): the denoiser's stored bytes against fp32, the
   fidelity of both over the model's sample prompts, the worst PSNR against eager fp32 at the same prompt and
   seed, and the time per image (medians of images timed in alternation).
2. Group offload to disk on a random-weight Flux denoiser of at least `--denoiser-gib` in fp32, built here
   from tiny-flux's other components (no download): each engine in a child process of its own, which reports
   its peak resident memory during one generate (VmHWM reset before it), its image and its time; the
   saving against the same engine without offload, as a share of the denoiser's weight bytes.
3. The prompt-embedding cache: the encode time of a repeated prompt against its first, and the image.

Each prints its figures side by side; docs/benchmarks.md has a run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine.config.flags import from_args
from engine.metrics import median

GIB = 2**30


def _runner(preset, levers: str, cache_dir: Path, precision: str = "fp32"):
    from engine.pipeline.runner import PipelineRunner
    from engine.protocol import EngineConfig, EngineKey, EngineOptions

    key = EngineKey(preset.name, "cpu", precision, memory=levers)
    runner = PipelineRunner(EngineConfig(key, preset, EngineOptions(warm_sizes=()), str(cache_dir)))
    runner.load()
    return runner


def _request(prompt: str, seed: int, steps: int, size: int = 64):
    from engine.protocol import GenerateRequest

    return GenerateRequest.checked(prompt=prompt, width=size, height=size, steps=steps, guidance=3.5, seed=seed)


def _denoiser_bytes(runner) -> int:
    module = getattr(runner.pipe, runner.preset.denoiser)
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def layerwise_row(cache_dir: Path, samples: int, steps: int, rounds: int) -> dict:
    """Layerwise fp8 against eager fp32 on the embedded model."""
    from bench import quality
    from engine.config.presets import get_preset

    preset = get_preset("tiny-shapes")
    plain, cast = _runner(preset, "", cache_dir), _runner(preset, "layerwise:fp8", cache_dir)
    prompts = quality.sample_prompts(preset, samples, seed=quality.PROMPT_SEED, fallback=preset.example_prompt)
    seeds = quality.image_seeds(len(prompts))
    ref = [plain.generate(_request(p, s, steps)).image_png for p, s in zip(prompts, seeds, strict=True)]
    mine = [cast.generate(_request(p, s, steps)).image_png for p, s in zip(prompts, seeds, strict=True)]
    ref_score = quality.score(ref, prompts, None, preset)
    score = quality.score(mine, prompts, ref, preset)
    psnrs = [d["psnr_db"] if d["psnr_db"] is not None else 100.0
             for d in (quality.image_drift(a, b) for a, b in zip(mine, ref, strict=True))]
    times = {"fp32": [], "layerwise": []}
    for i in range(rounds):  # alternating, the first of each pair swapped every round
        order = [("fp32", plain), ("layerwise", cast)][:: 1 if i % 2 == 0 else -1]
        for name, runner in order:
            times[name].append(runner.generate(_request(prompts[0], 7, steps)).timings.total_ms)
    return {"denoiser_bytes_fp32": _denoiser_bytes(plain), "denoiser_bytes_fp8": _denoiser_bytes(cast),
            "bytes_ratio": _denoiser_bytes(cast) / _denoiser_bytes(plain),
            "fidelity_fp32": ref_score.get("fidelity"), "fidelity_fp8": score.get("fidelity"),
            "samples": len(prompts), "worst_psnr_db": score["drift_psnr_db"], "max_diff": score["drift_max_diff"],
            "median_psnr_db": median(psnrs), "samples_35db": sum(p >= 35 for p in psnrs),
            "ms_fp32": median(times["fp32"]), "ms_fp8": median(times["layerwise"]),
            "time_ratio": median(times["layerwise"]) / median(times["fp32"]), "rounds": rounds}


def prompt_cache_row(cache_dir: Path, prompts: int, steps: int) -> dict:
    """A repeated prompt's encode time against its first (each prompt new to the engine, then again)."""
    from engine.config.presets import get_preset

    runner = _runner(get_preset("tiny-shapes"), "", cache_dir)
    runner.generate(_request("warm-up", 0, steps))  # first calls of the encoders at this shape
    first, again, equal = [], [], True
    for i in range(prompts):
        text = f"{['a red', 'a blue', 'two green', 'a yellow'][i % 4]} circle {i}"
        a, b = runner.generate(_request(text, i, steps)), runner.generate(_request(text, i, steps))
        first.append(a.timings.encode_ms)
        again.append(b.timings.encode_ms)
        equal = equal and _pixels_equal(a, b)
    stats = runner.caller.prompts.cache.stats()
    return {"encode_ms_first": median(first), "encode_ms_again": median(again),
            "ratio": median(again) / median(first), "image_equal": equal, "prompts": prompts, "cache": stats}


def _pixels_equal(a, b) -> bool:
    import numpy as np

    return bool((np.asarray(a.image()) == np.asarray(b.image())).all())


# -- group offload to disk, one engine per child process -----------------------------------------------
def build_big_pipeline(folder: Path, min_gib: float, cache_dir: Path) -> tuple[Path, int]:
    """A Flux pipeline folder whose denoiser is random, at least `min_gib` in fp32 (tiny-flux's encoders,
    VAE and shapes around it); (folder, the denoiser's weight bytes). Built once per size."""
    import shutil

    import torch
    from diffusers import FluxTransformer2DModel

    from engine import settings
    from engine.models.tiny import ensure_tiny_pipeline

    tiny = ensure_tiny_pipeline("tiny-flux", settings.models_dir(cache_dir))
    config = dict(FluxTransformer2DModel.load_config(tiny / "transformer"))
    config.update(num_attention_heads=12, attention_head_dim=128, axes_dims_rope=[16, 56, 56], num_layers=2,
                  num_single_layers=1)
    while _params(config) * 4 < min_gib * GIB:
        config["num_single_layers"] += 1
    marker = folder / f"denoiser-{config['num_single_layers']}.done"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny, folder)
        shutil.rmtree(folder / "transformer")
        torch.manual_seed(0)
        FluxTransformer2DModel.from_config(config).save_pretrained(folder / "transformer")
        marker.touch()
    return folder, _params(config) * 4


def _params(config: dict) -> int:
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return sum(p.numel() for p in FluxTransformer2DModel.from_config(config).parameters())


CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from engine.config.presets import preset_for_model
    from engine.pipeline.runner import PipelineRunner
    from engine.protocol import EngineConfig, EngineKey, EngineOptions, GenerateRequest
    preset = preset_for_model({folder!r}, [Path({folder!r}).parent])
    key = EngineKey(preset.name, "cpu", "fp32", memory={levers!r})
    options = EngineOptions(warm_sizes=(), prompt_cache_entries=0)
    runner = PipelineRunner(EngineConfig(key, preset, options, {cache!r}, (str(Path({folder!r}).parent),)))
    runner.load()
    request = GenerateRequest.checked(prompt="a red circle", width=64, height=64, steps={steps}, guidance=3.5, seed=0)
    runner.generate(request)  # first calls at this shape
    times = []
    for _ in range({runs}):
        runner.spec.reset_peak_memory()
        start = time.perf_counter()
        result = runner.generate(request)
        times.append((time.perf_counter() - start) * 1000)
        peak = runner.spec.peak_memory_bytes()
    Path({out!r}).write_bytes(result.image_png)
    print("RESULT " + json.dumps({{"peak_rss": peak, "ms": sorted(times)[len(times) // 2]}}))
""")


def offload_row(cache_dir: Path, min_gib: float, steps: int, runs: int) -> dict:
    """The same engine with and without group offload to disk, each in a child process."""
    import numpy as np
    from PIL import Image

    folder, denoiser_bytes = build_big_pipeline(Path(cache_dir) / "memory-bench" / "big-flux", min_gib, cache_dir)
    rows = {}
    for levers in ("", "group:block:1:disk"):
        out = Path(cache_dir) / "memory-bench" / f"image-{levers or 'none'}.png".replace(":", "-")
        script = CHILD.format(root=str(Path(__file__).resolve().parents[2]), folder=str(folder), levers=levers,
                              cache=str(cache_dir), steps=steps, runs=runs, out=str(out))
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1800)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"the {levers or 'no-lever'} engine failed: {proc.stderr[-2000:]}")
        rows[levers or "none"] = {**json.loads(line.removeprefix("RESULT ")), "image": out}
    plain, offloaded = rows["none"], rows["group:block:1:disk"]
    diff = np.abs(np.asarray(Image.open(plain["image"]), int) - np.asarray(Image.open(offloaded["image"]), int))
    saved = plain["peak_rss"] - offloaded["peak_rss"]
    return {"denoiser_bytes": denoiser_bytes, "peak_rss_none": plain["peak_rss"],
            "peak_rss_offload": offloaded["peak_rss"], "saved_share_of_denoiser": saved / denoiser_bytes,
            "max_diff": int(diff.max()), "ms_none": plain["ms"], "ms_offload": offloaded["ms"],
            "time_ratio": offloaded["ms"] / plain["ms"], "steps": steps}


def report(rows: dict) -> str:
    lines = []
    if lw := rows.get("layerwise"):
        lines.append(f"layerwise fp8 (tiny-shapes, eager): denoiser {lw['denoiser_bytes_fp8'] / 2**20:.2f} MiB vs "
                     f"{lw['denoiser_bytes_fp32'] / 2**20:.2f} MiB fp32 = {lw['bytes_ratio']:.2f}x; fidelity "
                     f"{_pct(lw['fidelity_fp8'])} vs {_pct(lw['fidelity_fp32'])} over {lw['samples']} prompts; PSNR "
                     f"median {lw['median_psnr_db']:.1f} dB, worst {lw['worst_psnr_db']:.1f} dB (max diff "
                     f"{lw['max_diff']}/255), {lw['samples_35db']} of {lw['samples']} samples >= 35 dB; "
                     f"{lw['ms_fp8']:.0f} vs {lw['ms_fp32']:.0f} ms/image = {lw['time_ratio']:.2f}x "
                     f"(medians of {lw['rounds']} alternating)")
    if off := rows.get("offload"):
        lines.append(f"group offload to disk (random Flux denoiser {off['denoiser_bytes'] / GIB:.2f} GiB fp32): peak "
                     f"RSS {off['peak_rss_offload'] / GIB:.2f} vs {off['peak_rss_none'] / GIB:.2f} GiB = "
                     f"{off['saved_share_of_denoiser'] * 100:.0f} % of the denoiser's bytes saved; image max diff "
                     f"{off['max_diff']}/255; {off['ms_offload']:.0f} vs {off['ms_none']:.0f} ms/image = "
                     f"{off['time_ratio']:.2f}x ({off['steps']} steps)")
    if pc := rows.get("prompt_cache"):
        lines.append(f"prompt cache: encode {pc['encode_ms_again']:.2f} ms repeated vs {pc['encode_ms_first']:.1f} ms "
                     f"first = {pc['ratio']:.3f}x (medians over {pc['prompts']} prompts); image equal: "
                     f"{pc['image_equal']}; cache {pc['cache']['entries']} entries, {pc['cache']['bytes']} bytes")
    return "\n".join(lines)


def _pct(share) -> str:
    return "—" if share is None else f"{share * 100:.0f} %"


@dataclass(frozen=True)
class MemoryBenchOptions:
    """`memory-bench`'s flags."""

    cache_dir: str | None = flags.cache_dir()
    only: str | None = flags.text(None, "comma-separated: layerwise, prompt_cache, offload")
    samples: int = flags.count(16, "fidelity prompts (layerwise)")
    steps: int = flags.steps(8)
    rounds: int = flags.count(6, "alternating timed images per configuration (layerwise)")
    prompts: int = flags.count(6, "prompts encoded twice (prompt cache)")
    denoiser_gib: float = flags.number(1.0, 0.001, 1024.0, "the random Flux denoiser's fp32 size (offload)")
    offload_steps: int = flags.steps(2)
    runs: int = flags.count(3, "timed generates per engine (offload)")
    gpu: str | None = flags.text(None, "instead: the preset's full-size denoiser (denoiser_config, random weights) "
                                       "in bf16 at 1024x1024 with each lever on --device (bench/memory_gpu.py)",
                                 metavar="PRESET")
    device: str = flags.device("cuda")
    gpu_steps: int = flags.steps(28)
    json: bool = flags.as_json()


def cmd_memory_bench(args) -> int:
    from engine import settings

    opts = from_args(MemoryBenchOptions, args)
    if opts.gpu:
        from bench.memory_gpu import run_gpu_levers

        rows = run_gpu_levers(opts.gpu, opts.device, opts.gpu_steps)
        if opts.json:
            print(json.dumps(rows))
        return 0 if not any(r.get("error") for r in rows) else 1
    cache_dir = Path(opts.cache_dir) if opts.cache_dir else settings.cache_dir()
    started, rows = time.perf_counter(), {}
    parts = opts.only.split(",") if opts.only else ["layerwise", "prompt_cache", "offload"]
    if "layerwise" in parts:
        rows["layerwise"] = layerwise_row(cache_dir, opts.samples, opts.steps, opts.rounds)
    if "prompt_cache" in parts:
        rows["prompt_cache"] = prompt_cache_row(cache_dir, opts.prompts, opts.steps)
    if "offload" in parts:
        rows["offload"] = offload_row(cache_dir, opts.denoiser_gib, opts.offload_steps, opts.runs)
    print(json.dumps({**rows, "elapsed_s": time.perf_counter() - started}, default=str) if opts.json else report(rows))
    return 0


def add_memory_bench_parser(sub) -> None:
    flags.add_command(sub, "memory-bench", MemoryBenchOptions, cmd_memory_bench,
                      help="what memory levers save and cost: layerwise fp8, group offload to disk on a >= 1 GiB "
                           "denoiser, the prompt cache")
