"""The latent space of the shapes VAE: semantic channels, defined analytically from the scene.

The 12 channels (at 1/4 resolution), in units of U = 64 pixels:

    0, 1   the cell's own position: x = (pixel x of the cell centre) / U - 1, y likewise (from the top left)
    2, 3   the object's centre, same units, the same everywhere
    4      the object's side / U - 0.8, the same everywhere
    5..7   object colour RGB in [-1, 1], the same everywhere
    8..10  background colour RGB in [-1, 1], the same everywhere
    11     shape code (circle -1, square 0, triangle +1), the same everywhere

Why this: every channel the transformer writes is either a constant over the image or the cell's own
position, so it never has to draw a coherent outline; the geometry is the decoder's job, and the decoder
(convolutional, per pixel after upsampling) gets everything it needs at every pixel: where the pixel is,
where the object is and how big, what kind. What was tried before, on this machine: a freely learned
latent space (the transformer drew blobs after 200k samples); a sharp mask channel (every constant field
right 100 % of the time after 2,000 steps, the mask a blob: 21 %); two linear ramps relative to the object
(70-80 % after 1,250 steps, but a GroupNorm decoder cannot threshold absolute values); a soft signed
distance (the decoder learned it, the transformer slowly: 8 % after 750 steps). The constant fields were
the one part the transformer always got right, so here the whole scene is constant fields.

The decoder is diffusers' AutoencoderTiny (no normalisation layers: it reads absolute values). It is trained
to render the clean image also from corrupted latents (noisy, slightly wrong fields), so approximate
latents still give a clean shape of the coded kind in palette colours. The encoder learns to produce the
channels from pixels (image-to-image); the transformer trains on the analytic latents directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.shapes import grammar

SCALE = 4  # pixels per latent cell (vae_scale_factor)
CHANNELS = 12
UNIT = 64.0  # pixels per latent unit of position and size
SIZE_OFFSET = 0.8
SHAPE_CODES = torch.tensor([-1.0, 0.0, 1.0])  # circle, square, triangle
CONSTANTS = slice(2, 12)  # the channels that are the same everywhere
BACKGROUND = slice(8, 11)


def position_grid(width: int, height: int, scale: int = SCALE) -> torch.Tensor:
    """(2, height/scale, width/scale): channels 0 and 1, the cell centres in latent units."""
    xs = ((torch.arange(width // scale, dtype=torch.float32) + 0.5) * scale) / UNIT - 1
    ys = ((torch.arange(height // scale, dtype=torch.float32) + 0.5) * scale) / UNIT - 1
    return torch.stack(torch.meshgrid(ys, xs, indexing="ij")[::-1])


def semantic_latents(
    colours: torch.Tensor,
    shapes: torch.Tensor,
    backgrounds: torch.Tensor,
    boxes: torch.Tensor,
    width: int,
    height: int,
) -> torch.Tensor:
    """Latents (n, 12, height/4, width/4) of scenes given as index tensors and boxes (x0, y0, side)."""
    n = len(boxes)
    x0, y0, side = (boxes[:, i].float() for i in range(3))
    geometry = torch.stack(
        [(x0 + side / 2) / UNIT - 1, (y0 + side / 2) / UNIT - 1, side / UNIT - SIZE_OFFSET], dim=1
    )
    palette = grammar.palette()
    constants = torch.cat(
        [geometry, palette[colours], palette[backgrounds], SHAPE_CODES[shapes].unsqueeze(1)], dim=1
    )
    grid = position_grid(width, height)
    h, w = grid.shape[1:]
    return torch.cat([grid.expand(n, 2, h, w), constants.view(n, 10, 1, 1).expand(n, 10, h, w)], dim=1)


def scenes(prompts, width: int, height: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rendered images in [-1, 1] and their semantic latents for a list of Prompts (random boxes)."""
    colours, shapes, backgrounds = grammar.prompt_indices(prompts)
    boxes = grammar.sample_boxes(len(prompts), width, height, generator)
    images = grammar.render_batch(colours, shapes, backgrounds, width, height, boxes=boxes)
    return images, semantic_latents(colours, shapes, backgrounds, boxes, width, height)


def read_scene(latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What latents say, read with the exact rules (no decoder): per image the median of each constant
    field, snapped to the nearest palette colour / shape code / whole pixel. Returns index tensors
    (colours, shapes, backgrounds) and boxes (x0, y0, side). Used to score a transformer on its own."""
    fields = latents[:, CONSTANTS].flatten(2).median(dim=2).values
    side = ((fields[:, 2] + SIZE_OFFSET) * UNIT).round().clamp(min=1)
    x0 = ((fields[:, 0] + 1) * UNIT - side / 2).round()
    y0 = ((fields[:, 1] + 1) * UNIT - side / 2).round()
    palette = grammar.palette()
    colours = torch.cdist(fields[:, 3:6], palette).argmin(dim=1)
    backgrounds = torch.cdist(fields[:, 6:9], palette).argmin(dim=1)
    shapes = (fields[:, 9:10] - SHAPE_CODES.view(1, 3)).abs().argmin(dim=1)
    return colours, shapes, backgrounds, torch.stack([x0, y0, side], dim=1).long()


def read_scene_background(latents: torch.Tensor) -> torch.Tensor:
    """(n, 3, 1, 1): the palette background colour latents say (read_scene), in [-1, 1]."""
    return grammar.palette()[read_scene(latents)[2]].view(-1, 3, 1, 1)


def render_exact(latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Images (n, 3, height, width) in [-1, 1] drawn from latents by the exact rules (see read_scene)."""
    colours, shapes, backgrounds, boxes = read_scene(latents)
    return grammar.render_batch(colours, shapes, backgrounds, width, height, boxes=boxes)


def corrupt(latents: torch.Tensor, generator: torch.Generator, clean_share: float = 0.25) -> torch.Tensor:
    """Approximate versions of clean latents, as an imperfect generator would produce them: the decoder
    learns to turn them back into the clean image (the scene the median of each field describes)."""
    n, c, h, w = latents.shape
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=generator).view(-1, 1, 1, 1)  # noqa: E731
    # Smooth, low-frequency disagreement between cells (a field that is not quite constant).
    lumps = F.interpolate(torch.randn(n, c, 3, 3, generator=generator), size=(h, w), mode="bicubic")
    lumps = lumps - lumps.flatten(2).mean(dim=2).view(n, c, 1, 1)
    corrupted = latents + u(0.0, 0.02) * lumps
    # Fine per-cell noise, larger on the colours and the code (the decoder snaps them to the palette).
    scale = torch.ones(c)
    scale[5:] = 3.0
    corrupted = corrupted + u(0.0, 0.015) * scale.view(1, c, 1, 1) * torch.randn(latents.shape, generator=generator)
    # Colours and code off by a constant (the nearest palette entry and code still win).
    offsets = torch.zeros(n, c, 1, 1)
    offsets[:, 5:] = 0.06 * torch.randn(n, c - 5, 1, 1, generator=generator)
    corrupted = corrupted + offsets
    keep = (torch.rand(n, generator=generator) < clean_share).view(-1, 1, 1, 1)
    return torch.where(keep, latents, corrupted)
