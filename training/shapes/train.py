"""Train the embedded text-to-image model (models/tiny-shapes) on the shapes grammar, on a CPU.

The result is an ordinary diffusers FluxPipeline folder, so the app loads it like any Hub model. Training is
reproducible from the repo (`python -m training.train_embedded`): fixed seeds, step-based schedules (a
stage stopped by --minutes resumes from its checkpoint to the same end point), checkpoints under a cache
folder, and data rendered on the fly by `training.shapes.grammar` (no data set on disk).

Stages (`--stage all` runs them one after the other; vae and transformer are independent and may also run
side by side):

1. vae: a x4 AutoencoderTiny (3 blocks: 64x64 pixels -> 16x16 latents -> 8x8 Flux tokens) over the semantic
   latent space of `training.shapes.latents` (cell positions, the object's centre and size, colours, shape
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
import os
import time
from dataclasses import asdict
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.shapes import grammar
from training.shapes import latents as semantic
from training.shapes.fidelity import check
from training.shapes.samples import PROMPT_SEED
from training.shapes.sampling import (
    DEFAULT_STEPS,
    LATENT_CHANNELS,
    SHIFT,
    Batch,
    build_scheduler,
    call_transformer,
    eval_prompts,
    generation_fidelity,
    image_ids,
    inference_sigmas,
    pack,
    sample_latents,
    shift_sigma,
)
from training.shapes.training import (
    GradientGroup,
    Settings,
    load_state,
    log_jsonl,
    lr_factor,
    save_state,
    spawn,
    step_and_average,
)

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# The recipe. The preset must use the same inference settings (steps, shift, max_sequence_length).
# --------------------------------------------------------------------------------------------------
BUCKETS: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (64, 128), (128, 64))  # (width, height)
MAX_SEQUENCE_LENGTH = 24  # the longest prompt is 24 T5 tokens with </s> (measured in tests)
DEFAULT_OUT = Path("models/tiny-shapes")
DEFAULT_CACHE = Path(".cache/train-embedded")


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
    group = GradientGroup(rank, world, store)
    ckpt_path = cache / "vae.ckpt"
    data_path = cache / f"vae-data-{rank}.ckpt"
    vae = build_vae(settings, settings.seed)  # same seed: identical replicas
    parameters = list(vae.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 1 + 1000 * rank)
    step, elapsed = 0, 0.0
    if (state := load_state(ckpt_path)) is not None:
        vae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        generator.set_state(load_state(data_path)["generator"])
        logger.info("resuming VAE at step %d", step)
    log_path = cache / "vae-log.jsonl"

    def checkpoint():
        save_state(data_path, {"generator": generator.get_state(), "step": step})
        if rank == 0:
            state = {"model": vae.state_dict(), "optimizer": optimizer.state_dict()}
            save_state(ckpt_path, {**state, "step": step, "elapsed": elapsed})

    vae.train()
    started = time.perf_counter()
    bar = tqdm(total=settings.vae_steps, initial=step, desc="vae", dynamic_ncols=True, disable=rank != 0)
    while step < settings.vae_steps:
        if os.getppid() != parent:
            raise SystemExit(f"vae worker {rank}: the training process is gone; stopping")
        for group_ in optimizer.param_groups:
            group_["lr"] = settings.vae_lr * lr_factor(step, settings.vae_steps, 100)
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
                log_jsonl(log_path, record)
            elapsed, started = elapsed_now, time.perf_counter()
            checkpoint()
            stop = minutes is not None and elapsed > minutes * 60 and step < settings.vae_steps
            if group.rank0_says(stop):
                break
    bar.close()
    group.close()


def train_vae(settings: Settings, cache: Path, minutes: float | None = None) -> Path:
    """Train (or resume) the VAE in `settings.processes` processes; returns the folder of the finished VAE."""
    out = cache / "vae"
    if (out / "config.json").is_file():
        logger.info("VAE already trained: %s", out)
        return out
    spawn(_vae_worker, settings.processes, (settings, cache, minutes))
    state = load_state(cache / "vae.ckpt")
    if state["step"] < settings.vae_steps:
        raise TimeoutError(f"VAE stage stopped at step {state['step']} (--minutes); rerun to resume")
    vae = build_vae(settings, settings.seed)
    vae.load_state_dict(state["model"])
    vae.eval()
    set_scaling(vae)
    final = {source: vae_fidelity(vae, 200, source=source) for source in ("clean", "corrupted", "encoded")}
    logger.info("VAE checker-correct: %s", final)
    log_jsonl(cache / "vae-log.jsonl", {"step": state["step"], "final_fidelity": final})
    vae.save_pretrained(out, safe_serialization=True)
    return out


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
    if (cached := load_state(path)) is not None:
        return cached
    pipe = assemble_pipeline(vae=None, transformer=None)  # the text encoders only
    texts = [p.text for p in grammar.all_prompts()]
    embeds, pooled, text_ids = pipe.encode_prompt(
        texts, prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    result = {"embeds": embeds.float(), "pooled": pooled.float(), "text_ids": text_ids.float()}
    save_state(path, result)
    return result


def latent_batch(prompt_ids: list[int], width: int, height: int, generator: torch.Generator) -> torch.Tensor:
    """Normalised analytic latents (what the decoder reads) of fresh random scenes: unlimited data."""
    prompts = [grammar.all_prompts()[i] for i in prompt_ids]
    colours, shapes, backgrounds = grammar.prompt_indices(prompts)
    boxes = grammar.sample_boxes(len(prompts), width, height, generator)
    z = semantic.semantic_latents(colours, shapes, backgrounds, boxes, width, height)
    shift, scale = latent_scaling()
    return (z - shift) * scale


@torch.no_grad()
def transformer_fidelity(transformer, text, n: int = 48, seed: int = PROMPT_SEED) -> dict[str, float]:
    """Share of samples right when their latents are read with the exact rules (latents.render_exact), per
    bucket and on held-out prompts at 64x64: how well the transformer alone does, whatever the decoder."""
    from training.shapes.latents import render_exact

    shift, scale = latent_scaling()
    config = SimpleNamespace(shift_factor=shift, scaling_factor=scale)  # what sample_latents reads of a VAE config
    result = {}
    for (width, height), held_out in [*((bucket, False) for bucket in BUCKETS), ((64, 64), True)]:
        prompts = eval_prompts(n if (width, height) == (64, 64) else n // 2, seed, held_out)
        ids = torch.tensor([grammar.all_prompts().index(p) for p in prompts])
        generator = torch.Generator().manual_seed(seed)
        z = sample_latents(transformer, config, text, Batch(ids, width, height, generator))
        images = grammar.to_pil(render_exact(z, width, height))
        key = f"exact_{width}x{height}" + ("_held_out" if held_out else "")
        result[key] = round(sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / len(prompts), 3)
    return result


class _TransformerTraining:
    """One data-parallel transformer training process: set up (models, optimizer, resume), then steps of
    draw a batch, learn from it, and every checkpoint_every steps log, evaluate (rank 0) and checkpoint."""

    @classmethod
    def worker(cls, rank: int, world: int, settings: Settings, cache: Path, minutes, store) -> None:
        torch.set_num_threads(settings.threads)
        training = cls(rank, world, settings, cache, store)
        try:
            training.run(minutes)
        finally:
            training.group.close()

    def __init__(self, rank: int, world: int, settings: Settings, cache: Path, store):
        self.parent = os.getppid()  # spawned workers outlive a killed parent: they check it every step and stop
        self.group = GradientGroup(rank, world, store)
        if rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        self.rank, self.world, self.settings, self.cache = rank, world, settings, cache
        self.text = prompt_embeddings(cache)
        self.ckpt_path = cache / "transformer.ckpt"
        self.data_path = cache / f"transformer-data-{rank}.ckpt"  # this rank's data generator
        self.transformer = build_transformer(settings, settings.seed + 10)  # same seed: identical replicas
        self.parameters = list(self.transformer.parameters())
        logger.info(
            "transformer: %.2f M parameters, %d process(es)", sum(p.numel() for p in self.parameters) / 1e6, world
        )
        self.ema = build_transformer(settings, settings.seed + 10).eval().requires_grad_(False)
        self.ema.load_state_dict(self.transformer.state_dict())
        self.optimizer = torch.optim.AdamW(self.parameters, lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(settings.seed + 11 + 1000 * rank)
        self.step, self.elapsed = 0, 0.0
        self.resume()
        self.training_ids = [grammar.all_prompts().index(p) for p in grammar.training_prompts()]
        self.disc_sigmas = inference_sigmas()
        self.ids_per_bucket = [image_ids(w, h) for w, h in BUCKETS]
        self.weights = torch.tensor(settings.bucket_weights)
        self.losses: list[float] = []

    def resume(self) -> None:
        state, data = load_state(self.ckpt_path), load_state(self.data_path)
        if state is not None:
            self.transformer.load_state_dict(state["model"])
            self.ema.load_state_dict(state["ema"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.elapsed = state["step"], state["elapsed"]
            self.generator.set_state(data["generator"])
            logger.info("resuming transformer at step %d", self.step)

    def run(self, minutes: float | None) -> None:
        settings = self.settings
        self.started = time.perf_counter()
        self.transformer.train()
        bar = tqdm(total=settings.steps, initial=self.step, desc="transformer", dynamic_ncols=True,
                   disable=self.rank != 0)
        while self.step < settings.steps:
            if os.getppid() != self.parent:
                raise SystemExit(f"transformer worker {self.rank}: the training process is gone; stopping")
            lr = settings.lr * lr_factor(self.step, settings.steps, settings.warmup)
            self.learn(*self.draw_batch(), lr)
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(self.losses[-50:]):.4f}", lr=f"{lr:.1e}")
            if self.step % settings.checkpoint_every == 0 or self.step == settings.steps:
                self.log(bar)
                self.checkpoint()
                stop = minutes is not None and self.elapsed > minutes * 60 and self.step < settings.steps
                if self.group.rank0_says(stop):
                    break
        bar.close()

    def draw_batch(self) -> tuple:
        """A random bucket, prompts, noise levels and noise: (prompt ids, bucket, sigma, clean, noise)."""
        settings, generator = self.settings, self.generator
        bucket = int(torch.multinomial(self.weights, 1, generator=generator))
        tokens = self.ids_per_bucket[bucket].shape[0]
        n = max(1, settings.tokens_per_batch // tokens // self.world)
        picks = torch.randint(0, len(self.training_ids), (n,), generator=generator)
        prompt_ids = torch.tensor([self.training_ids[int(i)] for i in picks])
        x0 = pack(latent_batch(prompt_ids.tolist(), *BUCKETS[bucket], generator))
        # Noise levels: a share exactly the inference sigmas, the rest logit-normal through the same shift.
        discrete = torch.rand(n, generator=generator) < settings.discrete_sigma_share
        continuous = shift_sigma(torch.sigmoid(torch.randn(n, generator=generator)))
        picked = self.disc_sigmas[torch.randint(0, len(self.disc_sigmas), (n,), generator=generator)]
        sigma = torch.where(discrete, picked, continuous)
        noise = torch.randn(x0.shape, generator=generator)
        return prompt_ids, bucket, sigma, x0, noise

    def learn(self, prompt_ids, bucket: int, sigma, x0, noise, lr: float) -> None:
        """One optimizer step on the rectified-flow loss (gradients averaged over the group), then the EMA."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        s = sigma.view(-1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        embeds, pooled = self.text["embeds"][prompt_ids], self.text["pooled"][prompt_ids]
        pred = call_transformer(self.transformer, xt, sigma, embeds, pooled, self.text["text_ids"],
                                self.ids_per_bucket[bucket])
        loss = F.mse_loss(pred, noise - x0)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.group.average_gradients(self.parameters)
        step_and_average(self.optimizer, self.parameters, self.ema, self.settings.ema, self.step)
        self.step += 1
        self.losses.append(loss.item())

    def log(self, bar) -> None:
        """Rank 0 logs the loss and, every eval_every steps, the EMA's fidelity; every rank's clock moves on."""
        settings, step = self.settings, self.step
        elapsed_now = self.elapsed + time.perf_counter() - self.started
        if self.rank == 0:
            record = {"step": step, "loss": float(np.mean(self.losses[-settings.checkpoint_every :])),
                      "minutes": elapsed_now / 60}
            if step % settings.eval_every == 0 or step == settings.steps:
                record |= transformer_fidelity(self.ema, self.text)  # the exact rules: no decoder needed
                if (vae := _vae_for_evaluation(settings, self.cache)) is not None:
                    prompts = eval_prompts(48, PROMPT_SEED)
                    record["decoded_64"] = generation_fidelity(self.ema, vae, self.text, prompts, 64, 64,
                                                               seed=PROMPT_SEED)
                bar.write(f"transformer step {step}: {record}")
            log_jsonl(self.cache / "transformer-log.jsonl", record)
        self.elapsed, self.started = elapsed_now, time.perf_counter()

    def checkpoint(self) -> None:
        save_state(self.data_path, {"generator": self.generator.get_state(), "step": self.step})
        if self.rank == 0:
            save_state(self.ckpt_path, {"model": self.transformer.state_dict(), "ema": self.ema.state_dict(),
                                        "optimizer": self.optimizer.state_dict(), "step": self.step,
                                        "elapsed": self.elapsed, "world": self.world})


def _vae_for_evaluation(settings: Settings, cache: Path):
    """The finished VAE, else the VAE stage's latest checkpoint (the stages may run side by side), else None.
    Only the logged evaluations use it; training never reads the VAE."""
    if (cache / "vae" / "config.json").is_file():
        return load_vae(cache / "vae")
    if (state := load_state(cache / "vae.ckpt")) is None:
        return None
    vae = build_vae(settings, settings.seed)
    vae.load_state_dict(state["model"])
    set_scaling(vae)
    return vae.eval()


def train_transformer(settings: Settings, cache: Path, minutes: float | None = None) -> None:
    """Train (or resume) the transformer in `settings.processes` processes (checkpoint: transformer.ckpt)."""
    prompt_embeddings(cache)  # computed once, before the workers start
    spawn(_TransformerTraining.worker, settings.processes, (settings, cache, minutes))
    state = load_state(cache / "transformer.ckpt")
    if state["step"] < settings.steps:
        raise TimeoutError(f"transformer stage stopped at step {state['step']} (--minutes); rerun to resume")


def _trained_transformer(settings: Settings, cache: Path):
    state = load_state(cache / "transformer.ckpt")
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
            pool.append((bucket, sample_latents(transformer, vae_config, text, Batch(ids, width, height, generator))))
    return pool


def tune_decoder_on(vae, pool: list[tuple[int, int, torch.Tensor]], settings: Settings, seed: int) -> None:
    """Fine-tune `vae`'s decoder on sampled latents ((width, height, latents) chunks), against the scene each
    describes read with the exact rules (latents.render_exact), half of each batch; the other half corrupted
    analytic latents of random training prompts, as in the VAE stage, so it keeps drawing those."""
    parameters = list(vae.decoder.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.tune_lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    vae.train()
    for step in tqdm(range(settings.tune_steps), desc="tune decoder", dynamic_ncols=True):
        for group in optimizer.param_groups:
            group["lr"] = settings.tune_lr * lr_factor(step, settings.tune_steps, 20)
        width, height, sampled = pool[int(torch.randint(0, len(pool), (1,), generator=generator))]
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
    tune_decoder_on(vae, [(*BUCKETS[bucket], z) for bucket, z in pool], settings, settings.seed + 21)
    final = {source: vae_fidelity(vae, 100, source=source) for source in ("clean", "corrupted")}
    prompts = eval_prompts(64, PROMPT_SEED)
    final["generated_64"] = generation_fidelity(transformer, vae, prompt_embeddings(cache), prompts, 64, 64, seed=PROMPT_SEED)
    logger.info("tuned decoder checker-correct: %s", final)
    log_jsonl(cache / "vae-log.jsonl", {"tuned": final, "minutes": (time.perf_counter() - started) / 60})
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
