"""Wan 2.1 / 2.2: text to video, and image to video with the source as the first frame (tiny-shapes-video)."""

import dataclasses

from engine.families.family import PipelineFamily
from engine.families.registry import register
from engine.protocol import ImageInputs

WAN = PipelineFamily(
    pipeline="WanPipeline", task="video", bucket_family="wan", denoiser="transformer", alignment=16,
    cfg=True, takes_negative=True, steps=30, guidance=5.0,
    frames=(33, 81, 17), frame_step=4, fps=16,  # its VAE compresses time 4x and keeps the first frame
    tiny="tiny-wan",
)
WAN_I2V = dataclasses.replace(WAN, pipeline="WanImageToVideoPipeline", inputs=ImageInputs.FIRST_FRAME,
                              max_images=1, tiny="tiny-wan-i2v")
register(WAN, WAN_I2V)
