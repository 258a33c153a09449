"""Train the embedded text-to-image model (models/tiny-shapes) on the shapes grammar, on a CPU.

The result is an ordinary diffusers FluxPipeline folder, so the app loads it like any Hub model. Training is
reproducible from the repo (`python -m engine.train_embedded`): fixed seeds, step-based schedules (a
stage stopped by --minutes resumes from its checkpoint to the same end point), checkpoints under a cache
folder, and the data rendered by `engine.shapes.grammar` (no data set on disk).

Stages:

1. vae: a x4 AutoencoderKL (3 blocks: 64x64 pixels -> 16x16 latents -> 8x8 Flux tokens, enough positions
   for geometry). Fully convolutional (no mid-block attention), so it is trained on 64x64 images only: half
   whole 64x64 renders, half 64x64 crops of 128x128 renders (the larger objects of the 128 buckets). Loss
   L1 + MSE + an edge term (image gradients, which keep corners sharp) + a small KL. Afterwards each latent
   channel is standardised by folding its measured mean/std into quant_conv and post_quant_conv, and the
   remaining global mean/std become shift_factor/scaling_factor (the pipeline applies them).
2. transformer: a FluxTransformer2DModel trained with rectified flow on pre-encoded latents of every
   bucket (one bucket per batch, batch sizes giving equal image tokens), text embeddings precomputed by
   the pipeline's own `encode_prompt` with the preset's max_sequence_length. Half the noise levels are the
   exact sigmas the scheduler uses at the default step count, half logit-normal through the same shift,
   so training matches inference. A slice of the latent pool is re-rendered every step (fresh positions
   and sizes without paying the encoder for every sample). EMA weights are what ships.
3. export: the pipeline (frozen random CLIP + T5 from engine.tiny, trained VAE, EMA transformer, the
   scheduler) saved with save_pretrained in float16 safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.shapes import grammar
from engine.shapes.fidelity import check

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# The recipe. The preset must use the same inference settings (steps, shift, max_sequence_length).
# --------------------------------------------------------------------------------------------------
BUCKETS: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (64, 128), (128, 64))  # (width, height)
MAX_SEQUENCE_LENGTH = 24  # the longest prompt is 24 T5 tokens with </s> (measured in tests)
DEFAULT_STEPS = 8
SHIFT = 3.0  # fixed (use_dynamic_shifting=False): one sigma schedule for every bucket
LATENT_CHANNELS = 8
VAE_BLOCKS = (16, 32, 64)  # 3 blocks -> vae_scale_factor 4
TEXT_SEEDS = (1, 2)  # engine.tiny's tiny-flux seeds for CLIP and T5 (frozen random encoders)
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
    vae_steps: int = 1500
    vae_batch: int = 16
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    vae_edge: float = 1.0
    # transformer
    depth: tuple[int, int] = (2, 2)  # double-stream, single-stream blocks
    heads: int = 2
    head_dim: int = 64
    steps: int = 2800
    tokens_per_batch: int = 4096  # image tokens: batch 64 at 64x64, 32 at 64x128, 16 at 128x128
    bucket_weights: tuple[float, ...] = (0.5, 0.2, 0.15, 0.15)  # 64x64 has the strictest target
    lr: float = 1e-3
    warmup: int = 300
    ema: float = 0.998
    discrete_sigma_share: float = 0.5
    pool_per_bucket: tuple[int, ...] = (2048, 512, 1024, 1024)  # initial; refreshed every step
    refresh_per_step: int = 16  # pool entries re-rendered per step (in 64x64 units, all processes)
    eval_every: int = 500
    checkpoint_every: int = 250


# --------------------------------------------------------------------------------------------------
# Components.
# --------------------------------------------------------------------------------------------------
def build_vae(seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCKS),
        block_out_channels=VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=64,
        mid_block_add_attention=False,  # fully convolutional: trains on 64x64, works at every bucket
        use_quant_conv=True,  # 1x1 convs that hold the per-channel latent standardisation
        use_post_quant_conv=True,
    )


def build_transformer(settings: Settings, seed: int):
    from diffusers import FluxTransformer2DModel

    from engine.tiny import CLIP_HIDDEN, T5_D_MODEL

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
    """engine.tiny's frozen random CLIP and T5, rounded through float16 first: that is how they are
    stored, so the embeddings trained on are exactly the ones the shipped pipeline computes in fp32."""
    from engine.tiny import build_clip, build_t5

    text_encoder, tokenizer = build_clip(seed=TEXT_SEEDS[0], with_projection=False)
    text_encoder_2, tokenizer_2 = build_t5(seed=TEXT_SEEDS[1])
    for model in (text_encoder, text_encoder_2):
        model.to(torch.float16).to(torch.float32)
    return text_encoder, tokenizer, text_encoder_2, tokenizer_2


def assemble_pipeline(vae, transformer):
    from diffusers import FluxPipeline

    text_encoder, tokenizer, text_encoder_2, tokenizer_2 = build_text_encoders()
    return FluxPipeline(
        scheduler=build_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


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
def _random_prompts(n: int, generator: torch.Generator, prompts=None) -> tuple[torch.Tensor, ...]:
    prompts = prompts or grammar.all_prompts()
    picks = torch.randint(0, len(prompts), (n,), generator=generator)
    return grammar.prompt_indices([prompts[int(i)] for i in picks])


def vae_batch(n: int, generator: torch.Generator) -> torch.Tensor:
    """n 64x64 images: half whole 64x64 renders, half random 64x64 crops of 128x128 renders."""
    half = n // 2
    small = grammar.render_batch(*_random_prompts(half, generator), 64, 64, generator)
    big = grammar.render_batch(*_random_prompts(n - half, generator), 128, 128, generator)
    offsets = torch.randint(0, 65, (n - half, 2), generator=generator)
    crops = torch.stack([img[:, y : y + 64, x : x + 64] for img, (x, y) in zip(big, offsets.tolist(), strict=True)])
    return torch.cat([small, crops])


def _edge_loss(recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    dx = lambda t: t[..., :, 1:] - t[..., :, :-1]  # noqa: E731
    dy = lambda t: t[..., 1:, :] - t[..., :-1, :]  # noqa: E731
    return (dx(recon) - dx(target)).abs().mean() + (dy(recon) - dy(target)).abs().mean()


@torch.no_grad()
def vae_fidelity(vae, n_per_bucket: int = 64, seed: int = 1234, buckets=BUCKETS) -> dict[str, float]:
    """Share of checker-correct reconstructions (posterior mean -> decode) per bucket."""
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for width, height in buckets:
        prompts = [grammar.all_prompts()[int(i)] for i in torch.randint(0, 168, (n_per_bucket,), generator=generator)]
        images = grammar.render_batch(*grammar.prompt_indices(prompts), width, height, generator)
        recon = torch.cat([vae.decode(vae.encode(chunk).latent_dist.mode()).sample for chunk in images.split(32)])
        pil = grammar.to_pil(recon)
        result[f"{width}x{height}"] = sum(check(i, p).correct for i, p in zip(pil, prompts, strict=True)) / len(pil)
    return result


def train_vae(settings: Settings, cache: Path, minutes: float | None = None) -> Path:
    """Train (or resume) the VAE; returns the folder of the finished, standardised VAE."""
    out = cache / "vae"
    if (out / "config.json").is_file():
        logger.info("VAE already trained: %s", out)
        return out
    ckpt_path = cache / "vae.ckpt"
    vae = build_vae(settings.seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    step, elapsed = 0, 0.0
    if (state := _load(ckpt_path)) is not None:
        vae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed = state["step"], state["elapsed"]
        logger.info("resuming VAE at step %d", step)
    else:
        torch.manual_seed(settings.seed + 2)  # posterior sampling noise
    log_path = cache / "vae-log.jsonl"

    def checkpoint():
        _save(
            ckpt_path,
            {
                "model": vae.state_dict(),
                "optimizer": optimizer.state_dict(),
                "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "step": step,
                "elapsed": elapsed,
            },
        )

    vae.train()
    started = time.perf_counter()
    bar = tqdm(total=settings.vae_steps, initial=step, desc="vae", dynamic_ncols=True)
    while step < settings.vae_steps:
        for group in optimizer.param_groups:
            group["lr"] = settings.vae_lr * _lr_factor(step, settings.vae_steps, 100)
        images = vae_batch(settings.vae_batch, generator)
        posterior = vae.encode(images).latent_dist
        recon = vae.decode(posterior.sample()).sample
        rec = F.l1_loss(recon, images) + F.mse_loss(recon, images)
        edge = _edge_loss(recon, images)
        kl = posterior.kl().mean()
        loss = rec + settings.vae_edge * edge + settings.vae_kl * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(rec=f"{rec.item():.4f}", edge=f"{edge.item():.4f}", kl=f"{kl.item():.0f}")
        if step % settings.checkpoint_every == 0 or step == settings.vae_steps:
            elapsed_now = elapsed + time.perf_counter() - started
            record = {"step": step, "rec": rec.item(), "edge": edge.item(), "kl": kl.item(), "minutes": elapsed_now / 60}
            if step % settings.eval_every == 0 or step == settings.vae_steps:
                vae.eval()
                record["fidelity"] = vae_fidelity(vae, 32, buckets=BUCKETS[:2])
                vae.train()
                bar.write(f"vae step {step}: {record}")
            _log_jsonl(log_path, record)
            elapsed, started = elapsed_now, time.perf_counter()
            checkpoint()
            if minutes is not None and elapsed > minutes * 60 and step < settings.vae_steps:
                bar.close()
                raise TimeoutError(f"VAE stage stopped at step {step} (--minutes); rerun with --resume")
    bar.close()
    vae.eval()
    standardise_latents(vae, generator)
    final = vae_fidelity(vae, 200)
    logger.info("VAE reconstructions checker-correct: %s", final)
    _log_jsonl(log_path, {"step": step, "final_fidelity": final, "minutes": elapsed / 60})
    vae.save_pretrained(out, safe_serialization=True)
    return out


@torch.no_grad()
def _latent_sample(vae, generator: torch.Generator, per_bucket: int = 256) -> list[torch.Tensor]:
    latents = []
    for width, height in BUCKETS:
        images = grammar.render_batch(*_random_prompts(per_bucket, generator), width, height, generator)
        latents += [vae.encode(chunk).latent_dist.mode() for chunk in images.split(64)]
    return latents


@torch.no_grad()
def standardise_latents(vae, generator: torch.Generator) -> None:
    """Fold each latent channel's mean/std into quant_conv (encoder side) and post_quant_conv (decoder
    side), so the diffusion model sees balanced channels. Channels whose posterior noise exceeds their
    spread carry nothing the decoder uses (the KL term emptied them); they are pinned to 0 on both sides,
    so the transformer is not asked to predict arbitrary encoder values there. Then the remaining global
    statistics of the live channels become shift_factor/scaling_factor, exactly as measured."""
    latents = _latent_sample(vae, generator)
    channels = torch.cat([z.permute(1, 0, 2, 3).flatten(1) for z in latents], dim=1)
    mean, std = channels.mean(1), channels.std(1)
    logger.info("latent channel means %s, stds %s", mean.numpy().round(3), std.numpy().round(3))
    c = LATENT_CHANNELS
    q, p = vae.quant_conv, vae.post_quant_conv
    q.weight[:c] /= std.view(c, 1, 1, 1)
    q.bias[:c] = (q.bias[:c] - mean) / std
    q.bias[c:] -= 2 * std.log()  # log-variance of (z - mean) / std
    # post_quant_conv(z) = W z + b with z = std * z' + mean
    p.bias += (p.weight[:, :, 0, 0] @ mean).view(-1)
    p.weight *= std.view(1, c, 1, 1)

    images = grammar.render_batch(*_random_prompts(256, generator), 64, 64, generator)
    noise = vae.encode(images).latent_dist.std.mean(dim=(0, 2, 3))
    dead = noise > 1.0
    logger.info("posterior std per standardised channel %s; pinned to 0: %s", noise.numpy().round(2), dead.nonzero().flatten().tolist())
    q.weight[:c][dead] = 0
    q.bias[:c][dead] = 0
    p.weight[:, dead] = 0

    live = torch.cat([z[:, ~dead].flatten() for z in _latent_sample(vae, generator, 64)])
    shift, scale = float(live.mean()), float(1 / live.std())
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    logger.info("after standardising: shift_factor %.4f, scaling_factor %.4f", shift, scale)


# --------------------------------------------------------------------------------------------------
# Stage 2: transformer.
# --------------------------------------------------------------------------------------------------
def load_vae(path: Path):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.no_grad()
def prompt_embeddings(cache: Path) -> dict[str, torch.Tensor]:
    """T5 embeddings, CLIP pooled embeddings and txt ids of all 168 prompts, computed by the pipeline's
    own encode_prompt with the preset's max_sequence_length (cached)."""
    path = cache / "prompt-embeddings.pt"
    if (cached := _load(path)) is not None:
        return cached
    from diffusers import FluxPipeline

    text_encoder, tokenizer, text_encoder_2, tokenizer_2 = build_text_encoders()
    pipe = FluxPipeline(
        scheduler=build_scheduler(),
        vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=None,
    )
    texts = [p.text for p in grammar.all_prompts()]
    embeds, pooled, text_ids = pipe.encode_prompt(texts, prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH)
    result = {"embeds": embeds.float(), "pooled": pooled.float(), "text_ids": text_ids.float()}
    _save(path, result)
    return result


def pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


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


class LatentPool:
    """Pre-encoded, normalised latents per bucket with their prompt indices; a few entries are replaced by
    fresh renders every step, so the data keeps growing at a small encoder cost."""

    def __init__(self, vae, settings: Settings, generator: torch.Generator, state: dict | None = None):
        self.vae = vae
        self.generator = generator
        self.prompt_ids = [grammar.all_prompts().index(p) for p in grammar.training_prompts()]
        if state is not None:
            self.latents, self.prompts = state["latents"], state["prompts"]
            return
        self.latents, self.prompts = [], []
        for (width, height), n in zip(BUCKETS, settings.pool_per_bucket, strict=True):
            latents, prompts = [], []
            for start in tqdm(range(0, n, 256), desc=f"encoding {width}x{height}", leave=False):
                z, p = self.encode(width, height, min(256, n - start))
                latents.append(z)
                prompts.append(p)
            self.latents.append(torch.cat(latents))
            self.prompts.append(torch.cat(prompts))

    @torch.no_grad()
    def encode(self, width: int, height: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.tensor(self.prompt_ids)[torch.randint(0, len(self.prompt_ids), (n,), generator=self.generator)]
        prompts = [grammar.all_prompts()[int(i)] for i in picks]
        images = grammar.render_batch(*grammar.prompt_indices(prompts), width, height, self.generator)
        cfg = self.vae.config
        z = torch.cat([self.vae.encode(chunk).latent_dist.mode() for chunk in images.split(64)])
        return ((z - cfg.shift_factor) * cfg.scaling_factor).to(torch.float16), picks

    def refresh(self, bucket: int, n: int) -> None:
        width, height = BUCKETS[bucket]
        z, p = self.encode(width, height, n)
        where = torch.randint(0, len(self.latents[bucket]), (n,), generator=self.generator)
        self.latents[bucket][where] = z
        self.prompts[bucket][where] = p

    def batch(self, bucket: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        where = torch.randint(0, len(self.latents[bucket]), (n,), generator=self.generator)
        return self.latents[bucket][where].float(), self.prompts[bucket][where]

    def state(self) -> dict:
        return {"latents": self.latents, "prompts": self.prompts}


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
def sample(transformer, vae, text: dict, prompt_ids, width, height, generator, steps=DEFAULT_STEPS, dtype=torch.float32):
    """FluxPipeline's denoising loop without the pipeline (for quick evaluations during training)."""
    n = len(prompt_ids)
    h, w = height // 4, width // 4
    latents = torch.randn((n, LATENT_CHANNELS, h, w), generator=generator).to(dtype)
    packed = pack(latents)
    sigmas = torch.cat([inference_sigmas(steps), torch.zeros(1)])
    embeds, pooled = text["embeds"][prompt_ids].to(dtype), text["pooled"][prompt_ids].to(dtype)
    txt_ids, img_ids = text["text_ids"], image_ids(width, height)
    for i in range(steps):
        v = call_transformer(transformer, packed, sigmas[i].expand(n).to(dtype), embeds, pooled, txt_ids, img_ids)
        packed = (packed.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(dtype)
    latents = unpack(packed, width, height) / vae.config.scaling_factor + vae.config.shift_factor
    return torch.cat([vae.decode(chunk.to(vae.dtype)).sample for chunk in latents.split(32)]).float()


def generation_fidelity(transformer, vae, text, prompts, width, height, seed: int, steps=DEFAULT_STEPS) -> float:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([grammar.all_prompts().index(p) for p in prompts])
    images = grammar.to_pil(sample(transformer, vae, text, ids, width, height, generator, steps))
    return sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / len(prompts)


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

        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in parameters])
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


def _transformer_worker(rank: int, world: int, settings: Settings, cache: Path, vae_path: Path, minutes, store):
    torch.set_num_threads(settings.threads)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    group = _Group(rank, world)
    vae = load_vae(vae_path)
    text = prompt_embeddings(cache)
    ckpt_path = cache / "transformer.ckpt"
    data_path = cache / f"transformer-data-{rank}.ckpt"  # this rank's pool and generator
    transformer = build_transformer(settings, settings.seed + 10)  # same seed: identical replicas
    parameters = list(transformer.parameters())
    logger.info("transformer: %.2f M parameters, %d process(es)", sum(p.numel() for p in parameters) / 1e6, world)
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
    pool_settings = dataclasses.replace(settings, pool_per_bucket=tuple(n // world for n in settings.pool_per_bucket))
    pool = LatentPool(vae, pool_settings, generator, data["pool"] if data else None)
    if data is None:
        logger.info("latent pool encoded in %.0fs", time.perf_counter() - started)
    del data
    log_path = cache / "transformer-log.jsonl"
    disc_sigmas = inference_sigmas()
    txt_ids = text["text_ids"]
    ids_per_bucket = [image_ids(w, h) for w, h in BUCKETS]
    weights = torch.tensor(settings.bucket_weights)

    def checkpoint():
        _save(data_path, {"generator": generator.get_state(), "pool": pool.state(), "step": step})
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
        lr = settings.lr * _lr_factor(step, settings.steps, settings.warmup)
        for g in optimizer.param_groups:
            g["lr"] = lr
        bucket = int(torch.multinomial(weights, 1, generator=generator))
        tokens = ids_per_bucket[bucket].shape[0]
        n = max(1, settings.tokens_per_batch // tokens // world)
        pool.refresh(bucket, max(1, settings.refresh_per_step * 64 // tokens // world))
        x0, prompt_ids = pool.batch(bucket, n)
        x0 = pack(x0)
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
                    prompts = _eval_prompts(48, 7)
                    record["fidelity_64"] = generation_fidelity(ema, vae, text, prompts, 64, 64, seed=7)
                    prompts = _eval_prompts(16, 8)
                    record["fidelity_64x128"] = generation_fidelity(ema, vae, text, prompts, 64, 128, seed=8)
                    prompts = _eval_prompts(24, 9, held_out=True)
                    record["fidelity_held_out_64"] = generation_fidelity(ema, vae, text, prompts, 64, 64, seed=9)
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


def train_transformer(settings: Settings, cache: Path, vae_path: Path, minutes: float | None = None):
    """Train (or resume) the transformer in `settings.processes` processes; returns (EMA transformer, vae)."""
    prompt_embeddings(cache)  # computed once, before the workers start
    world = settings.processes
    if world == 1:
        _transformer_worker(0, 1, settings, cache, vae_path, minutes, None)
    else:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            mp.spawn(_transformer_worker, (world, settings, cache, vae_path, minutes, store), nprocs=world)
    state = _load(cache / "transformer.ckpt")
    if state["step"] < settings.steps:
        raise TimeoutError(f"transformer stage stopped at step {state['step']} (--minutes); rerun to resume")
    ema = build_transformer(settings, settings.seed + 10).eval()
    ema.load_state_dict(state["ema"])
    return ema, load_vae(vae_path)


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
        for name in ("vae.ckpt", "transformer.ckpt", "vae-log.jsonl", "transformer-log.jsonl"):
            (cache / name).unlink(missing_ok=True)
        if (cache / "vae" / "config.json").is_file() and stage in ("vae", "all"):
            import shutil

            shutil.rmtree(cache / "vae")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "settings.json").write_text(json.dumps(asdict(settings), indent=2))
    started = time.perf_counter()
    if stage in ("vae", "all"):
        vae_path = train_vae(settings, cache, minutes)
    else:
        vae_path = cache / "vae"
    if stage in ("transformer", "all"):
        remaining = None if minutes is None else minutes - (time.perf_counter() - started) / 60
        transformer, vae = train_transformer(settings, cache, vae_path, remaining)
    elif stage == "export":
        state = _load(cache / "transformer.ckpt")
        if state is None:
            raise FileNotFoundError(f"no transformer checkpoint in {cache}")
        transformer = build_transformer(settings, settings.seed + 10)
        transformer.load_state_dict(state["ema"])
        vae = load_vae(vae_path)
    else:
        return
    export(transformer.eval(), vae, out, settings, {"wall_minutes_this_run": (time.perf_counter() - started) / 60})
