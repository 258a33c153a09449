"""The shapes grammar: vocabulary, the 168 prompts, the held-out list and the ground-truth renderer.

Everything here is deterministic and needs no model, so the training data (rendered on the fly, an
infinite supply), the fidelity checker and the tests all agree on one definition of what a prompt means.

Geometry, shared by every shape: a square bounding box of side `s` (35-65 % of the image's shorter side,
whole pixels) placed anywhere fully inside the image. The circle is inscribed in the box, the square fills
it, the triangle is upright and isosceles (base = bottom edge of the box, apex at the middle of its top
edge). Edges are hard (pixel centres inside the shape take the object colour), colours are flat.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from PIL import Image

# fmt: off
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
# fmt: on
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZE_RANGE = (0.35, 0.65)  # object side / diameter as a fraction of the image's shorter side
PROMPT_TEMPLATE = "a {colour} {shape} on a {background} background"


@dataclass(frozen=True, order=True)
class Prompt:
    colour: str
    shape: str
    background: str

    def __post_init__(self) -> None:
        if self.colour not in COLOURS or self.background not in COLOURS or self.shape not in SHAPES:
            raise ValueError(f"not in the grammar: {self!r}")
        if self.colour == self.background:
            raise ValueError(f"object and background share the colour {self.colour!r}")

    @property
    def text(self) -> str:
        return PROMPT_TEMPLATE.format(colour=self.colour, shape=self.shape, background=self.background)

    def __str__(self) -> str:
        return self.text


@cache
def all_prompts() -> tuple[Prompt, ...]:
    """The 8 x 7 x 3 = 168 prompts, in a fixed order (colour, background, shape)."""
    return tuple(
        Prompt(colour, shape, background)
        for colour in COLOUR_NAMES
        for background in COLOUR_NAMES
        if background != colour
        for shape in SHAPES
    )


# Never trained on; reported separately to measure generalisation to unseen combinations. 24 prompts: every
# (colour, shape) pair is held out with exactly one background (the colour's index + 1, 3, 5 for circle,
# square, triangle), and every background three times, so each pair and each colour-background pair still
# appears in training with other backgrounds/shapes. Written out (not computed) so the list cannot drift.
# fmt: off
HELD_OUT: tuple[Prompt, ...] = tuple(Prompt(c, s, b) for c, s, b in (
    ("red", "circle", "green"), ("red", "square", "yellow"), ("red", "triangle", "orange"),
    ("green", "circle", "blue"), ("green", "square", "purple"), ("green", "triangle", "white"),
    ("blue", "circle", "yellow"), ("blue", "square", "orange"), ("blue", "triangle", "black"),
    ("yellow", "circle", "purple"), ("yellow", "square", "white"), ("yellow", "triangle", "red"),
    ("purple", "circle", "orange"), ("purple", "square", "black"), ("purple", "triangle", "green"),
    ("orange", "circle", "white"), ("orange", "square", "red"), ("orange", "triangle", "blue"),
    ("white", "circle", "black"), ("white", "square", "green"), ("white", "triangle", "yellow"),
    ("black", "circle", "red"), ("black", "square", "blue"), ("black", "triangle", "purple"),
))
# fmt: on


@cache
def training_prompts() -> tuple[Prompt, ...]:
    held = set(HELD_OUT)
    return tuple(p for p in all_prompts() if p not in held)


_PROMPT_RE = re.compile(r"an? (\w+) (\w+) on an? (\w+) background")


def parse_prompt(text: str) -> Prompt | None:
    """The Prompt a text means, or None outside the grammar. Case, extra spaces, a final full stop and
    "an" for "a" are forgiven; nothing else is."""
    normalised = " ".join(str(text).lower().split()).rstrip(".").strip()
    match = _PROMPT_RE.fullmatch(normalised)
    if match is None:
        return None
    colour, shape, background = match.groups()
    try:
        return Prompt(colour, shape, background)
    except ValueError:
        return None


def _as_prompt(prompt: Prompt | str) -> Prompt:
    if isinstance(prompt, Prompt):
        return prompt
    parsed = parse_prompt(prompt)
    if parsed is None:
        raise ValueError(f"not a shapes prompt: {prompt!r}")
    return parsed


# --------------------------------------------------------------------------------------------------
# Rendering. One batched torch implementation serves both the training data and `render`.
# --------------------------------------------------------------------------------------------------
def sample_boxes(n: int, width: int, height: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """n random bounding boxes (x0, y0, side) in whole pixels, fully inside a width x height image."""
    short = min(width, height)
    lo, hi = round(SIZE_RANGE[0] * short), round(SIZE_RANGE[1] * short)
    side = torch.randint(lo, hi + 1, (n,), generator=generator)
    u = torch.rand(n, 2, generator=generator)
    x0 = (u[:, 0] * (width - side + 1)).floor().long()
    y0 = (u[:, 1] * (height - side + 1)).floor().long()
    return torch.stack([x0, y0, side], dim=1)


def shape_masks(shapes: torch.Tensor, boxes: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Boolean masks (n, height, width): pixel centres inside each shape (index into SHAPES) and box."""
    x = torch.arange(width, dtype=torch.float32).view(1, 1, width) + 0.5
    y = torch.arange(height, dtype=torch.float32).view(1, height, 1) + 0.5
    x0, y0, side = (boxes[:, i].float().view(-1, 1, 1) for i in range(3))
    u = (x - x0) / side  # box coordinates in [0, 1]
    v = (y - y0) / side
    inside_box = (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    circle = (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    triangle = (u - 0.5).abs() <= v / 2  # apex (0.5, 0), base on v = 1
    kind = shapes.view(-1, 1, 1)
    inside = torch.where(kind == 0, circle, torch.where(kind == 1, inside_box, triangle))
    return inside & inside_box


@cache
def palette() -> torch.Tensor:
    """(8, 3) colours in [-1, 1], in COLOUR_NAMES order (the VAE's pixel range)."""
    return torch.tensor([COLOURS[c] for c in COLOUR_NAMES], dtype=torch.float32) / 127.5 - 1


def render_batch(
    colours: torch.Tensor,
    shapes: torch.Tensor,
    backgrounds: torch.Tensor,
    width: int,
    height: int,
    generator: torch.Generator | None = None,
    boxes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Images (n, 3, height, width) in [-1, 1] for index tensors into COLOUR_NAMES / SHAPES."""
    if boxes is None:
        boxes = sample_boxes(len(colours), width, height, generator)
    mask = shape_masks(shapes, boxes, width, height).unsqueeze(1)
    fg = palette()[colours].view(-1, 3, 1, 1)
    bg = palette()[backgrounds].view(-1, 3, 1, 1)
    return torch.where(mask, fg, bg)


def prompt_indices(prompts: list[Prompt] | tuple[Prompt, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    colours = torch.tensor([COLOUR_NAMES.index(p.colour) for p in prompts])
    shapes = torch.tensor([SHAPES.index(p.shape) for p in prompts])
    backgrounds = torch.tensor([COLOUR_NAMES.index(p.background) for p in prompts])
    return colours, shapes, backgrounds


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[-1, 1] float images (n, 3, h, w) -> PIL RGB images."""
    arrays = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]


def render(
    prompt: Prompt | str, width: int = 64, height: int = 64, rng: int | np.random.Generator | None = None
) -> Image.Image:
    """Ground truth for one prompt: a random box drawn from `rng` (a seed or numpy Generator)."""
    prompt = _as_prompt(prompt)
    if isinstance(rng, np.random.Generator):
        seed = int(rng.integers(0, 2**62))
    else:
        seed = int(np.random.default_rng(rng).integers(0, 2**62))
    generator = torch.Generator().manual_seed(seed)
    colours, shapes, backgrounds = prompt_indices([prompt])
    return to_pil(render_batch(colours, shapes, backgrounds, width, height, generator))[0]
