"""The GPU run's edit and video cases (scripts/bench_gpu.sh edit / video) at tiny sizes on CPU: the Kontext
denoiser's doubled sequence (output + reference tokens, the reference's ids first coordinate 1) and its
analytic FLOPs against FlopCounterMode, the Wan denoiser's clip inputs, both through `python -m bench bench
--random-weights` with a tiny config override, the flags' checks, and the VAE decode table (plain and tiled,
and a clip smaller than the tile reported as such).

No timing assertions: only shapes, counts and the reports' structure.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import denoiser_shapes
from bench.commands import build_parser
from bench.plan import plan_from_args
from bench.run import run_bench
from engine.config.presets import get_preset
from engine.errors import InvalidRequest
from engine.protocol import Size

TINY_FLUX = {
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 6, 6],
}
TINY_WAN = {
    "num_attention_heads": 2, "attention_head_dim": 12, "text_dim": 32, "freq_dim": 32, "ffn_dim": 48,
    "num_layers": 1, "rope_max_seq_len": 32,
}
TINY_VAE = {"base_dim": 3, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}


def _plan(argv: list[str]):
    return plan_from_args(build_parser().parse_args(["bench", *argv]))


def test_kontext_inputs_append_the_reference_and_its_flops_match_the_counter():
    from diffusers import FluxTransformer2DModel

    cfg = {**TINY_FLUX, "in_channels": 64, "patch_size": 1, "guidance_embeds": True}
    shape = denoiser_shapes.DenoiserShape("FluxKontextPipeline", cfg, Size(64, 64), 8,
                                          references=(Size(128, 64),))
    inputs = denoiser_shapes.denoiser_inputs(shape, "cpu", torch.float32)
    # 4x4 output tokens, then 4x8 reference tokens whose ids' first coordinate is 1
    assert inputs["hidden_states"].shape == (1, 16 + 32, 64) and inputs["img_ids"].shape == (48, 3)
    assert inputs["img_ids"][:16, 0].eq(0).all() and inputs["img_ids"][16:, 0].eq(1).all()
    assert inputs["img_ids"][16:, 2].max() == 7  # the reference's own columns
    model = FluxTransformer2DModel.from_config(cfg).eval()
    with torch.no_grad():
        (out,) = model(**inputs)
    assert out.shape == (1, 48, 64)  # the whole sequence; the pipeline keeps the output's first 16
    assert denoiser_shapes.sequence(shape) == {"output": 16, "references": 32, "text": 8, "total": 56}
    counted = denoiser_shapes.count_flops_meta(FluxTransformer2DModel, shape, 2.5)
    assert counted == denoiser_shapes.flux_step_flops(cfg, 64, 64, 8, reference_tokens=32)
    # the full-size edit: 4096 output + 4096 reference + 512 text tokens
    full = get_preset("flux1-kontext-dev").denoiser_config
    doubled = denoiser_shapes.flux_step_flops(full, 1024, 1024, 512, reference_tokens=4096)
    assert 1.6e14 < doubled < 1.7e14 and doubled > 2 * denoiser_shapes.flux_step_flops(full, 1024, 1024, 512)


def test_wan_inputs_have_the_clips_latent_shape():
    from diffusers import WanTransformer3DModel

    cfg = {**get_preset("wan2.1-t2v-1.3b").denoiser_config, **TINY_WAN}
    shape = denoiser_shapes.DenoiserShape("WanPipeline", cfg, Size(48, 32), 8, frames=9)
    inputs = denoiser_shapes.denoiser_inputs(shape, "cpu", torch.float32)
    assert inputs["hidden_states"].shape == (1, 16, 3, 4, 6) and inputs["encoder_hidden_states"].shape == (1, 8, 32)
    with torch.no_grad():
        (out,) = WanTransformer3DModel.from_config(cfg).eval()(**inputs)
    assert out.shape == inputs["hidden_states"].shape
    assert denoiser_shapes.sequence(shape)["total"] == 3 * 2 * 3
    # the preset's full config is the real 1.3B model (30 layers of 1536 wide; the embedders bring 1.42B)
    with torch.device("meta"):
        full = WanTransformer3DModel.from_config(get_preset("wan2.1-t2v-1.3b").denoiser_config)
    assert 1.3e9 < sum(p.numel() for p in full.parameters()) < 1.5e9


def _bench(tmp_path, cache_dir, preset: str, override: dict, *extra: str) -> dict:
    plan = _plan(["--random-weights", "--preset", preset, "--device", "cpu", "--modes", "eager", "--precisions",
                  "fp32", "--steps", "1", "--runs", "1", "--warmup-calls", "0", "--text-len", "8", "--no-progress",
                  "--denoiser-config-override", json.dumps(override), "--cache-dir", str(cache_dir),
                  "--out", str(tmp_path), *extra])
    report = run_bench(plan)
    (r,) = report["results"]
    assert r["error"] is None, r["error"]
    assert r["parameters"] < 1_000_000 and r["flops_per_step"] > 0
    return report


def test_bench_runs_a_tiny_kontext_edit_with_its_reference(cache_dir, tmp_path):
    report = _bench(tmp_path, cache_dir, "flux1-kontext-dev", TINY_FLUX, "--sizes", "64x64")
    (r,) = report["results"]
    assert r["references"] == ["64x64"] and r["sequence_tokens"] == 16 + 16 + 8
    flops = report["extras"]["flops_per_step"]["64x64"]
    assert flops["analytic"] == flops["counted"]
    assert any("sequence at 64x64: 16 output + 16 reference (64x64) + 8 text = 40 tokens" in n
               for n in report["notes"])


def test_bench_runs_a_tiny_wan_clip_with_guidance_as_two_calls(cache_dir, tmp_path, monkeypatch):
    from bench import denoiser

    kept = []
    keep = denoiser._keep_in_fp32
    monkeypatch.setattr(denoiser, "_keep_in_fp32", lambda model: (keep(model), kept.append(model))[0])
    report = _bench(tmp_path, cache_dir, "wan2.1-t2v-1.3b", TINY_WAN, "--sizes", "32x32", "--frames", "5",
                    "--precisions", "bf16")
    # built in bf16 as from_pretrained loads it: the class's fp32 modules stay fp32
    (model,) = kept
    assert model.scale_shift_table.dtype == torch.float32 and model.proj_out.weight.dtype == torch.bfloat16
    (r,) = report["results"]
    assert r["frames"] == 5 and r["batch"] == 1 and report["extras"]["calls_per_step"] == 2
    assert r["sequence_tokens"] == 2 * 2 * 2  # 2 latent frames of 2x2 patches
    flops = report["extras"]["flops_per_step"]["32x32"]
    assert flops["used"] == flops["counted"] and flops["analytic"] is None
    assert any("2 synchronised forwards" in n for n in report["notes"])


def test_reference_and_frame_flags_are_checked(cache_dir):
    base = ["--random-weights", "--device", "cpu", "--cache-dir", str(cache_dir)]
    assert _plan([*base, "--preset", "flux1-kontext-dev"]).reference_sizes(Size(512, 512)) == (Size(512, 512),)
    assert _plan([*base, "--preset", "flux1-kontext-dev", "--references", "none"]).reference_sizes(Size(64, 64)) == ()
    assert _plan([*base, "--preset", "flux1-dev"]).reference_sizes(Size(64, 64)) == ()
    assert _plan([*base, "--preset", "wan2.1-t2v-1.3b"]).frames == 33
    with pytest.raises(InvalidRequest, match="at most 1 reference"):
        _plan([*base, "--preset", "flux1-kontext-dev", "--references", "64x64,64x64"])
    with pytest.raises(InvalidRequest, match="at most 0"):
        _plan([*base, "--preset", "flux1-dev", "--references", "64x64"])
    with pytest.raises(InvalidRequest, match="1 \\+ a multiple of 4"):
        _plan([*base, "--preset", "wan2.1-t2v-1.3b", "--frames", "10"])
    with pytest.raises(InvalidRequest, match="makes images"):
        _plan([*base, "--preset", "flux1-dev", "--frames", "9"])


def _vae_opts(**kw):
    from bench.vae_decode import VaeBenchOptions

    return VaeBenchOptions(device="cpu", precision="fp32", size="32x32", frames=5, runs=1,
                           vae_config_override=json.dumps(TINY_VAE), **kw)


def test_vae_decode_table_plain_and_tiled():
    from bench.vae_decode import markdown, run_vae_bench

    report = run_vae_bench(_vae_opts(tile=16, tile_stride=16))
    plain, tiled = report["rows"]
    assert report["latent_shape"] == [1, 16, 2, 4, 4]
    assert plain["error"] is None and plain["frames_out"] == 5 and plain["ms_median"] > 0
    assert tiled["applied"] and tiled["tiles"] == 4 and tiled["error"] is None and tiled["frames_out"] == 5
    table = markdown(report)
    assert "| plain | 1 |" in table and "| tiled | 4 |" in table


def test_vae_tiling_on_a_clip_within_one_tile_is_reported_not_run():
    from bench.vae_decode import markdown, run_vae_bench

    report = run_vae_bench(_vae_opts())  # diffusers' 256-pixel tiles: the 32x32 clip fits in one
    plain, tiled = report["rows"]
    assert plain["error"] is None and tiled["applied"] is False and "ms_median" not in tiled
    assert "fits in one 256x256 tile" in markdown(report)
