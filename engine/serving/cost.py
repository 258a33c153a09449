"""What a request costs an engine, priced before it is admitted (public mode), and the host's cost budgets.

The unit is a token-step: one latent token through the denoiser once. A request's price is its denoiser
steps × the latent tokens of one step at its bucket (× 2 where classifier-free guidance doubles the
denoiser's batch) × its images (a Compare: configurations × prompts). Counting requests, as before,
let one visitor queue 33 minutes of engine time in a single Compare; the denoiser's work is what every
other visitor waits behind (vLLM's scheduler budgets tokens per step for the same reason).

Two budgets, both the host's (`--max-request-cost`, `--max-visitor-cost`): the most one request may
cost, and the most one visitor (client address) may have queued and running at once. Host calls (the
CLI, an admin token, a Gradio login) are not priced. Everything here is pure: no engine, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import EngineBusy, InvalidRequest, NotAllowed
from engine.protocol import ModelPreset, Size

# The defaults let a visitor run 64 steps at the largest tiny bucket (128x128 of tiny-shapes: 256 tokens)
# in one request, or a Compare of 2 configurations × 9 prompts × 8 steps at 64x64; and hold two such
# requests queued or running. Measured on 2 shared cores: docs/hosting.md ("Fair by cost").
DEFAULT_REQUEST_COST = 16_384
DEFAULT_VISITOR_COST = 2 * DEFAULT_REQUEST_COST
# Decoding uploads is work too (the web process's): this many decoded pixels cost one token-step, about the CPU a
# token-step of the tiny engines takes (docs/hosting.md, "Uploads"); a 4096x4096 reference costs 2,048.
DECODE_PIXELS_PER_TOKEN_STEP = 8192


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def tokens_per_image_step(preset: ModelPreset, size: Size, guidance: float | None = None,
                          refs: tuple[Size, ...] = ()) -> int:
    """Latent tokens one denoiser step computes for one image at `size`. A transformer packs 2×2 latent
    pixels per token (the preset's alignment is that patch in image pixels); a UNet computes every latent
    pixel (half the alignment). `refs`: reference images whose tokens join the sequence (an instruction edit,
    FLUX.2's references), each counted like an output of its size. Classifier-free guidance (guidance > 1 on
    a cfg pipeline) doubles it."""
    side = preset.alignment if preset.denoiser == "transformer" else max(1, preset.alignment // 2)
    tokens = sum(math.ceil(s.width / side) * math.ceil(s.height / side) for s in (size, *refs))
    guidance = preset.guidance if guidance is None else guidance
    return tokens * (2 if preset.cfg and float(guidance) > 1.0 else 1)


def latent_frames(preset: ModelPreset, frames: int) -> int:
    """Latent frames a clip of `frames` frames denoises (Wan: (frames - 1) / 4 + 1); 1 for an image (0 frames)."""
    return (frames - 1) // preset.frame_step + 1 if frames > 0 else 1


def price(preset: ModelPreset, size: Size, steps: int, guidance: float | None = None, images: int = 1,
          refs: tuple[Size, ...] = (), frames: int = 0) -> int:
    """Token-steps of `images` images of `steps` steps at `size` (a Compare: configurations × prompts), with
    `refs` references in each one's sequence; a clip of `frames` frames costs its latent frames' tokens (frames ×
    size, as the denoiser sees them)."""
    if steps < 1 or images < 1:
        raise InvalidRequest(f"a request runs at least one step of one image (got {steps} steps, {images} images)")
    return steps * tokens_per_image_step(preset, size, guidance, refs) * latent_frames(preset, frames) * images


def decode_price(pixels: int) -> int:
    """Token-steps of decoding `pixels` pixels of uploads (once per request, however many images it makes)."""
    return math.ceil(pixels / DECODE_PIXELS_PER_TOKEN_STEP) if pixels > 0 else 0


def parse_cost(text, flag: str) -> int | None:
    """A budget flag's value: token-steps (a positive whole number), or 0 / 'off' for no bound (None)."""
    if text is None:
        return None
    value = str(text).strip().lower().replace("_", "")
    if value in ("off", "none", "0"):
        return None
    try:
        number = int(value)
    except ValueError:
        raise InvalidRequest(f"{flag} {text!r}: give token-steps as a whole number (e.g. {DEFAULT_REQUEST_COST}), "
                             "or 0 for no bound") from None
    if number < 0:
        raise InvalidRequest(f"{flag} {number}: give a positive number of token-steps, or 0 for no bound")
    return number or None


@dataclass(frozen=True)
class CostBudget:
    """The host's bounds in token-steps (None: unbounded)."""

    request: int | None = DEFAULT_REQUEST_COST
    visitor: int | None = DEFAULT_VISITOR_COST

    def describe(self) -> dict:
        return {"max_request_cost": self.request, "max_visitor_cost": self.visitor}


def max_steps(budget: int, preset: ModelPreset, size: Size, guidance: float | None = None, images: int = 1) -> int:
    """The most steps `images` images at `size` may take within `budget` (0: not even one)."""
    return budget // (tokens_per_image_step(preset, size, guidance) * images)


def check_generate(budget: CostBudget, preset: ModelPreset, size: Size, steps: int,
                   guidance: float | None = None, refs: tuple[Size, ...] = (), frames: int = 0,
                   decoded_pixels: int = 0) -> int:
    """The price of one image (`refs`: its references' sizes, each adding its tokens) or clip, with the decoding
    of its uploads (`decoded_pixels`), or NotAllowed saying what fits: fewer steps, or a smaller bucket."""
    decoding = decode_price(decoded_pixels)
    cost = price(preset, size, steps, guidance, refs=refs, frames=frames) + decoding
    if budget.request is None or cost <= budget.request:
        return cost
    if decoding and decoding >= budget.request // 2:
        raise NotAllowed(f"this request costs {cost:,} token-steps, {decoding:,} of them decoding its uploads "
                         f"({decoded_pixels / 10**6:.1f} megapixels, {DECODE_PIXELS_PER_TOKEN_STEP:,} a token-step), "
                         f"and this server allows {budget.request:,} per request: upload smaller or fewer images")
    if frames:
        raise NotAllowed(_clip_refusal(budget.request, cost, preset, size, steps, guidance, frames))
    if refs:
        raise NotAllowed(f"this edit costs {cost:,} token-steps ({_n(steps, 'step')} × "
                         f"{tokens_per_image_step(preset, size, guidance, refs)} latent tokens at {size}, "
                         f"{_n(len(refs), 'reference')} included) and this server allows {budget.request:,} per "
                         "request: fewer steps, a smaller size or fewer references")
    allowed = max_steps(budget.request, preset, size, guidance)
    hint = f"at most {_n(allowed, 'step')} at {size} here" if allowed else f"{size} does not fit here at any step count"
    smaller = [s for s in sorted(preset.buckets, key=lambda s: s.pixels) if s.pixels < size.pixels
               and max_steps(budget.request, preset, s, guidance) >= steps]
    if smaller:
        hint += f", or {_n(steps, 'step')} at {smaller[-1]}"
    raise NotAllowed(f"this request costs {cost:,} token-steps ({_n(steps, 'step')} × "
                     f"{tokens_per_image_step(preset, size, guidance)} latent tokens at {size}) and this server "
                     f"allows {budget.request:,} per request: {hint}")


def check_compare(budget: CostBudget, preset: ModelPreset, size: Size, steps: int, configurations: int,
                  prompts: int, guidance: float | None = None, frames: int = 0) -> int:
    """The price of a Compare (every configuration draws `prompts` images, or clips of `frames` frames: its
    prompts and timing rounds), or NotAllowed saying what fits."""
    images = configurations * prompts
    cost = price(preset, size, steps, guidance, images, frames=frames)
    if budget.request is None or cost <= budget.request:
        return cost
    per_image = price(preset, size, steps, guidance, frames=frames)
    fit = budget.request // per_image  # images of these steps and size that fit
    options = []
    def split(c: int, p: int) -> str:
        return f"{_n(c, 'configuration')} × {_n(p, 'image')} each"

    if fit >= configurations:
        options.append(split(configurations, fit // configurations))
    if fit >= prompts:
        options.append(split(fit // prompts, prompts))
    if fit and not options:
        options.append(split(1, min(fit, prompts)))
    steps_fit = max_steps(budget.request, preset, size, guidance, images * latent_frames(preset, frames))
    hint = f"at most {' or '.join(options)} at {_n(steps, 'step')}" if options else ""
    if steps_fit:
        hint += (", or " if hint else "") + f"at most {_n(steps_fit, 'step')} with these choices"
    raise NotAllowed(f"this comparison costs {cost:,} token-steps ({split(configurations, prompts)} × "
                     f"{_n(steps, 'step')} × {tokens_per_image_step(preset, size, guidance)} latent tokens at "
                     f"{size}{_clip_tokens(preset, frames)}) and this server allows {budget.request:,} per request: "
                     f"{hint or 'pick a smaller size'}")


@dataclass(frozen=True)
class Uploads:
    """A request's uploads as priced: how many there are (references: their tokens join each image's sequence
    where the family puts them there) and the pixels decoding them took, once for all its images."""

    count: int = 0
    pixels: int = 0


def check_uploads(budget: CostBudget, preset: ModelPreset, size: Size, steps: int, images: int, base: int,
                  uploads: Uploads, guidance: float | None = None) -> int:
    """`base` (a Compare's price, say) with its `images` images' references at `size` and the one decoding of the
    uploads added, or NotAllowed when together they are over the request budget."""
    refs = (size,) * uploads.count if preset.inputs.in_sequence else ()
    tokens = tokens_per_image_step(preset, size, guidance, refs) - tokens_per_image_step(preset, size, guidance)
    references, decoding = steps * tokens * images, decode_price(uploads.pixels)
    total = base + references + decoding
    if budget.request is None or total <= budget.request:
        return total
    raise NotAllowed(f"this costs {total:,} token-steps: {base:,} for its images, {references:,} for "
                     f"{_n(uploads.count, 'reference')} in their sequence and {decoding:,} for decoding the uploads "
                     f"({uploads.pixels / 10**6:.1f} megapixels, {DECODE_PIXELS_PER_TOKEN_STEP:,} a token-step); "
                     f"this server allows {budget.request:,} per request: fewer or smaller images, fewer "
                     "configurations or steps")


def _clip_tokens(preset: ModelPreset, frames: int) -> str:
    """' × 3 latent frames (9 frames)' for a clip's price, '' for an image's."""
    return f" × {latent_frames(preset, frames)} latent frames ({frames} frames)" if frames else ""


def check_visitor(budget: CostBudget, held: int, cost: int) -> None:
    """EngineBusy when a visitor's queued and running cost (`held`) plus `cost` is over their budget."""
    if budget.visitor is None or held + cost <= budget.visitor:
        return
    raise EngineBusy(f"you have {held:,} token-steps of requests queued or running and this one costs {cost:,}; "
                     f"this server allows {budget.visitor:,} per visitor at once: wait for yours to finish "
                     "(or cancel one), then send it again")


def _clip_refusal(allowed: int, cost: int, preset: ModelPreset, size: Size, steps: int, guidance, frames: int) -> str:
    """Why a clip is over the request budget, and the longest clip (of the preset's frame buckets) that fits."""
    tokens = tokens_per_image_step(preset, size, guidance)
    fitting = [f for f in sorted(preset.frames) if price(preset, size, steps, guidance, frames=f) <= allowed]
    hint = (f"at most {fitting[-1]} frames at {size} and {_n(steps, 'step')} here" if fitting
            else f"fewer steps or a smaller size ({size} at {_n(steps, 'step')} does not fit at any frame count)")
    return (f"this clip costs {cost:,} token-steps ({_n(steps, 'step')} × {tokens} latent tokens at {size} × "
            f"{latent_frames(preset, frames)} latent frames ({frames} frames)) and this server allows {allowed:,} "
            f"per request: {hint}")
