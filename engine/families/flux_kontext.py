"""FLUX.1 Kontext: an instruction edit of one image whose latent tokens join the sequence (tiny-shapes-edit)."""

from engine.families.family import CallArguments, PipelineFamily, unpack_flux_tokens
from engine.families.registry import register
from engine.protocol import ImageInputs

register(PipelineFamily(
    pipeline="FluxKontextPipeline", task="edit", bucket_family="flux", denoiser="transformer", alignment=16,
    cfg=False, takes_negative=False, steps=28, guidance=2.5, inputs=ImageInputs.EDIT, max_images=1,
    call=CallArguments(true_cfg=True, edit_area=True), unpack_latents=unpack_flux_tokens,
    decode_then_postprocess=True, cp_sequences=("image", "text"),
))
