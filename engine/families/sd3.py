"""Stable Diffusion 3 / 3.5: text to image, classifier-free guidance with a negative prompt."""

from engine.families.family import PipelineFamily
from engine.families.registry import register

register(PipelineFamily(
    pipeline="StableDiffusion3Pipeline", task="text-to-image", bucket_family="sd3", denoiser="transformer",
    alignment=16, cfg=True, takes_negative=True, steps=40, guidance=4.5, decode_then_postprocess=True,
    tiny="tiny-sd3",
))
