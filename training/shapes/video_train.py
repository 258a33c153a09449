"""Train tiny-shapes-video (a WanPipeline folder) on the moving-shapes grammar, on a CPU.

Stages (`--stage all` runs them in order; decoder and transformer are independent and may run side by side,
one single-threaded process each):

1. decoder: AutoencoderKLWan's decoder renders the clean clip from the analytic latents of
   `video_latents` (mostly corrupted), 17- and 9-frame clips at 32x32, with tiny-shapes' balanced loss
   (object and background pixels averaged apart) and edge term. The encoder is never trained.
2. transformer: a tiny WanTransformer3DModel trained by rectified flow on the normalised analytic latents of
   fresh random clips, the prompts' T5 embeddings from the pipeline's own encode_prompt; half the noise
   levels the exact sigmas of the 8-step schedule, half logit-normal through the same shift; EMA ships.
3. tune: the decoder fine-tuned on latents the trained transformer samples, against the clip they describe
   read with the exact rules (half of each batch; the other half corrupted analytic latents).
4. export: WanPipeline.save_pretrained in float16, plus training.json (settings and scores).

Fixed seeds, step-based schedules, checkpoints under the cache folder; `minutes` stops at a checkpoint and a
rerun resumes to the same end point.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.shapes import video_fidelity
from training.shapes import video_latents as vlatents
from training.shapes import video_sampling as vs
from training.shapes.samples import PROMPT_SEED
from training.shapes.train import _balanced_loss, _edge_loss
from training.shapes.training import load_state, log_jsonl, lr_factor, save_state, step_and_average

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path("models/tiny-shapes-video")
DEFAULT_CACHE = Path(".cache/train-video")


@dataclass
class VideoSettings:
    seed: int = 0
    threads: int = 1  # one process per stage, one thread each: the stages run side by side on 2 cores
    arch: vs.Architecture = field(default_factory=vs.Architecture)
    frame_weights: tuple[float, ...] = (0.5, 0.5)  # 17 and 9 frames (vs.FRAMES)
    # decoder: mostly 9-frame clips (8 per batch), for many scenes per step; the causal decoder unfolds a
    # 17-frame clip chunk by chunk as it does a 9-frame one
    decoder_frame_weights: tuple[float, ...] = (0.2, 0.8)
    decoder_steps: int = 4000
    decoder_frames_per_batch: int = 72  # 4 clips of 17 frames or 8 of 9
    decoder_lr: float = 1e-3
    # post_quant_conv (a 1x1 conv before the decoder) starts as this many times the identity: the semantic
    # fields then outweigh the random residual branches, whose RMS norms make their outputs O(1) whatever
    # comes in (1.0: diffusers' default initialisation)
    decoder_input_gain: float = 10.0
    # "fields": the decoder starts as a carrier of the 16 fields to every pixel (fields_init); "default":
    # diffusers' initialisation
    decoder_init: str = "fields"
    decoder_edge: float = 1.0
    clean_share: float = 0.25
    # transformer
    steps: int = 3000
    batch: int = 64  # clips
    lr: float = 1e-3
    warmup: int = 200
    ema: float = 0.998
    discrete_sigma_share: float = 0.5
    # decoder tuning on the transformer's samples
    # 0: no tuning. A 120-step tuning (lr 5e-4) lowered the pipeline's held-out clips from 13 to 8 of 24
    # (seed 0): the decoder draws the transformer's latents well enough already, and it forgets faster
    # than it adapts
    tune_steps: int = 0
    tune_lr: float = 5e-4
    tune_pool: int = 256  # sampled clips, split over the clip lengths
    checkpoint_every: int = 100
    eval_every: int = 500


def _frames(weights: tuple[float, ...], generator: torch.Generator) -> int:
    return vs.FRAMES[int(torch.multinomial(torch.tensor(weights), 1, generator=generator))]


def _clock(state: dict | None) -> tuple[int, float]:
    return (state["step"], state["elapsed"]) if state else (0, 0.0)


# --------------------------------------------------------------------------------------------------
# Stage 1: decoder.
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def decoder_fidelity(vae, n: int = 32, seed: int = 1234, corrupted: bool = False, frames: int = 17) -> float:
    """Share of clips the decoder draws right (clip checker) from analytic latents (or corrupted ones)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = vs.random_prompts(n, generator, vs.vgrammar.all_prompts())
    _, z = vs.scene_batch(prompts, frames, generator)
    if corrupted:
        z = vlatents.corrupt(z, generator, clean_share=0.0)
    clips = torch.cat([vs.decode(vae, chunk).clamp(-1, 1) for chunk in z.split(16)])
    results = [video_fidelity.check(vs.vgrammar.clip_to_pil(c), p) for c, p in zip(clips, prompts, strict=True)]
    return round(video_fidelity.rates(results)["right"], 3)


@torch.no_grad()
def fields_init(decoder) -> None:
    """Start Wan's decoder as a carrier of the latent fields: conv_in embeds the 16 channels in the first 16
    features, every residual branch and the attention adds nothing (last conv zero), shortcuts and the
    temporal up-sampling pass features on, and each spatial up-sampling conv smooths the nearest-neighbour
    copy into a bilinear one ([1, 2, 1]^2 / 16). So every output pixel starts with its own interpolated
    position, the object's centre, size, colours and code (what tiny-shapes' bilinear decoder had from
    the start); training then learns the rendering in the residual branches and the output layers."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanResample,
        WanResidualBlock,
    )

    def embed(conv, tap: tuple[int, ...]) -> None:
        conv.weight.zero_()
        conv.bias.zero_()
        for i in range(min(conv.weight.shape[0], conv.weight.shape[1])):
            conv.weight[(i, i, *tap)] = 1.0

    embed(decoder.conv_in, (2, 1, 1))  # causal: the current frame is the last time tap
    smooth = torch.tensor([1.0, 2.0, 1.0])
    smooth = torch.outer(smooth, smooth) / 16
    for module in decoder.modules():
        if isinstance(module, WanResidualBlock):
            module.conv2.weight.zero_()
            module.conv2.bias.zero_()
            if not isinstance(module.conv_shortcut, torch.nn.Identity):
                embed(module.conv_shortcut, (0, 0, 0))
        elif isinstance(module, WanAttentionBlock):
            module.proj.weight.zero_()
            module.proj.bias.zero_()
        elif isinstance(module, WanResample) and module.mode.startswith("upsample"):
            conv = module.resample[1]
            conv.weight.zero_()
            conv.bias.zero_()
            for i in range(min(conv.weight.shape[:2])):
                conv.weight[i, i] = smooth
            if module.mode == "upsample3d":  # both new frames start as copies of the current one
                dim = module.dim
                module.time_conv.weight.zero_()
                module.time_conv.bias.zero_()
                for i in range(dim):
                    module.time_conv.weight[i, i, 2, 0, 0] = 1.0
                    module.time_conv.weight[dim + i, i, 2, 0, 0] = 1.0


def _decoder_loss(vae, z, clips, background, settings: VideoSettings) -> torch.Tensor:
    recon = vs.decode(vae, z)
    return _balanced_loss(recon, clips, background) + settings.decoder_edge * _edge_loss(recon, clips)


def train_decoder(settings: VideoSettings, cache: Path, minutes: float | None = None) -> bool:
    """Train (or resume) the decoder; True when its last step is done (cache/decoder.ckpt)."""
    ckpt = cache / "decoder.ckpt"
    vae = vs.build_vae(settings.arch, settings.seed)
    parameters = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.decoder_lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    state = load_state(ckpt)
    if state is not None:
        vae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
    elif settings.decoder_input_gain != 1.0:
        with torch.no_grad():
            weight = vae.post_quant_conv.weight
            weight.copy_(settings.decoder_input_gain * torch.eye(weight.shape[0]).view(weight.shape))
            vae.post_quant_conv.bias.zero_()
        if settings.decoder_init == "fields":
            fields_init(vae.decoder)
    step, elapsed = _clock(state)
    logger.info("decoder: %.2f M parameters, from step %d", sum(p.numel() for p in parameters) / 1e6, step)
    started, losses = time.perf_counter(), []
    vae.train()
    bar = tqdm(total=settings.decoder_steps, initial=step, desc="decoder", dynamic_ncols=True)
    while step < settings.decoder_steps:
        for group in optimizer.param_groups:
            group["lr"] = settings.decoder_lr * lr_factor(step, settings.decoder_steps, 100)
        frames = _frames(settings.decoder_frame_weights, generator)
        clips, z = vs.scene_batch(vs.random_prompts(settings.decoder_frames_per_batch // frames, generator),
                                  frames, generator)
        loss = _decoder_loss(vae, vlatents.corrupt(z, generator, settings.clean_share), clips,
                             z[:, vlatents.BACKGROUND, :1, :1, :1], settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
        if step % settings.checkpoint_every == 0 or step == settings.decoder_steps:
            elapsed, started = elapsed + time.perf_counter() - started, time.perf_counter()
            record = {"step": step, "loss": vs.mean(losses[-settings.checkpoint_every:]), "minutes": elapsed / 60}
            if step % settings.eval_every == 0 or step == settings.decoder_steps:
                vae.eval()
                record |= {"clean_17": decoder_fidelity(vae), "corrupted_17": decoder_fidelity(vae, corrupted=True),
                           "clean_9": decoder_fidelity(vae, frames=9)}
                vae.train()
                bar.write(f"decoder step {step}: {record}")
            log_jsonl(cache / "decoder-log.jsonl", record)
            save_state(ckpt, {"model": vae.state_dict(), "optimizer": optimizer.state_dict(),
                              "generator": generator.get_state(), "step": step, "elapsed": elapsed})
            if minutes is not None and elapsed > minutes * 60 and step < settings.decoder_steps:
                break
    bar.close()
    return step >= settings.decoder_steps


def load_trained_vae(settings: VideoSettings, cache: Path, tuned: bool = True):
    """The tuned decoder if there is one (and `tuned`), else the decoder stage's latest checkpoint."""
    vae = vs.build_vae(settings.arch, settings.seed)
    state = load_state(cache / "decoder-tuned.ckpt") if tuned else None
    state = state or load_state(cache / "decoder.ckpt")
    if state is None:
        return None
    vae.load_state_dict(state["model"])
    return vae.eval()


# --------------------------------------------------------------------------------------------------
# Stage 2: transformer.
# --------------------------------------------------------------------------------------------------
def transformer_scores(ema, embeds, vae=None, n: int = 32) -> dict[str, float]:
    """Clip checker scores of the EMA transformer at 17 frames: the latents read by the exact rules, and
    decoded by the decoder in training when there is one."""
    scores = {}
    for name, held_out in (("train", False), ("held_out", True)):
        prompts = vs.eval_prompts(n, PROMPT_SEED, held_out)
        scores[f"exact_{name}"] = round(video_fidelity.rates(vs.grade(ema, embeds, prompts, 17, PROMPT_SEED))["right"], 3)
        if vae is not None:
            rates = video_fidelity.rates(vs.grade(ema, embeds, prompts, 17, PROMPT_SEED, vae=vae))
            scores[f"decoded_{name}"] = round(rates["right"], 3)
    return scores


def _draw_batch(settings: VideoSettings, generator: torch.Generator, training_ids: list[int], sigmas):
    frames = _frames(settings.frame_weights, generator)
    picks = torch.randint(0, len(training_ids), (settings.batch,), generator=generator)
    ids = [training_ids[int(i)] for i in picks]
    _, z = vs.scene_batch([vs.vgrammar.all_prompts()[i] for i in ids], frames, generator)
    x0 = vs.normalise(z)
    n = len(ids)
    discrete = torch.rand(n, generator=generator) < settings.discrete_sigma_share
    continuous = vs.shift_sigma(torch.sigmoid(torch.randn(n, generator=generator)))
    picked = sigmas[torch.randint(0, len(sigmas), (n,), generator=generator)]
    sigma = torch.where(discrete, picked, continuous)
    return ids, x0, sigma, torch.randn(x0.shape, generator=generator)


def train_transformer(settings: VideoSettings, cache: Path, minutes: float | None = None) -> bool:
    """Train (or resume) the transformer; True when its last step is done (cache/transformer.ckpt)."""
    ckpt = cache / "transformer.ckpt"
    embeds = vs.prompt_embeddings(cache)
    transformer = vs.build_transformer(settings.arch, settings.seed + 10)
    ema = vs.build_transformer(settings.arch, settings.seed + 10).eval().requires_grad_(False)
    parameters = list(transformer.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 11)
    state = load_state(ckpt)
    if state is not None:
        transformer.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
    else:
        ema.load_state_dict(transformer.state_dict())
    step, elapsed = _clock(state)
    logger.info("transformer: %.2f M parameters, from step %d", sum(p.numel() for p in parameters) / 1e6, step)
    index = {p: i for i, p in enumerate(vs.vgrammar.all_prompts())}
    training_ids = [index[p] for p in vs.vgrammar.training_prompts()]
    sigmas = vs.inference_sigmas()[:-1]
    started, losses = time.perf_counter(), []
    transformer.train()
    bar = tqdm(total=settings.steps, initial=step, desc="transformer", dynamic_ncols=True)
    while step < settings.steps:
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(step, settings.steps, settings.warmup)
        ids, x0, sigma, noise = _draw_batch(settings, generator, training_ids, sigmas)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = vs.call_transformer(transformer, (1 - s) * x0 + s * noise, sigma, embeds[ids])
        loss = F.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        step_and_average(optimizer, parameters, ema, settings.ema, step)
        step += 1
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            elapsed, started = elapsed + time.perf_counter() - started, time.perf_counter()
            record = {"step": step, "loss": vs.mean(losses[-settings.checkpoint_every:]), "minutes": elapsed / 60}
            if step % settings.eval_every == 0 or step == settings.steps:
                record |= transformer_scores(ema, embeds, load_trained_vae(settings, cache, tuned=False))
                bar.write(f"transformer step {step}: {record}")
            log_jsonl(cache / "transformer-log.jsonl", record)
            save_state(ckpt, {"model": transformer.state_dict(), "ema": ema.state_dict(),
                              "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                              "step": step, "elapsed": elapsed})
            if minutes is not None and elapsed > minutes * 60 and step < settings.steps:
                break
    bar.close()
    return step >= settings.steps


def trained_transformer(settings: VideoSettings, cache: Path):
    state = load_state(cache / "transformer.ckpt")
    if state is None:
        raise FileNotFoundError(f"no transformer checkpoint in {cache}; run --stage transformer first")
    transformer = vs.build_transformer(settings.arch, settings.seed + 10)
    transformer.load_state_dict(state["ema"])
    return transformer.eval()


# --------------------------------------------------------------------------------------------------
# Stage 3: tune the decoder on what the transformer writes.
# --------------------------------------------------------------------------------------------------
def tune_decoder(settings: VideoSettings, cache: Path) -> None:
    """Fine-tune the decoder on latents the trained transformer samples (training prompts, random seeds),
    against the clip each describes read with the exact rules; writes cache/decoder-tuned.ckpt."""
    out = cache / "decoder-tuned.ckpt"
    if out.is_file():
        logger.info("decoder already tuned: %s", out)
        return
    vae = load_trained_vae(settings, cache, tuned=False)
    transformer, embeds = trained_transformer(settings, cache), vs.prompt_embeddings(cache)
    generator = torch.Generator().manual_seed(settings.seed + 20)
    started = time.perf_counter()
    pool = []  # (frames, sampled latents) chunks of 16
    with torch.no_grad():
        for frames, weight in zip(vs.FRAMES, settings.frame_weights, strict=True):
            for _ in range(max(1, round(settings.tune_pool * weight / 16))):
                ids = vs.prompt_ids(vs.random_prompts(16, generator))
                pool.append((frames, vs.sample_latents(transformer, embeds, ids, frames, generator)))
    logger.info("sampled %d clips in %.0f s", 16 * len(pool), time.perf_counter() - started)
    parameters = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=settings.tune_lr, betas=(0.9, 0.99), weight_decay=0.0)
    vae.train()
    for step in tqdm(range(settings.tune_steps), desc="tune decoder", dynamic_ncols=True):
        for group in optimizer.param_groups:
            group["lr"] = settings.tune_lr * lr_factor(step, settings.tune_steps, 20)
        frames, sampled = pool[int(torch.randint(0, len(pool), (1,), generator=generator))]
        half = settings.decoder_frames_per_batch // frames // 2
        sampled = sampled[torch.randperm(len(sampled), generator=generator)[:half]]
        clips, analytic = vs.scene_batch(vs.random_prompts(half, generator), frames, generator)
        z = torch.cat([sampled, vlatents.corrupt(analytic, generator, settings.clean_share)])
        targets = torch.cat([vlatents.render_exact(sampled, frames, vs.SIZE), clips])
        background = torch.cat([vlatents.read_background(sampled), analytic[:, vlatents.BACKGROUND, :1, :1, :1]])
        loss = _decoder_loss(vae, z, targets, background, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
    vae.eval()
    save_state(out, {"model": vae.state_dict(), "minutes": (time.perf_counter() - started) / 60})


# --------------------------------------------------------------------------------------------------
# Stage 4: export.
# --------------------------------------------------------------------------------------------------
def export(settings: VideoSettings, cache: Path, out: Path, info: dict | None = None) -> Path:
    """Save the WanPipeline folder in float16 safetensors, plus training.json (the recipe and the logs)."""
    pipe = vs.assemble_pipeline(load_trained_vae(settings, cache), trained_transformer(settings, cache))
    pipe.to(torch.float16)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    logs = {}
    for name in ("decoder", "transformer"):
        path = cache / f"{name}-log.jsonl"
        if path.is_file():
            logs[name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trained = {name: (load_state(cache / f"{name}.ckpt") or {}).get("step") for name in ("decoder", "transformer")}
    recipe = {
        "trained_steps": trained,  # where each stage's checkpoint stood (a --minutes stop can end before the total)
        "steps": vs.DEFAULT_STEPS, "max_sequence_length": vs.MAX_SEQUENCE_LENGTH, "guidance": None,
        "scheduler": {"shift": vs.SHIFT}, "size": f"{vs.SIZE}x{vs.SIZE}", "frames": list(vs.FRAMES),
        "settings": asdict(settings), "logs": logs, **(info or {}),
    }
    (out / "training.json").write_text(json.dumps(recipe, indent=1) + "\n")
    logger.info("exported %s (%.1f MB)", out, sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6)
    return out


def run(stage: str, out: Path, cache: Path, minutes: float | None, settings: VideoSettings) -> bool:
    """Run `stage` ("decoder", "transformer", "tune", "export" or "all"); False when stopped by `minutes`."""
    torch.set_num_threads(settings.threads)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"settings-{stage}.json").write_text(json.dumps(asdict(settings), indent=2))
    started = time.perf_counter()
    remaining = lambda: None if minutes is None else minutes - (time.perf_counter() - started) / 60  # noqa: E731
    if stage in ("decoder", "all") and not train_decoder(settings, cache, remaining()):
        return False
    if stage in ("transformer", "all") and not train_transformer(settings, cache, remaining()):
        return False
    if stage == "tune" or (stage == "all" and settings.tune_steps > 0):
        tune_decoder(settings, cache)
    if stage in ("export", "all"):
        export(settings, cache, out)
    return True
