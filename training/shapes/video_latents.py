"""The latent space of tiny-shapes-video: semantic channels in Wan's latent layout, defined from the scene.

`AutoencoderKLWan` latents are (16, (F - 1) / 4 + 1, H / 8, W / 8); latent frame 0 is frame 0 and latent
frame t >= 1 covers frames 4t - 3 ... 4t. The 16 channels, in units of U = 32 pixels (the picture of the
shapes grammar's 32x32 bucket), as `latents` does for the picture model:

    0, 1    the cell's own position: (pixel x of the cell centre) / U - 0.5, y likewise
    2, 3    the object's centre in the latent frame's last frame (4t), same units
    4, 5    its displacement per frame * VELOCITY_SCALE / U (the decoder places it in the 4 frames it unfolds)
    6       the object's side / U - 0.5
    7..9    object colour RGB in [-1, 1]
    10..12  background colour RGB in [-1, 1]
    13      shape code (circle -1, square 0, triangle +1)
    14, 15  zero

Everything but channels 0-3 is the same in every cell and latent frame; the centre is the same over a
latent frame and moves linearly from one to the next. So the transformer writes constants (plus a straight
track) and the decoder turns "where am I, where is the object, how does it move, how big, what kind, which
colours" into pixels, as the picture model's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.shapes import grammar
from training.shapes import latents as still
from training.shapes.video_grammar import Motion

CHANNELS = 16
SCALE = 8  # pixels per latent cell
FRAME_STRIDE = 4  # frames per latent frame after the first
UNIT = 32.0
SIZE_OFFSET = 0.5
VELOCITY_SCALE = 8.0  # displacements are below 1.4 px per frame: scaled up to a range like the others'
CENTRE = slice(2, 4)
VELOCITY = slice(4, 6)
CONSTANTS = slice(4, 14)  # the same over the whole clip
BACKGROUND = slice(10, 13)


def latent_frames(frames: int) -> int:
    return (frames - 1) // FRAME_STRIDE + 1


def last_frames(frames: int) -> torch.Tensor:
    """The frame each latent frame ends on: 0, 4, 8, ..."""
    return torch.arange(latent_frames(frames)) * FRAME_STRIDE


def semantic_latents(colours, shapes, backgrounds, motion: Motion, frames: int, size: int) -> torch.Tensor:
    """Latents (n, 16, latent frames, size / 8, size / 8) of clips given as index tensors and motions."""
    n, t = len(colours), latent_frames(frames)
    h = w = size // SCALE
    centres = torch.stack([motion.centres(int(f)) for f in last_frames(frames)], dim=2) / UNIT  # (n, 2, t)
    palette = grammar.palette()
    constants = torch.cat([
        motion.velocity * VELOCITY_SCALE / UNIT,
        (motion.side / UNIT - SIZE_OFFSET).unsqueeze(1),
        palette[colours],
        palette[backgrounds],
        still.SHAPE_CODES[shapes].unsqueeze(1),
        torch.zeros(n, 2),
    ], dim=1)
    grid = still.position_grid(size, size, SCALE) * (still.UNIT / UNIT) + (still.UNIT / UNIT - 0.5)
    return torch.cat([
        grid.view(1, 2, 1, h, w).expand(n, 2, t, h, w),
        (centres - 0.5).view(n, 2, t, 1, 1).expand(n, 2, t, h, w),
        constants.view(n, 12, 1, 1, 1).expand(n, 12, t, h, w),
    ], dim=1)


def read_scene(latents: torch.Tensor, frames: int):
    """What latents say, read with the exact rules (no decoder): the median of each field (the centre per
    latent frame), snapped to the palette and shape codes. Returns (colours, shapes, backgrounds, motion),
    the motion fitted through the latent frames' centres by least squares with the written velocity's
    frames as the time axis (used to score a transformer alone and as the target for decoder tuning)."""
    constants = latents[:, CONSTANTS].flatten(2).median(dim=2).values  # (n, 10)
    centres = (latents[:, CENTRE].flatten(3).median(dim=3).values + 0.5) * UNIT  # (n, 2, t)
    side = ((constants[:, 2] + SIZE_OFFSET) * UNIT).round().clamp(min=1)
    velocity = constants[:, 0:2] * UNIT / VELOCITY_SCALE
    times = last_frames(frames).float().view(1, 1, -1)
    start_centre = (centres - velocity.unsqueeze(2) * times).mean(dim=2)
    palette = grammar.palette()
    colours = torch.cdist(constants[:, 3:6], palette).argmin(dim=1)
    backgrounds = torch.cdist(constants[:, 6:9], palette).argmin(dim=1)
    shapes = (constants[:, 9:10] - still.SHAPE_CODES.view(1, 3)).abs().argmin(dim=1)
    motion = Motion(start=start_centre - side.unsqueeze(1) / 2, side=side, velocity=velocity)
    return colours, shapes, backgrounds, motion


def read_background(latents: torch.Tensor) -> torch.Tensor:
    """(n, 3, 1, 1, 1): the palette background colour latents say, in [-1, 1]."""
    backgrounds = torch.cdist(latents[:, BACKGROUND].flatten(2).median(dim=2).values, grammar.palette())
    return grammar.palette()[backgrounds.argmin(dim=1)].view(-1, 3, 1, 1, 1)


def render_exact(latents: torch.Tensor, frames: int, size: int) -> torch.Tensor:
    """Clips (n, 3, frames, size, size) drawn from latents by the exact rules (read_scene)."""
    from training.shapes.video_grammar import render_clips

    colours, shapes, backgrounds, motion = read_scene(latents, frames)
    return render_clips(colours, shapes, backgrounds, motion, frames, size)


def corrupt(latents: torch.Tensor, generator: torch.Generator, clean_share: float = 0.25) -> torch.Tensor:
    """Approximate versions of clean latents, as an imperfect transformer writes them (fields not quite
    constant, a centre a little off its straight track, colours and code off by a little): the decoder
    learns to render the clean clip from them."""
    n, c, t, h, w = latents.shape
    amount = lambda hi: hi * torch.rand(n, generator=generator).view(-1, 1, 1, 1, 1)  # noqa: E731
    lumps = F.interpolate(torch.randn(n, c, 2, 3, 3, generator=generator), size=(t, h, w), mode="trilinear")
    lumps = lumps - lumps.flatten(2).mean(dim=2).view(n, c, 1, 1, 1)
    scale = torch.ones(c)
    scale[7:14] = 3.0  # colours and code: the decoder snaps them to the palette
    noisy = latents + amount(0.02) * lumps + amount(0.015) * scale.view(1, c, 1, 1, 1) * torch.randn(
        latents.shape, generator=generator)
    offsets = torch.zeros(n, c, t, 1, 1)
    offsets[:, CENTRE] = (0.4 / UNIT) * torch.randn(n, 2, t, 1, 1, generator=generator)  # ~0.4 px per frame
    offsets[:, 7:14] = 0.06 * torch.randn(n, 7, 1, 1, 1, generator=generator)
    keep = (torch.rand(n, generator=generator) < clean_share).view(-1, 1, 1, 1, 1)
    return torch.where(keep, latents, noisy + offsets)
