"""LTX-Video: text to video, and image to video with the source as the first frame; the rate is an argument."""

import dataclasses

from engine.families.family import CallArguments, PipelineFamily
from engine.families.registry import register
from engine.protocol import ImageInputs

LTX = PipelineFamily(
    pipeline="LTXPipeline", task="video", bucket_family="ltx", denoiser="transformer", alignment=32,
    cfg=True, takes_negative=True, steps=50, guidance=3.0,
    frames=(161, 97, 25), frame_step=8, fps=24,  # its VAE compresses 32x a side and 8x in time
    call=CallArguments(frame_rate=True), tiny="tiny-ltx",
)
LTX_I2V = dataclasses.replace(LTX, pipeline="LTXImageToVideoPipeline", inputs=ImageInputs.FIRST_FRAME,
                              max_images=1, tiny="tiny-ltx-i2v")
register(LTX, LTX_I2V)
