"""FluxPipeline's denoising loop for the embedded model, without the pipeline: the scheduler and its
sigmas, Flux's 2x2 latent packing, the transformer call, sampling latents or images for a batch of
prompts, and grading what is sampled with the pixel checker. The training stages (train.py,
lora_train.py) sample with it; the preset uses the same recipe (steps, shift).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from training.shapes import grammar
from training.shapes import latents as semantic
from training.shapes.fidelity import check

DEFAULT_STEPS = 8
SHIFT = 3.0  # fixed (use_dynamic_shifting=False): one sigma schedule for every bucket
LATENT_CHANNELS = semantic.CHANNELS


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=SHIFT, use_dynamic_shifting=False)


def inference_sigmas(steps: int = DEFAULT_STEPS) -> torch.Tensor:
    """The sigmas FluxPipeline + the scheduler use for `steps` steps (without the final 0)."""
    scheduler = build_scheduler()
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    return scheduler.sigmas[:-1].float()


def shift_sigma(s: torch.Tensor) -> torch.Tensor:
    return SHIFT * s / (1 + (SHIFT - 1) * s)


def pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return (
        latents.view(b, c, h // 2, 2, w // 2, 2)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(b, (h // 2) * (w // 2), c * 4)
    )


def unpack(packed: torch.Tensor, width: int, height: int, scale: int = 4) -> torch.Tensor:
    b, _, d = packed.shape
    h, w = height // scale, width // scale
    return packed.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def image_ids(width: int, height: int, scale: int = 4) -> torch.Tensor:
    h, w = height // scale // 2, width // scale // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def call_transformer(transformer, packed, sigma, embeds, pooled, txt_ids, img_ids):
    """Exactly how FluxPipeline calls the transformer (timestep = t / 1000 = sigma, no guidance)."""
    return transformer(
        hidden_states=packed,
        timestep=sigma,
        guidance=None,
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=txt_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]


@dataclass(frozen=True)
class Batch:
    """What to sample: the prompts (indices into grammar.all_prompts()), the size and the noise's generator."""

    prompt_ids: object  # a 1-D tensor or list of ints
    width: int
    height: int
    generator: torch.Generator


@torch.no_grad()
def sample(transformer, vae, text: dict, batch: Batch, steps=DEFAULT_STEPS, dtype=torch.float32):
    """FluxPipeline's denoising loop and decode without the pipeline (quick evaluations during training)."""
    latents = sample_latents(transformer, vae.config, text, batch, steps, dtype)
    return torch.cat([vae.decode(chunk.to(vae.dtype)).sample for chunk in latents.split(32)]).float()


@torch.no_grad()
def sample_latents(transformer, vae_config, text: dict, batch: Batch, steps=DEFAULT_STEPS, dtype=torch.float32):
    """FluxPipeline's denoising loop: the latents it hands the decoder (unscaled, shifted back)."""
    prompt_ids, width, height = batch.prompt_ids, batch.width, batch.height
    n = len(prompt_ids)
    h, w = height // 4, width // 4
    latents = torch.randn((n, LATENT_CHANNELS, h, w), generator=batch.generator).to(dtype)
    packed = pack(latents)
    sigmas = torch.cat([inference_sigmas(steps), torch.zeros(1)])
    embeds, pooled = text["embeds"][prompt_ids].to(dtype), text["pooled"][prompt_ids].to(dtype)
    txt_ids, img_ids = text["text_ids"], image_ids(width, height)
    for i in range(steps):
        v = call_transformer(
            transformer, packed, sigmas[i].expand(n).to(dtype), embeds, pooled, txt_ids, img_ids
        )
        packed = (packed.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(dtype)
    return unpack(packed.float(), width, height) / vae_config.scaling_factor + vae_config.shift_factor


def generation_fidelity(
    transformer, vae, text, prompts, width, height, seed: int, steps=DEFAULT_STEPS
) -> float:
    """The share of `prompts` drawn right (the pixel checker) at one size, sampled with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([grammar.all_prompts().index(p) for p in prompts])
    images = grammar.to_pil(sample(transformer, vae, text, Batch(ids, width, height, generator), steps))
    return sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / len(prompts)


def eval_prompts(n: int, seed: int, held_out: bool = False) -> list:
    """`n` prompts of the training grammar (or the held-out ones), drawn with `seed`."""
    source = grammar.HELD_OUT if held_out else grammar.training_prompts()
    generator = torch.Generator().manual_seed(seed)
    return [source[int(i)] for i in torch.randint(0, len(source), (n,), generator=generator)]
