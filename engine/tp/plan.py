"""Up-front checks that a model can be split N ways, with errors that name the module and N.

Run by the client before torchrun starts (when the model is on local disk) and by every rank before it
loads anything, so an impossible split fails in seconds with what to change rather than deep inside
`parallelize_module` or as ranks that disagree.

What is checked, per sharded component:
- transformer (diffusers): the class has a `_tp_plan`; every planned Linear block divides by N (the
  exact rule diffusers applies, `resolve_tp_shard_specs`, run on a meta-device model built from the
  config, so no weights are read); the attention heads divide by N; safetensors weights (each rank reads
  only its slice).
- text encoder (transformers, presets with tp_text_encoder): a `base_model_tp_plan`; attention and
  key/value heads divide by N; safetensors weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.errors import ModelLoadError, UnsupportedCombination

log = logging.getLogger(__name__)


class TensorParallelSplitError(UnsupportedCombination):
    """The model cannot be split over this many ranks; the message names the module and N."""


def _index(source: str) -> dict:
    path = Path(source) / "model_index.json"
    if path.is_file():
        return json.loads(path.read_text())
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(source)


def _weights(source: str, subfolder: str) -> list[str] | None:
    """Weight file names of a local component; None for a Hub id (diffusers checks the format itself)."""
    folder = Path(source) / subfolder
    if not folder.is_dir():
        return None
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"))


def _require_safetensors(source: str, subfolder: str, cls_name: str, tp: int) -> None:
    files = _weights(source, subfolder)
    if files is None:
        return
    if not any(f.endswith(".safetensors") for f in files):
        found = ", ".join(files) or "no weight files"
        raise TensorParallelSplitError(
            f"cannot shard {subfolder} ({cls_name}) over {tp} ranks: tensor parallel reads one slice of each "
            f"weight per rank, which needs safetensors files, but {Path(source) / subfolder} has {found}; "
            "convert the weights to safetensors or use tp=1"
        )


def check_transformer(source: str, subfolder: str, cls_name: str, tp: int) -> None:
    import diffusers
    import torch

    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ModelLoadError(f"{subfolder} class {cls_name!r} is not in diffusers")
    plan = getattr(cls, "_tp_plan", None)
    if not plan:
        raise TensorParallelSplitError(
            f"cannot shard {subfolder} ({cls_name}) over {tp} ranks: diffusers has no tensor-parallel plan "
            "(_tp_plan) for this class; use tp=1"
        )
    config = cls.load_config(source, subfolder=subfolder)
    heads = config.get("num_attention_heads")
    if heads is not None and heads % tp:
        raise TensorParallelSplitError(
            f"cannot shard {subfolder} ({cls_name}) over {tp} ranks: its {heads} attention heads are not "
            f"divisible by {tp}; pick tp from {_divisors(heads)}"
        )
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    with torch.device("meta"):
        model = cls.from_config(config)
    try:
        resolve_tp_shard_specs(model, plan, tp)
    except ValueError as exc:
        raise TensorParallelSplitError(f"cannot shard {subfolder} ({cls_name}) over {tp} ranks: {exc}") from None
    _require_safetensors(source, subfolder, cls_name, tp)


def check_text_encoder(source: str, subfolder: str, cls_name: str, tp: int) -> None:
    import transformers

    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ModelLoadError(f"{subfolder} class {cls_name!r} is not in transformers")
    config = transformers.AutoConfig.from_pretrained(source, subfolder=subfolder)
    text_config = getattr(config, "text_config", None) or config  # Mistral3 nests the language model
    plan = getattr(text_config, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise TensorParallelSplitError(
            f"cannot shard {subfolder} ({cls_name}) over {tp} ranks: transformers has no tensor-parallel plan "
            "(base_model_tp_plan) for it; set tp_text_encoder=false in the preset"
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(text_config, field, None)
        if n is not None and n % tp:
            raise TensorParallelSplitError(
                f"cannot shard {subfolder} ({cls_name}) over {tp} ranks: {field}={n} is not divisible by {tp}; "
                f"pick tp from {_divisors(n)}"
            )
    _require_safetensors(source, subfolder, cls_name, tp)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_split(preset, source: str, tp: int) -> None:
    """Raise TensorParallelSplitError naming the module and N if `preset` cannot run over `tp` ranks."""
    if tp < 2:
        return
    if not preset.tp:
        raise TensorParallelSplitError(f"preset {preset.name} has no tensor-parallel plan; use tp=1")
    index = _index(source)
    entry = index.get(preset.denoiser)
    if not entry or entry[0] != "diffusers":
        raise TensorParallelSplitError(
            f"cannot shard {preset.denoiser} of {preset.name} over {tp} ranks: model_index.json names {entry!r}"
        )
    check_transformer(source, preset.denoiser, entry[1], tp)
    if preset.tp_text_encoder:
        te = index.get("text_encoder")
        if not te or te[0] != "transformers":
            raise TensorParallelSplitError(
                f"cannot shard text_encoder of {preset.name} over {tp} ranks: model_index.json names {te!r}"
            )
        check_text_encoder(source, "text_encoder", te[1], tp)


def check_split_if_local(preset, source: str, tp: int) -> bool:
    """The client-side check: only when the model is already on disk (a Hub id is checked in the ranks,
    which download it anyway). Returns whether it ran."""
    if not (Path(source) / "model_index.json").is_file():
        log.debug("split check for %s deferred to the ranks (not a local folder)", source)
        return False
    check_split(preset, source, tp)
    return True
