"""The moving-shapes grammar of tiny-shapes-video: prompts, held-out list, motions and the clip renderer.

`a {colour} {shape} moving {left|right|up|down} on a {background} background`: the colours and shapes of
`grammar` (one object of the same sizes and hard-edged outlines), moving in a straight line at a constant
speed, staying fully inside the picture in every frame and travelling at least MIN_TRAVEL of the picture's
side over the clip, so its direction can be read from the pixels. Deterministic and model-free, like
`grammar`: the training data, the clip checker and the tests share this one definition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from PIL import Image

from training.shapes import grammar

# Name -> unit displacement (x, y) in image coordinates (y grows downwards).
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
DIRECTION_NAMES: tuple[str, ...] = tuple(DIRECTIONS)
PROMPT_TEMPLATE = "a {colour} {shape} moving {direction} on a {background} background"
MIN_TRAVEL = 6 / 32  # share of the picture's side the object travels at least (6 px at 32x32)


@dataclass(frozen=True, order=True)
class VideoPrompt:
    colour: str
    shape: str
    direction: str
    background: str

    def __post_init__(self) -> None:
        grammar.Prompt(self.colour, self.shape, self.background)  # validates colours, shape, fg != bg
        if self.direction not in DIRECTIONS:
            raise ValueError(f"not a direction of the grammar: {self.direction!r}")

    @property
    def still(self) -> grammar.Prompt:
        """The picture prompt of one frame (what the image checker reads)."""
        return grammar.Prompt(self.colour, self.shape, self.background)

    @property
    def text(self) -> str:
        return PROMPT_TEMPLATE.format(colour=self.colour, shape=self.shape, direction=self.direction,
                                      background=self.background)

    def __str__(self) -> str:
        return self.text


@cache
def all_prompts() -> tuple[VideoPrompt, ...]:
    """The 168 x 4 = 672 prompts, in a fixed order (the picture prompts' order, then the direction)."""
    return tuple(VideoPrompt(p.colour, p.shape, d, p.background) for p in grammar.all_prompts()
                 for d in DIRECTION_NAMES)


# Never trained on. 48 prompts: each of grammar.HELD_OUT's 24 picture prompts with two opposite directions
# (its index mod 2 picks left/right or up/down), so every direction is held out 12 times, and every
# (colour, shape, direction), (colour, background, direction) idea still appears in training.
HELD_OUT: tuple[VideoPrompt, ...] = tuple(
    VideoPrompt(p.colour, p.shape, d, p.background)
    for i, p in enumerate(grammar.HELD_OUT)
    for d in (("left", "right") if i % 2 == 0 else ("up", "down"))
)


@cache
def training_prompts() -> tuple[VideoPrompt, ...]:
    held = set(HELD_OUT)
    return tuple(p for p in all_prompts() if p not in held)


_PROMPT_RE = re.compile(r"an? (\w+) (\w+) moving (\w+) on an? (\w+) background")


def parse_prompt(text: str) -> VideoPrompt | None:
    """The VideoPrompt a text means, or None outside the grammar (forgiving as grammar.parse_prompt)."""
    normalised = " ".join(str(text).lower().split()).rstrip(".").strip()
    match = _PROMPT_RE.fullmatch(normalised)
    if match is None:
        return None
    colour, shape, direction, background = match.groups()
    try:
        return VideoPrompt(colour, shape, direction, background)
    except ValueError:
        return None


def prompt_indices(prompts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(colours, shapes, backgrounds, directions) index tensors of VideoPrompts."""
    colours, shapes, backgrounds = grammar.prompt_indices([p.still for p in prompts])
    return colours, shapes, backgrounds, torch.tensor([DIRECTION_NAMES.index(p.direction) for p in prompts])


# --------------------------------------------------------------------------------------------------
# Motion and rendering.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Motion:
    """Straight constant-speed motions of n objects: the box (x0, y0) in frame 0, the side, and the
    displacement per frame (vx, vy), all in pixels (floats)."""

    start: torch.Tensor  # (n, 2)
    side: torch.Tensor  # (n,)
    velocity: torch.Tensor  # (n, 2)

    def boxes(self, frame: int | float) -> torch.Tensor:
        """(n, 3) boxes (x0, y0, side) in `frame`."""
        corner = self.start + frame * self.velocity
        return torch.cat([corner, self.side.unsqueeze(1)], dim=1)

    def centres(self, frame: int | float) -> torch.Tensor:
        return self.start + frame * self.velocity + self.side.unsqueeze(1) / 2


def sample_motions(directions: torch.Tensor, frames: int, size: int, generator: torch.Generator | None = None
                   ) -> Motion:
    """Random motions in a square size x size picture for direction indices: a side as grammar.sample_boxes
    draws it, a travel uniform between MIN_TRAVEL and all the room the side leaves, a random start that
    keeps the object inside in every frame, and a random place across the direction of travel."""
    n = len(directions)
    side = grammar.sample_boxes(n, size, size, generator)[:, 2].float()
    room = size - side
    u = torch.rand(n, 3, generator=generator)
    travel = MIN_TRAVEL * size + u[:, 0] * (room - MIN_TRAVEL * size)
    unit = torch.tensor([DIRECTIONS[d] for d in DIRECTION_NAMES], dtype=torch.float32)[directions]
    along_start = u[:, 1] * (room - travel)  # the lower end of the travelled range
    across = (u[:, 2] * (room + 1)).floor().clamp(max=room)  # whole pixels, as still boxes
    forward = unit.sum(dim=1) > 0  # right or down
    along = torch.where(forward, along_start, along_start + travel)
    horizontal = unit[:, 0] != 0
    start = torch.stack([torch.where(horizontal, along, across), torch.where(horizontal, across, along)], dim=1)
    return Motion(start=start, side=side, velocity=unit * (travel / (frames - 1)).unsqueeze(1))


def render_clips(colours, shapes, backgrounds, motion: Motion, frames: int, size: int) -> torch.Tensor:
    """Clips (n, 3, frames, size, size) in [-1, 1], every frame drawn by grammar.render_batch."""
    n = len(colours)
    boxes = torch.stack([motion.boxes(f) for f in range(frames)], dim=1).reshape(n * frames, 3)
    repeat = lambda t: t.repeat_interleave(frames)  # noqa: E731
    images = grammar.render_batch(repeat(colours), repeat(shapes), repeat(backgrounds), size, size, boxes=boxes)
    return images.view(n, frames, 3, size, size).transpose(1, 2)


def render(prompt: VideoPrompt | str, frames: int = 17, size: int = 32, seed: int = 0) -> list[Image.Image]:
    """Ground truth for one prompt: the frames of a random motion drawn with `seed`."""
    prompt = prompt if isinstance(prompt, VideoPrompt) else parse_prompt(prompt)
    if prompt is None:
        raise ValueError("not a moving-shapes prompt")
    generator = torch.Generator().manual_seed(seed)
    colours, shapes, backgrounds, directions = prompt_indices([prompt])
    clip = render_clips(colours, shapes, backgrounds, sample_motions(directions, frames, size, generator),
                        frames, size)
    return clip_to_pil(clip[0])


def clip_to_pil(clip: torch.Tensor) -> list[Image.Image]:
    """One clip (3, frames, h, w) in [-1, 1] -> its frames as PIL images."""
    return grammar.to_pil(clip.transpose(0, 1))


def as_arrays(frames) -> list[np.ndarray]:
    """PIL images or (h, w, 3) arrays (uint8, or floats in [0, 1] as pipelines return) -> float arrays 0-255."""
    out = []
    for frame in frames:
        if isinstance(frame, Image.Image):
            out.append(np.asarray(frame.convert("RGB"), dtype=np.float32))
            continue
        array = np.asarray(frame)
        floats = np.issubdtype(array.dtype, np.floating)
        out.append(array.astype(np.float32) * (255.0 if floats else 1.0))
    return out
