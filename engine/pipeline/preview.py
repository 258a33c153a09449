"""Partial images while a run denoises (the /v1 API's streamed `partial_image` events): the latents of a step
decoded by the pipeline's own VAE, at a few steps spread over the run.

A partial image is the state of the run at that step (the noisy latents as they are, not a prediction of
the end), so early ones are mostly noise and later ones approach the image. Each costs one VAE decode of
the call's batch; its time is kept out of the step's step_ms (RunClock.exclude). Packed latents are unpacked as
the pipeline's family declares (PipelineFamily.unpack_latents); pipelines whose latents are still not the VAE's
(packed otherwise, normalised) make none: `decode` answers None and the run goes on. Bounded: at most
MAX_PREVIEWS (engine/config/validation.py) per request.
"""

from __future__ import annotations

import io
import logging

from engine.families import registry

log = logging.getLogger(__name__)


def preview_steps(steps: int, previews: int) -> frozenset[int]:
    """The 1-based steps whose latents become partial images: `previews` spread evenly before the last step
    (the last one's image is the result itself)."""
    if previews <= 0 or steps <= 1:
        return frozenset()
    return frozenset(min(steps - 1, max(1, round(k * steps / (previews + 1)))) for k in range(1, previews + 1))


def decode(pipe, vae, latents, height: int, width: int) -> list | None:
    """The latents of one step as PIL images (one per member of the call) through `vae` (the pipeline's), or None
    where this pipeline's latents cannot be decoded as they are."""
    if vae is None or not hasattr(pipe, "image_processor"):
        return None
    try:
        family = registry.find(type(pipe).__name__)
        if latents.ndim == 3 and family is not None and family.unpack_latents is not None:  # packed as tokens
            latents = family.unpack_latents(pipe, latents, height, width)
        if latents.ndim != 4 or getattr(vae.config, "latent_channels", latents.shape[1]) != latents.shape[1]:
            return None
        scaled = latents.to(vae.dtype) / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)
        # one member at a time: the shape the result's decode has (alone, or a batch decoded apart), so a
        # compiled VAE runs its warm graph instead of compiling one for the batch
        return [pipe.image_processor.postprocess(vae.decode(scaled[i:i + 1], return_dict=False)[0],
                                                 output_type="pil")[0] for i in range(scaled.shape[0])]
    except Exception as exc:  # noqa: BLE001 - a preview is optional: the run itself must not fail for one
        log.warning("no partial image for %s: %s", type(pipe).__name__, exc)
        return None


def to_png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()
