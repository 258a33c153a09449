"""`python -m training.train_edit`: train tiny-shapes-edit and write models/tiny-shapes-edit.

A thin command line over training.shapes.edit_train: first the edit folder's own VAE encoder
(training.shapes.edit_encoder: pixels to the analytic latents), then the tiny-shapes transformer fine-tuned in
FLUX.1 Kontext form on edits of the shapes grammar; fixed seeds; checkpoints in .cache/train-edit.
`--minutes M` stops at the next checkpoint once M minutes of training have passed and a rerun resumes; the
export runs when the last step is done (or alone with `--stage export`), then the decoder is tuned on what the
trained transformer writes (or alone with `--stage tune`). `--stage encoder --set encoder_steps=N` trains the
encoder on and puts it into the folder; `--stage transformer --set continue_from=N steps=M` trains the transformer
on from its step-N checkpoint with that encoder's references and exports it, keeping the folder's VAE; each then
tunes the decoder. Training never runs as part of the app or the tests.
"""

from __future__ import annotations

import argparse
import logging
import sys

from training.shapes import edit_continue, edit_train, edit_tune
from training.shapes.training import override_settings, training_parser


def main(argv: list[str] | None = None) -> int:
    parser = training_parser("python -m training.train_edit", __doc__, edit_train.DEFAULT_OUT,
                             edit_train.DEFAULT_CACHE, "--set steps=1500 (changes the result)")
    parser.add_argument("--stage", default="all",
                        choices=("train", "export", "tune", "encoder", "transformer", "all"), help="export: write the folder from the checkpoint, then tune its decoder; tune: only that; "
                             "encoder: train the encoder on to --set encoder_steps=N, put it into the folder, then "
                             "tune its decoder; transformer: train the transformer on from --set continue_from=N "
                             "to steps=M, export it keeping the folder's VAE, then tune its decoder")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="continue from the checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = edit_train.EditSettings()
    override_settings(settings, args.set, parser.error)
    if args.stage == "encoder":
        done = edit_continue.continue_encoder(args.out, args.cache, args.minutes, settings)
    elif args.stage == "transformer":
        done = edit_continue.continue_transformer(args.out, args.cache, args.minutes, settings)
    else:
        done = args.stage == "tune" or edit_train.run(args.out, args.cache, args.minutes, settings,
                                                      args.resume, args.stage)
    if not done:
        logging.getLogger(__name__).warning("stopped at a checkpoint (--minutes); rerun to resume")
        return 3
    if args.stage != "train":  # a folder was written (or is asked to be tuned again): its decoder is tuned last
        edit_tune.tune(args.out, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
