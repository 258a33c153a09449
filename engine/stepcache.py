"""diffusers step caches: which can run for a preset, device and mode, and why not, before anyone picks one.

A step cache reuses (or predicts) denoiser work from earlier steps instead of computing every step in
full. diffusers implements them as hooks a CacheMixin denoiser installs with `enable_cache(config)`:

- first-block (FirstBlockCacheConfig): the first transformer block always runs; when its output moved less
  than `threshold` (relative) since the last computed step, the other blocks are skipped and their cached
  residual added. Hooks sit on the blocks.
- magcache (MagCacheConfig): skips steps while the accumulated error predicted by per-step magnitude
  ratios stays under `threshold`; the ratios come from one calibration run per preset and step count
  (stored under the cache folder). Hooks sit on the blocks.
- taylorseer (TaylorSeerCacheConfig): computes every `interval`-th step in full after `warmup` steps and
  predicts the attention outputs in between from a Taylor expansion. Hooks sit on the attention layers.
- faster-cache (FasterCacheConfig), pyramid (PyramidAttentionBroadcastConfig): attention outputs are
  recomputed every `interval` steps within a timestep range and reused in between. Hooks sit on the
  attention layers.

Whether a choice runs depends on, in this order: the denoiser (a CacheMixin model with the blocks the
hooks look for), then the mode: eager (and defer-and-fuse, the same modules) takes every cache; regional
takes the block-level caches (the hooks wrap each compiled block from outside, so the warm graphs serve
unchanged); compile and aot are refused (one graph of the whole denoiser cannot skip its own blocks per
step), as are the attention-level caches under regional (their hooks would sit inside the compiled blocks).

`available_step_caches` returns every cache with `usable` and `why_not`; `check_step_cache` refuses an
unusable choice with UnsupportedCombination. Importing this module imports no torch.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from engine.errors import UnsupportedCombination
from engine.protocol import STEP_CACHE_FORMS, Mode, ModelPreset, StepCache, StepCacheKind

BLOCKS = "blocks"  # hooks on whole transformer blocks
ATTENTION = "attention"  # hooks on attention layers inside the blocks


@dataclass(frozen=True)
class CacheKind:
    kind: StepCacheKind
    config: str  # diffusers config class
    level: str  # where its hooks sit: BLOCKS or ATTENTION
    summary: str
    calibrated: bool = False


KINDS: dict[StepCacheKind, CacheKind] = {k.kind: k for k in (
    CacheKind(StepCacheKind.FIRST_BLOCK, "FirstBlockCacheConfig", BLOCKS,
              "skip the remaining blocks while the first block's output barely changes"),
    CacheKind(StepCacheKind.TAYLORSEER, "TaylorSeerCacheConfig", ATTENTION,
              "compute every INTERVAL-th step after WARMUP, predict attention outputs in between"),
    CacheKind(StepCacheKind.MAGCACHE, "MagCacheConfig", BLOCKS,
              "skip steps by calibrated residual-magnitude ratios (one calibration run per preset and steps)",
              calibrated=True),
    CacheKind(StepCacheKind.FASTER_CACHE, "FasterCacheConfig", ATTENTION,
              "reuse attention outputs, recomputed every INTERVAL steps in a timestep range"),
    CacheKind(StepCacheKind.PYRAMID, "PyramidAttentionBroadcastConfig", ATTENTION,
              "broadcast attention outputs, recomputed every INTERVAL steps in a timestep range"),
)}

# Modes whose denoiser is the loaded module itself (hooks on a clone of it run as they do eagerly).
EAGER_MODES = (Mode.EAGER, Mode.DEFER_AND_FUSE)


@functools.cache
def denoiser_class(pipeline: str, denoiser: str) -> type | None:
    """The denoiser's model class, from the pipeline's constructor annotation (no weights loaded)."""
    import diffusers

    cls = getattr(diffusers, pipeline, None)
    if cls is None:
        return None
    try:
        annotation = inspect.signature(cls.__init__).parameters[denoiser].annotation
    except (KeyError, ValueError, TypeError):
        return None
    if isinstance(annotation, str):
        annotation = getattr(diffusers, annotation.split("|")[0].strip(), None)
    return annotation if isinstance(annotation, type) else None


def _denoiser_problem(preset: ModelPreset) -> str:
    from diffusers.models.cache_utils import CacheMixin

    cls = denoiser_class(preset.pipeline, preset.denoiser)
    if cls is None:
        return f"the denoiser class of {preset.pipeline} is not known here"
    if not issubclass(cls, CacheMixin):
        return f"{cls.__name__} has no diffusers cache hooks (not a CacheMixin model)"
    return ""


def _mode_problem(kind: CacheKind, mode: Mode) -> str:
    if mode in EAGER_MODES:
        return ""
    if mode is Mode.REGIONAL:
        if kind.level == BLOCKS:
            return ""
        return ("its hooks sit on the attention layers inside the repeated blocks that regional compiles, "
                "and a compiled block cannot skip its own attention per step; use eager, or first-block / "
                "magcache with regional")
    if mode is Mode.COMPILE:
        return ("compile traces the whole denoiser into one graph, which cannot skip its own blocks per step "
                "(the cache's decision is data-dependent); use regional (first-block, magcache) or eager")
    if mode is Mode.AOT:
        return ("an aot package is one exported graph of the whole denoiser, which cannot skip its own blocks "
                "per step; use regional (first-block, magcache) or eager")
    return f"mode {mode} takes no step cache"


def cache_status(kind: StepCacheKind, preset: ModelPreset, spec, mode) -> dict:
    """One row: can step cache `kind` run for `preset` on `spec` in `mode`, and why not."""
    mode = Mode.parse(mode, "mode")
    names, defaults = STEP_CACHE_FORMS[kind]
    row = {"name": kind.value, "usable": True, "why_not": "", "params": {n: defaults[n] for n in names},
           "summary": "every step computed in full" if kind is StepCacheKind.NONE else KINDS[kind].summary,
           "form": kind.value + "".join(f"[:{n.upper()}]" for n in names), "default": str(StepCache(kind))}
    if kind is StepCacheKind.NONE:
        return row
    info = KINDS[kind]
    if mode not in spec.modes:
        why = f"{spec.label} [{spec.name}] does not run mode {mode}"
    else:
        why = _denoiser_problem(preset) or _mode_problem(info, mode)
    if why:
        row.update(usable=False, why_not=why)
    return row


def available_step_caches(preset: ModelPreset, device_spec, mode=Mode.EAGER) -> list[dict]:
    """Every step cache with whether it can run for `preset` on `device_spec` in `mode`, and why not:
    dicts of name, usable, why_not, params (defaults of its parameters), summary, form, default."""
    return [cache_status(kind, preset, device_spec, mode) for kind in StepCacheKind]


def check_step_cache(cache, preset: ModelPreset, spec, mode) -> list[str]:
    """Notices for running `cache`; UnsupportedCombination with the reason when it cannot run here."""
    cache = StepCache.parse(cache)
    if not cache.enabled:
        return []
    row = cache_status(cache.kind, preset, spec, mode)
    if not row["usable"]:
        raise UnsupportedCombination(
            f"step cache {cache} cannot run for {preset.name} in mode {Mode.parse(mode, 'mode')}: {row['why_not']}. "
            "`python -m engine step-caches` lists the ones that can")
    return [f"step cache {cache}: {row['summary']}"]


def format_table(rows: list[dict]) -> str:
    """The table as aligned text (`python -m engine step-caches`)."""
    width = max(len(r["form"]) for r in rows)
    lines = []
    for r in rows:
        state = "usable" if r["usable"] else "no"
        lines.append(f"{r['form']:{width}s}  {state:6s}  {r['why_not'] or r['summary']}"
                     + (f" (default {r['default']})" if r["usable"] and r["params"] else ""))
    return "\n".join(lines)
