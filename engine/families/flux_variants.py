"""FLUX.1 img2img and inpainting, built over a FLUX.1 text-to-image folder's weights (no copy)."""

import dataclasses

from engine.families.family import CallArguments, PipelineFamily, unpack_flux_tokens
from engine.families.registry import register
from engine.protocol import ImageInputs

IMG2IMG = PipelineFamily(
    pipeline="FluxImg2ImgPipeline", task="edit", bucket_family="flux", denoiser="transformer", alignment=16,
    cfg=False, takes_negative=False, steps=28, guidance=3.5, inputs=ImageInputs.IMG2IMG, max_images=1,
    base="FluxPipeline", call=CallArguments(true_cfg=True), unpack_latents=unpack_flux_tokens,
    decode_then_postprocess=True, cp_sequences=("image", "text"), tiny="tiny-flux",
)
# Its __call__ may overlay the source on the decoded images (padding_mask_crop): it decodes its batch whole.
INPAINT = dataclasses.replace(IMG2IMG, pipeline="FluxInpaintPipeline", inputs=ImageInputs.INPAINT,
                              decode_then_postprocess=False)
register(IMG2IMG, INPAINT)
