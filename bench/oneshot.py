"""One-shot bench: a fresh `python -m engine generate --mode eager` against a bare diffusers script.

    python -m bench oneshot                       # tiny-shapes, 64x64, 3 runs of each, interleaved

Both are whole fresh processes timed from launch to exit (interpreter start, imports, the weights' load,
the image, writing it), so what a one-shot CLI run pays beyond diffusers itself shows: the engine's
imports and checks (an eager run serves in the command's own process: engine/cli.py oneshot_runtime). The bare script loads the same folder with
`DiffusionPipeline.from_pretrained` and calls the pipeline with the same prompt, size, steps and seed.
Runs alternate (engine, bare, bare, engine, ...) so a load change on the machine hits both alike; the
figure is the ratio of the medians. Only presets whose weights are a folder here (the embedded model, a
local --model, the random tiny pipelines) can be compared: the bare script must load without a download.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from bench.stats import ratio
from engine.config.flags import SourceFlags, from_args, options_from_args, presets_from_args
from engine.metrics import median
from engine.protocol import EngineKey, Size

TARGET_RATIO = 0.9  # the engine's one-shot run at most this much of the bare script's

BARE_SCRIPT = """
import sys, torch
from diffusers import DiffusionPipeline
folder, prompt, width, height, steps, guidance, seed, out = sys.argv[1:9]
pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
kwargs = dict(prompt=prompt, width=int(width), height=int(height), num_inference_steps=int(steps),
              guidance_scale=float(guidance), generator=torch.Generator("cpu").manual_seed(int(seed)))
if len(sys.argv) > 9:
    kwargs["max_sequence_length"] = int(sys.argv[9])
pipe(**kwargs).images[0].save(out)
"""


@dataclass(frozen=True)
class OneshotOptions:
    """`oneshot`'s flags (the engine flags follow them: --model, --cache-dir, ...)."""

    preset: str = flags.preset("tiny-shapes", "a preset whose weights are a local folder")
    size: str = flags.size("64x64")
    steps: int | None = flags.steps(None, "default: the preset's")
    runs: int = flags.count(3, "fresh processes of each (default 3)")
    prompt: str | None = flags.text(None, "default: the preset's example prompt")
    json: bool = flags.as_json("print the result as one JSON line")


def add_oneshot_parser(sub) -> None:
    flags.add_command(sub, "oneshot", OneshotOptions, cmd_oneshot, engine=True,
                      help="a fresh `generate --mode eager` process against a bare diffusers script (medians of "
                           "interleaved runs, the ratio)")


def model_folder(args) -> tuple[object, str]:
    """(preset, the folder its weights load from), or SystemExit saying why the bare script cannot load it."""
    from engine import settings
    from engine.config.resolve import Catalog, resolve_source

    roots, extra = presets_from_args(args)
    catalog = Catalog(allowed_roots=roots, extra_presets=extra)
    preset = catalog.preset(args.preset)
    key = EngineKey(preset=preset.name, device="cpu", precision="fp32")
    cache_dir = args.cache_dir or settings.cache_dir()
    folder = resolve_source(catalog.config(key, options_from_args(args), cache_dir))
    if not Path(folder).is_dir():
        raise SystemExit(f"error: preset {preset.name} loads {folder!r} from the Hub; the bare script needs a "
                         "local folder (the embedded tiny-shapes, a tiny-* preset or --model PATH)")
    return preset, folder


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process and every process it waited for (a worker, where
    one runs): CPU time moves much less than wall time when other work shares the cores."""
    cpu, start = _cpu_of_children(), time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds, cpu = time.perf_counter() - start, _cpu_of_children() - cpu
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv[:4])} ... exited with {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds, cpu


def cmd_oneshot(args) -> int:
    opts, source = from_args(OneshotOptions, args), from_args(SourceFlags, args)
    preset, folder = model_folder(args)
    size = Size.parse(opts.size)
    steps = opts.steps or preset.steps
    prompt = opts.prompt if opts.prompt is not None else preset.example_prompt
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="showcase-oneshot-") as tmp:
        engine_argv = [sys.executable, "-m", "engine", "generate", "--preset", preset.name, "--device", "cpu",
                       "--precision", "fp32", "--mode", "eager", "--size", str(size), "--steps", str(steps),
                       "--seed", "0", "--prompt", prompt, "--out", str(Path(tmp, "engine.png"))]
        if source.cache_dir:
            engine_argv += ["--cache-dir", str(source.cache_dir)]
        if source.model:
            engine_argv += ["--model", source.model]
        bare_argv = [sys.executable, "-c", BARE_SCRIPT, folder, prompt, str(size.width), str(size.height),
                     str(steps), str(preset.guidance), "0", str(Path(tmp, "bare.png"))]
        if preset.max_sequence_length:
            bare_argv.append(str(preset.max_sequence_length))
        load_before = os.getloadavg()
        engine_runs, bare_runs = [], []
        for i in range(opts.runs):
            pair = ((engine_argv, engine_runs), (bare_argv, bare_runs))
            for argv, out in (pair if i % 2 == 0 else pair[::-1]):
                out.append(_timed(argv, env))
    engine_s, bare_s = [w for w, _ in engine_runs], [w for w, _ in bare_runs]
    engine_cpu, bare_cpu = [c for _, c in engine_runs], [c for _, c in bare_runs]
    e, b = median(engine_s), median(bare_s)
    result = {"preset": preset.name, "size": str(size), "steps": steps, "runs": opts.runs,
              "engine_s": [round(x, 3) for x in engine_s], "bare_s": [round(x, 3) for x in bare_s],
              "engine_median_s": round(e, 3), "bare_median_s": round(b, 3), "ratio": round(ratio(e, b), 3),
              "engine_cpu_s": [round(x, 3) for x in engine_cpu], "bare_cpu_s": [round(x, 3) for x in bare_cpu],
              "cpu_ratio": round(ratio(median(engine_cpu), median(bare_cpu)), 3),
              "target": TARGET_RATIO, "load_avg": [round(x, 2) for x in os.getloadavg()],
              "load_avg_before": [round(x, 2) for x in load_before], "cores": os.cpu_count()}
    if opts.json:
        print(json.dumps(result))
    else:
        print(f"fresh `python -m engine generate --mode eager` ({preset.name} {size}, {steps} steps): "
              f"median {e:.2f} s of {', '.join(f'{x:.2f}' for x in engine_s)}")
        print(f"bare diffusers script, same folder:  median {b:.2f} s of {', '.join(f'{x:.2f}' for x in bare_s)}")
        verdict = "meets" if result["ratio"] <= TARGET_RATIO else "misses"
        print(f"ratio {result['ratio']:.2f}x ({verdict} the target <= {TARGET_RATIO}x); CPU seconds (every process "
              f"of a run): median {median(engine_cpu):.2f} vs {median(bare_cpu):.2f}, {result['cpu_ratio']:.2f}x; "
              f"load average {load_before[0]:.2f} before, {result['load_avg'][0]:.2f} after, on {os.cpu_count()} cores")
    return 0
