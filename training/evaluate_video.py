"""`python -m training.evaluate_video`: how often tiny-shapes-video draws its prompts right, by the clip checker.

Loads the folder with the stock `WanPipeline.from_pretrained` (as the app does) and draws, at 32x32 and 17
frames with the preset's 8 steps and no guidance: every held-out prompt (never trained) with several seeds,
and a seeded sample of training prompts. Prints the share of clips fully right and per part (shape and
colours in every frame, direction of motion), in eager fp32 and, with --compile, with the transformer under
torch.compile (the same seeds; the largest pixel difference to eager is printed too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from training.shapes import video_fidelity
from training.shapes import video_grammar as vgrammar
from training.shapes import video_sampling as vs
from training.shapes.samples import PROMPT_SEED

BATCH = 16


def load(model: Path, dtype=torch.float32):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts, seeds, frames: int = 17, size: int = vs.SIZE, steps: int = vs.DEFAULT_STEPS
             ) -> np.ndarray:
    """Clips (n, frames, size, size, 3) as float arrays in [0, 1], one generator per (prompt, seed)."""
    clips = []
    for start in range(0, len(prompts), BATCH):
        chunk = slice(start, start + BATCH)
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds[chunk]]
        out = pipe(prompt=[p.text for p in prompts[chunk]], height=size, width=size, num_frames=frames,
                   num_inference_steps=steps, guidance_scale=1.0, generator=generators, output_type="np",
                   max_sequence_length=vs.MAX_SEQUENCE_LENGTH)
        clips.append(np.asarray(out.frames))
    return np.concatenate(clips)


def sample(seeds_per_prompt: int, train_sample: int):
    """(prompts, seeds) of the held-out set (every prompt x seeds) and of a training sample."""
    held = [p for p in vgrammar.HELD_OUT for _ in range(seeds_per_prompt)]
    held_seeds = [i % seeds_per_prompt for i in range(len(held))]
    train = vs.eval_prompts(train_sample, PROMPT_SEED)
    return (held, held_seeds), (train, list(range(100, 100 + train_sample)))


def score(clips, prompts) -> dict[str, float]:
    return video_fidelity.rates([video_fidelity.check(list(c), p) for c, p in zip(clips, prompts, strict=True)])


def evaluate(model: Path, compile_: bool = False, seeds_per_prompt: int = 4, train_sample: int = 96,
             frames: int = 17) -> dict:
    pipe = load(model)
    (held, held_seeds), (train, train_seeds) = sample(seeds_per_prompt, train_sample)
    report = {"size": f"{vs.SIZE}x{vs.SIZE}", "frames": frames, "steps": vs.DEFAULT_STEPS,
              "held_out_clips": len(held), "train_clips": len(train)}
    variants = [("eager", pipe.transformer)]
    if compile_:
        variants.append(("compile", torch.compile(pipe.transformer)))
    eager_clips = None
    for name, transformer in variants:
        pipe.transformer = transformer
        generate(pipe, held[:BATCH], held_seeds[:BATCH], frames)  # warm-up (compilation) is not timed
        started = time.perf_counter()
        held_clips = generate(pipe, held, held_seeds, frames)
        seconds = (time.perf_counter() - started) / len(held)
        row = {"held_out": score(held_clips, held), "train": score(generate(pipe, train, train_seeds, frames), train),
               "seconds_per_clip": round(seconds, 3)}
        if eager_clips is None:
            eager_clips = held_clips
        else:
            row["max_pixel_diff_vs_eager"] = int(np.abs(np.round(held_clips * 255) - np.round(eager_clips * 255)).max())
        report[name] = row
    return report


def format_report(report: dict) -> str:
    lines = [f"tiny-shapes-video at {report['size']} x {report['frames']} frames, {report['steps']} steps: "
             f"{report['held_out_clips']} held-out clips, {report['train_clips']} training-prompt clips",
             f"{'mode':8s} {'set':9s} {'right':>6s} {'shape':>6s} {'colours':>8s} {'direction':>10s}"]
    for mode in ("eager", "compile"):
        if mode not in report:
            continue
        for part in ("held_out", "train"):
            r = report[mode][part]
            lines.append(f"{mode:8s} {part:9s} {100 * r['right']:5.1f}% {100 * r['shape']:5.1f}% "
                         f"{100 * r['colours']:7.1f}% {100 * r['direction']:9.1f}%")
        extra = report[mode].get("max_pixel_diff_vs_eager")
        lines.append(f"{mode:8s} {report[mode]['seconds_per_clip']:.3f} s per clip (batch {BATCH})"
                     + ("" if extra is None else f"; largest pixel difference to eager {extra}/255"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate_video", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-shapes-video"))
    parser.add_argument("--compile", action="store_true", help="also with the transformer under torch.compile")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per held-out prompt")
    parser.add_argument("--train-sample", type=int, default=96, help="training prompts drawn (one seed each)")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = evaluate(args.model, args.compile, args.seeds, args.train_sample, args.frames)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
