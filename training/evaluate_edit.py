"""`python -m training.evaluate_edit`: held-out accuracy of tiny-shapes-edit and of the img2img baseline.

Every held-out (instruction, source) combination (training.shapes.edits.HELD_OUT rule), `--seeds` sources
each (a random box per source and seed), 64x64, eager float32, 8 steps:

- tiny-shapes-edit through the stock FluxKontextPipeline (`_auto_resize=False`, `max_area` 64*64);
- the baseline: FluxImg2ImgPipeline from tiny-shapes' own folder, strength 0.6, the whole target prompt
  ("a green circle on a blue background"), on the same sources.

Prints the share the edit checker (training.shapes.edit_fidelity) reads right, split per instruction kind,
the share whose attributes read right whatever the geometry, and the median IoU of the object's box
against the source's. `--train-sample N` also scores N random training combinations (seen instructions and
sources, new boxes). `--compile` scores the held-out edits again with the transformer under torch.compile
(same sources and seeds) and prints the largest pixel difference to eager.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from training.shapes import edit_eval
from training.shapes.edits import held_out_edits, training_edits


def _report(name: str, scores: edit_eval.EditScores, seconds: float) -> dict:
    kinds = scores.per_kind()
    split = ", ".join(f"{k} {r}/{n} ({r / max(1, n):.1%})" for k, (r, n) in kinds.items())
    print(f"{name}: {scores.accuracy:.1%} right of {len(scores.scores)} ({split}); attributes right "
          f"{scores.attributes_right():.1%}; box IoU median {scores.iou_median():.2f}; {seconds:.0f} s")
    return {"accuracy": round(scores.accuracy, 4), "per_kind": {k: list(v) for k, v in kinds.items()},
            "attributes_right": round(scores.attributes_right(), 4), "iou_median": round(scores.iou_median(), 3),
            "n": len(scores.scores)}


def evaluate(model: Path, seeds: int, seed: int, baseline: bool, train_sample: int, compile_: bool = False) -> dict:
    edits = list(held_out_edits()) * seeds
    sources = edit_eval.sources_for(edits, seed)
    result = {}
    started = time.perf_counter()
    pipe = edit_eval.load_edit_pipeline(model)
    eager = edit_eval.run_kontext(pipe, edits, sources, seed)
    scores = edit_eval.score_edits(edits, sources, eager)
    result["held_out"] = _report("tiny-shapes-edit, held out (FluxKontextPipeline)", scores,
                                 time.perf_counter() - started)
    if compile_:
        result["held_out_compile"] = _compiled(pipe, edits, sources, seed, eager)
    started = time.perf_counter()
    exact = edit_eval.exact_references(pipe, edits, edit_eval.source_boxes(edits, seed))
    result["held_out_exact_reference"] = _report(
        "tiny-shapes-edit, held out, reference given as the source's exact latents (no VAE encoder)",
        edit_eval.score_edits(edits, sources, edit_eval.run_kontext(pipe, edits, exact, seed)),
        time.perf_counter() - started)
    if train_sample:
        generator = torch.Generator().manual_seed(seed + 1)
        pool = training_edits()
        seen = [pool[int(i)] for i in torch.randint(0, len(pool), (train_sample,), generator=generator)]
        seen_sources = edit_eval.sources_for(seen, seed + 1)
        started = time.perf_counter()
        seen_scores = edit_eval.score_edits(seen, seen_sources, edit_eval.run_kontext(pipe, seen, seen_sources, seed))
        result["training"] = _report("tiny-shapes-edit, training combinations", seen_scores,
                                     time.perf_counter() - started)
    if baseline:
        started = time.perf_counter()
        base = edit_eval.load_img2img_baseline()
        base_scores = edit_eval.score_edits(edits, sources, edit_eval.run_img2img(base, edits, sources, seed))
        result["img2img_baseline"] = _report(
            f"baseline, held out (FluxImg2ImgPipeline on tiny-shapes, strength {edit_eval.BASELINE_STRENGTH}, "
            "target prompt)", base_scores, time.perf_counter() - started)
    return result


def _compiled(pipe, edits, sources, seed: int, eager) -> dict:
    """The held-out edits again with the transformer under torch.compile, and the largest pixel difference."""
    eager_transformer = pipe.transformer
    pipe.transformer = torch.compile(eager_transformer)
    try:
        started = time.perf_counter()
        compiled = edit_eval.run_kontext(pipe, edits, sources, seed)
        report = _report("tiny-shapes-edit, held out, transformer under torch.compile",
                         edit_eval.score_edits(edits, sources, compiled), time.perf_counter() - started)
    finally:
        pipe.transformer = eager_transformer
    report["max_pixel_diff_vs_eager"] = max(int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())
                                            for a, b in zip(compiled, eager, strict=True))
    print(f"  largest pixel difference to eager: {report['max_pixel_diff_vs_eager']}/255")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate_edit", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=edit_eval.DEFAULT_OUT, help="the FluxKontextPipeline folder")
    parser.add_argument("--seeds", type=int, default=1, help="sources per held-out combination")
    parser.add_argument("--seed", type=int, default=0, help="boxes and noise")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also score img2img on tiny-shapes")
    parser.add_argument("--train-sample", type=int, default=0, help="also score N training combinations")
    parser.add_argument("--compile", action="store_true", help="also the held-out edits under torch.compile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if not (args.model / "model_index.json").is_file():
        parser.error(f"no pipeline folder at {args.model}; train it with python -m training.train_edit")
    result = evaluate(args.model, args.seeds, args.seed, args.baseline, args.train_sample, args.compile)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
