"""The tiny video pipelines (engine/models/tiny.py builds and caches them like the image ones): a Wan 2.x
text-to-video pipeline with random weights, 2 layers of 2 heads x 12, the project's tiny T5 and its
tokenizer, and a tiny `AutoencoderKLWan` (base_dim 3, z_dim 16: 8x spatial and 4x temporal compression as
the real one, so latents are (1, 16, (frames - 1) / 4 + 1, H / 8, W / 8)).

Its image-to-video sibling (`WanImageToVideoPipeline`) adds a tiny CLIP vision encoder and its image
processor, both made from configs here: the source frame is encoded by the VAE as the clip's first latent
frame (16 channels of condition and 4 of mask join the 16 of noise: 36 in) and by CLIP as image tokens the
transformer's cross-attention reads (`image_dim`). As in diffusers' own tiny test, those tokens join the text's
in one cross-attention: the 14B model's separate image projections (`added_kv_proj_dim`) assume 512 text
tokens, which the tiny presets do not pad to.

LTX-Video's pair (`LTXPipeline`, `LTXImageToVideoPipeline`) shares one recipe: a tiny `AutoencoderKLLTXVideo`
with the real compression (32x a side, 8x in time) and a 2-layer `LTXVideoTransformer3DModel` over the tiny T5.
"""

from __future__ import annotations

import torch

from engine.models.tiny_builders import T5_D_MODEL, build_t5

WAN_HEADS = 2
WAN_HEAD_DIM = 12
CLIP_VISION_HIDDEN = 16  # the transformer's image_dim
CLIP_VISION_SIDE = 32
# What the VAE-encoded source adds to the noise latents: 16 condition channels and 4 of first-frame mask.
I2V_IN_CHANNELS = 16 + 16 + 4
LTX_LATENT_CHANNELS = 16


def build_wan_vae(seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def build_wan_transformer(seed: int, in_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=WAN_HEADS,
        attention_head_dim=WAN_HEAD_DIM,
        in_channels=in_channels,
        out_channels=16,
        text_dim=T5_D_MODEL,
        freq_dim=32,
        ffn_dim=2 * WAN_HEADS * WAN_HEAD_DIM,
        num_layers=2,
        rope_max_seq_len=32,
        **extra,
    ).eval()


def build_clip_vision(seed: int):
    """A tiny CLIP vision encoder and its image processor: 32x32 pixels in patches of 4, so 64 + 1 tokens of
    CLIP_VISION_HIDDEN (the pipeline reads hidden_states[-2], hence two layers)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=CLIP_VISION_HIDDEN, intermediate_size=2 * CLIP_VISION_HIDDEN,
                              projection_dim=CLIP_VISION_HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                              image_size=CLIP_VISION_SIDE, patch_size=4)
    torch.manual_seed(seed)
    processor = CLIPImageProcessor(size={"shortest_edge": CLIP_VISION_SIDE},
                                   crop_size={"height": CLIP_VISION_SIDE, "width": CLIP_VISION_SIDE})
    return CLIPVisionModel(config).eval(), processor


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


def build_wan_i2v():
    """`WanImageToVideoPipeline` (a source image as the first frame), random weights: tiny-wan's T5, VAE and
    scheduler recipes, a transformer taking 36 channels and CLIP image tokens, a tiny CLIP vision encoder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    text_encoder, tokenizer = build_t5(seed=1)
    image_encoder, image_processor = build_clip_vision(seed=5)
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=build_wan_vae(seed=3),
        transformer=build_wan_transformer(seed=6, in_channels=I2V_IN_CHANNELS, image_dim=CLIP_VISION_HIDDEN),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        image_processor=image_processor,
        image_encoder=image_encoder,
    )


def build_ltx_vae(seed: int):
    """A tiny `AutoencoderKLLTXVideo` compressing as LTX-Video's does (32x a side: 3 halvings and a 4x4 patch;
    8x in time, so frames are 8k + 1), 8 channels a block, 16 latent channels."""
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    return AutoencoderKLLTXVideo(
        latent_channels=LTX_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False), decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=False, patch_size=4, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    ).eval()


def build_ltx_transformer(seed: int):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    return LTXVideoTransformer3DModel(
        in_channels=LTX_LATENT_CHANNELS, out_channels=LTX_LATENT_CHANNELS, patch_size=1, patch_size_t=1,
        num_attention_heads=WAN_HEADS, attention_head_dim=WAN_HEAD_DIM, cross_attention_dim=WAN_HEADS * WAN_HEAD_DIM,
        num_layers=2, caption_channels=T5_D_MODEL,
    ).eval()


def _ltx(pipeline_cls):
    """An LTX-Video pipeline (text to video, or image to video: the same components, the source image encoded
    as the first latent frame), random weights, the project's tiny T5."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    text_encoder, tokenizer = build_t5(seed=1)
    return pipeline_cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=build_ltx_vae(seed=7),
                        text_encoder=text_encoder, tokenizer=tokenizer, transformer=build_ltx_transformer(seed=8))


def build_ltx():
    from diffusers import LTXPipeline

    return _ltx(LTXPipeline)


def build_ltx_i2v():
    from diffusers import LTXImageToVideoPipeline

    return _ltx(LTXImageToVideoPipeline)


VIDEO_BUILDERS = {"tiny-wan": build_wan, "tiny-wan-i2v": build_wan_i2v, "tiny-ltx": build_ltx,
                  "tiny-ltx-i2v": build_ltx_i2v}
VIDEO_PRESETS: tuple[str, ...] = tuple(VIDEO_BUILDERS)
