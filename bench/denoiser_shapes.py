"""What a pipeline hands its denoiser at one step, for the random-weights bench (bench/denoiser.py): the
inputs' shapes per pipeline class, the self-attention sequence they make, and the FLOPs of one forward
(analytic for the Flux transformer, FlopCounterMode on the meta device for any denoiser).

An instruction edit (FluxKontextPipeline) appends each reference's packed latent tokens to the output's, with
position ids whose first coordinate is 1 (the pipeline's `prepare_latents`); the transformer sees the whole
sequence and the pipeline keeps only the output's part of its prediction. A Wan clip's latents are
(16, (frames - 1) / 4 + 1, H / 8, W / 8), cut into 1x2x2 patches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)

VAE_SCALE = 8
WAN_TIME_SCALE = 4  # Wan 2.1's VAE keeps the first frame and compresses the rest 4x in time
FLUX_PIPELINES = ("FluxPipeline", "FluxKontextPipeline")
REFERENCE_PIPELINES = ("FluxKontextPipeline",)  # whose denoiser inputs take references' tokens here
VIDEO_PIPELINES = ("WanPipeline",)


@dataclass(frozen=True)
class DenoiserShape:
    """What a pipeline hands its denoiser at one step: the pipeline class, the denoiser's config, the bucket,
    the text length in tokens, the batch, the references' sizes (an edit) and the clip's frames (a video)."""

    pipeline: str
    cfg: dict
    size: object  # Size
    text_len: int
    batch: int = 1
    references: tuple = ()  # Size each
    frames: int = 0


def flux_tokens(cfg: dict, width: int, height: int) -> int:
    """Packed latent tokens of one Flux image: 2x2 patches of the 8x-compressed latent."""
    patch = cfg.get("patch_size", 1)
    return (height // (VAE_SCALE * 2)) * (width // (VAE_SCALE * 2)) // (patch * patch)


def wan_latent_frames(frames: int) -> int:
    return (frames - 1) // WAN_TIME_SCALE + 1


def sequence(shape: DenoiserShape) -> dict:
    """The self-attention sequence of one forward, in tokens: the output's, the references', the text's
    (Flux's joint attention; Wan's text is read by cross-attention instead) and their total."""
    size, cfg = shape.size, shape.cfg
    if shape.pipeline in VIDEO_PIPELINES:
        _, ph, pw = cfg.get("patch_size", (1, 2, 2))
        out = wan_latent_frames(shape.frames) * (size.height // VAE_SCALE // ph) * (size.width // VAE_SCALE // pw)
        return {"output": out, "references": 0, "text": 0, "total": out}
    if shape.pipeline in FLUX_PIPELINES:
        out = flux_tokens(cfg, size.width, size.height)
        refs = sum(flux_tokens(cfg, r.width, r.height) for r in shape.references)
        return {"output": out, "references": refs, "text": shape.text_len, "total": out + refs + shape.text_len}
    return {"output": None, "references": 0, "text": shape.text_len, "total": None}


def flux_step_flops(cfg: dict, width: int, height: int, text_len: int = 512, batch: int = 1,
                    reference_tokens: int = 0) -> int:
    """FLOPs of one FluxTransformer2DModel forward, counted analytically (multiply-add = 2 FLOPs).

    With D = heads·head_dim, N_img = (H/16)·(W/16) image tokens plus `reference_tokens` (an edit's references
    join the image tokens: every image-token layer runs on them too), N_txt text tokens, N = N_img + N_txt:
      linear layer:  2 · tokens · in · out;   attention (QKᵀ and AV): 4 · N² · D per layer
      double block:  qkv img+txt 6·N·D², out projections 2·N·D², MLP 4D 16·N·D²  -> 24·N·D² + 4·N²·D
                     + AdaLN modulation of the 1-token embedding for img and txt: 2 · 2·D·6D
      single block:  qkv 6·N·D², proj_mlp 8·N·D², proj_out (5D -> D) 10·N·D²   -> 24·N·D² + 4·N²·D
                     + AdaLN modulation 2·D·3D
      embedders:     x 2·N_img·C_in·D, context 2·N_txt·J·D, proj_out 2·N_img·D·C_out, norm_out 2·D·2D,
                     timestep (and guidance) 2·256·D + 2·D², pooled 2·P·D + 2·D²
    FLUX.1-dev at 1024² with 512 text tokens: ≈ 74.4 TFLOP per step. Everything times the batch.
    Checked against torch.utils.flop_counter.FlopCounterMode (tests/test_bench.py).
    """
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    d = heads * head_dim
    patch = cfg.get("patch_size", 1)
    c_in = cfg.get("in_channels", 64)
    c_out = (cfg.get("out_channels") or c_in) * patch * patch
    n_img = flux_tokens(cfg, width, height) + reference_tokens
    n = n_img + text_len
    per_layer = 24 * n * d * d + 4 * n * n * d
    double = cfg.get("num_layers", 19) * (per_layer + 2 * 2 * d * 6 * d)
    single = cfg.get("num_single_layers", 38) * (per_layer + 2 * d * 3 * d)
    time_embeds = (2 * 256 * d + 2 * d * d) * (2 if cfg.get("guidance_embeds", False) else 1)
    pooled = 2 * cfg.get("pooled_projection_dim", 768) * d + 2 * d * d
    embed = (2 * n_img * c_in * d + 2 * text_len * cfg.get("joint_attention_dim", 4096) * d
             + 2 * n_img * d * c_out + 2 * d * 2 * d + time_embeds + pooled)
    return batch * (double + single + embed)


def _flux_ids(hp: int, wp: int, first: float) -> torch.Tensor:
    """Position ids of one packed image: (first, row, column) per token."""
    ids = torch.zeros(hp, wp, 3)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(hp)[:, None]
    ids[..., 2] = torch.arange(wp)[None, :]
    return ids.reshape(hp * wp, 3)


def _flux_inputs(shape: DenoiserShape, rnd, device: str, dtype, guidance: float) -> dict:
    # Packed latents: 2x2 patches of the 16-channel latent -> (H/16)·(W/16) tokens of 64 channels; an edit's
    # references follow the output's tokens, their ids' first coordinate 1.
    cfg, batch, text_len = shape.cfg, shape.batch, shape.text_len
    images = [(shape.size, 0.0), *((r, 1.0) for r in shape.references)]
    ids = [_flux_ids(s.height // VAE_SCALE // 2, s.width // VAE_SCALE // 2, first) for s, first in images]
    n_img = sum(len(i) for i in ids)
    inputs = {
        "hidden_states": rnd(batch, n_img, cfg.get("in_channels", 64)),
        "encoder_hidden_states": rnd(batch, text_len, cfg.get("joint_attention_dim", 4096)),
        "pooled_projections": rnd(batch, cfg.get("pooled_projection_dim", 768)),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),  # sigma; the model scales by 1000
        "img_ids": torch.cat(ids).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(text_len, 3, device=device, dtype=dtype),
        "return_dict": False,
    }
    if cfg.get("guidance_embeds", False):
        inputs["guidance"] = torch.full((batch,), guidance, device=device, dtype=torch.float32)
    return inputs


def _unet_inputs(shape: DenoiserShape, rnd, device: str, dtype) -> dict:
    # UNet2DConditionModel (SDXL: text_time micro-conditioning)
    cfg, batch = shape.cfg, shape.batch
    inputs = {
        "sample": rnd(batch, cfg.get("in_channels", 4), shape.size.height // VAE_SCALE, shape.size.width // VAE_SCALE),
        "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": rnd(batch, shape.text_len, cfg.get("cross_attention_dim", 2048)),
        "return_dict": False,
    }
    if cfg.get("addition_embed_type") == "text_time":
        time_dim = cfg.get("addition_time_embed_dim", 256)
        text_dim = cfg.get("projection_class_embeddings_input_dim", 2816) - 6 * time_dim
        inputs["added_cond_kwargs"] = {"text_embeds": rnd(batch, text_dim), "time_ids": rnd(batch, 6)}
    return inputs


def denoiser_inputs(shape: DenoiserShape, device: str, dtype, guidance: float = 3.5, seed: int = 0) -> dict:
    """Random inputs of the shapes the pipeline gives its denoiser at one step for this bucket."""
    if shape.references and shape.pipeline not in REFERENCE_PIPELINES:
        raise ValueError(f"references: the bench knows them for {', '.join(REFERENCE_PIPELINES)}, not {shape.pipeline}")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*dims):
        return torch.randn(*dims, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    cfg, size, batch = shape.cfg, shape.size, shape.batch
    h, w = size.height // VAE_SCALE, size.width // VAE_SCALE
    if shape.pipeline in FLUX_PIPELINES:
        return _flux_inputs(shape, rnd, device, dtype, guidance)
    if shape.pipeline in VIDEO_PIPELINES:
        return {
            "hidden_states": rnd(batch, cfg.get("in_channels", 16), wan_latent_frames(shape.frames), h, w),
            "encoder_hidden_states": rnd(batch, shape.text_len, cfg.get("text_dim", 4096)),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),  # the scheduler's 0..1000 scale
            "return_dict": False,
        }
    if shape.pipeline == "StableDiffusion3Pipeline":
        return {
            "hidden_states": rnd(batch, cfg.get("in_channels", 16), h, w),
            "encoder_hidden_states": rnd(batch, shape.text_len, cfg.get("joint_attention_dim", 4096)),
            "pooled_projections": rnd(batch, cfg.get("pooled_projection_dim", 2048)),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
            "return_dict": False,
        }
    return _unet_inputs(shape, rnd, device, dtype)


def count_flops_meta(cls, shape: DenoiserShape, guidance: float) -> int | None:
    """FLOPs of one forward counted by FlopCounterMode on the meta device (no memory, no compute).
    On meta, SDPA takes the math path, so attention's matmuls are counted too."""
    try:
        with torch.device("meta"):
            model = cls.from_config(shape.cfg)
        inputs = denoiser_inputs(shape, "meta", torch.float32, guidance)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(**inputs)
        return int(counter.get_total_flops())
    except Exception as exc:  # counting is informative; never fail the benchmark over it
        log.warning("FLOP count on meta failed: %s", exc)
        return None
