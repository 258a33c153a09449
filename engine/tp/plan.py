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

Context parallel (Ulysses, Ring: every rank holds the whole denoiser and 1/N of the tokens), `check_context`:
the class has a `_cp_plan`; each sequence that plan splits (image and text tokens, at every bucket) divides
by N; Ulysses also splits the attention heads N ways; the attention backend runs the layout on this device
(engine/pipeline/attention.py: Ring needs one that returns the log-sum-exp); the weights fit unsharded (no `min_tp`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError, UnsupportedCombination
from engine.families import registry
from engine.protocol import Parallel

log = logging.getLogger(__name__)


class TensorParallelSplitError(UnsupportedCombination):
    """The model cannot be split over this many ranks; the message names the module and N."""


@dataclass(frozen=True)
class ContextLayout:
    degree_field: str  # the ContextParallelConfig field set to the number of ranks
    splits_heads: bool  # Ulysses' all-to-all hands each rank 1/N of the heads
    summary: str


CONTEXT_LAYOUTS: dict[Parallel, ContextLayout] = {
    Parallel.ULYSSES: ContextLayout("ulysses_degree", True,
                                    "Ulysses: all-to-all swaps the token split for a head split around attention"),
    Parallel.RING: ContextLayout("ring_degree", False,
                                 "Ring: each rank keeps its tokens and passes K/V round the ring, merging by LSE"),
}


def _image_tokens(preset, size) -> int:
    # Packed latents: one token per (vae_scale_factor * 2)-pixel square, which is the preset's alignment.
    return (size.width // preset.alignment) * (size.height // preset.alignment)


def _text_tokens(preset, size) -> int | None:
    return preset.max_sequence_length or _pipeline_default(preset.pipeline, "max_sequence_length")


# How many tokens each sequence a family's denoiser splits for context parallel (PipelineFamily.cp_sequences)
# has at a bucket (the text is padded to max_sequence_length). A family that lists none is checked by
# diffusers at run time.
SEQUENCE_TOKENS = {"image": _image_tokens, "text": _text_tokens}


def _pipeline_default(pipeline: str, argument: str):
    import inspect

    import diffusers

    parameter = inspect.signature(getattr(diffusers, pipeline).__call__).parameters.get(argument)
    return parameter.default if parameter is not None and isinstance(parameter.default, int) else None


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


def check_context(preset, source: str, n: int, parallel: Parallel, attention_backend: str, spec) -> list[str]:
    """Raise TensorParallelSplitError naming what to change if `preset` cannot run `parallel` (ulysses or ring)
    over `n` ranks; the notices of what was checked otherwise."""
    import diffusers

    from engine.pipeline import attention

    parallel = Parallel.parse(parallel, "parallel")
    layout = CONTEXT_LAYOUTS[parallel]
    what = f"{preset.name} over {n} ranks with context parallel ({parallel})"
    if preset.min_tp > 1:
        raise TensorParallelSplitError(
            f"cannot run {what}: the preset needs its weights sharded over at least {preset.min_tp} ranks, and "
            f"context parallel keeps the whole {preset.denoiser} on every rank; use --parallel tensor")
    try:
        attention.check_context_parallel(attention_backend, parallel, spec)
    except UnsupportedCombination as exc:
        raise TensorParallelSplitError(f"cannot run {what}: {exc}") from None
    index = _index(source)
    entry = index.get(preset.denoiser)
    if not entry or entry[0] != "diffusers":
        raise TensorParallelSplitError(f"cannot run {what}: model_index.json names {preset.denoiser} {entry!r}")
    cls_name = entry[1]
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ModelLoadError(f"{preset.denoiser} class {cls_name!r} is not in diffusers")
    if not getattr(cls, "_cp_plan", None):
        raise TensorParallelSplitError(
            f"cannot run {what}: diffusers has no context-parallel plan (_cp_plan) for {cls_name}; "
            "use --parallel tensor or tp=1")
    config = cls.load_config(source, subfolder=preset.denoiser)
    heads = config.get("num_attention_heads")
    if layout.splits_heads and heads is not None and heads % n:
        raise TensorParallelSplitError(
            f"cannot run {what}: Ulysses gives each rank 1/{n} of the attention heads and {cls_name} has "
            f"{heads}; pick tp from {_divisors(heads)}, or --parallel ring")
    notices = [f"context parallel ({parallel}) over {n} ranks: the whole {preset.denoiser} ({cls_name}) on every "
               f"rank, 1/{n} of the tokens each; {layout.summary}"]
    family = registry.find(preset.pipeline)
    sequences = [(name, SEQUENCE_TOKENS[name]) for name in family.cp_sequences] if family is not None else []
    if not sequences:
        notices.append(f"token counts of {cls_name} are not described here: diffusers checks that they divide "
                       f"by {n} at the first request")
        return notices
    for name, count in sequences:
        bad = [(size, count(preset, size)) for size in preset.buckets]
        bad = [(size, tokens) for size, tokens in bad if tokens is not None and tokens % n]
        if bad:
            listed = ", ".join(f"{size}: {tokens}" for size, tokens in bad)
            change = (f"set the preset's max_sequence_length to a multiple of {n}" if name == "text"
                      else "pick a tp that divides every bucket's count, or drop those buckets")
            raise TensorParallelSplitError(
                f"cannot run {what}: each rank takes 1/{n} of the {name} tokens, and they are not divisible by "
                f"{n} at {listed}; {change}")
    return notices


def check_layout(preset, source: str, n: int, parallel: Parallel, attention_backend: str = "native",
                 spec=None) -> list[str]:
    """The check for `parallel` over `n` ranks: check_split (tensor) or check_context (ulysses, ring)."""
    if n < 2:
        return []
    if Parallel.parse(parallel, "parallel").context:
        return check_context(preset, source, n, parallel, attention_backend, spec)
    check_split(preset, source, n)
    return []


def check_layout_if_local(preset, source: str, n: int, parallel: Parallel, attention_backend: str = "native",
                          spec=None) -> bool:
    """check_layout on the client, when the model is already on disk (a Hub id is checked in the ranks)."""
    if not (Path(source) / "model_index.json").is_file():
        log.debug("parallel-layout check for %s deferred to the ranks (not a local folder)", source)
        return False
    check_layout(preset, source, n, parallel, attention_backend, spec)
    return True
