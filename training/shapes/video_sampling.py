"""tiny-shapes-video's components and WanPipeline's denoising loop without the pipeline: the VAE,
transformer, text encoder and scheduler builders, the latent normalisation the VAE config carries, the
prompts' text embeddings (the pipeline's own encode_prompt), sampling latents and clips for a batch of
prompts, and grading them with the clip checker. The training stages (video_train.py) and the evaluation
command share them; the preset uses the same recipe (steps, shift, max_sequence_length).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from training.shapes import video_fidelity
from training.shapes import video_grammar as vgrammar
from training.shapes import video_latents as vlatents
from training.shapes.training import load_state, save_state

DEFAULT_STEPS = 8
SHIFT = 3.0  # Wan 2.1's flow-matching shift, as the tiny-wan preset
MAX_SEQUENCE_LENGTH = 32  # the longest prompt is 30 T5 tokens with </s> (tests check every prompt fits)
SIZE = 32
FRAMES = (17, 9)


@dataclass
class Architecture:
    """The sizes of the VAE decoder and the transformer (the training settings carry one)."""

    decoder_dim: int = 32
    decoder_mult: tuple[int, ...] = (1, 1, 1, 1)
    encoder_dim: int = 8  # the encoder is never trained (text-to-video needs none): kept small
    heads: int = 4
    head_dim: int = 32
    layers: int = 4
    ffn_mult: int = 2


def build_vae(arch: Architecture, seed: int):
    """AutoencoderKLWan with the real Wan 2.1 layout (z_dim 16, 8x space, 4x time), a small decoder and the
    latent normalisation of the semantic space (latents_mean/latents_std: WanPipeline un-normalises with
    them, so what the transformer writes becomes what the decoder reads)."""
    from diffusers import AutoencoderKLWan

    mean, std = latent_stats()
    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=arch.encoder_dim, decoder_base_dim=arch.decoder_dim, z_dim=vlatents.CHANNELS,
        dim_mult=list(arch.decoder_mult), num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=mean, latents_std=std,
    )


def build_transformer(arch: Architecture, seed: int):
    from diffusers import WanTransformer3DModel

    from engine.models.tiny_builders import T5_D_MODEL

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=arch.heads, attention_head_dim=arch.head_dim,
        in_channels=vlatents.CHANNELS, out_channels=vlatents.CHANNELS, text_dim=T5_D_MODEL, freq_dim=64,
        ffn_dim=arch.ffn_mult * arch.heads * arch.head_dim, num_layers=arch.layers, rope_max_seq_len=32,
    )


def build_text_encoder():
    """The project's tiny T5 (frozen random, engine.models.tiny_builders.build_t5, the seed tiny-wan uses),
    rounded through float16 first: that is how it is stored, so training sees the shipped embeddings."""
    from engine.models.tiny_builders import build_t5

    encoder, tokenizer = build_t5(seed=1)
    return encoder.to(torch.float16).to(torch.float32), tokenizer


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=SHIFT)


def assemble_pipeline(vae, transformer):
    from diffusers import WanPipeline

    text_encoder, tokenizer = build_text_encoder()
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=build_scheduler())


@cache
def latent_stats() -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the analytic latents (fixed seed, both clip lengths); channels that are
    always zero get std 1."""
    generator = torch.Generator().manual_seed(4321)
    values = []
    for frames in FRAMES:
        prompts = random_prompts(512, generator, vgrammar.all_prompts())
        values.append(scene_batch(prompts, frames, generator)[1].transpose(0, 1).flatten(1))
    values = torch.cat(values, dim=1)
    std = values.std(dim=1)
    std = torch.where(std < 1e-6, torch.ones_like(std), std)
    return [round(float(v), 4) for v in values.mean(dim=1)], [round(float(v), 4) for v in std]


def normalise(z: torch.Tensor) -> torch.Tensor:
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in latent_stats())
    return (z - mean) / std


def denormalise(z: torch.Tensor) -> torch.Tensor:
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in latent_stats())
    return z * std + mean


def random_prompts(n: int, generator: torch.Generator, prompts=None) -> list:
    prompts = prompts or vgrammar.training_prompts()
    return [prompts[int(i)] for i in torch.randint(0, len(prompts), (n,), generator=generator)]


def scene_batch(prompts, frames: int, generator: torch.Generator, size: int = SIZE):
    """Rendered clips (n, 3, frames, size, size) in [-1, 1] and their analytic latents for random motions."""
    colours, shapes, backgrounds, directions = vgrammar.prompt_indices(prompts)
    motion = vgrammar.sample_motions(directions, frames, size, generator)
    clips = vgrammar.render_clips(colours, shapes, backgrounds, motion, frames, size)
    return clips, vlatents.semantic_latents(colours, shapes, backgrounds, motion, frames, size)


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan's decode (latent frame by latent frame with the causal cache) without the final
    clamp, so training gets gradients where the output overshoots [-1, 1]."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    chunks = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        chunks.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(chunks, dim=2)


@torch.no_grad()
def prompt_embeddings(cache_dir: Path) -> torch.Tensor:
    """T5 embeddings (672, MAX_SEQUENCE_LENGTH, d) of every prompt, from WanPipeline's own encode_prompt
    (cached in cache_dir)."""
    path = Path(cache_dir) / "prompt-embeddings.pt"
    if (cached := load_state(path)) is not None:
        return cached
    from diffusers import WanPipeline

    text_encoder, tokenizer = build_text_encoder()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, transformer=None,
                       scheduler=build_scheduler())
    embeds, _ = pipe.encode_prompt([p.text for p in vgrammar.all_prompts()], do_classifier_free_guidance=False,
                                   max_sequence_length=MAX_SEQUENCE_LENGTH)
    save_state(path, embeds.float())
    return embeds.float()


def inference_sigmas(steps: int = DEFAULT_STEPS) -> torch.Tensor:
    """The sigmas WanPipeline's scheduler steps through for `steps` steps, with the final 0."""
    scheduler = build_scheduler()
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()


def shift_sigma(s: torch.Tensor) -> torch.Tensor:
    return SHIFT * s / (1 + (SHIFT - 1) * s)


def call_transformer(transformer, latents, sigma, embeds):
    """As WanPipeline calls it: timestep = sigma * 1000, no guidance."""
    return transformer(hidden_states=latents, timestep=sigma * 1000, encoder_hidden_states=embeds,
                       return_dict=False)[0]


@torch.no_grad()
def sample_latents(transformer, embeds: torch.Tensor, prompt_ids, frames: int, generator: torch.Generator,
                   steps: int = DEFAULT_STEPS, size: int = SIZE) -> torch.Tensor:
    """WanPipeline's denoising loop: the un-normalised latents it hands the decoder."""
    n = len(prompt_ids)
    shape = (n, vlatents.CHANNELS, vlatents.latent_frames(frames), size // vlatents.SCALE, size // vlatents.SCALE)
    latents = torch.randn(shape, generator=generator)
    sigmas = inference_sigmas(steps)
    text = embeds[torch.as_tensor(prompt_ids)]
    for i in range(steps):
        v = call_transformer(transformer, latents, sigmas[i].expand(n), text)
        latents = latents + (sigmas[i + 1] - sigmas[i]) * v.float()
    return denormalise(latents)


def prompt_ids(prompts) -> list[int]:
    index = {p: i for i, p in enumerate(vgrammar.all_prompts())}
    return [index[p] for p in prompts]


@torch.no_grad()
def grade(transformer, embeds, prompts, frames: int, seed: int, vae=None, steps: int = DEFAULT_STEPS
          ) -> list[video_fidelity.ClipFidelity]:
    """Sample clips for `prompts` (one generator seeded `seed`, in chunks of 16) and check them: decoded by
    `vae`, or drawn from the latents by the exact rules when vae is None (the transformer alone)."""
    generator = torch.Generator().manual_seed(seed)
    results = []
    for start in range(0, len(prompts), 16):
        chunk = prompts[start : start + 16]
        z = sample_latents(transformer, embeds, prompt_ids(chunk), frames, generator, steps)
        clips = vlatents.render_exact(z, frames, SIZE) if vae is None else decode(vae, z).clamp(-1, 1)
        results += [video_fidelity.check(vgrammar.clip_to_pil(c), p) for c, p in zip(clips, chunk, strict=True)]
    return results


def eval_prompts(n: int, seed: int, held_out: bool = False) -> list:
    """`n` prompts of the training grammar (or every held-out prompt, cycled), drawn with `seed`."""
    if held_out:
        return [vgrammar.HELD_OUT[i % len(vgrammar.HELD_OUT)] for i in range(n)]
    generator = torch.Generator().manual_seed(seed)
    return random_prompts(n, generator)


def mean(values) -> float:
    return float(np.mean(values)) if len(values) else float("nan")
