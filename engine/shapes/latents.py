"""The latent space of the shapes VAE: semantic channels, defined analytically from the scene.

What was tried, and why it is this: with a freely learned latent space the transformer had to paint the
encoder's edge codes and still drew blobs after 200k samples. With a sharp mask channel (the share of each
latent cell the object covers) it wrote every constant field right (colours, shape code: 100 % after 2,000
steps) but drew the mask as a blob. With two linear ramps (the cell's position relative to the object) it
placed objects well (70-80 % after 1,250 steps, read with the exact rules), but the GroupNorm decoder of
an AutoencoderKL could not learn to threshold absolute ramp values (0 % after 750 steps). So the geometry
channel is a *soft signed distance*: smooth enough for the transformer (it changes over a quarter of the
object's side), and a mask the decoder reads by its sign. The 8 channels (at 1/4 resolution):

    0      shape: -d / BAND clipped to [-1, 1], with d the signed distance from the cell's centre to the
           outline of the object (in units of its side; negative inside): +1 deep inside, -1 far away, 0
           on the outline
    1..3   object colour RGB in [-1, 1], the same everywhere
    4..6   background colour RGB in [-1, 1], the same everywhere
    7      shape code (circle -1, square 0, triangle +1), the same everywhere

The decoder is trained to render the clean image from these channels, also when they are corrupted
(warped, blurred, eroded or dilated, noisy; noisy colours and codes), so an approximate outline still gives
a clean shape of the coded kind in palette colours. The encoder learns to produce the channels from pixels
(reconstructions and image-to-image); the transformer trains on the analytic latents directly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.shapes import grammar

SCALE = 4  # pixels per latent cell (vae_scale_factor)
CHANNELS = 8
BAND = 0.25  # the shape channel goes from +1 to -1 over d in [-BAND, BAND] (units of the object's side)
SHAPE_CODES = torch.tensor([-1.0, 0.0, 1.0])  # circle, square, triangle


def signed_distance(shapes: torch.Tensor, boxes: torch.Tensor, width: int, height: int, scale: int = SCALE):
    """(n, height/scale, width/scale): signed distance (units of the side, negative inside) from each cell's
    centre to the outline of the object of kind `shapes` in `boxes` (x0, y0, side)."""
    n = len(boxes)
    h, w = height // scale, width // scale
    x0, y0, side = (boxes[:, i].float().view(n, 1, 1) for i in range(3))
    xs = ((torch.arange(w, dtype=torch.float32) + 0.5) * scale).view(1, 1, w)
    ys = ((torch.arange(h, dtype=torch.float32) + 0.5) * scale).view(1, h, 1)
    u = ((xs - x0) / side - 0.5).expand(n, h, w)  # box centre at 0, the box is [-1/2, 1/2]^2
    v = ((ys - y0) / side - 0.5).expand(n, h, w)
    circle = (u**2 + v**2).sqrt() - 0.5
    square = torch.maximum(u.abs(), v.abs()) - 0.5
    # upright triangle, apex (0, -1/2), base on v = 1/2: the base, and the two sides |u| = (v + 1/2) / 2
    triangle = torch.maximum(v - 0.5, (2 * u.abs() - v - 0.5) / math.sqrt(5))
    kind = shapes.view(-1, 1, 1)
    return torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))


def semantic_latents(
    colours: torch.Tensor,
    shapes: torch.Tensor,
    backgrounds: torch.Tensor,
    boxes: torch.Tensor,
    width: int,
    height: int,
) -> torch.Tensor:
    """Latents (n, 8, height/4, width/4) of scenes given as index tensors and boxes (x0, y0, side)."""
    shape = (-signed_distance(shapes, boxes, width, height) / BAND).clamp(-1, 1).unsqueeze(1)
    n, _, h, w = shape.shape
    palette = grammar.palette()
    fields = torch.cat(
        [palette[colours], palette[backgrounds], SHAPE_CODES[shapes].unsqueeze(1)], dim=1
    ).view(n, 7, 1, 1)
    return torch.cat([shape, fields.expand(n, 7, h, w)], dim=1)


def scenes(prompts, width: int, height: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rendered images in [-1, 1] and their semantic latents for a list of Prompts (random boxes)."""
    colours, shapes, backgrounds = grammar.prompt_indices(prompts)
    boxes = grammar.sample_boxes(len(prompts), width, height, generator)
    images = grammar.render_batch(colours, shapes, backgrounds, width, height, boxes=boxes)
    return images, semantic_latents(colours, shapes, backgrounds, boxes, width, height)


def _smooth_field(
    n: int, h: int, w: int, amplitude: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """A smooth random displacement field (n, h, w, 2) in grid_sample units, `amplitude` in cells."""
    coarse = torch.randn(n, 2, 3, 3, generator=generator)
    field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=True)
    scale = torch.tensor([2.0 / w, 2.0 / h]).view(1, 2, 1, 1)
    return (field * amplitude.view(-1, 1, 1, 1) * scale).permute(0, 2, 3, 1)


def corrupt(latents: torch.Tensor, generator: torch.Generator, clean_share: float = 0.25) -> torch.Tensor:
    """Approximate versions of clean latents, as an imperfect generator would produce them: the decoder
    learns to turn them back into the clean image."""
    n, _, h, w = latents.shape
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=generator)  # noqa: E731
    coverage = (latents[:, :1] + 1) / 2  # the shape channel as a [0, 1] soft mask
    # Warp: a smooth deformation of the blob (wobbly outlines, slightly wrong proportions).
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    grid = torch.stack([xs, ys], dim=-1).expand(n, h, w, 2)
    grid = grid + _smooth_field(n, h, w, u(0.0, 1.8), generator)
    coverage = F.grid_sample(coverage, grid, mode="bilinear", padding_mode="border", align_corners=True)
    # Blur, then a random contrast/threshold change (erodes or dilates, hardens or softens edges).
    blurred = F.avg_pool2d(F.pad(coverage, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    mix = u(0.0, 1.0).view(-1, 1, 1, 1)
    coverage = mix * blurred + (1 - mix) * coverage
    gain, bias = u(0.6, 1.8).view(-1, 1, 1, 1), u(-0.15, 0.15).view(-1, 1, 1, 1)
    coverage = ((coverage - 0.5) * gain + 0.5 + bias).clamp(0, 1)
    # Lumps and dents (smooth noise), then fine noise.
    lumps = F.interpolate(torch.randn(n, 1, 4, 4, generator=generator), size=(h, w), mode="bicubic")
    noise = u(0.0, 0.15).view(-1, 1, 1, 1) * torch.randn(coverage.shape, generator=generator)
    coverage = coverage * 2 - 1 + u(0.0, 0.3).view(-1, 1, 1, 1) * lumps + noise
    # Constant fields: an offset per image and a little per-cell noise.
    fields = latents[:, 1:]
    fields = fields + 0.08 * torch.randn(n, 7, 1, 1, generator=generator)
    fields = fields + u(0.0, 0.1).view(-1, 1, 1, 1) * torch.randn(fields.shape, generator=generator)
    corrupted = torch.cat([coverage, fields], dim=1)
    keep = (torch.rand(n, generator=generator) < clean_share).view(-1, 1, 1, 1)
    return torch.where(keep, latents, corrupted)
