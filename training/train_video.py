"""`python -m training.train_video`: train tiny-shapes-video and write models/tiny-shapes-video.

A thin command line over training.shapes.video_train: the decoder, the transformer (independent: they may run
side by side with `--stage decoder` and `--stage transformer`), the decoder tuned on the transformer's own
samples, then the export. Fixed seeds; checkpoints in .cache/train-video; `--minutes M` stops at a checkpoint
once M minutes of training have passed and a rerun resumes. Training never runs as part of the app or tests.
"""

from __future__ import annotations

import logging
import sys

from training.shapes import video_train
from training.shapes.training import override_settings, training_parser
from training.shapes.video_sampling import Architecture


def main(argv: list[str] | None = None) -> int:
    parser = training_parser("python -m training.train_video", __doc__, video_train.DEFAULT_OUT,
                             video_train.DEFAULT_CACHE, "--set steps=1500 or --set arch='{\"layers\": 2}'")
    parser.add_argument("--stage", choices=("decoder", "transformer", "tune", "export", "all"), default="all")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = video_train.VideoSettings()
    override_settings(settings, args.set, parser.error)
    if isinstance(settings.arch, dict):
        settings.arch = Architecture(**settings.arch)
    if not video_train.run(args.stage, args.out, args.cache, args.minutes, settings):
        logging.getLogger(__name__).warning("stopped at a checkpoint (--minutes); rerun to resume")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
