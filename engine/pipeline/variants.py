"""Pipelines over the loaded pipeline's components: the mode variants, step-cache variants, aot stand-ins.

`pipeline_over(base, transformer=...)` is diffusers' documented way to run several pipelines on one set of
weights: a pipeline of the same class built from `base.components`, with some components replaced (a
compiled denoiser, a denoiser clone with step-cache hooks, aot stand-ins, a vae whose decode is compiled).
No tensor is copied or cast. `DiffusionPipeline.from_pipe` would build the same pipeline, but it then casts
every component to one dtype in place (float32 unless told: a bf16 engine's modules, the ones it serves
with, became float32), and it leaves out a component whose class is not the pipeline's annotation (the
embedded tiny-shapes' AutoencoderTiny in a FluxPipeline: it then refuses to build). So the constructor is
called directly, with the base's init settings from its config, as from_pipe passes them.

`run_copy(pipe, scheduler)` is the one other way a pipeline object is made: per run, a shallow copy with
its own scheduler, because a pipeline keeps per-call state on itself (`_guidance_scale`, `_interrupt`,
`_current_timestep`) and a scheduler keeps per-run state; a shallow copy is far cheaper than
constructing a pipeline on every request (docs/architecture.md has the figures).

`VariantSet` builds each mode's pipeline once, on the loaded weights:

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
import inspect
import threading
from collections import OrderedDict

import torch

from engine.errors import InvalidRequest, UnsupportedCombination
from engine.pipeline import recipes
from engine.pipeline.faults import failing_backend
from engine.protocol import Mode

# What enable_model_cpu_offload keeps on the pipeline object rather than on its modules: a variant's runs
# re-install offload hooks at their end (maybe_free_model_hooks) as the base's do.
_OFFLOAD_STATE = ("_offload_device", "_offload_gpu_id", "_all_hooks")


def pipeline_over(base, **replaced):
    """A pipeline of `base`'s class over `base`'s components, `replaced` in place of some of them."""
    components = base.components
    unknown = sorted(set(replaced) - set(components))
    if unknown:
        raise ValueError(f"{type(base).__name__} has no component {', '.join(unknown)}")
    cls = type(base)
    settings = {name: base.config[name] for name in inspect.signature(cls.__init__).parameters
                if name not in components and name in base.config}
    pipe = cls(**{**components, **replaced}, **settings)
    pipe.set_progress_bar_config(**getattr(base, "_progress_bar_config", {}))
    for name in _OFFLOAD_STATE:
        if name in base.__dict__:
            setattr(pipe, name, base.__dict__[name])
    return pipe


def vae_decoding_with(vae, decode):
    """`vae` with its own `decode` (compiled, or an aot package): a shallow copy, so every Parameter,
    buffer and submodule stays the loaded vae's."""
    copied = copy.copy(vae)
    copied.decode = decode
    return copied


# Pipelines whose __call__ hands the decoded batch straight to image_processor.postprocess (SDXL: but for
# its optional watermark), read in diffusers' source. Another pipeline may do more after its decode (a
# safety checker, resizing back from a binned resolution): it decodes its batch whole.
DECODE_THEN_POSTPROCESS = frozenset({
    "FluxPipeline", "Flux2Pipeline", "Flux2KleinPipeline", "StableDiffusion3Pipeline", "StableDiffusionXLPipeline",
})


def can_decode_apart(pipe) -> bool:
    """Whether decode_apart may hand on images the pipeline has not finished: only where nothing runs on
    the decoded images after the decode but the image processor."""
    return (type(pipe).__name__ in DECODE_THEN_POSTPROCESS and getattr(pipe, "safety_checker", None) is None
            and getattr(pipe, "watermark", None) is None
            and hasattr(getattr(pipe, "image_processor", None), "postprocess") and hasattr(pipe, "vae"))


def decode_apart(run, on_image) -> None:
    """Make `run` (a run_copy) decode its batch's latents one at a time: `on_image(index, image)` gets each
    image (PIL) as soon as it is decoded, while the pipeline goes on with the rest. The pipeline then
    returns the whole batch as it would; a caller that took every image from on_image asks for
    output_type="pt", the cheapest."""
    vae = run.vae
    decode = vae.decode

    def decode_each(z, *args, return_dict: bool = True, **kwargs):
        samples = []
        for index in range(z.shape[0]):
            sample = decode(z[index:index + 1], *args, return_dict=False, **kwargs)[0]
            on_image(index, run.image_processor.postprocess(sample, output_type="pil")[0])
            samples.append(sample)
        sample = torch.cat(samples)
        if not return_dict:
            return (sample,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=sample)

    object.__setattr__(run, "vae", vae_decoding_with(vae, decode_each))  # not a new component, as run_copy


def run_copy(pipe, scheduler, on_loop_start=None):
    """A private pipeline object for one run, with its own scheduler (see the module's docstring);
    `on_loop_start()` is called as its denoising loop starts."""
    run = copy.copy(pipe)
    object.__setattr__(run, "scheduler", scheduler)  # not a new component: the config stays the variant's
    if on_loop_start is not None:
        # diffusers has no callback before the first step (callback_on_step_end closes each step); every
        # pipeline opens its progress bar as its denoising loop starts, so this run's own copy marks it there.
        open_bar = run.progress_bar

        def progress_bar(*args, **kwargs):
            on_loop_start()
            return open_bar(*args, **kwargs)

        run.progress_bar = progress_bar
    return run


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
    """The pipeline of each mode of one runner (engine/pipeline/runner.py), built once on its loaded weights;
    compiled modules compile lazily per shape. The aot variant's AotEngine is kept as `aot`."""

    def __init__(self, runner):
        self.runner = runner
        self.aot = None  # engine/pipeline/aot.py AotEngine, built with the aot variant
        self._built: dict[Mode, object] = {}
        self._lock = threading.Lock()

    def loaded(self, pipe) -> None:
        """The loaded pipeline: the eager variant (every other one is built over its components)."""
        self._built[Mode.EAGER] = pipe

    def has(self, mode: Mode) -> bool:
        return mode in self._built

    def get(self, mode: Mode):
        mode = Mode.parse(mode, "mode")
        with self._lock:
            if mode not in self._built:
                self._built[mode] = self._build(mode)
            return self._built[mode]

    def _build(self, mode: Mode):
        runner = self.runner
        base = runner.pipe
        if mode is Mode.DEFER_AND_FUSE:
            return base  # same modules; the eager mode is switched per run (devices.enter_eager_mode)
        if mode is Mode.AOT:
            from engine.pipeline import aot

            self.aot = aot.AotEngine(runner, recipes.aot_inductor_configs(runner.options, runner.spec))
            return self.aot.pipe
        kwargs, notices = recipes.compile_kwargs(runner.options, runner.spec, mode=mode)
        runner.notices += notices
        if runner.faults.should_fail_compile():
            kwargs["backend"] = failing_backend
        denoiser = runner.preset.denoiser
        replaced = {denoiser: compile_denoiser(getattr(base, denoiser), mode, kwargs)}
        if mode is Mode.COMPILE and runner.options.recipe.compile_vae:
            replaced["vae"] = vae_decoding_with(base.vae, torch.compile(base.vae.decode, **{**kwargs, "fullgraph": False}))
        return pipeline_over(base, **replaced)
