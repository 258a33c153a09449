"""Print the embedded shapes model's fidelity table (per bucket, held out, fp32 vs bf16) and its latency.

    HF_HUB_OFFLINE=1 python scripts/eval_embedded.py [--model models/tiny-shapes] [--n 100] [--json out.json]

The numbers in docs/embedded-model.md come from this script (training.shapes.evaluate holds the definitions).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from training.shapes import evaluate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-shapes"))
    parser.add_argument("--n", type=int, default=100, help="random prompts x seeds per bucket")
    parser.add_argument("--held-out-seeds", type=int, default=4, help="seeds per held-out prompt")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--latency-runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=evaluate.DEFAULT_STEPS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = evaluate.evaluate(
        args.model,
        n=args.n,
        held_out_seeds=args.held_out_seeds,
        dtypes=tuple(args.dtypes.split(",")),
        latency_runs=args.latency_runs,
        steps=args.steps,
    )
    print(evaluate.format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
