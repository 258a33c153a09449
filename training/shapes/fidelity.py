"""Fidelity checker: read background colour, object colour and shape back from the pixels alone.

It grades the embedded model (tests, bench, UI) without any model of its own, so it must be right on the
ground truth (>= 99.5 % of renders at every bucket size) and must not be fooled by images that are not a
flat object on a flat background (random noise scores ~0). The steps:

1. background: the palette colour nearest the per-channel median of a 2-pixel border ring (the object
   covers well under half of the ring even in a corner);
2. object: pixels farther from the background colour than half the gap to its nearest other palette
   colour, then the largest 4-connected component;
3. object colour: the palette colour nearest the median of the component's pixels;
4. shape, from the component's bounding box (all three shapes have a square box): fill ratio (square 1,
   circle 0.785, triangle 0.5) and taper, the mean row width in the top quarter-band over the bottom one
   (upright triangle ~0.33, circle and square ~1).

An image that is not clean (background or object colour far from every palette colour, the object too
small or too large, a box far from square, many stray pixels) gets None for what cannot be read, so it
can never be scored correct by chance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from PIL import Image

from training.shapes.grammar import COLOURS, SIZE_RANGE, Prompt, parse_prompt

logger = logging.getLogger(__name__)

_NAMES = tuple(COLOURS)
_RGB = np.array([COLOURS[c] for c in _NAMES], dtype=np.float32)
# A colour farther than this (RGB Euclidean) from every palette entry is not a palette colour. The closest
# pair (yellow, orange) is 71 apart, so nearest-colour answers within this radius are unambiguous enough.
_MAX_COLOUR_DISTANCE = 60.0
# Object area relative to the image's shorter side squared: the smallest triangle is 0.5 * 0.35^2 = 0.061,
# the largest square 0.65^2 = 0.42; generous margins for soft generated edges.
_MIN_AREA = 0.5 * 0.5 * SIZE_RANGE[0] ** 2
_MAX_AREA = 1.3 * SIZE_RANGE[1] ** 2
_MAX_ASPECT = 1.35  # box width / height (or its inverse) still read as square
_MIN_PURE = 0.6  # share of object pixels close to the object colour (soft edges are the rest)
_MAX_STRAY = 0.2  # pixels far from the background outside the object, relative to the object's area


@dataclass(frozen=True)
class Reading:
    """What the checker sees in an image; None where it cannot read that attribute."""

    background: str | None
    colour: str | None
    shape: str | None
    fill: float = float("nan")
    taper: float = float("nan")
    note: str = ""
    box: tuple[int, int, int, int] | None = None  # the object's bounding box (x0, y0, x1, y1), x1/y1 exclusive


@dataclass(frozen=True)
class Fidelity:
    background: str | None
    colour: str | None
    shape: str | None
    expected_background: str | None
    expected_colour: str | None
    expected_shape: str | None
    note: str = ""

    @property
    def attributes_right(self) -> int:
        return (
            (self.background is not None and self.background == self.expected_background)
            + (self.colour is not None and self.colour == self.expected_colour)
            + (self.shape is not None and self.shape == self.expected_shape)
        )

    @property
    def correct(self) -> bool:
        return self.attributes_right == 3


def _nearest(rgb: np.ndarray) -> tuple[int, float]:
    distances = np.linalg.norm(_RGB - rgb, axis=1)
    index = int(distances.argmin())
    return index, float(distances[index])


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """Largest 4-connected component of a boolean mask (label propagation with numpy)."""
    h, w = mask.shape
    big = h * w + 1
    labels = np.where(mask, np.arange(h * w).reshape(h, w), big)
    for _ in range(h * w):
        shifted = labels.copy()
        np.minimum(shifted[1:], labels[:-1], out=shifted[1:])
        np.minimum(shifted[:-1], labels[1:], out=shifted[:-1])
        np.minimum(shifted[:, 1:], labels[:, :-1], out=shifted[:, 1:])
        np.minimum(shifted[:, :-1], labels[:, 1:], out=shifted[:, :-1])
        shifted = np.where(mask, shifted, big)
        if np.array_equal(shifted, labels):
            break
        labels = shifted
    values, counts = np.unique(labels[mask], return_counts=True)
    if len(values) == 0:
        return mask
    return labels == values[counts.argmax()]


def read(image: Image.Image | np.ndarray) -> Reading:
    """Background, object colour and shape of one image, from its pixels."""
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    h, w, _ = pixels.shape
    ring = np.ones((h, w), dtype=bool)
    ring[2:-2, 2:-2] = False
    bg_index, bg_distance = _nearest(np.median(pixels[ring], axis=0))
    if bg_distance > _MAX_COLOUR_DISTANCE:
        return Reading(None, None, None, note=f"border is no palette colour ({bg_distance:.0f} away)")
    background = _NAMES[bg_index]
    bg_rgb = _RGB[bg_index]
    gap = min(np.linalg.norm(_RGB[i] - bg_rgb) for i in range(len(_NAMES)) if i != bg_index)
    far = np.linalg.norm(pixels - bg_rgb, axis=2) > gap / 2
    if not far.any():
        return Reading(background, None, None, note="no object")
    obj = _largest_component(far)
    area = int(obj.sum())
    short = min(h, w)

    colour_index, colour_distance = _nearest(np.median(pixels[obj], axis=0))
    colour = _NAMES[colour_index] if colour_distance <= _MAX_COLOUR_DISTANCE else None
    notes = []
    if colour is None:
        notes.append(f"object is no palette colour ({colour_distance:.0f} away)")
    elif colour_index == bg_index:
        colour, notes = None, ["object has the background colour"]
    else:
        pure = np.linalg.norm(pixels[obj] - _RGB[colour_index], axis=1) <= _MAX_COLOUR_DISTANCE
        if pure.mean() < _MIN_PURE:
            colour = None
            notes.append(f"object not flat ({pure.mean():.0%} near its colour)")

    stray = int(far.sum()) - area
    rows = np.flatnonzero(obj.any(axis=1))
    cols = np.flatnonzero(obj.any(axis=0))
    box_h, box_w = rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1
    fill = area / float(box_h * box_w)
    widths = obj[rows[0] : rows[-1] + 1].sum(axis=1).astype(np.float32)
    band = max(1, box_h // 5)  # rows 15-35 % and 65-85 % of the box height
    # The bottom band mirrors the top one row for row: on a small box (11 px at 32x32) rounding both starts
    # down would compare a circle's narrow top with rows nearer its middle.
    margin = int(0.15 * box_h)
    top = widths[margin : margin + band].mean()
    bottom = widths[box_h - margin - band : box_h - margin].mean()
    taper = float(top / max(bottom, 1.0))

    shape = None
    if not _MIN_AREA <= area / short**2 <= _MAX_AREA:
        notes.append(f"object area {area / short**2:.3f} of the short side squared")
    elif max(box_w / box_h, box_h / box_w) > _MAX_ASPECT:
        notes.append(f"box {box_w}x{box_h} is not square")
    elif stray > _MAX_STRAY * area:
        notes.append(f"{stray} stray pixels")
    elif taper < 0.6 and 0.35 <= fill <= 0.68:
        shape = "triangle"
    elif 0.8 <= taper <= 1.25 and fill >= 0.9:
        shape = "square"
    elif 0.8 <= taper <= 1.25 and 0.68 <= fill < 0.9:
        shape = "circle"
    else:
        notes.append(f"no shape has fill {fill:.2f} and taper {taper:.2f}")
    box = (int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1)
    return Reading(background, colour, shape, fill=fill, taper=taper, note="; ".join(notes), box=box)


def check(image: Image.Image | np.ndarray, prompt: Prompt | str) -> Fidelity:
    """Score one image against its prompt: all three attributes must be read and right."""
    expected = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt)
    seen = read(image)
    return Fidelity(
        background=seen.background,
        colour=seen.colour,
        shape=seen.shape,
        expected_background=expected.background if expected else None,
        expected_colour=expected.colour if expected else None,
        expected_shape=expected.shape if expected else None,
        note=seen.note if expected else f"prompt outside the grammar: {prompt!r}",
    )


def score(images: list[Image.Image], prompts: list[Prompt | str]) -> float:
    """Share of images that are correct for their prompt."""
    if len(images) != len(prompts):
        raise ValueError("one prompt per image")
    return sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / max(len(images), 1)
