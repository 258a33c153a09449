"""Stable Diffusion 1.x / 2.x: a UNet, text to image (its safety checker runs after the decode)."""

from engine.families.family import CallArguments, PipelineFamily
from engine.families.registry import register

register(PipelineFamily(
    pipeline="StableDiffusionPipeline", task="text-to-image", bucket_family="default", denoiser="unet", alignment=8,
    cfg=True, takes_negative=True, steps=50, guidance=7.5, call=CallArguments(max_sequence_length=False),
))
