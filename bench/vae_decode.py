"""`python -m bench vae-bench`: a video VAE's decode of one clip, plain against tiled, with random weights.

AutoencoderKLWan built from its default config (Wan 2.1's VAE: base_dim 96, z_dim 16, 8x a side and 4x in
time) directly on the device, in the benchmark dtype, decodes random latents of the clip's shape
(1, 16, (frames - 1) / 4 + 1, H / 8, W / 8): once to warm, then `--runs` synchronised decodes whose median is
reported with the device's peak memory (the VAE's weights included). Then the same with `enable_tiling()`
(spatial tiles of `--tile` pixels every `--tile-stride`, diffusers' defaults unless given). Where the clip fits
in one tile diffusers decodes it whole: the tiled row says so instead of timing the same decode again.

No download: the decode's cost depends on the architecture and the shapes, not on the weights' values.
`--vae-config-override` (JSON) swaps in a smaller VAE, as the tests do on CPU.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine.config.flags import from_args

log = logging.getLogger(__name__)

VAE_CLASSES = {"WanPipeline": "AutoencoderKLWan", "WanImageToVideoPipeline": "AutoencoderKLWan"}
WAN21_ALIGNMENT = 16  # Wan 2.1's VAE: 8x a side, so buckets align to 16; Wan 2.2's 5B VAE compresses 16x


@dataclass(frozen=True)
class VaeBenchOptions:
    """`vae-bench`'s flags."""

    preset: str = flags.preset("wan2.1-t2v-1.3b", "a Wan 2.1 video preset: its first bucket and frame count are "
                                                  "the defaults")
    device: str = flags.device("auto")
    precision: str = flags.precision("bf16", "the VAE's dtype")
    size: str | None = flags.size(None, "WxH of the clip (default: the preset's first bucket)")
    frames: int | None = flags.count(None, "frames of the clip (default: the preset's first)", zero="the preset's")
    runs: int = flags.count(3, "timed decodes of each (after one warm-up)")
    tile: int | None = flags.count(None, "tiled: tile side in pixels (default: diffusers' 256)")
    tile_stride: int | None = flags.count(None, "tiled: pixels between tiles (default: diffusers' 192)")
    vae_config_override: str | None = flags.text(None, "JSON object merged into the VAE's default config (e.g. a "
                                                       "small VAE for a CPU smoke run)")
    out: str | None = flags.out(None, "folder for vae.json and vae.md")
    json: bool = flags.as_json("print the result as JSON")


def add_vae_bench_parser(sub) -> None:
    flags.add_command(sub, "vae-bench", VaeBenchOptions, cmd_vae_bench,
                      help="a video VAE's decode of one clip: plain vs tiled, ms and peak memory (random weights)")


def _override(text: str | None) -> dict:
    from bench.plan import json_object_flag

    return json_object_flag(text, "--vae-config-override") or {}


def _clip(opts: VaeBenchOptions):
    """The preset, the clip's size and frames, checked: a Wan 2.1 video preset unless the VAE is overridden."""
    from engine.config.presets import get_preset
    from engine.errors import InvalidRequest
    from engine.protocol import Size

    preset = get_preset(opts.preset)
    if preset.pipeline not in VAE_CLASSES or not preset.video:
        raise InvalidRequest(f"vae-bench knows the VAE of {', '.join(VAE_CLASSES)}; {preset.name} runs "
                             f"{preset.pipeline}")
    if preset.alignment != WAN21_ALIGNMENT and not opts.vae_config_override:
        raise InvalidRequest(f"{preset.name}'s VAE is not Wan 2.1's (buckets align to {preset.alignment}): give its "
                             "config with --vae-config-override")
    size = Size.parse(opts.size) if opts.size else preset.buckets[0]
    frames = opts.frames or preset.frames[0]
    if size.width % preset.alignment or size.height % preset.alignment or (frames - 1) % preset.frame_step:
        raise InvalidRequest(f"{size} x {frames} frames: sizes align to {preset.alignment}, frames are 1 + a "
                             f"multiple of {preset.frame_step}")
    return preset, size, frames


def _time_decode(vae, z, spec, runs: int) -> dict:
    """One warm-up decode, then `runs` synchronised ones: median and spread in ms, the device's peak bytes."""
    import torch

    from engine.metrics import median, percentile

    with torch.no_grad():
        vae.decode(z, return_dict=False)
        spec.synchronize()
        spec.reset_peak_memory()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            out = vae.decode(z, return_dict=False)[0]
            spec.synchronize()
            times.append((time.perf_counter() - start) * 1000)
            frames = out.shape[2]
            del out
    return {"ms_median": median(times), "ms_p90": percentile(times, 0.9), "samples_ms": [round(t, 3) for t in times],
            "peak_memory_bytes": spec.peak_memory_bytes(), "frames_out": frames}


def _tiles(vae, size, tile: int | None, stride: int | None) -> dict:
    """enable_tiling() with these sides; whether diffusers will tile this clip, and into how many tiles."""
    vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_sample_stride_height=stride,
                      tile_sample_stride_width=stride)
    tile_h, tile_w = vae.tile_sample_min_height, vae.tile_sample_min_width
    stride_h, stride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    applied = size.width > tile_w or size.height > tile_h  # AutoencoderKLWan._decode's own test
    s = vae.config.scale_factor_spatial  # tiled_decode steps through the latent in strides of stride / s
    count = math.ceil(size.height // s / (stride_h // s)) * math.ceil(size.width // s / (stride_w // s)) if applied else 1
    return {"tile": f"{tile_w}x{tile_h}", "stride": f"{stride_w}x{stride_h}", "applied": applied, "tiles": count}


def _measure(label: str, vae, z, spec, runs: int, extra: dict) -> dict:
    row = {"decode": label, **extra, "error": None}
    try:
        row.update(_time_decode(vae, z, spec, runs))
    except Exception as exc:  # an out-of-memory plain decode is a finding; the tiled row still runs
        log.warning("%s decode failed: %s", label, exc)
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        spec.empty_cache()
    return row


def run_vae_bench(opts: VaeBenchOptions) -> dict:
    import diffusers
    import torch

    from engine import devices

    preset, size, frames = _clip(opts)
    override = _override(opts.vae_config_override)
    spec = devices.resolve_device(opts.device)
    dtype = devices.plan_precision(spec, opts.precision).dtype
    cls = getattr(diffusers, VAE_CLASSES[preset.pipeline])
    torch.manual_seed(0)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(spec.torch_device):
            vae = cls.from_config(override).eval()  # diffusers' defaults are Wan 2.1's VAE
    finally:
        torch.set_default_dtype(old_dtype)
    cfg = vae.config
    latent = (1, cfg.z_dim, (frames - 1) // cfg.scale_factor_temporal + 1, size.height // cfg.scale_factor_spatial,
              size.width // cfg.scale_factor_spatial)
    z = torch.randn(*latent, generator=torch.Generator("cpu").manual_seed(0)).to(spec.torch_device, dtype)
    rows = [_measure("plain", vae, z, spec, opts.runs, {"applied": None, "tiles": 1})]
    tiling = _tiles(vae, size, opts.tile, opts.tile_stride)
    if tiling["applied"]:
        rows.append(_measure("tiled", vae, z, spec, opts.runs, tiling))
    else:
        rows.append({"decode": "tiled", **tiling, "error": None,
                     "skipped": f"not applied: a {size} clip fits in one {tiling['tile']} tile, so diffusers "
                                "decodes it whole (the plain row)"})
    vae.disable_tiling()
    return {
        "preset": preset.name, "device": spec.name, "precision": opts.precision, "size": str(size), "frames": frames,
        "latent_shape": list(latent), "vae": cls.__name__,
        "vae_config": override or "default (Wan 2.1's VAE)", "parameters": sum(p.numel() for p in vae.parameters()),
        "rows": rows,
        "notes": [f"{opts.runs} synchronised decodes each after one warm-up; random weights (the cost depends on "
                  "the shapes, not the values); peak = the device's peak allocation during the timed decodes, "
                  "the VAE's weights included (on cpu: the process's peak resident memory, the interpreter's included)"],
    }


def _fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    config = report["vae_config"] if isinstance(report["vae_config"], str) else "config override"
    lines = [f"## VAE decode: {report['vae']} ({config}, {report['parameters'] / 1e6:.2f}M parameters), "
             f"{report['size']} x {report['frames']} frames, "
             f"{report['precision']} on {report['device']}; latents {report['latent_shape']}", "",
             "| decode | tiles | ms (median) | ms (p90) | peak GiB | note |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        peak = r.get("peak_memory_bytes")
        note = r.get("error") or r.get("skipped") or (f"tile {r['tile']}, stride {r['stride']}" if r.get("tile") else "")
        lines.append(f"| {r['decode']} | {r.get('tiles', '')} | {_fmt(r.get('ms_median'))} | {_fmt(r.get('ms_p90'))} "
                     f"| {_fmt(peak / 2**30 if peak else None, 2)} | {note} |")
    return "\n".join([*lines, "", *[f"- {n}" for n in report["notes"]]])


def cmd_vae_bench(args) -> int:
    opts = from_args(VaeBenchOptions, args)
    report = run_vae_bench(opts)
    text = markdown(report)
    if opts.out:
        folder = Path(opts.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vae.json").write_text(json.dumps(report, indent=2))
        (folder / "vae.md").write_text(text + "\n")
    print(json.dumps(report, indent=2) if opts.json else text)
    return 0 if all(not r.get("error") for r in report["rows"]) else 1
