"""Quality next to speed: what each configuration draws, against the reference configuration.

Two measures, for every configuration of a bench run:

- **drift**, for any model: the same prompt, seed, size and steps drawn by this configuration and by
  the reference (eager, fp32, same size); PSNR in dB (higher is closer; None for identical images, so
  the JSON stays standard), SSIM (1.0 identical; it sees a moved or blurred object that PSNR prices
  like noise) and the largest pixel difference out of 255, over a few fixed samples (the worst sample
  kept); `diff_heatmap` draws |image - reference| as a picture.
- **fidelity**, for a model trained on a closed grammar (a preset with `fidelity = "shapes"`): the
  share of images whose background colour, object colour and shape a pixel-only checker reads as the
  prompt says (training/shapes/fidelity.py), over seeded random prompts of the grammar; for
  `fidelity = "shapes-video"` the share of clips whose every frame and direction of motion read right
  (training/shapes/video_fidelity.py).

For a clip (a video preset), `clip_drift` measures the same frame by frame against the reference clip and adds
the **temporal flicker**: how much the clip's error changes from one frame to the next (`flicker`); a video
preset's fidelity checker is looked up by its `fidelity` value in CLIP_CHECKERS.

Pure functions here are shared with the UI's Compare tab (`image_drift`, `clip_drift`); torch is not imported.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

# the quality samples' seeds, named once below the bench so the trainer uses them too
from training.shapes.samples import IMAGE_SEED as IMAGE_SEED
from training.shapes.samples import PROMPT_SEED as PROMPT_SEED
from training.shapes.samples import image_seeds as image_seeds

REFERENCE = ("fp32", "eager")  # (precision, mode) every drift is measured against


def to_array(image) -> np.ndarray:
    """HxWx3 uint8 from a PIL image, PNG bytes or an array."""
    if isinstance(image, bytes | bytearray):
        image = Image.open(io.BytesIO(image))
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    return np.asarray(image, dtype=np.uint8)


def image_drift(image, reference) -> dict:
    """PSNR (dB) and the largest per-pixel difference (0-255) of `image` against `reference`."""
    a, b = to_array(image).astype(np.float64), to_array(reference).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"images of different sizes: {a.shape} vs {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    psnr = None if mse == 0 else 10 * math.log10(255.0**2 / mse)
    return {"psnr_db": psnr, "max_diff": int(np.max(np.abs(a - b)))}


SSIM_SIGMA, SSIM_RADIUS = 1.5, 5  # Wang et al. 2004: an 11x11 Gaussian window, sigma 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _gaussian_blur(x: np.ndarray) -> np.ndarray:
    """x filtered by the SSIM window (separable, edges reflected), same shape."""
    t = np.arange(-SSIM_RADIUS, SSIM_RADIUS + 1, dtype=np.float64)
    w = np.exp(-(t**2) / (2 * SSIM_SIGMA**2))
    w /= w.sum()
    pad = np.pad(x, SSIM_RADIUS, mode="reflect") if min(x.shape) > SSIM_RADIUS else \
        np.pad(x, SSIM_RADIUS, mode="edge")
    rows = sum(w[i] * pad[i:i + x.shape[0], :] for i in range(len(w)))
    return sum(w[i] * rows[:, i:i + x.shape[1]] for i in range(len(w)))


def _luma(image) -> np.ndarray:
    """ITU-R BT.601 luma of an image, float64 in 0..255 (SSIM is taken on the grey image, as usual)."""
    rgb = to_array(image).astype(np.float64)
    return rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114


def ssim(image, reference) -> float:
    """Mean structural similarity (Wang et al. 2004: Gaussian window, K1 0.01, K2 0.03, range 255) of
    the two images' luma: 1.0 for identical images, lower as structure, contrast or brightness differ."""
    a, b = _luma(image), _luma(reference)
    if a.shape != b.shape:
        raise ValueError(f"images of different sizes: {a.shape} vs {b.shape}")
    c1, c2 = (SSIM_K1 * 255) ** 2, (SSIM_K2 * 255) ** 2
    mu_a, mu_b = _gaussian_blur(a), _gaussian_blur(b)
    var_a = _gaussian_blur(a * a) - mu_a**2
    var_b = _gaussian_blur(b * b) - mu_b**2
    cov = _gaussian_blur(a * b) - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return float(np.mean(num / den))


def diff_heatmap(image, reference, scale: float | None = None) -> Image.Image:
    """|image - reference| as a picture: black where the pixels agree, through red and yellow to white
    where they differ most. Scaled so the largest difference is bright (`scale`: the difference, 0-255,
    drawn white; default the largest one here, at least 16 so a few levels of noise stay dark)."""
    a, b = to_array(image).astype(np.float64), to_array(reference).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"images of different sizes: {a.shape} vs {b.shape}")
    diff = np.abs(a - b).max(axis=2)
    top = scale if scale else max(16.0, float(diff.max()))
    t = np.clip(diff / top, 0.0, 1.0)
    rgb = np.stack([np.clip(3 * t, 0, 1), np.clip(3 * t - 1, 0, 1), np.clip(3 * t - 2, 0, 1)], axis=2)
    return Image.fromarray((rgb * 255).round().astype(np.uint8), "RGB")


def png_b64(image, max_px: int = 256) -> str:
    """An image as base64 PNG text, at most `max_px` on its longer side: small enough for a JSON report."""
    import base64

    picture = Image.fromarray(to_array(image)) if not isinstance(image, Image.Image) else image.copy()
    picture.thumbnail((max_px, max_px))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def worst_sample(images: list, reference: list) -> int:
    """The index of the sample whose image differs most from the reference's (lowest PSNR)."""
    drifts = [image_drift(a, b) for a, b in zip(images, reference, strict=True)]
    return min(range(len(drifts)), key=lambda i: math.inf if drifts[i]["psnr_db"] is None else drifts[i]["psnr_db"])


def worst_drift(drifts: list[dict]) -> dict:
    """The worst sample: the lowest PSNR and the largest pixel difference over the samples."""
    if not drifts:
        return {"psnr_db": None, "max_diff": None}
    psnrs = [d["psnr_db"] for d in drifts if d["psnr_db"] is not None]
    return {"psnr_db": min(psnrs) if psnrs else None, "max_diff": max(d["max_diff"] for d in drifts)}


def clip_drift(clip: list, reference_clip: list) -> dict:
    """A clip against the reference clip (the same prompt and seed under eager fp32), frame by frame.

    Per frame: PSNR (None where the frames are identical) and SSIM. Summed up: the worst frame (lowest PSNR,
    1-based; None when every frame matches) and its PSNR (`psnr_db`), the median frame's PSNR, the lowest
    SSIM, the largest pixel difference over the clip, and the temporal flicker (`flicker`)."""
    if len(clip) != len(reference_clip):
        raise ValueError(f"clips of different lengths: {len(clip)} vs {len(reference_clip)} frames")
    if not clip:
        raise ValueError("a clip needs at least one frame")
    drifts = [image_drift(a, b) for a, b in zip(clip, reference_clip, strict=True)]
    psnrs = [d["psnr_db"] for d in drifts]
    differing = [i for i, p in enumerate(psnrs) if p is not None]
    worst = min(differing, key=lambda i: psnrs[i]) if differing else None
    ssims = [ssim(a, b) for a, b in zip(clip, reference_clip, strict=True)]
    transitions = flicker(clip, reference_clip)
    return {"frames": len(clip), "frame_psnr_db": psnrs, "frame_ssim": ssims,
            "psnr_db": None if worst is None else psnrs[worst], "median_psnr_db": _median_psnr(psnrs),
            "worst_frame": None if worst is None else worst + 1, "ssim": min(ssims),
            "max_diff": max(d["max_diff"] for d in drifts),
            "flicker": float(np.mean(transitions)) if transitions else None, "transition_flicker": transitions}


def _median_psnr(psnrs: list) -> float | None:
    """The median frame's PSNR, identical frames counted as infinitely close (None when the median one is)."""
    ordered = sorted(math.inf if p is None else p for p in psnrs)
    mid = len(ordered) // 2
    value = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return None if math.isinf(value) else value


def flicker(clip: list, reference_clip: list) -> list[float]:
    """Temporal flicker, per transition between consecutive frames: the mean absolute difference (pixel levels,
    0-255) between this clip's frame-to-frame change and the reference's, |(f[t] - f[t-1]) - (r[t] - r[t-1])|.

    It is how much the clip's error against the reference changes from one frame to the next: an error that
    stays put (a constant offset, a steady blur) gives 0, one that moves or shimmers gives more. Empty for a
    single frame."""
    error = [to_array(a).astype(np.float64) - to_array(b).astype(np.float64)
             for a, b in zip(clip, reference_clip, strict=True)]
    return [float(np.mean(np.abs(after - before))) for before, after in zip(error, error[1:], strict=False)]


def frame_change(frames: list) -> float | None:
    """A clip's own motion: the mean absolute change (0-255) between consecutive frames (None for one frame)."""
    if len(frames) < 2:
        return None
    arrays = [to_array(f).astype(np.float64) for f in frames]
    return float(np.mean([np.mean(np.abs(b - a)) for a, b in zip(arrays, arrays[1:], strict=False)]))


def fmt_clip_drift(drift: dict) -> str:
    """A clip's drift on one line: 'identical', or the median and worst frame's PSNR, the lowest SSIM, the largest
    pixel difference and the flicker."""
    if not drift.get("max_diff"):
        return "identical" if drift.get("max_diff") == 0 else "—"
    median = drift["median_psnr_db"]
    text = (f"PSNR median {'identical' if median is None else f'{median:.1f} dB'}, worst "
            f"{drift['psnr_db']:.1f} dB (frame {drift['worst_frame']}/{drift['frames']}), SSIM {drift['ssim']:.3f}, "
            f"max diff {drift['max_diff']}")
    return text + ("" if drift.get("flicker") is None else f", flicker {drift['flicker']:.2f} px")


def fmt_drift(psnr_db, max_diff) -> str:
    """'identical', '48.2 dB / 6' (PSNR / largest pixel difference), or '—' when not measured."""
    if max_diff is None:
        return "—"
    if max_diff == 0:
        return "identical"
    return f"{psnr_db:.1f} dB / {max_diff}"


def sample_prompts(preset, n: int, seed: int, fallback: str, held_out: bool = False) -> list[str]:
    """`n` prompts for quality samples: random prompts of the model's grammar (seeded; training prompts,
    or the held-out ones), else the bench's own prompt each time."""
    if preset.fidelity in ("shapes", "shapes-video"):
        if preset.fidelity == "shapes":
            from training.shapes.grammar import HELD_OUT, training_prompts
        else:
            from training.shapes.video_grammar import HELD_OUT, training_prompts

        pool = list(HELD_OUT if held_out else training_prompts())
        rng = random.Random(seed)
        return [rng.choice(pool).text for _ in range(n)]
    return [fallback] * n


@dataclass(frozen=True)
class EditSample:
    """A quality sample of a preset that edits: the instruction, the source picture it edits (at the output
    size), and, for the embedded edit model, the grammar's edit the two mean (None: drift only)."""

    prompt: str
    source: Image.Image
    edit: object | None = None


def edit_sample(preset, instruction: str, source: Image.Image) -> EditSample:
    """`instruction` on `source` as a sample: for a preset with an edit checker, the scene the checker reads in
    the source and the instruction parsed against it (an edit outside the grammar is not scored)."""
    if preset.fidelity != "shapes-edit":
        return EditSample(instruction, source)
    from training.shapes.edits import parse_edit
    from training.shapes.fidelity import read
    from training.shapes.grammar import Prompt

    seen = read(source)
    scene = Prompt(seen.colour, seen.shape, seen.background) if None not in (seen.colour, seen.shape,
                                                                              seen.background) else None
    return EditSample(instruction, source, parse_edit(instruction, scene) if scene else None)


def sample_edits(preset, n: int, seed: int, fallback: str, size, held_out: bool = False) -> list[EditSample]:
    """`n` edits for quality samples at `size`: for the embedded edit model, seeded random edits of its grammar
    (training edits, or the held-out ones) on sources rendered as its training drew them; else the bench's own
    prompt on a plain grey source each time."""
    if preset.fidelity != "shapes-edit":
        grey = Image.new("RGB", (size.width, size.height), (128, 128, 128))
        return [EditSample(fallback, grey)] * n
    from training.shapes.edits import held_out_edits, training_edits
    from training.shapes.grammar import render

    pool = list(held_out_edits() if held_out else training_edits())
    rng = random.Random(seed)
    edits = [rng.choice(pool) for _ in range(n)]
    return [EditSample(e.instruction, render(e.source, size.width, size.height, rng=seed + i), e)
            for i, e in enumerate(edits)]


def _edit_checker() -> Callable:
    from training.shapes.edit_fidelity import edit_fidelity

    def check(image, sample) -> bool | None:
        if not isinstance(sample, EditSample) or sample.edit is None:
            return None  # a plain prompt, or an edit outside the grammar: nothing to score
        return edit_fidelity(sample.source, Image.fromarray(to_array(image)), sample.edit).correct

    return check


def fidelity_checker(preset, style: str | None = None) -> Callable | None:
    """(image, prompt) -> correct? (None for a prompt outside the grammar: nothing to score), for presets
    whose model draws a closed grammar; None for other presets. With a LoRA `style` on, an image is checked
    against what the style implies (the embedded model's styles); a style the checker does not know: None.
    The edit model's checker takes (image, EditSample): the changed attribute right, the rest and the
    object's place and size kept; a video preset's, (clip, prompt) (CLIP_CHECKERS)."""
    if preset.fidelity == "shapes-edit" and style is None:
        return _edit_checker()
    if preset.fidelity == "shapes-video":
        return shapes_video_correct  # also CLIP_CHECKERS' entry for it, as Compare looks clip checkers up
    if preset.fidelity != "shapes":
        return None
    from training.shapes.fidelity import check
    from training.shapes.grammar import parse_prompt

    if style is None:
        return lambda image, prompt: check(to_array(image), prompt).correct if parse_prompt(prompt) else None
    from training.shapes import styles  # imports torch: only where a style is scored

    if style not in styles.STYLES:
        return None
    return lambda image, prompt: (styles.check(Image.fromarray(to_array(image)), prompt, style).correct
                                  if parse_prompt(prompt) else None)


# A video preset's `fidelity` -> its clip checker, "module:function" taking (frames, prompt) -> correct? (None: a
# prompt outside its grammar), looked up by value as `fidelity_checker` does an image preset's. A video preset
# whose value is not listed here has no fidelity figure.
CLIP_CHECKERS: dict[str, str] = {"shapes-video": "bench.quality:shapes_video_correct"}


def clip_checker(preset) -> Callable | None:
    """(frames, prompt) -> correct? for a video preset with a clip checker; None for any other preset."""
    target = CLIP_CHECKERS.get(preset.fidelity or "") if preset.video else None
    if target is None:
        return None
    import importlib

    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def shapes_video_correct(clip, prompt: str) -> bool | None:
    """The moving-shapes grammar's clip checker: a clip (its frames: a list of images or arrays, or an
    (frames, h, w, 3) array) is right when every frame reads right and so does the direction of motion
    (training/shapes/video_fidelity.py); None for a prompt outside the grammar or a lone picture."""
    from training.shapes import video_fidelity
    from training.shapes.video_grammar import parse_prompt

    if parse_prompt(prompt) is None or isinstance(clip, bytes | bytearray | Image.Image):
        return None
    frames = list(clip)  # uint8 frames (an MP4's) or floats in [0, 1] (a pipeline's): the checker takes both
    return video_fidelity.check(frames, prompt).correct if len(frames) > 1 else None


def score(images: list, prompts: list[str], reference: list | None, preset, style: str | None = None) -> dict:
    """One configuration's quality over its samples: drift of each image against the reference image of
    the same prompt and seed (the worst sample kept) and, where the preset has a checker, fidelity (the
    share of scorable prompts drawn right; prompts outside the grammar are not counted)."""
    drift = worst_drift([image_drift(a, b) for a, b in zip(images, reference, strict=True)]) if reference else \
        {"psnr_db": None, "max_diff": None}
    ssims = [ssim(a, b) for a, b in zip(images, reference, strict=True)] if reference else []
    row = {"drift_psnr_db": drift["psnr_db"], "drift_max_diff": drift["max_diff"],
           "drift_ssim": min(ssims) if ssims else None, "quality_samples": len(prompts)}
    checker = fidelity_checker(preset, style)
    if checker is not None:
        verdicts = [v for v in (checker(img, p) for img, p in zip(images, prompts, strict=True)) if v is not None]
        row["fidelity"] = sum(verdicts) / len(verdicts) if verdicts else None
        row["fidelity_samples"] = len(verdicts)
    return row


def measure(configs: list, draw: Callable, prompts: list[str], seeds: list[int], preset) -> dict:
    """For every configuration (precision, mode, size): drift against the reference configuration of the
    same size and, where the preset has a checker, fidelity. `draw(config, prompt, seed)` -> PNG bytes."""
    images = {c: [draw(c, p, s) for p, s in zip(prompts, seeds, strict=True)] for c in configs}
    return {c: score(images[c], prompts, images.get((REFERENCE[0], REFERENCE[1], c[2])), preset) for c in configs}
