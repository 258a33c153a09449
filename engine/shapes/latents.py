"""The latent space of the shapes VAE: semantic channels, defined analytically from the scene.

Why: with a freely learned latent space the transformer has to learn to paint the encoder's edge codes
and, after 200k samples, still drew blobs (right colours, wrong geometry). Here the 8 latent channels
(at 1/4 resolution) mean something fixed, so most of the prompt becomes constant fields that the
transformer writes through its text-conditioned modulation, and only one channel holds geometry:

    0      coverage: the share of each 4x4 pixel cell covered by the object, 2c - 1 (an anti-aliased
           low-resolution mask whose partial values place edges to about a pixel)
    1..3   object colour RGB in [-1, 1], the same everywhere
    4..6   background colour RGB in [-1, 1], the same everywhere
    7      shape code (circle -1, square 0, triangle +1), the same everywhere

The decoder is trained to render the clean image from these channels, also when they are corrupted
(blurred, warped, dilated, noisy coverage; noisy colours and codes), so it snaps an approximate blob to the
exact shape of the coded kind and colours to the palette: the convolutional decoder does the drawing, the
transformer the layout. The encoder learns to produce the channels from pixels (for reconstructions and
image-to-image); the transformer trains on the analytic latents directly, which is what the encoder
regresses to and what the decoder was trained to read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.shapes import grammar

SCALE = 4  # pixels per latent cell (vae_scale_factor)
CHANNELS = 8
SHAPE_CODES = torch.tensor([-1.0, 0.0, 1.0])  # circle, square, triangle


def semantic_latents(
    colours: torch.Tensor,
    shapes: torch.Tensor,
    backgrounds: torch.Tensor,
    boxes: torch.Tensor,
    width: int,
    height: int,
) -> torch.Tensor:
    """Latents (n, 8, height/4, width/4) of scenes given as index tensors and boxes (x0, y0, side)."""
    mask = grammar.shape_masks(shapes, boxes, width, height).float().unsqueeze(1)
    coverage = F.avg_pool2d(mask, SCALE) * 2 - 1
    n, _, h, w = coverage.shape
    palette = grammar.palette()
    fields = torch.cat(
        [palette[colours], palette[backgrounds], SHAPE_CODES[shapes].unsqueeze(1)], dim=1
    ).view(n, 7, 1, 1)
    return torch.cat([coverage, fields.expand(n, 7, h, w)], dim=1)


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
    coverage = (latents[:, :1] + 1) / 2
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
