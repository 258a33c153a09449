"""Train a part of tiny-shapes-edit on from its checkpoint and put it into the existing folder.

`continue_encoder`: the edit encoder from cache/encoder.ckpt on to `encoder_steps` (its cosine restarted over the
new total), written into the folder's VAE beside the folder's own tuned decoder.
`continue_transformer`: the transformer from cache/edit.ckpt (at `continue_from`) on to `steps` at `continue_lr`,
with references from the cache's encoder, exported with the folder's VAE kept.
Both record what they did in the folder's training.json; train_edit then tunes the decoder on what the folder
now writes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from training.shapes import edit_encoder, edit_train
from training.shapes.training import load_state

logger = logging.getLogger(__name__)


def _recipe(out: Path) -> dict:
    path = Path(out) / "training.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out} has no training.json: export the edit folder first (`--stage export`)")
    return json.loads(path.read_text())


def _add_reproduce(recipe: dict, command: str) -> None:
    recipe["reproduce"] = [*recipe.get("reproduce", ["python -m training.train_edit"]), command]


def _folder_vae(out: Path):
    from diffusers import AutoencoderTiny

    return AutoencoderTiny.from_pretrained(Path(out) / "vae", torch_dtype=torch.float32).eval()


def continue_encoder(out: Path, cache: Path, minutes: float | None, settings) -> bool:
    """Train the encoder on to settings.encoder_steps and put it into `out`. False when stopped at --minutes."""
    torch.set_num_threads(settings.threads)
    cache, out = Path(cache), Path(out)
    recipe = _recipe(out)
    before = load_state(cache / "encoder.ckpt")
    if before is None:
        raise FileNotFoundError(f"no encoder checkpoint in {cache}: train the edit model first")
    first = recipe.get("encoder_continued", {}).get("from", before["step"])
    _, tiny_vae = edit_train.load_components()
    trained, finished = edit_encoder.train_encoder(tiny_vae, settings, cache, minutes)
    if not finished:
        return False
    vae = _folder_vae(out)
    vae.encoder.load_state_dict(trained.encoder.state_dict())
    edit_train.save_vae(vae, out / "vae")
    steps = settings.encoder_steps
    recipe["encoder_continued"] = {"steps": steps, "from": first,
                                   "schedule": f"cosine restarted over {steps:,} steps at step {first:,}",
                                   **edit_encoder.encoder_accuracy(trained)}
    _add_reproduce(recipe, f"python -m training.train_edit --stage encoder --set encoder_steps={steps}")
    (out / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")
    logger.info("the encoder at %d steps is in %s", steps, out)
    return True


def continue_transformer(out: Path, cache: Path, minutes: float | None, settings) -> bool:
    """Train the transformer on from settings.continue_from to settings.steps and export it into `out`, keeping the
    folder's VAE and its record. False when stopped at --minutes."""
    if not settings.continue_from or settings.continue_from >= settings.steps:
        raise ValueError("--stage transformer needs --set continue_from=<the checkpoint's step> steps=<more>")
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    cache, out = Path(cache), Path(out)
    recipe = _recipe(out)
    state = load_state(cache / "edit.ckpt")
    if state is None or state["step"] < settings.continue_from:
        raise FileNotFoundError(f"{cache}/edit.ckpt is not at step {settings.continue_from} or later")
    _, tiny_vae = edit_train.load_components()
    encoder_vae = edit_encoder.load_trained(tiny_vae, settings, cache)
    if not edit_train.EditTraining(settings, cache, encoder_vae).run(minutes):
        return False
    kept = {key: recipe[key] for key in ("encoder_continued", "decoder_tuning", "decoder_tuning_rounds", "reproduce")
            if key in recipe}
    kept["transformer_continued"] = {"from": settings.continue_from, "steps": settings.steps,
                                     "lr": settings.continue_lr, "encoder": encoder_steps(recipe)}
    _add_reproduce(kept, f"python -m training.train_edit --stage transformer --set continue_from="
                         f"{settings.continue_from} --set steps={settings.steps}")
    edit_train.export(cache, out, _folder_vae(out), info=kept)
    return True


def encoder_steps(recipe: dict) -> int:
    """The steps of the encoder in the folder `recipe` describes."""
    return recipe.get("encoder_continued", {}).get("steps", recipe["settings"]["encoder_steps"])
