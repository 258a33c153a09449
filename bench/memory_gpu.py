"""Memory levers on an accelerator at full size (`python -m bench memory-bench --gpu PRESET --device cuda`,
`bash scripts/bench_gpu.sh memory`): the preset's denoiser (its denoiser_config, random weights: no
download) in bf16 at 1024x1024, one image's denoising loop per lever set, seconds per image and peak GiB
(torch's own counter, reset before each), beside the estimate (engine/serving/fit.py) and diffusers'
published FLUX.1-dev table. Denoiser only: the text encoders and the VAE are not built (on FLUX.1-dev the
estimate adds 9.8 GB of them with no lever).

- none: the denoiser on the device;
- layerwise:fp8: its weights stored in float8_e4m3fn there, computed in bf16;
- group:block:1:stream: in host RAM (pinned), one block group on the device at a time, the next
  prefetched on a copy stream;
- model-offload: in host RAM between images, moved to the device for the loop and back (what
  enable_model_cpu_offload does to each model of a pipeline).
"""

from __future__ import annotations

import gc
import sys
import time

GIB = 2**30
LEVERS = ("none", "layerwise:fp8", "group:block:1:stream", "model-offload")
PEER = {"none": "6.59 s / 33.9 GB", "model-offload": "21.7 s / 22.6 GB", "group:block:1:stream": "47.7 s / 11.7 GB "
        "(group offload)", "layerwise:fp8": "—"}  # diffusers PR 11682, whole pipeline, H100


def _build(preset, spec, dtype, where: str):
    import torch

    from bench.denoiser import denoiser_class

    cls = denoiser_class(preset.pipeline)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(where):
            model = cls.from_config(dict(preset.denoiser_config))
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def _prepared(levers: str, preset, spec, dtype):
    """(the denoiser with `levers` applied, a function run before each image, one after)."""
    import torch

    device = spec.torch_device
    if levers == "none":
        return _build(preset, spec, dtype, device), None, None
    if levers == "layerwise:fp8":
        model = _build(preset, spec, dtype, device)
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)
        return model, None, None
    model = _build(preset, spec, dtype, "cpu")
    if levers == "group:block:1:stream":
        model.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=True)
        return model, None, None
    return model, lambda: model.to(device), lambda: model.to("cpu")  # model offload


def measure_lever(levers: str, preset, spec, size, steps: int) -> dict:
    import torch

    from bench.denoiser_shapes import DenoiserShape, denoiser_inputs

    dtype = torch.bfloat16
    gc.collect()
    spec.empty_cache()
    spec.reset_peak_memory()
    model, before, after = _prepared(levers, preset, spec, dtype)
    inputs = denoiser_inputs(DenoiserShape(preset.pipeline, dict(preset.denoiser_config), size, 512), spec.torch_device,
                             dtype)

    def image(n: int) -> float:
        spec.synchronize()
        start = time.perf_counter()
        if before:
            before()
        with torch.no_grad():
            for _ in range(n):
                model(**inputs)
        if after:
            after()
        spec.synchronize()
        return time.perf_counter() - start

    image(1)  # first calls: kernels, the stream's pinned buffers
    spec.reset_peak_memory()
    seconds = image(steps)
    peak = spec.peak_memory_bytes()
    model = inputs = None  # freed before the next lever builds its own
    gc.collect()
    spec.empty_cache()
    return {"levers": levers, "s_per_image": seconds, "peak_gib": None if peak is None else peak / GIB,
            "peer": PEER.get(levers, "—")}


def run_gpu_levers(preset_name: str, device: str, steps: int) -> list[dict]:
    from engine import devices
    from engine.config.presets import get_preset
    from engine.protocol import Size
    from engine.serving import fit

    preset, spec = get_preset(preset_name), devices.get_device(device)
    size = Size(1024, 1024)
    model = fit.model_for(preset, None, "bf16")
    denoiser_only = fit.Model({preset.denoiser: model.components[preset.denoiser]}, preset.denoiser, model.hidden,
                              "bf16")
    rows = []
    for levers in LEVERS:
        lever_text = "" if levers == "none" else levers
        estimate = denoiser_only.estimate(lever_text, size.width, size.height, False)
        try:
            row = measure_lever(levers, preset, spec, size, steps)
        except Exception as exc:  # one lever failing must not end the run
            row = {"levers": levers, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        rows.append({**row, "estimate_gib": estimate.device_bytes / GIB})
        print(format_row(rows[-1], steps), file=sys.stderr, flush=True)  # stdout: the JSON
    return rows


def format_row(r: dict, steps: int) -> str:
    if r.get("error"):
        return f"{r['levers']:24s} failed: {r['error']}"
    return (f"{r['levers']:24s} {r['s_per_image']:7.2f} s / {steps} steps  peak {r['peak_gib']:6.2f} GiB  "
            f"(estimate {r['estimate_gib']:6.2f} GiB; diffusers' pipeline: {r['peer']})")
