"""The tiny video pipelines (engine/models/tiny.py builds and caches them like the image ones): a Wan 2.x
text-to-video pipeline with random weights, 2 layers of 2 heads x 12, the project's tiny T5 and its
tokenizer, and a tiny `AutoencoderKLWan` (base_dim 3, z_dim 16: 8x spatial and 4x temporal compression as
the real one, so latents are (1, 16, (frames - 1) / 4 + 1, H / 8, W / 8)).

Image-to-video (`WanImageToVideoPipeline`) is served from the Hub ids only: its tiny build would need a
CLIP vision encoder and image processor of our own, which this module does not make.
"""

from __future__ import annotations

import torch

from engine.models.tiny_builders import T5_D_MODEL, build_t5

WAN_HEADS = 2
WAN_HEAD_DIM = 12


def build_wan_vae(seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def build_wan_transformer(seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=WAN_HEADS,
        attention_head_dim=WAN_HEAD_DIM,
        in_channels=16,
        out_channels=16,
        text_dim=T5_D_MODEL,
        freq_dim=32,
        ffn_dim=2 * WAN_HEADS * WAN_HEAD_DIM,
        num_layers=2,
        rope_max_seq_len=32,
    ).eval()


def build_wan():
    """`WanPipeline` (text to video), random weights; its scheduler is Wan 2.1's (flow matching, shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    text_encoder, tokenizer = build_t5(seed=1)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=build_wan_vae(seed=3),
        transformer=build_wan_transformer(seed=4),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


VIDEO_PRESETS: tuple[str, ...] = ("tiny-wan",)
VIDEO_BUILDERS = {"tiny-wan": build_wan}
