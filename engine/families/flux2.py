"""FLUX.2 (dev) and FLUX.2 [klein]: text to image with 0..N reference images joining the sequence."""

import dataclasses

from engine.families.family import PipelineFamily
from engine.families.registry import register
from engine.protocol import ImageInputs

FLUX2 = PipelineFamily(
    pipeline="Flux2Pipeline", task="edit", bucket_family="flux", denoiser="transformer", alignment=16,
    cfg=False, takes_negative=False, steps=28, guidance=4.0,
    inputs=ImageInputs.REFERENCES, max_images=10,  # diffusers warns beyond 10 (its model card's bound)
    decode_then_postprocess=True, cp_sequences=("image", "text"),
)
KLEIN = dataclasses.replace(FLUX2, pipeline="Flux2KleinPipeline", steps=4, guidance=1.0, max_images=4,
                            tiny="tiny-flux2-klein")  # distilled: 4 steps
register(FLUX2, KLEIN)
