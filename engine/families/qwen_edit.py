"""Qwen-Image-Edit-Plus (2509): an instruction edit of one to three reference images; guidance is true CFG."""

from engine.families.family import CallArguments, PipelineFamily
from engine.families.registry import register
from engine.protocol import ImageInputs

register(PipelineFamily(
    pipeline="QwenImageEditPlusPipeline", task="edit", bucket_family="qwen", denoiser="transformer", alignment=16,
    cfg=True, takes_negative=True, steps=40, guidance=4.0,
    inputs=ImageInputs.REFERENCES, max_images=3,  # the 2509 model card: one to three images
    call=CallArguments(true_cfg=True),
))
