"""Each mode's pipeline, built once on the loaded weights (`VariantSet`):

- eager:    the loaded pipeline itself, never compiled, so it can serve while a bucket compiles;
- compile:  `torch.compile(denoiser)` (an OptimizedModule wrapping the same module) and a compiled
            `vae.decode` on a shallow VAE copy;
- regional: `compile_repeated_blocks` on a structural clone of the denoiser whose Parameters are the
            very same tensors (compile_repeated_blocks works in place, and eager must stay eager);
- defer-and-fuse: the eager variant run under torch_tpu's DEFER_AND_FUSE eager mode;
- aot:      the denoiser (and vae.decode) dispatch to one AOTInductor package per bucket and batch shape
            (engine/pipeline/aot.py).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.errors import InvalidRequest, UnsupportedCombination
from engine.pipeline import recipes
from engine.pipeline.faults import failing_backend
from engine.pipeline.variants import pipeline_over, vae_decoding_with
from engine.protocol import Mode


def clone_module_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A new module tree whose Parameters and buffers are the same tensors (no extra weight memory).

    Used for regional compile: `compile_repeated_blocks` sets `_compiled_call_impl` on each block in
    place, so it works on the clone and the eager original stays eager.
    """
    clone = copy.copy(module)
    clone._modules = OrderedDict(
        (name, clone_module_tree(child) if child is not None else None) for name, child in module._modules.items()
    )
    for hooks in ("_forward_hooks", "_forward_pre_hooks"):
        setattr(clone, hooks, OrderedDict(getattr(module, hooks)))
    return clone


def compile_denoiser(denoiser: torch.nn.Module, mode: Mode, compile_kwargs: dict) -> torch.nn.Module:
    """The denoiser of a compiled mode, over the same weights (the engine and the bench both use it).

    compile: an OptimizedModule wrapping the module; regional: `compile_repeated_blocks` on a
    structural clone, because it compiles in place and the eager original must stay eager.
    """
    if mode == Mode.COMPILE:
        return torch.compile(denoiser, **compile_kwargs)
    if mode == Mode.REGIONAL:
        clone = clone_module_tree(denoiser)
        try:
            clone.compile_repeated_blocks(**compile_kwargs)
        except ValueError as exc:
            raise UnsupportedCombination(
                f"regional compile is not possible for {type(denoiser).__name__}: {exc}; use mode 'compile'"
            ) from None
        return clone
    raise InvalidRequest(f"mode {mode!r} has no compiled denoiser")


class VariantSet:
    """The pipeline of each mode of one engine, built once on its loaded weights; compiled modules compile
    lazily per shape. It reads the engine's preset (its denoiser), options and device (the compile recipe),
    adds the recipe's notices to the engine's `notices` and asks `faults` whether a compile must fail.
    `build_aot(pipe, inductor_configs)` makes the aot variant's AotEngine (engine/pipeline/aot.py), kept as
    `aot`; `on_built(mode, pipe)` is told of each variant the first time it is handed out."""

    def __init__(self, preset, options, spec, faults, notices: list[str],
                 build_aot: Callable[[object, dict], object], on_built: Callable[[Mode, object], None]):
        self.preset, self.options, self.spec, self.faults, self.notices = preset, options, spec, faults, notices
        self.build_aot, self.on_built = build_aot, on_built
        self.aot = None  # engine/pipeline/aot.py AotEngine, built with the aot variant
        self._built: dict[Mode, object] = {}
        self._handed: set[Mode] = set()
        self._lock = threading.Lock()

    def loaded(self, pipe) -> None:
        """The loaded pipeline: the eager variant (every other one is built over its components)."""
        self._built[Mode.EAGER] = pipe

    def get(self, mode: Mode):
        mode = Mode.parse(mode, "mode")
        with self._lock:
            if mode not in self._built:
                self._built[mode] = self._build(mode)
            if mode not in self._handed:
                self.on_built(mode, self._built[mode])
                self._handed.add(mode)
            return self._built[mode]

    def _build(self, mode: Mode):
        base = self._built[Mode.EAGER]
        if mode is Mode.DEFER_AND_FUSE:
            return base  # same modules; the eager mode is switched per run (devices.enter_eager_mode)
        if mode is Mode.AOT:
            self.aot = self.build_aot(base, recipes.aot_inductor_configs(self.options, self.spec))
            return self.aot.pipe
        kwargs, notices = recipes.compile_kwargs(self.options, self.spec, mode=mode)
        self.notices += notices
        if self.faults.should_fail_compile():
            kwargs["backend"] = failing_backend
        denoiser = self.preset.denoiser
        replaced = {denoiser: compile_denoiser(getattr(base, denoiser), mode, kwargs)}
        if mode is Mode.COMPILE and self.options.recipe.compile_vae:
            replaced["vae"] = vae_decoding_with(base.vae, torch.compile(base.vae.decode, **{**kwargs, "fullgraph": False}))
        return pipeline_over(base, **replaced)
