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
step, and diffusers runs its hook code under torch.compiler.disable, so a fullgraph compile fails on it:
"Skip inlining torch.compiler.disable()d function"), as are the attention-level caches under regional
(their hooks would sit inside the compiled blocks).

`available_step_caches` returns every cache with `usable` and `why_not`; `check_step_cache` refuses an
unusable choice with UnsupportedCombination. Importing this module imports no torch.

At run time (`CacheVariants`, used by engine/pipeline/runner.py) a cache never goes on a module another run uses:
the eager variant, the compiled variants and the warm-up thread share the denoiser, and diffusers keeps
its hook registry on the module instance. Each (mode, cache) gets a structural clone of the mode's
denoiser over the same Parameters, with its own hooks; under regional, each compiled block of the clone
delegates to the warm compiled block, so switching caches costs a clone (milliseconds), never a reload
or a recompile. Which steps were served from the cache is counted under the hooks: a counter wraps the
modules the hooks sit on (whole blocks, or attention layers), and a step that called fewer of them than
a full denoiser pass was (at least partly) served from the cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import UnsupportedCombination
from engine.pipeline.variants import pipeline_over
from engine.protocol import STEP_CACHES, CacheRun, Mode, ModelPreset, StepCache, StepCacheKind
from engine.protocol.stepcaches import BLOCKS

log = logging.getLogger(__name__)

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


@functools.cache
def sets_cache_context(pipeline: str) -> bool:
    """Whether the pipeline's own call enters its denoiser's `cache_context(...)`: diffusers' cache hooks read
    the context and fail every step without one ("No cache context is set")."""
    import diffusers

    cls = getattr(diffusers, pipeline, None)
    try:
        return cls is not None and "cache_context(" in inspect.getsource(cls.__call__)
    except (OSError, TypeError):  # no source to read: assume it does, as the diffusers pipelines of its age do
        return True


def _denoiser_problem(preset: ModelPreset) -> str:
    from diffusers.models.cache_utils import CacheMixin

    cls = denoiser_class(preset.pipeline, preset.denoiser)
    if cls is None:
        return f"the denoiser class of {preset.pipeline} is not known here"
    if not issubclass(cls, CacheMixin):
        return f"{cls.__name__} has no diffusers cache hooks (not a CacheMixin model)"
    if not sets_cache_context(preset.pipeline):
        return (f"{preset.pipeline} calls its denoiser outside a diffusers cache context, which the step caches' "
                "hooks need; run it without a step cache")
    return ""


def cache_status(kind, preset: ModelPreset, spec, mode) -> dict:
    """One row: can step cache `kind` run for `preset` on `spec` in `mode`, and why not."""
    mode = Mode.parse(mode, "mode")
    entry = StepCacheKind.parse(kind, "step cache").entry
    row = {"name": entry.name, "usable": True, "why_not": "", "params": {p.name: p.default for p in entry.params},
           "ranges": {p.name: str(p.range) for p in entry.params},  # what diffusers' hooks run with
           "summary": entry.summary, "form": entry.form, "default": str(StepCache(entry.name))}
    if not StepCache(entry.name).enabled:
        return row
    if mode not in spec.modes:
        why = f"{spec.label} [{spec.name}] does not run mode {mode}"
    else:
        why = _denoiser_problem(preset) or entry.mode_problem(mode)
    if why:
        row.update(usable=False, why_not=why)
    return row


def available_step_caches(preset: ModelPreset, device_spec, mode=Mode.EAGER) -> list[dict]:
    """Every step cache with whether it can run for `preset` on `device_spec` in `mode`, and why not:
    dicts of name, usable, why_not, params (defaults of its parameters), summary, form, default."""
    return [cache_status(kind, preset, device_spec, mode) for kind in STEP_CACHES]


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
        entry = STEP_CACHES[r["name"]]
        spans = ", ".join(f"{p.name.upper()} {p.range.span}" for p in entry.params)
        lines.append(f"{r['form']:{width}s}  {state:6s}  {r['why_not'] or r['summary']}"
                     + (f" (default {r['default']}; {spans})" if r["usable"] and r["params"] else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Run time: per (mode, cache) denoiser clones with the cache's hooks, and which steps they served
# ------------------------------------------------------------------------------------------------


def detached_clone(denoiser, clone_tree):
    """A structural clone of `denoiser` over the same Parameters (`clone_tree`: the runner's
    clone_module_tree), with no diffusers hook registry of its own yet (a shallow copy would share the
    original's). A compiled submodule (regional compile sets `_compiled_call_impl` on each repeated block)
    is delegated to: the clone's module calls the original's, so hooks placed on the clone wrap the warm
    compiled graph from outside."""
    clone = clone_tree(denoiser)
    for original, copied in zip(denoiser.modules(), clone.modules(), strict=True):
        for name in ("_diffusers_hook", "forward"):
            copied.__dict__.pop(name, None)
        if getattr(original, "_compiled_call_impl", None) is not None:
            copied._compiled_call_impl = None
            copied.forward = original.__call__  # the bound method, not the module (that would register it)
    if hasattr(clone, "_cache_config"):
        clone._cache_config = None
    return clone


def hooked_modules(denoiser, level: str) -> list:
    """The modules a cache at `level` puts its hooks on (the counters wrap the same ones)."""
    import torch
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS, _ATTENTION_CLASSES

    blocks = [block for name, child in denoiser.named_children()
              if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
              for block in child]
    if level == BLOCKS:
        return blocks
    return [m for block in blocks for m in block.modules() if isinstance(m, _ATTENTION_CLASSES)]


@dataclass
class StepCounter:
    """Calls of the hooked modules' own forwards (under the hooks) and of the denoiser, per step."""

    modules: int = 0  # hooked modules per full denoiser pass
    calls: int = 0
    passes: int = 0
    cached: list = field(default_factory=list)
    _step: int = 0

    def wrap(self, module, root: bool = False) -> None:
        inner = module.forward

        @functools.wraps(type(module).forward)
        def forward(*args, **kwargs):
            if root:
                self.passes += 1
            else:
                self.calls += 1
            return inner(*args, **kwargs)

        module.forward = forward

    def start(self) -> None:
        self.calls = self.passes = self._step = 0
        self.cached = []

    def step_end(self) -> bool:
        """Close a step; True when its denoiser output came (at least partly) from the cache."""
        self._step += 1
        cached = self.passes > 0 and self.calls < self.modules * self.passes
        if cached:
            self.cached.append(self._step)
        self.calls = self.passes = 0
        return cached


class CachedDenoiser:
    """One (mode, cache) variant: the pipeline with a hooked denoiser clone, and its step counter."""

    def __init__(self, base_pipe, denoiser_name: str, cache: StepCache, config_factory, clone_tree):
        self.cache = cache
        self.counter = StepCounter()
        self._run = None  # the pipeline copy running now (timestep callbacks read it)
        denoiser = detached_clone(getattr(base_pipe, denoiser_name), clone_tree)
        modules = hooked_modules(denoiser, cache.kind.entry.level)
        if not modules:
            raise UnsupportedCombination(
                f"step cache {cache}: {type(denoiser).__name__} has none of the "
                f"{cache.kind.entry.level} its hooks go on")
        self.counter.modules = len(modules)
        for module in modules:
            self.counter.wrap(module)
        self.counter.wrap(denoiser, root=True)
        self.config = config_factory(self)
        denoiser.enable_cache(self.config)
        self.denoiser = denoiser
        self.pipe = pipeline_over(base_pipe, **{denoiser_name: denoiser})

    def current_timestep(self):
        """The running pipeline's timestep (pyramid and faster-cache decide by it)."""
        run = self._run
        t = getattr(run, "_current_timestep", None) if run is not None else None
        return -1 if t is None else (float(t.flatten()[0]) if hasattr(t, "flatten") else float(t))

    def start(self, run) -> None:
        """Before a run: fresh hook state (a cancelled run may have left some) and counters."""
        self._run = run
        self.denoiser._reset_stateful_cache()
        self.counter.start()

    def finish(self) -> tuple[int, ...]:
        self._run = None
        return tuple(self.counter.cached)


def diffusers_config(cache: StepCache, *, steps: int, cfg: bool, timestep, mag_ratios=None, calibrate=False):
    """The diffusers cache config for `cache` (what enable_cache takes): its entry's class and arguments."""
    import diffusers

    entry = cache.kind.entry
    config = getattr(diffusers, entry.config, None) if entry.config else None
    if config is None:
        raise UnsupportedCombination(f"step cache {cache} has no diffusers config")
    run = CacheRun(steps=steps, cfg=cfg, timestep=timestep, mag_ratios=mag_ratios, calibrate=calibrate)
    return config(**entry.arguments(cache, run))


class CacheVariants:
    """The (mode, cache) variants of one engine, built on first use and kept (a few, most recent)."""

    KEEP = 8

    def __init__(self, preset: ModelPreset, cache_dir: Path, clone_tree, source_id: str = ""):
        self.preset = preset
        self.clone_tree = clone_tree
        self.cache_dir = Path(cache_dir)
        self.source_id = source_id
        self._lock = threading.Lock()
        self._variants: OrderedDict = OrderedDict()

    def calibration_path(self, steps: int) -> Path:
        return self.cache_dir / "stepcache" / "magcache" / f"{self.preset.name}-{steps}steps.json"

    def mag_ratios(self, steps: int) -> list[float] | None:
        path = self.calibration_path(steps)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        ratios = data.get("mag_ratios") if data.get("source") == self.source_id else None
        return ratios if isinstance(ratios, list) and len(ratios) == steps else None

    def calibrate(self, base_pipe, steps: int, run, calibrated: StepCacheKind) -> list[float]:
        """One full run with a calibrated cache (MagCache) in calibration mode; the ratios are stored for
        (preset, steps). `run(pipe, variant)` runs the pipeline once."""
        ratios: list[float] = []
        variant = CachedDenoiser(
            base_pipe, self.preset.denoiser, StepCache(calibrated),
            lambda v: diffusers_config(v.cache, steps=steps, cfg=self.preset.cfg, timestep=v.current_timestep,
                                       calibrate=True), self.clone_tree)
        for module in variant.denoiser.modules():
            registry = getattr(module, "_diffusers_hook", None)
            for hook in (registry.hooks.values() if registry is not None else ()):
                if getattr(hook, "is_tail", False) and hasattr(hook, "_perform_calibration_step"):
                    original = hook._perform_calibration_step

                    def record(state, residual, original=original):
                        original(state, residual)
                        ratios.append(float(state.calibration_ratios[-1]))

                    hook._perform_calibration_step = record
        with contextlib.redirect_stdout(io.StringIO()):  # diffusers prints the ratios
            run(variant.pipe, variant)
        if len(ratios) != steps:
            raise RuntimeError(f"magcache calibration recorded {len(ratios)} ratios for {steps} steps")
        path = self.calibration_path(steps)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"preset": self.preset.name, "source": self.source_id, "steps": steps,
                                   "mag_ratios": ratios}))
        tmp.replace(path)
        return ratios

    def get(self, mode: Mode, base_pipe, cache: StepCache, steps: int, run, fused: bool = False
            ) -> tuple[CachedDenoiser, list[str]]:
        """The variant for (mode, cache[, steps]) over `base_pipe` (`fused`: the fused-LoRA pipeline, a denoiser
        of its own); MagCache calibrates first where no calibration is stored."""
        key = (mode, fused, str(cache), steps if cache.kind.entry.calibrated else None)
        with self._lock:
            if key in self._variants:
                self._variants.move_to_end(key)
                return self._variants[key], []
        notices = []
        ratios = None
        if cache.kind.entry.calibrated:
            ratios = self.mag_ratios(steps)
            if ratios is None:
                ratios = self.calibrate(base_pipe, steps, run, cache.kind)
                # Visitors read the notice: the cache folder's name, not its path on the server.
                notices.append(f"magcache: calibrated {self.preset.name} at {steps} steps (one full run first); "
                               "stored in the cache folder (stepcache/magcache), reused from now on")
        variant = CachedDenoiser(
            base_pipe, self.preset.denoiser, cache,
            lambda v: diffusers_config(cache, steps=steps, cfg=self.preset.cfg, timestep=v.current_timestep,
                                       mag_ratios=ratios), self.clone_tree)
        with self._lock:
            self._variants[key] = variant
            while len(self._variants) > self.KEEP:
                self._variants.popitem(last=False)
        return variant, notices
