"""The embedded model's LoRA styles: what each adapter does to a scene, and how the checker reads it.

Each style is defined once here, so the training data (training/shapes/lora_train.py), the checker and
the tests agree on what "drawn as the LoRA implies" means:

- swap:   the object and background colours exchanged ("a red circle on a blue background" -> a blue
          circle on red);
- small:  the object at the small end of the grammar's sizes, side 35-42 % of the image's shorter side
          (instead of 35-65 %); the embedded decoder draws no clean shape below 35 % (measured: 37 % of
          exact half-size latents decode to a readable shape), so "small" stops there;
- corner: the object's centre in the top-left quarter of the image.

`check(image, prompt, style)` scores an image against the prompt the style implies: colours and shape
from training.shapes.fidelity, plus the style's geometry (the object's bounding box).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from training.shapes import fidelity, grammar
from training.shapes.grammar import Prompt

STYLES: tuple[str, ...] = ("swap", "small", "corner")
SMALL_RANGE = (0.35, 0.42)  # object side / shorter image side under "small"
# The checker's bound on a "small" object's box (soft decoded edges grow a box by a pixel or two).
SMALL_MAX_BOX = 0.47


def implied(prompt: Prompt | str, style: str | None) -> Prompt:
    """The prompt an image made with `style` should be checked against (colours only; geometry apart)."""
    prompt = prompt if isinstance(prompt, Prompt) else grammar.parse_prompt(prompt)
    if prompt is None:
        raise ValueError("not a shapes prompt")
    if style == "swap":
        return Prompt(prompt.background, prompt.shape, prompt.colour)
    return prompt


def boxes(style: str | None, n: int, width: int, height: int, generator: torch.Generator) -> torch.Tensor:
    """n bounding boxes (x0, y0, side) of scenes drawn in `style` (training data)."""
    if style not in ("small", "corner"):
        return grammar.sample_boxes(n, width, height, generator)
    short = min(width, height)
    if style == "small":
        lo, hi = round(SMALL_RANGE[0] * short), round(SMALL_RANGE[1] * short)
        side = torch.randint(lo, hi + 1, (n,), generator=generator)
        u = torch.rand(n, 2, generator=generator)
        x0 = (u[:, 0] * (width - side + 1)).floor().long()
        y0 = (u[:, 1] * (height - side + 1)).floor().long()
        return torch.stack([x0, y0, side], dim=1)
    side = grammar.sample_boxes(n, width, height, generator)[:, 2]
    # Centre anywhere in the top-left quarter at least 2 pixels in (decoded edges are soft), box inside the image.
    u = torch.rand(n, 2, generator=generator)
    x0 = (u[:, 0] * ((width - side) // 2 - 1)).floor().long()
    y0 = (u[:, 1] * ((height - side) // 2 - 1)).floor().long()
    return torch.stack([x0, y0, side], dim=1)


def render(prompt: Prompt | str, style: str | None, width: int = 64, height: int = 64, seed: int = 0) -> Image.Image:
    """Ground truth for a prompt drawn in `style`."""
    generator = torch.Generator().manual_seed(seed)
    shown = implied(prompt, style)
    colours, shapes, backgrounds = grammar.prompt_indices([shown])
    box = boxes(style, 1, width, height, generator)
    return grammar.to_pil(grammar.render_batch(colours, shapes, backgrounds, width, height, boxes=box))[0]


@dataclass(frozen=True)
class StyleFidelity:
    base: fidelity.Fidelity  # colours and shape against the implied prompt
    geometry_right: bool
    note: str = ""

    @property
    def correct(self) -> bool:
        return self.base.correct and self.geometry_right


def _object_box(image: Image.Image, background: str) -> tuple[int, int, int, int] | None:
    """(x0, y0, width, height) of the largest blob far from the background colour."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    bg = np.array(grammar.COLOURS[background], dtype=np.float32)
    others = [np.linalg.norm(np.array(c, np.float32) - bg) for n, c in grammar.COLOURS.items() if n != background]
    far = np.linalg.norm(pixels - bg, axis=2) > min(others) / 2
    if not far.any():
        return None
    obj = fidelity._largest_component(far)
    rows, cols = np.flatnonzero(obj.any(axis=1)), np.flatnonzero(obj.any(axis=0))
    return int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1), int(rows[-1] - rows[0] + 1)


def check(image: Image.Image, prompt: Prompt | str, style: str | None) -> StyleFidelity:
    """Score an image made with `style` (None: no LoRA) against what the style implies."""
    if style is not None and style not in STYLES:
        raise ValueError(f"unknown style {style!r}: one of {', '.join(STYLES)}")
    expected = implied(prompt, style)
    base = fidelity.check(image, expected)  # "small" starts where the plain checker's sizes do
    if style in (None, "swap") or base.background is None:
        return StyleFidelity(base, base.background is not None)
    box = _object_box(image, base.background)
    if box is None:
        return StyleFidelity(base, False, "no object")
    x0, y0, w, h = box
    width, height = image.size
    if style == "small":
        side = max(w, h) / min(width, height)
        return StyleFidelity(base, side <= SMALL_MAX_BOX, f"box side {side:.2f} of the shorter side")
    cx, cy = x0 + w / 2, y0 + h / 2
    return StyleFidelity(base, cx <= width / 2 and cy <= height / 2, f"box centre ({cx:.1f}, {cy:.1f})")


def score(images, prompts, style: str | None) -> float:
    """Share of images drawn as `style` implies for their prompts."""
    return sum(check(i, p, style).correct for i, p in zip(images, prompts, strict=True)) / max(len(images), 1)
