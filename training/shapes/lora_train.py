"""Train the embedded model's LoRA styles (training/shapes/styles.py) and write them as diffusers LoRAs.

Each style is a rank-4 LoRA on the transformer's attention projections, trained with the base model's own
rectified-flow recipe (training/shapes/train.py) on analytic latents of scenes drawn in the style, with
the prompt's own text embedding: "a red circle on a blue background" + swap learns to draw a blue circle on
red. The base weights stay frozen, so with no adapter the model is unchanged. Fixed seeds, one thread,
minutes on a CPU; `python -m training.train_loras` writes models/tiny-shapes-loras/<style>/.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.shapes import grammar, sampling, styles, train
from training.shapes import latents as semantic

logger = logging.getLogger(__name__)

DEFAULT_MODEL = Path("models/tiny-shapes")
DEFAULT_OUT = Path("models/tiny-shapes-loras")
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# Every style targets the same layers, so any of them can be hot-swapped into an engine that loaded another:
# every linear layer of the blocks and the output projection. Attention alone learnt swap to 4 % in 100 steps
# (the colours also reach the image through the modulation layers).
TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                  "proj_mlp", "proj_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
                  "norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear")


# Training rounds per style (steps each; a round restarts the schedule from the previous round's adapter with
# new data). swap needs the most: after one round 62 % of held-out prompts came out swapped.
STYLE_ROUNDS: dict[str, tuple[int, ...]] = {"swap": (300, 300), "small": (150, 150, 150, 300), "corner": (150,)}


@dataclass
class LoraSettings:
    seed: int = 0
    rank: int = 4
    alpha: float = 4.0
    steps: int | None = None  # one round of this many steps instead of STYLE_ROUNDS
    batch: int = 32  # 64x64 images (64 tokens each)
    lr: float = 3e-3
    warmup: int = 30
    threads: int = 1
    eval_seeds: int = 4  # per held-out prompt (24 prompts)


def load_pipeline(model: Path = DEFAULT_MODEL):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def _embeddings(pipe) -> dict[str, torch.Tensor]:
    texts = [p.text for p in grammar.all_prompts()]
    embeds, pooled, text_ids = pipe.encode_prompt(texts, prompt_2=None, max_sequence_length=train.MAX_SEQUENCE_LENGTH)
    return {"embeds": embeds.float(), "pooled": pooled.float(), "text_ids": text_ids.float()}


def _styled_latents(style: str, prompt_ids: list[int], width: int, height: int, generator) -> torch.Tensor:
    prompts = [styles.implied(grammar.all_prompts()[i], style) for i in prompt_ids]
    colours, shapes, backgrounds = grammar.prompt_indices(prompts)
    boxes = styles.boxes(style, len(prompts), width, height, generator)
    z = semantic.semantic_latents(colours, shapes, backgrounds, boxes, width, height)
    shift, scale = train.latent_scaling()
    return (z - shift) * scale


def train_style(pipe, style: str, settings: LoraSettings, text: dict, init: Path | None = None,
                first_round: int = 0) -> dict[str, torch.Tensor]:
    """Train one style's LoRA on `pipe.transformer` (left without an adapter) and return its state dict. `init`:
    an adapter file to go on from at round `first_round` (what an interrupted run had written)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    transformer = pipe.transformer
    torch.manual_seed(settings.seed)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, init_lora_weights="gaussian",
                        target_modules=list(TARGET_MODULES))
    transformer.add_adapter(config, adapter_name=style)
    transformer.set_adapter(style)
    if init is not None:
        from safetensors.torch import load_file

        state = {k.removeprefix("transformer."): v for k, v in load_file(str(init)).items()}
        set_peft_model_state_dict(transformer, state, adapter_name=style)
    parameters = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in transformer.parameters():
        p.requires_grad_(False)
    for p in parameters:
        p.requires_grad_(True)
    rounds = (settings.steps,) if settings.steps else STYLE_ROUNDS[style]
    for round_index in range(first_round, len(rounds)):
        _train_round(transformer, parameters, style, settings, text, rounds[round_index], round_index)
    transformer.eval()
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer, adapter_name=style).items()}
    transformer.delete_adapters(style)
    for p in transformer.parameters():
        p.requires_grad_(False)
    return state


def _train_round(transformer, parameters, style: str, settings: LoraSettings, text: dict, steps: int,
                 round_index: int) -> None:
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 100 + styles.STYLES.index(style) + 1000 * round_index)
    training_ids = [grammar.all_prompts().index(p) for p in grammar.training_prompts()]
    disc_sigmas = sampling.inference_sigmas()
    img_ids = sampling.image_ids(64, 64)
    transformer.train()
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup) * (0.5 + 0.5 * np.cos(np.pi * step / steps))
        for g in optimizer.param_groups:
            g["lr"] = lr
        picks = torch.randint(0, len(training_ids), (settings.batch,), generator=generator)
        prompt_ids = [training_ids[int(i)] for i in picks]
        x0 = sampling.pack(_styled_latents(style, prompt_ids, 64, 64, generator))
        discrete = torch.rand(settings.batch, generator=generator) < 0.5
        continuous = sampling.shift_sigma(torch.sigmoid(torch.randn(settings.batch, generator=generator)))
        picked = disc_sigmas[torch.randint(0, len(disc_sigmas), (settings.batch,), generator=generator)]
        sigma = torch.where(discrete, picked, continuous)
        noise = torch.randn(x0.shape, generator=generator)
        s = sigma.view(-1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        ids = torch.tensor(prompt_ids)
        pred = sampling.call_transformer(transformer, xt, sigma, text["embeds"][ids], text["pooled"][ids],
                                      text["text_ids"], img_ids)
        loss = F.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            logger.info("%s round %d step %d: loss %.4f (%.0f s)", style, round_index + 1, step + 1,
                        np.mean(losses[-50:]), time.perf_counter() - start)


def save(state: dict[str, torch.Tensor], out: Path) -> Path:
    from diffusers import FluxPipeline

    out.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(str(out), transformer_lora_layers=state, weight_name=WEIGHT_NAME)
    return out / WEIGHT_NAME


def evaluate_style(pipe, folder: Path, style: str | None, seeds_each: int, width: int = 64, height: int = 64,
                   seed: int = 7) -> float:
    """Share of held-out prompts (seeds_each seeds each) the checker reads as drawn in `style` (None: no LoRA)."""
    from training.shapes.evaluate import generate, held_out_cases

    if style is not None:
        pipe.load_lora_weights(str(folder / style), weight_name=WEIGHT_NAME, adapter_name=style)
    try:
        prompts, seeds = held_out_cases(seeds_each, seed)
        images = generate(pipe, prompts, seeds, width, height)
        return styles.score(images, prompts, style)
    finally:
        if style is not None:
            pipe.delete_adapters(style)


def run(names: tuple[str, ...], model: Path, out: Path, settings: LoraSettings, go_on_from: int = 0) -> dict:
    """Train `names` into `out`/<style>; `go_on_from` > 0: start at that round from the adapter already there."""
    torch.set_num_threads(settings.threads)
    pipe = load_pipeline(model)
    text = _embeddings(pipe)
    report = {"settings": asdict(settings), "rounds": {s: settings.steps or STYLE_ROUNDS[s] for s in names},
              "styles": {}}
    for style in names:
        start = time.perf_counter()
        init = out / style / WEIGHT_NAME if go_on_from else None
        state = train_style(pipe, style, settings, text, init, go_on_from)
        save(state, out / style)
        minutes = (time.perf_counter() - start) / 60
        score = evaluate_style(pipe, out, style, settings.eval_seeds)
        report["styles"][style] = {"train_minutes": round(minutes, 2), "held_out_64": round(score, 3)}
        logger.info("%s: %.1f min, held-out fidelity at 64x64 %.1f %%", style, minutes, 100 * score)
    report["no_lora_held_out_64"] = round(evaluate_style(pipe, out, None, settings.eval_seeds), 3)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
