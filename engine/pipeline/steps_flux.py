"""FLUX.1's step function (its text-to-image pipeline): the pipeline's own `__call__`, cut at its step boundaries.

`prepare` runs what the call runs before its loop (encode_prompt, prepare_latents, the shifted sigmas and
retrieve_timesteps on the request's own scheduler), `step` one pass of the loop for several requests at once
(each its own latents, timestep, guidance and prompt embeddings; the position ids are a bucket's, shared),
`finish` what the call runs after its loop (unpack, decode, postprocess). The order of operations and their
arguments are the pipeline's, so a request stepped alone makes the pipeline's own picture bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from engine.pipeline.stepstate import StepState


class FluxSteps:
    """The FLUX.1 text-to-image loop, a step at a time (engine/pipeline/stepping.py's StepFunction)."""

    @torch.no_grad()  # as the pipeline's __call__
    def prepare(self, run, request, generator: torch.Generator, max_sequence_length: int | None) -> StepState:
        device = run._execution_device
        prompt_embeds, pooled, text_ids = run.encode_prompt(
            prompt=request.prompt, prompt_2=None, prompt_embeds=None, pooled_prompt_embeds=None, device=device,
            num_images_per_prompt=1, max_sequence_length=max_sequence_length or 512)
        latents, image_ids = run.prepare_latents(1, run.transformer.config.in_channels // 4, request.height,
                                                 request.width, prompt_embeds.dtype, device, generator, None)
        steps = request.steps
        config = run.scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(run.scheduler, steps, device, sigmas=sigmas, mu=mu)
        run.scheduler.set_begin_index(0)
        guidance = (torch.full([1], request.guidance, device=device, dtype=torch.float32)
                    if run.transformer.config.guidance_embeds else None)
        own = dict(encoder_hidden_states=prompt_embeds, pooled_projections=pooled, guidance=guidance)
        return StepState(request, run, latents, list(timesteps), own, dict(txt_ids=text_ids, img_ids=image_ids))

    def batch_key(self, state: StepState) -> tuple:
        """What states must share to run in one denoiser call: the token counts (one graph per bucket) and
        whether guidance is embedded."""
        return (tuple(state.latents.shape[1:]), tuple(state.own["encoder_hidden_states"].shape[1:]),
                state.own["guidance"] is None)

    @torch.no_grad()
    def step(self, states: list[StepState]) -> None:
        lead = states[0]
        transformer = lead.run.transformer
        latents = torch.cat([s.latents for s in states]) if len(states) > 1 else lead.latents
        times = [s.timesteps[s.index] for s in states]
        timestep = (torch.stack(times) if len(states) > 1 else times[0].expand(1)).to(latents.dtype)

        def joined(name):
            parts = [s.own[name] for s in states]
            return None if parts[0] is None else (torch.cat(parts) if len(parts) > 1 else parts[0])

        with transformer.cache_context("cond"):
            noise_pred = transformer(
                hidden_states=latents, timestep=timestep / 1000, guidance=joined("guidance"),
                pooled_projections=joined("pooled_projections"),
                encoder_hidden_states=joined("encoder_hidden_states"), txt_ids=lead.shared["txt_ids"],
                img_ids=lead.shared["img_ids"], joint_attention_kwargs={}, return_dict=False)[0]
        for k, (state, t) in enumerate(zip(states, times, strict=True)):
            own_pred = noise_pred[k:k + 1] if len(states) > 1 else noise_pred
            state.latents = state.run.scheduler.step(own_pred, t, state.latents, return_dict=False)[0]
            state.index += 1

    @torch.no_grad()
    def finish(self, state: StepState):
        run, request = state.run, state.request
        latents = run._unpack_latents(state.latents, request.height, request.width, run.vae_scale_factor)
        latents = (latents / run.vae.config.scaling_factor) + run.vae.config.shift_factor
        image = run.vae.decode(latents, return_dict=False)[0]
        image = run.image_processor.postprocess(image, output_type="pil")
        run.maybe_free_model_hooks()
        return image[0]
