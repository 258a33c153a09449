"""Stable Diffusion XL: a UNet, text to image, classifier-free guidance with a negative prompt."""

from engine.families.family import CallArguments, PipelineFamily
from engine.families.registry import register

register(PipelineFamily(
    pipeline="StableDiffusionXLPipeline", task="text-to-image", bucket_family="sdxl", denoiser="unet", alignment=8,
    cfg=True, takes_negative=True, steps=30, guidance=5.0, call=CallArguments(max_sequence_length=False),
    decode_then_postprocess=True,  # but for its optional watermark (can_decode_apart checks it)
    tiny="tiny-sdxl",
))
