"""`python -m bench inpaint-bench`: what the embedded inpaint keeps and repaints, through an EngineManager.

Prints, for tiny-shapes-inpaint on CPU: the mean difference of a keep-everything mask's output from its source
next to the preset VAE's own round trip of that source, and, for scenes whose object is masked (its box and
MARGIN pixels of room), what the checker (training/shapes/fidelity.py) reads against the new prompt and the
mean difference outside the mask.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from bench import flags
from engine.config.flags import from_args

PRESET = "tiny-shapes-inpaint"
MARGIN = 16
REPAINTS = [("a red circle on a blue background", "a green square on a blue background"),
            ("a white square on a black background", "a yellow triangle on a black background"),
            ("a blue triangle on a white background", "a red circle on a white background")]


@dataclass
class InpaintBenchOptions:
    """`inpaint-bench`'s flags."""

    device: str = flags.device("cpu")
    cache_dir: str | None = flags.cache_dir()
    json: bool = flags.as_json()


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _difference(a, b, where=None) -> float:
    import numpy as np

    d = np.abs(np.asarray(a.convert("RGB"), dtype=np.float32) - np.asarray(b.convert("RGB"), dtype=np.float32))
    return round(float(d[where].mean() if where is not None else d.mean()), 2)


def _round_trip(image):
    import numpy as np
    import torch
    from diffusers import AutoModel

    from engine import settings
    from engine.config.presets import get_preset
    from training.shapes import grammar

    folder = settings.data_path(get_preset(PRESET).vae.removeprefix("repo:"))
    vae = AutoModel.from_pretrained(str(folder), subfolder="vae", torch_dtype=torch.float32)
    pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        return grammar.to_pil(vae.decode(vae.encode(pixels).latents).sample)[0]


def measure(manager, device: str) -> dict:
    import numpy as np
    from PIL import Image

    from engine.config.request import ImageRequest
    from training.shapes import fidelity, grammar

    def inpaint(source, mask, prompt):
        return manager.generate(ImageRequest(preset=PRESET, device=device, prompt=prompt, seed=0, strength=1.0,
                                             images=(_png(source),), mask=_png(mask)), timeout=600).image()

    scene = REPAINTS[0][0]
    source = grammar.render(scene, 64, 64, 0)
    kept = inpaint(source, Image.new("L", (64, 64), 0), scene)
    report = {"keep_all_mean_diff": _difference(kept, source),
              "vae_round_trip_mean_diff": _difference(_round_trip(source), source),
              "keep_all_checker_right": fidelity.check(kept, scene).correct, "repaints": []}
    for scene, prompt in REPAINTS:
        source = grammar.render(scene, 64, 64, 0)
        x0, y0, x1, y1 = fidelity.read(source).box
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (max(0, x0 - MARGIN), max(0, y0 - MARGIN), min(64, x1 + MARGIN), min(64, y1 + MARGIN)))
        out = inpaint(source, mask, prompt)
        reading = fidelity.read(out)
        report["repaints"].append({"prompt": prompt, "read": f"{reading.colour} {reading.shape} on {reading.background}",
                                   "checker_right": fidelity.check(out, prompt).correct,
                                   "outside_mean_diff": _difference(out, source, np.asarray(mask) == 0)})
    return report


def format_report(r: dict) -> str:
    lines = [f"keep-all mask: mean |output - source| {r['keep_all_mean_diff']}/255, the VAE's round trip "
             f"{r['vae_round_trip_mean_diff']}/255, checker right: {r['keep_all_checker_right']}"]
    right = sum(x["checker_right"] for x in r["repaints"])
    lines.append(f"object repainted: checker right {right}/{len(r['repaints'])}")
    lines += [f"  {x['prompt']}: read {x['read']}, right {x['checker_right']}, outside the mask "
              f"{x['outside_mean_diff']}/255" for x in r["repaints"]]
    return "\n".join(lines)


def cmd_inpaint_bench(args) -> int:
    from pathlib import Path

    from engine import settings
    from engine.protocol import EngineOptions
    from engine.serving.manager import EngineManager

    opts = from_args(InpaintBenchOptions, args)
    cache = Path(opts.cache_dir) if opts.cache_dir else settings.cache_dir()
    manager = EngineManager(cache_dir=cache, options=EngineOptions(warm_sizes=()))
    try:
        report = measure(manager, opts.device)
    finally:
        manager.shutdown()
    print(json.dumps(report, indent=2) if opts.json else format_report(report))
    return 0


def add_inpaint_bench_parser(sub) -> None:
    flags.add_command(sub, "inpaint-bench", InpaintBenchOptions, cmd_inpaint_bench,
                      help="what the embedded inpaint keeps (a keep-all mask against the VAE's round trip) and "
                           "repaints (an object under its mask, read by the checker)")
