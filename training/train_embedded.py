"""`python -m training.train_embedded`: train the embedded shapes model and write models/tiny-shapes.

A thin command line over training.shapes.train, so the shipped weights can be reproduced with one command.
Training never runs as part of the app or the tests; they load the committed folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from training.shapes import train
from training.shapes.training import override_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train_embedded", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=train.DEFAULT_OUT, help="diffusers folder to write")
    parser.add_argument("--cache", type=Path, default=train.DEFAULT_CACHE, help="checkpoints and logs")
    parser.add_argument("--stage", choices=("vae", "transformer", "tune", "export", "all"), default="all")
    parser.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=True, help="continue from checkpoints"
    )
    parser.add_argument(
        "--minutes", type=float, default=None, help="stop (checkpointed) after this budget; rerun to resume"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="override a training setting, e.g. --set steps=2000 --set depth=[2,2] (changes the result)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    settings = train.Settings()
    override_settings(settings, args.set, parser.error)
    try:
        train.run(args.stage, args.out, args.cache, args.resume, args.minutes, settings)
    except TimeoutError as stopped:
        logging.getLogger(__name__).warning("%s", stopped)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
