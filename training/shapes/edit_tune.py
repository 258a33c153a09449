"""The last stage of tiny-shapes-edit: tune the edit folder's decoder on latents the trained edit transformer
writes, against the scene each describes (read with the exact rules), as tiny-shapes' own last stage does.

Why: on the 328 held-out edits, the edit transformer's latents read with the exact rules (no decoder) were
right far more often than the pictures the decoder drew from them: the decoder, trained on analytic and
corrupted latents and on tiny-shapes' samples, draws the edit transformer's not-quite-constant fields a
pixel or two off, and the edit checker asks for the object's box kept to IoU 0.8. The figures are in
docs/embedded-model.md. Only training edits are sampled (the held-out ones stay unseen); 64x64, the size the
edit model was trained at. The encoder (references) is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from training.shapes import grammar
from training.shapes.edit_continue import encoder_steps
from training.shapes.edit_train import MAX_SEQUENCE_LENGTH, SIZE, STEPS, EditSettings, render, save_vae
from training.shapes.edits import training_edits
from training.shapes.sampling import unpack
from training.shapes.train import tune_decoder_on
from training.shapes.training import Settings

logger = logging.getLogger(__name__)

CHUNK = 32  # edits sampled per pipeline call


@torch.no_grad()
def sampled_pool(pipe, settings: EditSettings) -> list[tuple[int, int, torch.Tensor]]:
    """(width, height, latents) chunks: the latents the pipeline's transformer writes (un-normalised, as its VAE
    decodes them) for random training edits on rendered sources, `settings.tune_pool` in all."""
    generator = torch.Generator().manual_seed(settings.seed + 30)
    edits = training_edits()
    pool = []
    for start in range(0, settings.tune_pool, CHUNK):
        picks = [edits[int(i)] for i in torch.randint(0, len(edits), (min(CHUNK, settings.tune_pool - start),),
                                                      generator=generator)]
        sources = grammar.to_pil(render([e.source for e in picks], grammar.sample_boxes(len(picks), SIZE, SIZE,
                                                                                       generator)))
        noise = [torch.Generator().manual_seed(settings.seed + 40 + start + i) for i in range(len(picks))]
        packed = pipe(image=sources, prompt=[e.instruction for e in picks], width=SIZE, height=SIZE,
                      max_area=SIZE * SIZE, _auto_resize=False, num_inference_steps=STEPS,
                      max_sequence_length=MAX_SEQUENCE_LENGTH, generator=noise, output_type="latent").images
        config = pipe.vae.config
        pool.append((SIZE, SIZE, unpack(packed, SIZE, SIZE) / config.scaling_factor + config.shift_factor))
    return pool


def tune(out: Path, settings: EditSettings) -> None:
    """Tune the decoder of the exported folder `out` in place and record the stage in its training.json."""
    from training.shapes.edit_eval import load_edit_pipeline

    torch.set_num_threads(settings.threads)
    started = time.perf_counter()
    pipe = load_edit_pipeline(out)
    pool = sampled_pool(pipe, settings)
    logger.info("sampled %d edit latents in %.0f s", sum(len(z) for *_, z in pool), time.perf_counter() - started)
    vae = pipe.vae.requires_grad_(False)
    vae.decoder.requires_grad_(True)
    tuning = dataclasses.replace(Settings(), tune_steps=settings.tune_steps, tune_lr=settings.tune_lr)
    tune_decoder_on(vae, pool, tuning, settings.seed + 31)
    save_vae(vae.requires_grad_(False), Path(out) / "vae")
    recipe_path = Path(out) / "training.json"
    recipe = json.loads(recipe_path.read_text())
    this_round = {"sampled_edits": settings.tune_pool, "steps": settings.tune_steps, "lr": settings.tune_lr,
                  "minutes": round((time.perf_counter() - started) / 60, 1),
                  "encoder": f"{encoder_steps(recipe):,} steps"}
    recipe["decoder_tuning"] = this_round  # the last round; every round, in order, below
    recipe["decoder_tuning_rounds"] = [*recipe.get("decoder_tuning_rounds", []), this_round]
    recipe_path.write_text(json.dumps(recipe, indent=2) + "\n")
    logger.info("tuned the decoder of %s in %.1f min", out, (time.perf_counter() - started) / 60)
