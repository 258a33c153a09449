"""Measure the embedded shapes model through the real pipeline: fidelity per bucket, on held-out prompts,
fp32 against bf16, and the latency of one 64x64 image.

Everything goes through `FluxPipeline.from_pretrained(folder)` and `pipe(...)` with the preset's settings,
so the numbers are what the app serves. The definitions (also in docs/embedded-model.md):

- fidelity: share of images the checker (training.shapes.fidelity) reads as right on all three attributes;
  per bucket, `n` random training prompts with random seeds (one seed per image, drawn from `seed`);
- held out: every held-out prompt with `held_out_seeds` seeds each, at 64x64;
- latency: median wall time of the whole `pipe(...)` call (text encoding, denoising, VAE decode) for one
  64x64 image in float32, after warm-up.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from engine.metrics import median
from training.shapes import grammar
from training.shapes.fidelity import check
from training.shapes.train import BUCKETS, DEFAULT_OUT, DEFAULT_STEPS, MAX_SEQUENCE_LENGTH

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load(model_dir: Path | str = DEFAULT_OUT, dtype: torch.dtype = torch.float32):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(model_dir), dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts, seeds, width: int, height: int, steps: int = DEFAULT_STEPS, batch: int = 25):
    """PIL images, one per (prompt, seed); batched, with one generator per image (as separate calls)."""
    images = []
    for start in range(0, len(prompts), batch):
        chunk = [str(p) for p in prompts[start : start + batch]]
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds[start : start + batch]]
        images += pipe(
            chunk,
            width=width,
            height=height,
            num_inference_steps=steps,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            generator=generators,
        ).images
    return images


def fidelity(pipe, prompts, seeds, width: int, height: int, steps: int = DEFAULT_STEPS) -> float:
    images = generate(pipe, prompts, seeds, width, height, steps)
    return sum(check(i, p).correct for i, p in zip(images, prompts, strict=True)) / len(prompts)


def random_cases(n: int, seed: int, held_out: bool = False) -> tuple[list, list[int]]:
    rng = np.random.default_rng(seed)
    source = grammar.HELD_OUT if held_out else grammar.training_prompts()
    prompts = [source[i] for i in rng.integers(0, len(source), n)]
    return prompts, [int(s) for s in rng.integers(0, 2**31, n)]


def held_out_cases(seeds_each: int, seed: int) -> tuple[list, list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [p for p in grammar.HELD_OUT for _ in range(seeds_each)]
    return prompts, [int(s) for s in rng.integers(0, 2**31, len(prompts))]


def latency_ms(pipe, runs: int = 20, warmup: int = 3, steps: int = DEFAULT_STEPS) -> float:
    def once():
        pipe(
            "a red circle on a blue background",
            width=64,
            height=64,
            num_inference_steps=steps,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            generator=torch.Generator().manual_seed(0),
        )

    for _ in range(warmup):
        once()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    return 1000 * median(times)


def evaluate(
    model_dir: Path | str = DEFAULT_OUT,
    n: int = 100,
    held_out_seeds: int = 4,
    seed: int = 0,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    buckets: tuple[tuple[int, int], ...] = BUCKETS,
    latency_runs: int = 20,
    steps: int = DEFAULT_STEPS,
) -> dict:
    """The fidelity table as a dict: {dtype: {bucket or "held-out 64x64": share}, "latency_ms": median}."""
    results: dict = {}
    for name in dtypes:
        pipe = load(model_dir, DTYPES[name])
        row = {}
        for i, (width, height) in enumerate(buckets):
            prompts, seeds = random_cases(n, seed + i)
            row[f"{width}x{height}"] = fidelity(pipe, prompts, seeds, width, height, steps)
            logger.info("%s %dx%d: %.3f", name, width, height, row[f"{width}x{height}"])
        prompts, seeds = held_out_cases(held_out_seeds, seed + 100)
        row["held-out 64x64"] = fidelity(pipe, prompts, seeds, 64, 64, steps)
        logger.info("%s held out: %.3f", name, row["held-out 64x64"])
        results[name] = row
        if name == "fp32" and latency_runs:
            results["latency_ms"] = latency_ms(pipe, latency_runs, steps=steps)
    return results


def format_table(results: dict) -> str:
    dtypes = [k for k in results if k in DTYPES]
    columns = list(results[dtypes[0]])
    lines = ["| precision | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in dtypes:
        lines.append(f"| {name} | " + " | ".join(f"{100 * results[name][c]:.1f} %" for c in columns) + " |")
    if "latency_ms" in results:
        lines.append(f"\nOne 64x64 image, fp32, whole pipe() call: median {results['latency_ms']:.1f} ms")
    return "\n".join(lines)
