"""The tiny pipelines' components and pipelines (engine/models/tiny.py builds and caches them): text
encoders, VAEs and the four pipelines, every component created right after `torch.manual_seed(...)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.tiny_tokenizers import (
    CLIP_MAX_TOKENS,
    QWEN_MAX_TOKENS,
    build_clip_tokenizer,
    build_qwen_tokenizer,
    build_t5_tokenizer,
)

TINY_PRESETS: tuple[str, ...] = ("tiny-flux", "tiny-flux2-klein", "tiny-sd3", "tiny-sdxl")

# --------------------------------------------------------------------------------------------------
# Sizes. Shared by several pipelines so the same encoder is literally the same recipe everywhere.
# --------------------------------------------------------------------------------------------------
CLIP_HIDDEN = 32  # Flux: pooled_projection_dim; SD3/SDXL: two of them are concatenated
CLIP_PROJECTION = 32  # CLIPTextModelWithProjection.text_embeds (SD3 pooled, SDXL add_embedding)
T5_D_MODEL = 64  # SD3 zero-pads the 2 x 32 CLIP features up to the T5 width, so it must be >= 64
QWEN_HIDDEN = 16  # thin, because it needs many layers (below)
QWEN_LAYERS = 27  # Flux2Klein's default text_encoder_out_layers=(9, 18, 27) reads hidden_states[27]
QWEN_OUT_LAYERS = (9, 18, 27)  # -> joint_attention_dim = 3 * QWEN_HIDDEN

# --------------------------------------------------------------------------------------------------
# Text encoders (each seeded right before construction).
# --------------------------------------------------------------------------------------------------
def build_clip(seed: int, with_projection: bool):
    """CLIP text encoder + tokenizer. Two layers, because SD3 and SDXL read hidden_states[-2]."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = build_clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=2 * CLIP_HIDDEN,
        projection_dim=CLIP_PROJECTION,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_TOKENS,
        # The pooled output is read at the first eos token; eos_token_id == 2 would switch transformers to
        # the legacy argmax(input_ids) rule, so give the real ids.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    return model.eval(), tokenizer


def build_t5(seed: int):
    """T5 v1.1-style encoder (gated GELU) + Unigram tokenizer; relative positions, so no length limit."""
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_D_MODEL,
        d_kv=T5_D_MODEL // 4,
        d_ff=2 * T5_D_MODEL,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval(), tokenizer


def build_qwen3(seed: int):
    """Qwen3ForCausalLM, as Flux2Klein expects. Many thin layers: the pipeline stacks hidden_states at its
    default text_encoder_out_layers (9, 18, 27), so 27 layers make the defaults work."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=QWEN_HIDDEN,
        intermediate_size=2 * QWEN_HIDDEN,
        num_hidden_layers=QWEN_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=QWEN_HIDDEN // 2,
        max_position_embeddings=2 * QWEN_MAX_TOKENS,
        tie_word_embeddings=True,  # the LM head is never used; tying keeps it off the disk
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval(), tokenizer


# --------------------------------------------------------------------------------------------------
# VAEs: 4 blocks -> vae_scale_factor 8, tiny widths.
# --------------------------------------------------------------------------------------------------
def build_vae(seed: int, latent_channels: int, cls=None, **extra):
    """AutoencoderKL, or a class with the same constructor such as AutoencoderKLFlux2, with 4 tiny blocks."""
    from diffusers import AutoencoderKL

    cls = cls or AutoencoderKL
    torch.manual_seed(seed)
    return cls(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=128,
        **extra,
    ).eval()


# --------------------------------------------------------------------------------------------------
# Pipelines.
# --------------------------------------------------------------------------------------------------
def _flux_dev_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev / FLUX.2 scheduler config: resolution-dependent shift (the pipelines pass `mu`).
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def flux_text_encoders() -> tuple:
    """FLUX.1's text side: (CLIP, its tokenizer, T5, its tokenizer), tiny, random and seeded."""
    text_encoder, tokenizer = build_clip(seed=1, with_projection=False)
    text_encoder_2, tokenizer_2 = build_t5(seed=2)
    return text_encoder, tokenizer, text_encoder_2, tokenizer_2


def flux_pipeline(scheduler, vae, transformer, text_encoders: tuple):
    """A FluxPipeline from its parts (`text_encoders` as flux_text_encoders returns them)."""
    from diffusers import FluxPipeline

    text_encoder, tokenizer, text_encoder_2, tokenizer_2 = text_encoders
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def _build_flux():
    from diffusers import FluxTransformer2DModel

    text_encoders = flux_text_encoders()
    # FLUX.1 latents: 16 channels, packed 2x2 -> in_channels 64; shift/scale as FLUX.1's VAE.
    vae = build_vae(
        seed=3,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(4)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # must sum to attention_head_dim
    ).eval()
    return flux_pipeline(_flux_dev_scheduler(), vae, transformer, text_encoders)


def _build_flux2_klein():
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel

    text_encoder, tokenizer = build_qwen3(seed=1)
    # AutoencoderKLFlux2 patchifies 2x2 and batch-normalises: transformer in_channels = 4 * latent_channels.
    vae = build_vae(
        seed=3, latent_channels=16, cls=AutoencoderKLFlux2, use_quant_conv=True, use_post_quant_conv=True
    )
    torch.manual_seed(4)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=len(QWEN_OUT_LAYERS) * QWEN_HIDDEN,
        axes_dims_rope=(4, 4, 4, 4),  # 4 axes (t, h, w, l), summing to attention_head_dim
        guidance_embeds=False,  # the distilled klein models take no guidance input
    ).eval()
    # is_distilled: like FLUX.2-klein-4B, no classifier-free guidance (one transformer pass per step).
    return Flux2KleinPipeline(
        scheduler=_flux_dev_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def _build_sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    text_encoder, tokenizer = build_clip(seed=1, with_projection=True)
    text_encoder_2, tokenizer_2 = build_clip(seed=2, with_projection=True)
    text_encoder_3, tokenizer_3 = build_t5(seed=5)
    vae = build_vae(
        seed=3,
        latent_channels=16,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(4)
    transformer = SD3Transformer2DModel(
        # sample_size 16 -> the pipeline's default image is 128x128 instead of 1024x1024.
        sample_size=16,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        caption_projection_dim=4 * 16,  # = inner dim
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=2 * CLIP_PROJECTION,  # both CLIPs' text_embeds, concatenated
        # Positional table covers latents up to 64 patches a side (1024 px); it is saved, so keep it small.
        pos_embed_max_size=64,
    ).eval()
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
    )


def _build_sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    text_encoder, tokenizer = build_clip(seed=1, with_projection=False)
    text_encoder_2, tokenizer_2 = build_clip(seed=2, with_projection=True)
    vae = build_vae(seed=3, latent_channels=4, scaling_factor=0.13025)
    time_embed_dim = 8
    torch.manual_seed(4)
    unet = UNet2DConditionModel(
        sample_size=16,  # default image 128x128 instead of 1024x1024
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        # diffusers' legacy name: this is the number of heads per block (SDXL: 5, 10, 20).
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 1),
        use_linear_projection=True,
        norm_num_groups=8,
        cross_attention_dim=2 * CLIP_HIDDEN,  # both CLIPs' hidden states, concatenated
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        # 6 micro-conditioning ids (original size, crop, target size) + text_encoder_2's pooled embeds.
        projection_class_embeddings_input_dim=6 * time_embed_dim + CLIP_PROJECTION,
    ).eval()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
        steps_offset=1,
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
    )


BUILDERS: dict[str, Callable] = {
    "tiny-flux": _build_flux,
    "tiny-flux2-klein": _build_flux2_klein,
    "tiny-sd3": _build_sd3,
    "tiny-sdxl": _build_sdxl,
}
assert tuple(BUILDERS) == TINY_PRESETS
