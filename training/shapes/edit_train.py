"""Train tiny-shapes-edit: the tiny-shapes transformer fine-tuned in FLUX.1 Kontext form, on a CPU.

Kontext form (diffusers' FluxKontextPipeline): the reference image is VAE-encoded, normalised with the
VAE's shift/scale, packed 2x2 like the noisy latents, and its tokens are appended after them; their
image ids are the noisy latents' ids with the first coordinate set to 1. The transformer's output for the
reference tokens is dropped. Training uses exactly that packing (`kontext_inputs`), so the stock pipeline
runs the result.

Stages: the edit folder's own VAE encoder first (training.shapes.edit_encoder; tiny-shapes' decoder, frozen),
then the transformer: a plain loss, then the object's centre and size weighted (`geometry_from`), then a
copy stage (`copy_from`: a fresh warm-up and cosine, the geometry weighted more).

Data (none on disk): a random training edit (training.shapes.edits; the three kinds equally often), a
random box, the analytic latents of the target scene (what the transformer learns to write, as in the
tiny-shapes transformer stage) and the source scene as the reference: the VAE encoder's latents of the
rendered source for `encoded_share` of each batch (what inference sees: the pipeline encodes pixels),
the analytic source latents for the rest. Rectified flow with the tiny-shapes recipe (half the noise levels
the exact 8-step sigmas, half logit-normal through the same shift; AdamW, warm-up, cosine to a tenth; EMA,
which ships), at 64x64. The text encoders, tokenizers and scheduler are tiny-shapes' own, frozen, and exported
byte for byte; the VAE is tiny-shapes' decoder with the edit encoder.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.shapes import edit_encoder, grammar
from training.shapes import edits as edit_grammar
from training.shapes import latents as semantic
from training.shapes.edit_fidelity import edit_fidelity
from training.shapes.sampling import call_transformer, image_ids, inference_sigmas, pack, shift_sigma, unpack
from training.shapes.training import load_state, log_jsonl, lr_factor, save_state, step_and_average

logger = logging.getLogger(__name__)

SOURCE_MODEL = Path("models/tiny-shapes")
DEFAULT_OUT = Path("models/tiny-shapes-edit")
DEFAULT_CACHE = Path(".cache/train-edit")
SIZE = 64  # trained at 64x64
MAX_SEQUENCE_LENGTH = 24  # the longest instruction is 20 T5 tokens with </s> (tests)
STEPS = 8
COPIED = ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


@dataclass
class EditSettings:
    seed: int = 0
    threads: int = 1
    steps: int = 9750
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    ema: float = 0.998
    discrete_sigma_share: float = 0.5
    encoded_share: float = 0.85  # references from the VAE encoder (the rest: analytic source latents)
    early_encoded_share: float = 0.75  # before geometry_from
    # The object's centre and size (latent channels 2-4) must be copied to about a pixel (IoU >= 0.8); from
    # this step on their squared error weighs `geometry_weight` times the other channels' (mean weight 1).
    geometry_weight: float = 8.0
    geometry_from: int = 1100
    # Stage 3, from copy_from on: a fresh warm-up and cosine at copy_lr, references encoded by the edit
    # folder's own encoder for copy_encoded_share of each batch, the geometry weighted copy_geometry_weight.
    copy_from: int = 1750
    copy_lr: float = 5e-4
    copy_warmup: int = 50
    copy_encoded_share: float = 0.9
    copy_geometry_weight: float = 12.0
    # Training on (`--stage transformer`, training.shapes.edit_continue): from step continue_from to steps, a
    # fresh warm-up and cosine at continue_lr in the copy stage, references from the cache's (continued) encoder.
    continue_from: int = 0
    continue_lr: float = 2.5e-4
    # The encoder stage (training.shapes.edit_encoder), before the transformer.
    encoder_steps: int = 1800
    encoder_batch: int = 32
    encoder_lr: float = 2e-3
    encoder_warmup: int = 50
    encoder_extra_blocks: int = 4
    encoder_geometry_weight: float = 10.0
    kind_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)  # colour, background, shape
    # The last stage (training.shapes.edit_tune): the decoder tuned on tune_pool latents the transformer writes.
    tune_pool: int = 2048
    tune_steps: int = 1200
    tune_lr: float = 5e-4
    checkpoint_every: int = 50
    eval_every: int = 200
    eval_n: int = 96


# --------------------------------------------------------------------------------------------------
# Components and the Kontext packing.
# --------------------------------------------------------------------------------------------------
def load_components(source: Path = SOURCE_MODEL):
    """tiny-shapes' transformer and VAE in float32."""
    from diffusers import AutoencoderTiny, FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(source / "transformer", torch_dtype=torch.float32)
    vae = AutoencoderTiny.from_pretrained(source / "vae", torch_dtype=torch.float32).eval().requires_grad_(False)
    return transformer, vae


@torch.no_grad()
def instruction_embeddings(cache: Path, source: Path = SOURCE_MODEL) -> dict[str, torch.Tensor]:
    """T5 embeddings, pooled CLIP embeddings and text ids of the 38 instructions, computed by the pipeline's own
    encode_prompt from tiny-shapes' stored (float16) encoders run in float32, as the exported folder runs."""
    path = cache / "instruction-embeddings.pt"
    if (cached := load_state(path)) is not None:
        return cached
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(str(source), transformer=None, vae=None, torch_dtype=torch.float32)
    embeds, pooled, text_ids = pipe.encode_prompt(
        list(edit_grammar.instructions()), prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    result = {"embeds": embeds.float(), "pooled": pooled.float(), "text_ids": text_ids.float()}
    save_state(path, result)
    return result


def reference_ids(width: int = SIZE, height: int = SIZE) -> torch.Tensor:
    """FluxKontextPipeline's ids of the reference tokens: the latent ids with the first coordinate 1."""
    ids = image_ids(width, height)
    ids[:, 0] = 1
    return ids


def kontext_inputs(noisy: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's image tokens and ids as FluxKontextPipeline builds them: reference tokens appended."""
    ids = torch.cat([image_ids(SIZE, SIZE), reference_ids()])
    return torch.cat([noisy, reference], dim=1), ids


def predict(transformer, noisy, reference, sigma, text, rows):
    """The velocity for the noisy tokens (the reference tokens' output dropped, as the pipeline does)."""
    hidden, ids = kontext_inputs(noisy, reference)
    out = call_transformer(transformer, hidden, sigma, text["embeds"][rows], text["pooled"][rows],
                           text["text_ids"], ids)
    return out[:, : noisy.shape[1]]


def _indices(prompts):
    return grammar.prompt_indices(list(prompts))


def scene_latents(prompts, boxes: torch.Tensor) -> torch.Tensor:
    return semantic.semantic_latents(*_indices(prompts), boxes, SIZE, SIZE)


def render(prompts, boxes: torch.Tensor) -> torch.Tensor:
    return grammar.render_batch(*_indices(prompts), SIZE, SIZE, boxes=boxes)


def normalise(vae, z: torch.Tensor) -> torch.Tensor:
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


@torch.no_grad()
def encode_reference(vae, images: torch.Tensor) -> torch.Tensor:
    """What FluxKontextPipeline._encode_vae_image makes of images in [-1, 1], packed."""
    return pack(normalise(vae, vae.encode(images).latents))


# --------------------------------------------------------------------------------------------------
# Sampling (the pipeline's loop, for quick evaluations during training).
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def sample_edits(transformer, vae, text, edits, boxes, generator, steps: int = STEPS) -> torch.Tensor:
    """Edited images (n, 3, 64, 64) in [-1, 1] for `edits` on sources drawn in `boxes`."""
    reference = encode_reference(vae, render([e.source for e in edits], boxes))
    rows = torch.tensor([edit_grammar.instructions().index(e.instruction) for e in edits])
    noisy = pack(torch.randn((len(edits), semantic.CHANNELS, SIZE // 4, SIZE // 4), generator=generator))
    sigmas = torch.cat([inference_sigmas(steps), torch.zeros(1)])
    for i in range(steps):
        v = predict(transformer, noisy, reference, sigmas[i].expand(len(edits)), text, rows)
        noisy = noisy + (sigmas[i + 1] - sigmas[i]) * v
    z = unpack(noisy, SIZE, SIZE) / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z).sample


def quick_accuracy(transformer, vae, text, n: int, seed: int = 7) -> dict[str, float]:
    """Share of `n` held-out edits the checker reads right (own loop, fixed seed), per kind and in all."""
    generator = torch.Generator().manual_seed(seed)
    pool = edit_grammar.held_out_edits()
    chosen = [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=generator)]
    boxes = grammar.sample_boxes(n, SIZE, SIZE, generator)
    results = grammar.to_pil(sample_edits(transformer, vae, text, chosen, boxes, generator))
    sources = grammar.to_pil(render([e.source for e in chosen], boxes))
    scores = [edit_fidelity(s, r, e) for s, r, e in zip(sources, results, chosen, strict=True)]
    out = {"held_out": round(sum(f.correct for f in scores) / n, 3)}
    for kind in edit_grammar.KINDS:
        mine = [f.correct for f in scores if f.kind == kind]
        out[kind] = round(sum(mine) / max(1, len(mine)), 3)
    return out


# --------------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------------
def geometry_weights(weight: float) -> torch.Tensor:
    """Per packed feature (channel c is features 4c..4c+3): `weight` on the centre and size channels (2-4),
    1 elsewhere, scaled to mean 1."""
    per_channel = torch.ones(semantic.CHANNELS)
    per_channel[2:5] = weight
    per_feature = per_channel.repeat_interleave(4)
    return per_feature / per_feature.mean()


class EditTraining:
    """Steps of draw a batch, learn from it; every checkpoint_every steps a checkpoint, every eval_every an
    evaluation of the EMA on held-out edits. Resumes from cache/edit.ckpt."""

    def __init__(self, settings: EditSettings, cache: Path, vae):
        self.settings, self.cache, self.vae = settings, cache, vae
        self.text = instruction_embeddings(cache)
        self.transformer, _ = load_components()
        self.ema, _ = load_components()
        self.ema.eval().requires_grad_(False)
        self.parameters = list(self.transformer.parameters())
        self.optimizer = torch.optim.AdamW(self.parameters, lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(settings.seed + 31)
        self.step, self.elapsed, self.losses = 0, 0.0, []
        self.by_kind = [[e for e in edit_grammar.training_edits() if e.kind == k] for k in edit_grammar.KINDS]
        self.rows = {text: i for i, text in enumerate(edit_grammar.instructions())}
        self.disc_sigmas = inference_sigmas()
        self.loss_weights = geometry_weights(settings.geometry_weight)
        self.copy_weights = geometry_weights(settings.copy_geometry_weight)
        if (state := load_state(cache / "edit.ckpt")) is not None:
            self.transformer.load_state_dict(state["model"])
            self.ema.load_state_dict(state["ema"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.elapsed = state["step"], state["elapsed"]
            self.generator.set_state(state["generator"])
            logger.info("resuming the edit transformer at step %d", self.step)

    def draw_batch(self):
        """(instruction rows, sigma, clean target tokens, reference tokens, noise)."""
        settings, g = self.settings, self.generator
        n = settings.batch
        kinds = torch.multinomial(torch.tensor(settings.kind_weights), n, replacement=True, generator=g)
        chosen = [self.by_kind[int(k)][int(torch.randint(0, len(self.by_kind[int(k)]), (1,), generator=g))]
                  for k in kinds]
        boxes = grammar.sample_boxes(n, SIZE, SIZE, g)
        sources = [e.source for e in chosen]
        x0 = pack(normalise(self.vae, scene_latents([e.target for e in chosen], boxes)))
        analytic = pack(normalise(self.vae, scene_latents(sources, boxes)))
        encoded = encode_reference(self.vae, render(sources, boxes))
        share = (settings.early_encoded_share, settings.encoded_share, settings.copy_encoded_share)[self.stage]
        use_encoded = (torch.rand(n, generator=g) < share).view(-1, 1, 1)
        reference = torch.where(use_encoded, encoded, analytic)
        discrete = torch.rand(n, generator=g) < settings.discrete_sigma_share
        continuous = shift_sigma(torch.sigmoid(torch.randn(n, generator=g)))
        picked = self.disc_sigmas[torch.randint(0, len(self.disc_sigmas), (n,), generator=g)]
        sigma = torch.where(discrete, picked, continuous)
        rows = torch.tensor([self.rows[e.instruction] for e in chosen])
        return rows, sigma, x0, reference, torch.randn(x0.shape, generator=g)

    def learn(self, rows, sigma, x0, reference, noise, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        s = sigma.view(-1, 1, 1)
        pred = predict(self.transformer, (1 - s) * x0 + s * noise, reference, sigma, self.text, rows)
        if self.stage == 0:
            loss = F.mse_loss(pred, noise - x0)
        else:
            weights = self.loss_weights if self.stage == 1 else self.copy_weights
            loss = ((pred - (noise - x0)).pow(2) * weights).mean()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        step_and_average(self.optimizer, self.parameters, self.ema, self.settings.ema, self.step)
        self.step += 1
        self.losses.append(loss.item())

    @property
    def stage(self) -> int:
        """0: plain loss, 1: the geometry weighted, 2: the copy stage (see EditSettings)."""
        return int(self.step >= self.settings.geometry_from) + int(self.step >= self.settings.copy_from)

    def learning_rate(self) -> float:
        """The cosine over stages 1-2 (to copy_from), then a fresh warm-up and cosine for the copy stage."""
        s = self.settings
        if s.continue_from and self.step >= s.continue_from:
            return s.continue_lr * lr_factor(self.step - s.continue_from, s.steps - s.continue_from, s.copy_warmup)
        if self.stage < 2:
            return s.lr * lr_factor(self.step, min(s.copy_from, s.steps), s.warmup)
        return s.copy_lr * lr_factor(self.step - s.copy_from, s.steps - s.copy_from, s.copy_warmup)

    def run(self, minutes: float | None) -> bool:
        """Train until the last step or, past `minutes`, the next checkpoint. True when finished."""
        settings = self.settings
        started = time.perf_counter()
        self.transformer.train()
        bar = tqdm(total=settings.steps, initial=self.step, desc="edit transformer", dynamic_ncols=True)
        while self.step < settings.steps:
            lr = self.learning_rate()
            self.learn(*self.draw_batch(), lr)
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(self.losses[-50:]):.4f}", lr=f"{lr:.1e}")
            if self.step % settings.checkpoint_every == 0 or self.step == settings.steps:
                self.elapsed += time.perf_counter() - started
                started = time.perf_counter()
                self.log(bar)
                self.checkpoint()
                if minutes is not None and self.elapsed > minutes * 60 and self.step < settings.steps:
                    break
        bar.close()
        return self.step >= settings.steps

    def log(self, bar) -> None:
        settings = self.settings
        record = {"step": self.step, "loss": float(np.mean(self.losses[-settings.checkpoint_every:])),
                  "minutes": round(self.elapsed / 60, 2)}
        if self.step % settings.eval_every == 0 or self.step == settings.steps:
            record |= quick_accuracy(self.ema, self.vae, self.text, settings.eval_n)
        bar.write(f"edit step {self.step}: {record}")
        log_jsonl(self.cache / "edit-log.jsonl", record)

    def checkpoint(self) -> None:
        save_state(self.cache / "edit.ckpt", {
            "model": self.transformer.state_dict(), "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(), "step": self.step, "elapsed": self.elapsed,
            "generator": self.generator.get_state(), "settings": asdict(self.settings)})


# --------------------------------------------------------------------------------------------------
# Export.
# --------------------------------------------------------------------------------------------------
def save_vae(vae, folder: Path) -> None:
    """The VAE in float16 safetensors. AutoencoderTiny registers block_out_channels (the pipeline's
    vae_scale_factor reads it) but does not take it: left in config.json it makes every load warn."""
    vae.to(torch.float16).save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    config.pop("block_out_channels", None)
    config.pop("_name_or_path", None)  # a VAE loaded from a folder (training on) names where it was read
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    vae.to(torch.float32)


def export(cache: Path, out: Path, vae, source: Path = SOURCE_MODEL, info: dict | None = None) -> Path:
    """models/tiny-shapes-edit: tiny-shapes' frozen parts copied byte for byte, the EMA transformer and `vae`
    (the edit encoder, tiny-shapes' decoder) in float16 safetensors, a model_index.json naming
    FluxKontextPipeline and training.json."""
    state = load_state(cache / "edit.ckpt")
    if state is None:
        raise FileNotFoundError(f"no edit checkpoint in {cache}; train first")
    transformer, _ = load_components(source)
    transformer.load_state_dict(state["ema"])
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in COPIED:
        shutil.copytree(source / name, out / name)
    transformer.to(torch.float16).save_pretrained(out / "transformer", safe_serialization=True)
    save_vae(vae, out / "vae")
    index = json.loads((source / "model_index.json").read_text())
    index["_class_name"] = "FluxKontextPipeline"
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    recipe = json.loads((source / "training.json").read_text())
    recipe = {
        "steps": STEPS, "max_sequence_length": MAX_SEQUENCE_LENGTH, "guidance": None,
        "scheduler": recipe["scheduler"], "buckets": [f"{SIZE}x{SIZE}"],
        "call": {"_auto_resize": False, "max_area": "width * height of the output"},
        "init": str(source), "settings": state["settings"], "trained_steps": state["step"],
        "train_minutes": round(state["elapsed"] / 60, 1), **(info or {}),
    }
    (out / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    logger.info("exported %s (%.1f MB)", out, total / 1e6)
    return out


def run(out: Path = DEFAULT_OUT, cache: Path = DEFAULT_CACHE, minutes: float | None = None,
        settings: EditSettings | None = None, resume: bool = True, stage: str = "all") -> bool:
    """Train (or resume), then export when finished. False when training stopped early (--minutes)."""
    settings = settings or EditSettings()
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    cache = Path(cache)
    if not resume:
        (cache / "edit.ckpt").unlink(missing_ok=True)
        (cache / "edit-log.jsonl").unlink(missing_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "settings.json").write_text(json.dumps(asdict(settings), indent=2))
    _, tiny_vae = load_components()
    if stage == "export":
        export(cache, out, edit_encoder.load_trained(tiny_vae, settings, cache))
        return True
    started = time.perf_counter()
    vae, finished = edit_encoder.train_encoder(tiny_vae, settings, cache, minutes)
    if finished:
        left = None if minutes is None else max(0.0, minutes - (time.perf_counter() - started) / 60)
        finished = EditTraining(settings, cache, vae).run(left)
    if stage == "all" and finished:
        export(cache, out, vae)
    return finished

