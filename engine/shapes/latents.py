"""The latent space of the shapes VAE: semantic channels, defined analytically from the scene.

Why: with a freely learned latent space the transformer has to learn to paint the encoder's edge codes
and, after 200k samples, still drew blobs (right colours, wrong geometry). A mask channel (the share of
each latent cell the object covers) was no better: the transformer wrote every constant field right
(colours, shape code: 100 % at 2,000 steps) but drew the mask as a blob. So here nothing in the latents is
sharp. The 9 channels (at 1/4 resolution) are

    0, 1   where the cell is relative to the object: u = (x - cx) / side, v = (y - cy) / side, with
           (cx, cy) the centre of the object's box, each divided by RAMP_RANGE and clipped to [-1, 1]:
           two linear ramps (flat far from the object), set by three numbers per image
    2..4   object colour RGB in [-1, 1], the same everywhere
    5..7   background colour RGB in [-1, 1], the same everywhere
    8      shape code (circle -1, square 0, triangle +1), the same everywhere

so the transformer writes smooth, low-frequency fields, and the decoder does the drawing *locally*: a pixel
is inside a circle when u^2 + v^2 <= 1/4, inside a square when |u|, |v| <= 1/2, inside the upright
triangle when |u| <= (v + 1/2) / 2; bilinear up-sampling of a ramp is exact. The decoder is trained on
corrupted latents too (bent, tilted, offset ramps, noisy fields), so an approximate ramp still gives a
clean shape in palette colours. The encoder learns to produce the channels from pixels (reconstructions and
image-to-image); the transformer trains on the analytic latents directly.
"""

from __future__ import annotations

import torch

from engine.shapes import grammar

SCALE = 4  # pixels per latent cell (vae_scale_factor)
CHANNELS = 9
RAMP_RANGE = 1.5  # |u|, |v| beyond this (well outside every shape) read as "far away"
SHAPE_CODES = torch.tensor([-1.0, 0.0, 1.0])  # circle, square, triangle


def _ramps(boxes: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(n, 2, height/4, width/4): u and v at every latent cell's centre, scaled and clipped."""
    n = len(boxes)
    h, w = height // SCALE, width // SCALE
    x0, y0, side = (boxes[:, i].float().view(n, 1, 1) for i in range(3))
    xs = ((torch.arange(w, dtype=torch.float32) + 0.5) * SCALE).view(1, 1, w)
    ys = ((torch.arange(h, dtype=torch.float32) + 0.5) * SCALE).view(1, h, 1)
    u = ((xs - x0 - side / 2) / side).expand(n, h, w)
    v = ((ys - y0 - side / 2) / side).expand(n, h, w)
    return (torch.stack([u, v], dim=1) / RAMP_RANGE).clamp(-1, 1)


def semantic_latents(
    colours: torch.Tensor,
    shapes: torch.Tensor,
    backgrounds: torch.Tensor,
    boxes: torch.Tensor,
    width: int,
    height: int,
) -> torch.Tensor:
    """Latents (n, 9, height/4, width/4) of scenes given as index tensors and boxes (x0, y0, side)."""
    ramps = _ramps(boxes, width, height)
    n, _, h, w = ramps.shape
    palette = grammar.palette()
    fields = torch.cat(
        [palette[colours], palette[backgrounds], SHAPE_CODES[shapes].unsqueeze(1)], dim=1
    ).view(n, 7, 1, 1)
    return torch.cat([ramps, fields.expand(n, 7, h, w)], dim=1)


def scenes(prompts, width: int, height: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rendered images in [-1, 1] and their semantic latents for a list of Prompts (random boxes)."""
    colours, shapes, backgrounds = grammar.prompt_indices(prompts)
    boxes = grammar.sample_boxes(len(prompts), width, height, generator)
    images = grammar.render_batch(colours, shapes, backgrounds, width, height, boxes=boxes)
    return images, semantic_latents(colours, shapes, backgrounds, boxes, width, height)


def corrupt(latents: torch.Tensor, generator: torch.Generator, clean_share: float = 0.25) -> torch.Tensor:
    """Approximate versions of clean latents, as an imperfect generator would produce them: the decoder
    learns to turn them back into the clean image."""
    n, _, h, w = latents.shape
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=generator).view(n, 1, 1, 1)  # noqa: E731
    ramps = latents[:, :2]
    # Slightly wrong slope (size), offset (position) and a little cross-talk (tilt), per image.
    ramps = ramps * u(0.92, 1.08) + 0.03 * torch.randn(n, 2, 1, 1, generator=generator)
    ramps = ramps + 0.03 * torch.randn(n, 2, 1, 1, generator=generator) * ramps.flip(1)
    # Bends: smooth low-frequency noise; then fine per-cell noise.
    bends = torch.nn.functional.interpolate(torch.randn(n, 2, 3, 3, generator=generator), size=(h, w),
                                            mode="bicubic", align_corners=True)
    ramps = ramps + u(0.0, 0.04) * bends + u(0.0, 0.02) * torch.randn(ramps.shape, generator=generator)
    # Constant fields: an offset per image and a little per-cell noise.
    fields = latents[:, 2:]
    fields = fields + 0.08 * torch.randn(n, 7, 1, 1, generator=generator)
    fields = fields + u(0.0, 0.1) * torch.randn(fields.shape, generator=generator)
    corrupted = torch.cat([ramps, fields], dim=1)
    keep = (torch.rand(n, generator=generator) < clean_share).view(-1, 1, 1, 1)
    return torch.where(keep, latents, corrupted)
