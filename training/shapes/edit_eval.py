"""Score edits through the stock diffusers pipelines: tiny-shapes-edit under FluxKontextPipeline, and the
img2img baseline (FluxImg2ImgPipeline over tiny-shapes' own components, the whole target prompt).

Everything goes through `from_pretrained(folder)` and `pipe(...)`, so the numbers are what a server would
get. The edits' sources are ground-truth renders at 64x64 (a seeded random box per edit); the checker is
training.shapes.edit_fidelity. Kontext is called with `_auto_resize=False` and `max_area` = the output's
area, so the 64x64 reference stays 64x64 (64 output tokens + 64 reference tokens); without them the
pipeline resizes the reference to a ~1024x1024 Kontext resolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.shapes import grammar
from training.shapes.edit_fidelity import EditFidelity, edit_fidelity
from training.shapes.edit_train import (
    DEFAULT_OUT,
    MAX_SEQUENCE_LENGTH,
    SIZE,
    SOURCE_MODEL,
    STEPS,
    render,
    scene_latents,
)
from training.shapes.edits import KINDS, Edit

BASELINE_STRENGTH = 0.6


def load_edit_pipeline(folder: Path | str = DEFAULT_OUT, dtype: torch.dtype = torch.float32):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(str(folder), dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_img2img_baseline(folder: Path | str = SOURCE_MODEL, dtype: torch.dtype = torch.float32):
    from diffusers import FluxImg2ImgPipeline

    pipe = FluxImg2ImgPipeline.from_pretrained(str(folder), dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def source_boxes(edits: list[Edit], seed: int) -> torch.Tensor:
    return grammar.sample_boxes(len(edits), SIZE, SIZE, torch.Generator().manual_seed(seed))


def sources_for(edits: list[Edit], seed: int):
    """Ground-truth 64x64 renders of each edit's source, in seeded random boxes (PIL images)."""
    return grammar.to_pil(render([e.source for e in edits], source_boxes(edits, seed)))


def exact_references(pipe, edits: list[Edit], boxes: torch.Tensor) -> torch.Tensor:
    """The sources' exact (analytic) latents, normalised as the pipeline normalises encoded ones: passed as
    `image` (12 channels), FluxKontextPipeline uses them as the reference latents without the VAE encoder."""
    z = scene_latents([e.source for e in edits], boxes)
    return (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor


def run_kontext(pipe, edits: list[Edit], sources, seed: int, batch: int = 64):
    """Edited images: the instruction and the source through FluxKontextPipeline, one generator per edit.
    `sources`: PIL images (encoded by the pipeline's VAE) or a tensor of reference latents."""
    images = []
    for start in range(0, len(edits), batch):
        chunk = edits[start : start + batch]
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        images += pipe(
            image=sources[start : start + batch], prompt=[e.instruction for e in chunk], width=SIZE, height=SIZE,
            max_area=SIZE * SIZE, _auto_resize=False, num_inference_steps=STEPS,
            max_sequence_length=MAX_SEQUENCE_LENGTH, generator=generators,
        ).images
    return images


def run_img2img(pipe, edits: list[Edit], sources, seed: int, batch: int = 64, strength: float = BASELINE_STRENGTH):
    """The baseline: the source re-noised to `strength` and denoised towards the whole target prompt."""
    images = []
    for start in range(0, len(edits), batch):
        chunk = edits[start : start + batch]
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))]
        images += pipe(
            prompt=[e.target.text for e in chunk], image=sources[start : start + batch], strength=strength,
            width=SIZE, height=SIZE, num_inference_steps=STEPS, max_sequence_length=MAX_SEQUENCE_LENGTH,
            generator=generators,
        ).images
    return images


@dataclass(frozen=True)
class EditScores:
    scores: tuple[EditFidelity, ...]

    @property
    def accuracy(self) -> float:
        return sum(s.correct for s in self.scores) / max(1, len(self.scores))

    def per_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (right, total)."""
        return {k: (sum(s.correct for s in self.scores if s.kind == k), sum(s.kind == k for s in self.scores))
                for k in KINDS}

    def attributes_right(self) -> float:
        return sum(s.attributes_right for s in self.scores) / max(1, len(self.scores))

    def iou_median(self) -> float:
        values = [s.iou for s in self.scores if not np.isnan(s.iou)]
        return float(np.median(values)) if values else float("nan")


def score_edits(edits: list[Edit], sources, results) -> EditScores:
    return EditScores(tuple(edit_fidelity(s, r, e) for e, s, r in zip(edits, sources, results, strict=True)))
