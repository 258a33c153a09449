"""FLUX.1 text to image (dev, schnell; the embedded tiny-shapes is one)."""

from engine.families.family import CallArguments, PipelineFamily, unpack_flux_tokens
from engine.families.registry import register

# FLUX.1's encoders and VAE (CLIP-L, T5-XXL, its 16-channel VAE), parameter counts as published on the Hub.
FLUX1_PUBLISHED = {"text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656, "vae": 83_819_683}

(FLUX1,) = register(PipelineFamily(
    pipeline="FluxPipeline", task="text-to-image", bucket_family="flux", denoiser="transformer", alignment=16,
    cfg=False, takes_negative=False, steps=28, guidance=3.5,
    call=CallArguments(true_cfg=True), unpack_latents=unpack_flux_tokens, decode_then_postprocess=True,
    published=FLUX1_PUBLISHED, cp_sequences=("image", "text"), tiny="tiny-flux", step="flux",
))
