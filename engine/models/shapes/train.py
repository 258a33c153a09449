"""Train the embedded text-to-image model (models/tiny-shapes) on the shapes grammar, on a CPU.

The result is an ordinary diffusers FluxPipeline folder, so the app loads it like any Hub model. Training is
reproducible from the repo (`python -m engine.models.train_embedded`): fixed seeds, step-based schedules (a
stage stopped by --minutes resumes from its checkpoint to the same end point), checkpoints under a cache
folder, and data rendered on the fly by `engine.models.shapes.grammar` (no data set on disk).

Stages (`--stage all` runs them one after the other; vae and transformer are independent and may also run
side by side):

1. vae: a x4 AutoencoderTiny (3 blocks: 64x64 pixels -> 16x16 latents -> 8x8 Flux tokens) over the semantic
   latent space of `engine.models.shapes.latents` (cell positions, the object's centre and size, colours, shape
   code). The decoder renders the clean image from the analytic latents, mostly corrupted, so approximate
   latents still give the exact shape (L1 + MSE + an edge term on image gradients, which keeps corners);
   the encoder regresses the analytic latents from pixels on a share of each batch.
   shift_factor/scaling_factor normalise the latents (measured).
2. transformer: a FluxTransformer2DModel trained with rectified flow on analytic latents of fresh random
   scenes of every bucket (one bucket per batch, batch sizes giving equal image tokens), text embeddings
   precomputed by the pipeline's own `encode_prompt` with the preset's max_sequence_length. Half the
   noise levels are the exact sigmas the scheduler uses at the default step count, half logit-normal
   through the same shift, so training matches inference. EMA weights are what ships. Data parallel over
   single-threaded processes.
3. export: the pipeline (frozen random CLIP + T5 from engine.models.tiny, trained VAE, EMA transformer, the
   scheduler) saved with save_pretrained in float16 safetensors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.models.shapes import grammar
from engine.models.shapes import latents as semantic
from engine.models.shapes.fidelity import check
from engine.models.shapes.samples import PROMPT_SEED

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# The recipe. The preset must use the same inference settings (steps, shift, max_sequence_length).
# --------------------------------------------------------------------------------------------------
BUCKETS: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (64, 128), (128, 64))  # (width, height)
MAX_SEQUENCE_LENGTH = 24  # the longest prompt is 24 T5 tokens with </s> (measured in tests)
DEFAULT_STEPS = 8
SHIFT = 3.0  # fixed (use_dynamic_shifting=False): one sigma schedule for every bucket
LATENT_CHANNELS = semantic.CHANNELS
DEFAULT_OUT = Path("models/tiny-shapes")
DEFAULT_CACHE = Path(".cache/train-embedded")


@dataclass
class Settings:
    seed: int = 0
    # One thread: on a shared, niced 2-core machine two OpenMP threads stall on each other's preemption
    # (measured: VAE step 4.5 s with 2 threads vs 0.85 s with 1 while the test suite ran).
    threads: int = 1
    processes: int = 2  # data-parallel transformer training, one thread each
    # VAE
    vae_steps: int = 3500
    vae_batch: int = 16  # at 64x64; fewer images at the larger buckets (same pixels)
    vae_lr: float = 3e-3
    vae_edge: float = 1.0
    vae_width: int = 32
    # Most of the decoder's work is at latent resolution (cheap); one block at full resolution sharpens edges.
    vae_decoder_blocks: tuple[int, int, int] = (3, 3, 1)
    vae_encoder_weight: float = 0.1
    vae_encoder_share: float = 0.25  # images of each batch the encoder trains on (it serves image-to-image)
    vae_clean_share: float = 0.25  # decoder inputs left uncorrupted
    # transformer
    depth: tuple[int, int] = (2, 2)  # double-stream, single-stream blocks
    heads: int = 2
    head_dim: int = 64
    steps: int = 3000
    tokens_per_batch: int = 4096  # image tokens: batch 64 at 64x64, 32 at 64x128, 16 at 128x128
    bucket_weights: tuple[float, ...] = (0.5, 0.2, 0.15, 0.15)  # 64x64 has the strictest target
    lr: float = 1e-3
    warmup: int = 300
    ema: float = 0.998
    discrete_sigma_share: float = 0.5
    eval_every: int = 250
    # decoder tuning on the trained transformer's own latents
    tune_steps: int = 400
    tune_lr: float = 5e-4
    tune_pool: int = 1024  # sampled latents (64x64-equivalent images), split over the buckets by weight
    tune_threads: int = 2  # the stage runs alone
    checkpoint_every: int = 250


# --------------------------------------------------------------------------------------------------
# Components.
# --------------------------------------------------------------------------------------------------
def build_vae(settings: Settings, seed: int):
    """diffusers' AutoencoderTiny at x4 (3 blocks): no normalisation layers, so the decoder can read the
    absolute values of the position and size fields; bilinear up-sampling keeps the position fields exact
    between latent cells."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    width = settings.vae_width
    return AutoencoderTiny(
        in_channels=3,
        out_channels=3,
        encoder_block_out_channels=(width,) * 3,
        decoder_block_out_channels=(width,) * 3,
        num_encoder_blocks=(1, 2, 2),
        num_decoder_blocks=settings.vae_decoder_blocks,
        upsample_fn="bilinear",
        latent_channels=LATENT_CHANNELS,
    )


def build_transformer(settings: Settings, seed: int):
    from diffusers import FluxTransformer2DModel

    from engine.models.tiny_builders import CLIP_HIDDEN, T5_D_MODEL

    head_dim = settings.head_dim
    # RoPE axes (unused time axis, height, width) must sum to the head dim; height and width get the most.
    rope_t = head_dim // 4
    rope_hw = (head_dim - rope_t) // 2
    axes = (head_dim - 2 * rope_hw, rope_hw, rope_hw)
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # 2x2 packing
        num_layers=settings.depth[0],
        num_single_layers=settings.depth[1],
        attention_head_dim=head_dim,
        num_attention_heads=settings.heads,
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=False,  # FLUX.1-schnell style: no guidance input
        axes_dims_rope=axes,
    )


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=SHIFT, use_dynamic_shifting=False)


def build_text_encoders():
    """engine.models.tiny's frozen random FLUX.1 CLIP and T5, rounded through float16 first: that is how they are
    stored, so the embeddings trained on are exactly the ones the shipped pipeline computes in fp32."""
    from engine.models.tiny_builders import flux_text_encoders

    encoders = flux_text_encoders()
    for model in (encoders[0], encoders[2]):
        model.to(torch.float16).to(torch.float32)
    return encoders


def assemble_pipeline(vae, transformer):
    from engine.models.tiny_builders import flux_pipeline

    return flux_pipeline(build_scheduler(), vae, transformer, build_text_encoders())


def inference_sigmas(steps: int = DEFAULT_STEPS) -> torch.Tensor:
    """The sigmas FluxPipeline + the scheduler use for `steps` steps (without the final 0)."""
    scheduler = build_scheduler()
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    return scheduler.sigmas[:-1].float()


def shift_sigma(s: torch.Tensor) -> torch.Tensor:
    return SHIFT * s / (1 + (SHIFT - 1) * s)


# --------------------------------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------------------------------
def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: an interrupted save never corrupts the last checkpoint


def _load(path: Path) -> dict | None:
    return torch.load(path, weights_only=False) if path.is_file() else None


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _log_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------------------------------
# Stage 1: VAE.
# --------------------------------------------------------------------------------------------------
def _random_prompts(n: int, generator: torch.Generator, prompts=None) -> list:
    prompts = prompts or grammar.training_prompts()
    return [prompts[int(i)] for i in torch.randint(0, len(prompts), (n,), generator=generator)]


def _edge_loss(recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    dx = lambda t: t[..., :, 1:] - t[..., :, :-1]  # noqa: E731
    dy = lambda t: t[..., 1:, :] - t[..., :-1, :]  # noqa: E731
    return (dx(recon) - dx(target)).abs().mean() + (dy(recon) - dy(target)).abs().mean()


def _bucket_batch(settings: Settings, generator: torch.Generator, base: int) -> tuple[int, int, int]:
    """A random bucket (by settings.bucket_weights) and a batch size with the pixels of `base` 64x64 images."""
    bucket = int(torch.multinomial(torch.tensor(settings.bucket_weights), 1, generator=generator))
    width, height = BUCKETS[bucket]
    return width, height, max(1, base * 64 * 64 // (width * height))


@torch.no_grad()
def vae_fidelity(vae, n_per_bucket: int = 64, seed: int = 1234, buckets=BUCKETS, source: str = "clean"):
    """Share of checker-correct decoder outputs per bucket, from the analytic latents ("clean"), from
    corrupted ones ("corrupted": how well the decoder cleans up approximate latents) or from the encoder's
    latents of the rendered image ("encoded": image -> encoder -> decoder)."""
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for width, height in buckets:
        prompts = _random_prompts(n_per_bucket, generator, grammar.all_prompts())
        images, z = semantic.scenes(prompts, width, height, generator)
        if source == "corrupted":
            z = semantic.corrupt(z, generator, clean_share=0.0)
        elif source == "encoded":
            z = torch.cat([vae.encode(chunk).latents for chunk in images.split(32)])
        recon = torch.cat([vae.decode(chunk).sample for chunk in z.split(32)])
        pil = grammar.to_pil(recon)
        result[f"{width}x{height}"] = sum(
            check(i, p).correct for i, p in zip(pil, prompts, strict=True)
        ) / len(pil)
    return result


def _balanced_loss(recon: torch.Tensor, images: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """L1 + MSE averaged over the object's pixels and over the background's separately.
    A plain mean lets the background (most pixels) win: the decoder first learns to paint it alone and
    stays there for hundreds of steps (measured: 0 % of objects drawn after 250 steps, ~5 % after 200 with
    the balanced loss, which keeps climbing)."""
    mask = ((images - background).abs().sum(dim=1, keepdim=True) > 1e-3).float()
    error = (recon - images).abs() + (recon - images).pow(2)

    def mean_over(weights: torch.Tensor) -> torch.Tensor:
        return (error * weights).sum() / (weights.sum() * error.shape[1]).clamp(min=1)

    return mean_over(mask) + mean_over(1 - mask)


def _vae_worker(rank: int, world: int, settings: Settings, cache: Path, minutes, store) -> None:
    """One data-parallel VAE training process (as _transformer_worker): rank 0 checkpoints and evaluates.

    Encoder: regress the analytic latents from pixels (a share of each batch). Decoder: render the clean
    image from the analytic latents, corrupted for most samples (semantic.corrupt)."""
    torch.set_num_threads(settings.threads)
    parent = os.getppid()
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = _Group(rank, world)
    ckpt_path = cache / "vae.ckpt"
    data_path = cache / f"vae-data-{rank}.ckpt"
    vae = build_vae(settings, settings.seed)  # same seed: identical replicas
    parameters = list(vae.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 1 + 1000 * rank)
    step, elapsed = 0, 0.0
    if (state := _load(ckpt_path)) is not None:
        vae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        generator.set_state(_load(data_path)["generator"])
        logger.info("resuming VAE at step %d", step)
    log_path = cache / "vae-log.jsonl"

    def checkpoint():
        _save(data_path, {"generator": generator.get_state(), "step": step})
        if rank == 0:
            state = {"model": vae.state_dict(), "optimizer": optimizer.state_dict()}
            _save(ckpt_path, {**state, "step": step, "elapsed": elapsed})

    vae.train()
    started = time.perf_counter()
    bar = tqdm(total=settings.vae_steps, initial=step, desc="vae", dynamic_ncols=True, disable=rank != 0)
    while step < settings.vae_steps:
        if os.getppid() != parent:
            raise SystemExit(f"vae worker {rank}: the training process is gone; stopping")
        for group_ in optimizer.param_groups:
            group_["lr"] = settings.vae_lr * _lr_factor(step, settings.vae_steps, 100)
        width, height, n = _bucket_batch(settings, generator, max(1, settings.vae_batch // world))
        images, z = semantic.scenes(_random_prompts(n, generator), width, height, generator)
        k = max(1, round(n * settings.vae_encoder_share))
        encode = settings.vae_encoder_weight * F.mse_loss(vae.encode(images[:k]).latents, z[:k])
        recon = vae.decode(semantic.corrupt(z, generator, settings.vae_clean_share)).sample
        rec = _balanced_loss(recon, images, z[:, semantic.BACKGROUND, :1, :1])
        edge = _edge_loss(recon, images)
        loss = rec + settings.vae_edge * edge + encode
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        group.average_gradients(parameters)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(rec=f"{rec.item():.4f}", edge=f"{edge.item():.4f}", enc=f"{encode.item():.4f}")
        if step % settings.checkpoint_every == 0 or step == settings.vae_steps:
            elapsed_now = elapsed + time.perf_counter() - started
            if rank == 0:
                record = {"step": step, "rec": rec.item(), "edge": edge.item(), "encode": encode.item()}
                record["minutes"] = elapsed_now / 60
                if step % settings.eval_every == 0 or step == settings.vae_steps:
                    vae.eval()
                    record["decoded"] = vae_fidelity(vae, 32, buckets=BUCKETS[:2], source="clean")
                    record["from_corrupted"] = vae_fidelity(vae, 32, buckets=BUCKETS[:2], source="corrupted")
                    vae.train()
                    bar.write(f"vae step {step}: {record}")
                _log_jsonl(log_path, record)
            elapsed, started = elapsed_now, time.perf_counter()
            checkpoint()
            stop = minutes is not None and elapsed > minutes * 60 and step < settings.vae_steps
            if group.rank0_says(stop):
                break
    bar.close()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def train_vae(settings: Settings, cache: Path, minutes: float | None = None) -> Path:
    """Train (or resume) the VAE in `settings.processes` processes; returns the folder of the finished VAE."""
    out = cache / "vae"
    if (out / "config.json").is_file():
        logger.info("VAE already trained: %s", out)
        return out
    _spawn(_vae_worker, settings, (settings, cache, minutes))
    state = _load(cache / "vae.ckpt")
    if state["step"] < settings.vae_steps:
        raise TimeoutError(f"VAE stage stopped at step {state['step']} (--minutes); rerun to resume")
    vae = build_vae(settings, settings.seed)
    vae.load_state_dict(state["model"])
    vae.eval()
    set_scaling(vae)
    final = {source: vae_fidelity(vae, 200, source=source) for source in ("clean", "corrupted", "encoded")}
    logger.info("VAE checker-correct: %s", final)
    _log_jsonl(cache / "vae-log.jsonl", {"step": state["step"], "final_fidelity": final})
    vae.save_pretrained(out, safe_serialization=True)
    return out


def _spawn(worker, settings: Settings, args: tuple) -> None:
    """worker(rank, world, *args, store) in settings.processes processes (in this one when 1)."""
    world = settings.processes
    if world == 1:
        worker(0, 1, *args, None)
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, (world, *args, Path(tmp) / "store"), nprocs=world)


@cache
def latent_scaling() -> tuple[float, float]:
    """(shift_factor, scaling_factor): the measured mean and 1/std of the latents over all buckets (the
    pipeline divides by the scale and adds the shift before decoding). Measured on the analytic latents
    with a fixed seed, so the VAE and the transformer stages agree without waiting for each other."""
    generator = torch.Generator().manual_seed(4321)
    values = []
    for width, height in BUCKETS:
        prompts = _random_prompts(256, generator, grammar.all_prompts())
        values.append(semantic.scenes(prompts, width, height, generator)[1].flatten())
    values = torch.cat(values)
    return round(float(values.mean()), 4), round(float(1 / values.std()), 4)


def set_scaling(vae) -> None:
    shift, scale = latent_scaling()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    logger.info("latents: shift_factor %.4f, scaling_factor %.4f", shift, scale)


# --------------------------------------------------------------------------------------------------
# Stage 2: transformer.
# --------------------------------------------------------------------------------------------------
def load_vae(path: Path):
    from diffusers import AutoencoderTiny

    return AutoencoderTiny.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.no_grad()
def prompt_embeddings(cache: Path) -> dict[str, torch.Tensor]:
    """T5 embeddings, CLIP pooled embeddings and txt ids of all 168 prompts, computed by the pipeline's
    own encode_prompt with the preset's max_sequence_length (cached)."""
    path = cache / "prompt-embeddings.pt"
    if (cached := _load(path)) is not None:
        return cached
    pipe = assemble_pipeline(vae=None, transformer=None)  # the text encoders only
    texts = [p.text for p in grammar.all_prompts()]
    embeds, pooled, text_ids = pipe.encode_prompt(
        texts, prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    result = {"embeds": embeds.float(), "pooled": pooled.float(), "text_ids": text_ids.float()}
    _save(path, result)
    return result


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


def latent_batch(prompt_ids: list[int], width: int, height: int, generator: torch.Generator) -> torch.Tensor:
    """Normalised analytic latents (what the decoder reads) of fresh random scenes: unlimited data."""
    prompts = [grammar.all_prompts()[i] for i in prompt_ids]
    colours, shapes, backgrounds = grammar.prompt_indices(prompts)
    boxes = grammar.sample_boxes(len(prompts), width, height, generator)
    z = semantic.semantic_latents(colours, shapes, backgrounds, boxes, width, height)
    shift, scale = latent_scaling()
    return (z - shift) * scale


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


@torch.no_grad()
def sample(
    transformer,
    vae,
    text: dict,
    prompt_ids,
    width,
    height,
    generator,
    steps=DEFAULT_STEPS,
    dtype=torch.float32,
):
    """FluxPipeline's denoising loop and decode without the pipeline (quick evaluations during training)."""
    latents = sample_latents(transformer, vae.config, text, prompt_ids, width, height, generator, steps, dtype)
    return torch.cat([vae.decode(chunk.to(vae.dtype)).sample for chunk in latents.split(32)]).float()


@torch.no_grad()
def sample_latents(
    transformer, vae_config, text: dict, prompt_ids, width, height, generator, steps=DEFAULT_STEPS, dtype=torch.float32
):
    """FluxPipeline's denoising loop: the latents it hands the decoder (unscaled, shifted back)."""
    n = len(prompt_ids)
    h, w = height // 4, width // 4
    latents = torch.randn((n, LATENT_CHANNELS, h, w), generator=generator).to(dtype)
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
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([grammar.all_prompts().index(p) for p in prompts])
    images = grammar.to_pil(sample(transformer, vae, text, ids, width, height, generator, steps))
    return sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / len(prompts)


@torch.no_grad()
def transformer_fidelity(transformer, text, n: int = 48, seed: int = 7) -> dict[str, float]:
    """Share of samples right when their latents are read with the exact rules (latents.render_exact), per
    bucket and on held-out prompts at 64x64: how well the transformer alone does, whatever the decoder."""
    from engine.models.shapes.latents import render_exact

    shift, scale = latent_scaling()
    config = SimpleNamespace(shift_factor=shift, scaling_factor=scale)  # what sample_latents reads of a VAE config
    result = {}
    for (width, height), held_out in [*((bucket, False) for bucket in BUCKETS), ((64, 64), True)]:
        prompts = _eval_prompts(n if (width, height) == (64, 64) else n // 2, seed, held_out)
        ids = torch.tensor([grammar.all_prompts().index(p) for p in prompts])
        generator = torch.Generator().manual_seed(seed)
        z = sample_latents(transformer, config, text, ids, width, height, generator)
        images = grammar.to_pil(render_exact(z, width, height))
        key = f"exact_{width}x{height}" + ("_held_out" if held_out else "")
        result[key] = round(sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / len(prompts), 3)
    return result


def _eval_prompts(n: int, seed: int, held_out: bool = False) -> list:
    source = grammar.HELD_OUT if held_out else grammar.training_prompts()
    generator = torch.Generator().manual_seed(seed)
    return [source[int(i)] for i in torch.randint(0, len(source), (n,), generator=generator)]


class _Group:
    """Data parallelism over `world` single-threaded processes (gloo). One gradient all-reduce per step:
    on a shared, niced machine that stalls far less than two OpenMP threads syncing inside every op."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        import torch.distributed as dist

        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in parameters]
        )
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in parameters:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def rank0_says(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        import torch.distributed as dist

        tensor = torch.tensor([int(flag)])
        dist.broadcast(tensor, 0)
        return bool(tensor.item())


def _transformer_worker(
    rank: int, world: int, settings: Settings, cache: Path, minutes, store
):
    torch.set_num_threads(settings.threads)
    parent = os.getppid()  # spawned workers outlive a killed parent: they check it every step and stop
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    group = _Group(rank, world)
    text = prompt_embeddings(cache)
    ckpt_path = cache / "transformer.ckpt"
    data_path = cache / f"transformer-data-{rank}.ckpt"  # this rank's data generator
    transformer = build_transformer(settings, settings.seed + 10)  # same seed: identical replicas
    parameters = list(transformer.parameters())
    logger.info(
        "transformer: %.2f M parameters, %d process(es)", sum(p.numel() for p in parameters) / 1e6, world
    )
    ema = build_transformer(settings, settings.seed + 10).eval().requires_grad_(False)
    ema.load_state_dict(transformer.state_dict())
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 11 + 1000 * rank)
    step, elapsed = 0, 0.0
    state, data = _load(ckpt_path), _load(data_path)
    if state is not None:
        transformer.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        generator.set_state(data["generator"])
        logger.info("resuming transformer at step %d", step)
    del state
    started = time.perf_counter()
    del data
    training_ids = [grammar.all_prompts().index(p) for p in grammar.training_prompts()]
    log_path = cache / "transformer-log.jsonl"
    disc_sigmas = inference_sigmas()
    txt_ids = text["text_ids"]
    ids_per_bucket = [image_ids(w, h) for w, h in BUCKETS]
    weights = torch.tensor(settings.bucket_weights)

    def checkpoint():
        _save(data_path, {"generator": generator.get_state(), "step": step})
        if rank == 0:
            _save(
                ckpt_path,
                {
                    "model": transformer.state_dict(),
                    "ema": ema.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "elapsed": elapsed,
                    "world": world,
                },
            )

    transformer.train()
    bar = tqdm(total=settings.steps, initial=step, desc="transformer", dynamic_ncols=True, disable=rank != 0)
    losses: list[float] = []
    while step < settings.steps:
        if os.getppid() != parent:
            raise SystemExit(f"transformer worker {rank}: the training process is gone; stopping")
        lr = settings.lr * _lr_factor(step, settings.steps, settings.warmup)
        for g in optimizer.param_groups:
            g["lr"] = lr
        bucket = int(torch.multinomial(weights, 1, generator=generator))
        tokens = ids_per_bucket[bucket].shape[0]
        n = max(1, settings.tokens_per_batch // tokens // world)
        picks = torch.randint(0, len(training_ids), (n,), generator=generator)
        prompt_ids = torch.tensor([training_ids[int(i)] for i in picks])
        x0 = pack(latent_batch(prompt_ids.tolist(), *BUCKETS[bucket], generator))
        # Noise levels: a share exactly the inference sigmas, the rest logit-normal through the same shift.
        discrete = torch.rand(n, generator=generator) < settings.discrete_sigma_share
        continuous = shift_sigma(torch.sigmoid(torch.randn(n, generator=generator)))
        picked = disc_sigmas[torch.randint(0, len(disc_sigmas), (n,), generator=generator)]
        sigma = torch.where(discrete, picked, continuous)
        noise = torch.randn(x0.shape, generator=generator)
        s = sigma.view(-1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        embeds, pooled = text["embeds"][prompt_ids], text["pooled"][prompt_ids]
        pred = call_transformer(transformer, xt, sigma, embeds, pooled, txt_ids, ids_per_bucket[bucket])
        loss = F.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        group.average_gradients(parameters)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        decay = min(settings.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), parameters, strict=True):
                e.lerp_(p, 1 - decay)
        step += 1
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}", lr=f"{lr:.1e}")
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            elapsed_now = elapsed + time.perf_counter() - started
            if rank == 0:
                record = {
                    "step": step,
                    "loss": float(np.mean(losses[-settings.checkpoint_every :])),
                    "minutes": elapsed_now / 60,
                }
                if step % settings.eval_every == 0 or step == settings.steps:
                    record |= transformer_fidelity(ema, text)  # the exact rules: no decoder needed
                    if (vae := _vae_for_evaluation(settings, cache)) is not None:
                        prompts = _eval_prompts(48, PROMPT_SEED)
                        record["decoded_64"] = generation_fidelity(ema, vae, text, prompts, 64, 64, seed=PROMPT_SEED)
                    bar.write(f"transformer step {step}: {record}")
                _log_jsonl(log_path, record)
            elapsed, started = elapsed_now, time.perf_counter()
            checkpoint()
            stop = minutes is not None and elapsed > minutes * 60 and step < settings.steps
            if group.rank0_says(stop):
                break
    bar.close()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _vae_for_evaluation(settings: Settings, cache: Path):
    """The finished VAE, else the VAE stage's latest checkpoint (the stages may run side by side), else None.
    Only the logged evaluations use it; training never reads the VAE."""
    if (cache / "vae" / "config.json").is_file():
        return load_vae(cache / "vae")
    if (state := _load(cache / "vae.ckpt")) is None:
        return None
    vae = build_vae(settings, settings.seed)
    vae.load_state_dict(state["model"])
    set_scaling(vae)
    return vae.eval()


def train_transformer(settings: Settings, cache: Path, minutes: float | None = None) -> None:
    """Train (or resume) the transformer in `settings.processes` processes (checkpoint: transformer.ckpt)."""
    prompt_embeddings(cache)  # computed once, before the workers start
    _spawn(_transformer_worker, settings, (settings, cache, minutes))
    state = _load(cache / "transformer.ckpt")
    if state["step"] < settings.steps:
        raise TimeoutError(f"transformer stage stopped at step {state['step']} (--minutes); rerun to resume")


def _trained_transformer(settings: Settings, cache: Path):
    state = _load(cache / "transformer.ckpt")
    if state is None:
        raise FileNotFoundError(f"no transformer checkpoint in {cache}; run --stage transformer first")
    transformer = build_transformer(settings, settings.seed + 10)
    transformer.load_state_dict(state["ema"])
    return transformer.eval()


# --------------------------------------------------------------------------------------------------
# Stage 3: tune the decoder on what the transformer writes.
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def _sampled_pool(transformer, vae_config, text, settings: Settings) -> list[tuple[int, torch.Tensor]]:
    """(bucket index, latents) chunks the trained transformer samples with the inference schedule, for
    random training prompts and seeds, about settings.tune_pool 64x64-equivalent images in all."""
    generator = torch.Generator().manual_seed(settings.seed + 20)
    training_ids = [grammar.all_prompts().index(p) for p in grammar.training_prompts()]
    pool = []
    for bucket, ((width, height), weight) in enumerate(zip(BUCKETS, settings.bucket_weights, strict=True)):
        images = max(16, round(settings.tune_pool * weight * 64 * 64 / (width * height)))
        for start in range(0, images, 32):
            picks = torch.randint(0, len(training_ids), (min(32, images - start),), generator=generator)
            ids = torch.tensor([training_ids[int(i)] for i in picks])
            pool.append((bucket, sample_latents(transformer, vae_config, text, ids, width, height, generator)))
    return pool


def tune_decoder(settings: Settings, cache: Path) -> Path:
    """Fine-tune the decoder on latents the trained transformer samples, against the scene each describes
    (read with the exact rules: latents.render_exact), half of each batch, the other half corrupted
    analytic latents as in the VAE stage. The transformer's fields are never exactly constant; the decoder
    learns to draw what they say anyway (measured: 94 % of 64x64 images right before, see the model card).
    Writes cache/vae-tuned."""
    out = cache / "vae-tuned"
    if (out / "config.json").is_file():
        logger.info("decoder already tuned: %s", out)
        return out
    torch.set_num_threads(settings.tune_threads)
    vae = load_vae(cache / "vae")
    transformer = _trained_transformer(settings, cache)
    started = time.perf_counter()
    pool = _sampled_pool(transformer, vae.config, prompt_embeddings(cache), settings)
    logger.info("sampled %d latents in %.0f s", sum(len(z) for _, z in pool), time.perf_counter() - started)
    parameters = list(vae.decoder.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.tune_lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 21)
    vae.train()
    for step in tqdm(range(settings.tune_steps), desc="tune decoder", dynamic_ncols=True):
        for group in optimizer.param_groups:
            group["lr"] = settings.tune_lr * _lr_factor(step, settings.tune_steps, 20)
        bucket, sampled = pool[int(torch.randint(0, len(pool), (1,), generator=generator))]
        width, height = BUCKETS[bucket]
        half = max(1, len(sampled) // 2)
        sampled = sampled[torch.randperm(len(sampled), generator=generator)[:half]]
        analytic_images, analytic = semantic.scenes(_random_prompts(half, generator), width, height, generator)
        z = torch.cat([sampled, semantic.corrupt(analytic, generator, settings.vae_clean_share)])
        images = torch.cat([semantic.render_exact(sampled, width, height), analytic_images])
        background = torch.cat([semantic.read_scene_background(sampled), analytic[:, semantic.BACKGROUND, :1, :1]])
        recon = vae.decode(z).sample
        loss = _balanced_loss(recon, images, background) + settings.vae_edge * _edge_loss(recon, images)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
    vae.eval()
    final = {source: vae_fidelity(vae, 100, source=source) for source in ("clean", "corrupted")}
    prompts = _eval_prompts(64, PROMPT_SEED)
    final["generated_64"] = generation_fidelity(transformer, vae, prompt_embeddings(cache), prompts, 64, 64, seed=PROMPT_SEED)
    logger.info("tuned decoder checker-correct: %s", final)
    _log_jsonl(cache / "vae-log.jsonl", {"tuned": final, "minutes": (time.perf_counter() - started) / 60})
    vae.save_pretrained(out, safe_serialization=True)
    return out


# --------------------------------------------------------------------------------------------------
# Stage 3: export.
# --------------------------------------------------------------------------------------------------
def export(transformer, vae, out: Path, settings: Settings, info: dict | None = None) -> Path:
    """Save the FluxPipeline folder in float16 safetensors, plus the recipe the preset must follow."""
    import shutil

    pipe = assemble_pipeline(vae, transformer)
    pipe.to(torch.float16)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    # AutoencoderTiny registers block_out_channels (FluxPipeline's vae_scale_factor reads it) but does not
    # take it as an argument: written to config.json it only makes every load print a warning.
    vae_config = out / "vae" / "config.json"
    vae_config.write_text(json.dumps({k: v for k, v in json.loads(vae_config.read_text()).items()
                                      if k != "block_out_channels"}, indent=2, sort_keys=True) + "\n")
    recipe = {
        "steps": DEFAULT_STEPS,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "guidance": None,
        "scheduler": {"shift": SHIFT, "use_dynamic_shifting": False},
        "buckets": [f"{w}x{h}" for w, h in BUCKETS],
        "settings": asdict(settings),
        **(info or {}),
    }
    (out / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    logger.info("exported %s (%.1f MB)", out, total / 1e6)
    return out


def run(
    stage: str = "all",
    out: Path = DEFAULT_OUT,
    cache: Path = DEFAULT_CACHE,
    resume: bool = True,
    minutes: float | None = None,
    settings: Settings | None = None,
) -> None:
    settings = settings or Settings()
    torch.set_num_threads(settings.threads)
    cache = Path(cache)
    if not resume:
        for path in cache.glob("*.ckpt"):
            path.unlink()
        for name in ("vae-log.jsonl", "transformer-log.jsonl"):
            (cache / name).unlink(missing_ok=True)
        import shutil

        if stage in ("vae", "all"):
            shutil.rmtree(cache / "vae", ignore_errors=True)
        if stage in ("vae", "transformer", "tune", "all"):
            shutil.rmtree(cache / "vae-tuned", ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "settings.json").write_text(json.dumps(asdict(settings), indent=2))
    started = time.perf_counter()
    vae_path = train_vae(settings, cache, minutes) if stage in ("vae", "all") else cache / "vae"
    if stage in ("transformer", "all"):
        remaining = None if minutes is None else minutes - (time.perf_counter() - started) / 60
        train_transformer(settings, cache, remaining)
    if stage in ("tune", "all"):
        if not (vae_path / "config.json").is_file():
            raise FileNotFoundError(f"no trained VAE in {vae_path}; run --stage vae first")
        tune_decoder(settings, cache)
    if stage in ("export", "all"):
        tuned = cache / "vae-tuned"
        if not (tuned / "config.json").is_file():
            raise FileNotFoundError(f"no tuned decoder in {tuned}; run --stage tune first")
        export(_trained_transformer(settings, cache), load_vae(tuned), out, settings,
               {"wall_minutes_this_run": (time.perf_counter() - started) / 60})
