"""`python -m training.train_loras`: train the embedded model's LoRA styles into models/tiny-shapes-loras.

A thin command line over training.shapes.lora_train (fixed seeds: the committed adapters are reproduced
by one command). Never run by the app or the tests; they load the committed files.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from training.shapes import lora_train, styles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train_loras", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=lora_train.DEFAULT_MODEL, help="the base model folder")
    parser.add_argument("--out", type=Path, default=lora_train.DEFAULT_OUT, help="folder of the adapters")
    parser.add_argument("--style", action="append", choices=styles.STYLES, help="train only these (default all)")
    parser.add_argument("--steps", type=int, default=None, help="one round of this many steps (default: the "
                        "style's rounds, lora_train.STYLE_ROUNDS)")
    parser.add_argument("--go-on-from", type=int, default=0, metavar="ROUND",
                        help="start at this round (0-based) from the adapter already in --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = lora_train.LoraSettings(steps=args.steps)
    report = lora_train.run(tuple(args.style or styles.STYLES), args.model, args.out, settings, args.go_on_from)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
