"""Optimisation recipes as small named steps driven by one options object (flux-fast's `optimize()`).

Each step is a function that changes the pipeline (or the compile settings) and returns a notice
saying what it did; each has a test that it took effect. Device differences come from the device
spec, never from `if device == ...` here.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.errors import UnsupportedCombination
from engine.protocol import EngineOptions, Mode, Precision

log = logging.getLogger(__name__)


def _denoiser(pipe, name: str):
    return getattr(pipe, name)


def step_channels_last(pipe, denoiser_name: str) -> str:
    changed = []
    for name in ("unet", "vae"):
        module = getattr(pipe, name, None)
        if module is not None and _has_conv(module):
            module.to(memory_format=torch.channels_last)
            changed.append(name)
    return f"channels_last on {', '.join(changed) or 'nothing (no conv modules)'}"


def _has_conv(module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in module.modules())


def step_fuse_qkv(pipe, denoiser_name: str) -> str:
    denoiser = _denoiser(pipe, denoiser_name)
    if not hasattr(denoiser, "fuse_qkv_projections"):
        return f"fuse_qkv skipped: {type(denoiser).__name__} has no fuse_qkv_projections()"
    denoiser.fuse_qkv_projections()
    fused = sum(1 for m in denoiser.modules() if getattr(m, "fused_projections", False))
    return f"fused QKV projections in {fused} attention modules"


def keep_torchao_unloaded() -> bool:
    """Tell diffusers and transformers that torchao is not installed, in a process whose engine quantizes
    nothing. Both import it whenever it is installed (CPU time at every start, and three warnings) to read
    checkpoints saved quantized by torchao, which no engine loads; the quantized precisions call torchao
    themselves (quantize_denoiser). Only before their quantizers are imported; True when in force."""
    if any(name in sys.modules for name in ("torchao", "diffusers.quantizers", "transformers.quantizers")):
        return False
    import diffusers.utils.import_utils as diffusers_imports
    import transformers.utils
    import transformers.utils.import_utils as transformers_imports

    def not_installed(*args, **kwargs) -> bool:
        return False

    diffusers_imports._torchao_available = False  # what diffusers' is_torchao_available() returns
    for module in (transformers_imports, transformers.utils):
        module.is_torchao_available = not_installed
    return True


def quantize_denoiser(pipe, denoiser_name: str, precision: Precision) -> str:
    """torchao quantization of the denoiser's linear layers for a quantized precision (int8wo, int8dq, fp8).
    Runs after the weights are on the device: torchao picks its kernels from where the weights are."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            PerRow,
            quantize_,
        )
    except ImportError:
        raise UnsupportedCombination(f"{precision} needs torchao: pip install torchao==0.18.0") from None
    configs = {
        Precision.INT8_WEIGHT: (Int8WeightOnlyConfig, {}, "int8 weight-only"),
        Precision.INT8_DYNAMIC: (Int8DynamicActivationInt8WeightConfig, {}, "int8 dynamic activation + int8 weight"),
        Precision.FP8: (Float8DynamicActivationFloat8WeightConfig, {"granularity": PerRow()},
                        "float8 dynamic activation + float8 weight (per row)"),
    }
    from torchao.quantization.quant_api import _is_linear

    config_cls, kwargs, what = configs[Precision(precision)]
    denoiser = _denoiser(pipe, denoiser_name)
    # A LoRA slot's A and B stay in the compute precision: a hot-swap copies the next adapter into them.
    quantize_(denoiser, config_cls(**kwargs), filter_fn=lambda m, fqn: _is_linear(m) and ".lora_" not in fqn)
    linears = sum(1 for m in denoiser.modules() if isinstance(m, torch.nn.Linear)
                  and type(m.weight).__name__ not in ("Parameter", "Tensor"))
    return f"{precision}: {what} quantization (torchao) of {linears} linear layers in the denoiser"


@dataclass(frozen=True)
class RecipeLever:
    """One recipe lever, keyed by its RecipeOptions field (whose `flag(...)` metadata makes it a flag of the CLI
    and app.py: name, type, default, help, range): the modes an engine with it on cannot run and why, whether
    it changes the compiled or exported graph (then it is part of an aot package's key), and its load-time
    step (pipe, denoiser name) -> notice. The compile-time levers (max_autotune, dynamic, cuda_graphs,
    inductor_flags) are read by `compile_kwargs` and `aot_inductor_configs` below."""

    name: str
    load: Callable[[object, str], str] | None = None
    graph: bool = False
    excludes: dict[Mode, str] = field(default_factory=dict)


# Offload hooks cannot be traced (seed: compile only the repeated blocks), and an aot package points at weights
# that offload moves between devices.
_OFFLOADED = "CPU offload is on"

# In the order they apply (load steps: fuse before channels_last). Offload / .to(device) come after these.
RECIPE_LEVERS: dict[str, RecipeLever] = {lever.name: lever for lever in (
    RecipeLever("fuse_qkv", load=step_fuse_qkv, graph=True),
    RecipeLever("channels_last", load=step_channels_last, graph=True),
    RecipeLever("cpu_offload", excludes={Mode.COMPILE: _OFFLOADED, Mode.AOT: _OFFLOADED}),
    RecipeLever("max_autotune", graph=True),
    RecipeLever("attention_backend", graph=True),
    RecipeLever("cuda_graphs", graph=True),
)}


def apply_load_steps(pipe, denoiser_name: str, options: EngineOptions) -> list[str]:
    notices = []
    for lever in RECIPE_LEVERS.values():
        if lever.load is not None and getattr(options.recipe, lever.name):
            notices.append(lever.load(pipe, denoiser_name))
            log.info("recipe %s: %s", lever.name, notices[-1])
    return notices


def excluded_mode(options: EngineOptions, mode: Mode) -> str:
    """Why the engine's recipe levers rule `mode` out ("" when they do not)."""
    return next((lever.excludes[mode] for lever in RECIPE_LEVERS.values()
                 if mode in lever.excludes and getattr(options.recipe, lever.name)), "")


def graph_options(recipe) -> dict:
    """The recipe levers (RecipeOptions) that change the compiled or exported graph, with their values (an aot
    package's key)."""
    return {lever.name: getattr(recipe, lever.name) for lever in RECIPE_LEVERS.values() if lever.graph}


INDUCTOR_FLAGS = {
    # flux-fast / the seed's max-speed flags
    "conv_1x1_as_mm": True,
    "coordinate_descent_tuning": True,
    "epilogue_fusion": False,
    "coordinate_descent_check_all_directions": True,
}


def apply_inductor_flags(options: EngineOptions, device_spec) -> list[str]:
    wanted = options.recipe.inductor_flags
    if wanted is None:
        wanted = device_spec.inductor_flags_default
    if not wanted or device_spec.compile_backend != "inductor":
        return []
    import torch._inductor.config as inductor_config

    for key, value in INDUCTOR_FLAGS.items():
        setattr(inductor_config, key, value)
    return ["inductor flags: " + ", ".join(f"{k}={v}" for k, v in INDUCTOR_FLAGS.items())]


# Modes whose graphs replay as CUDA graphs with --cuda-graphs (regional compiles many small regions, where
# one graph per block would add more launches than it saves).
CUDA_GRAPH_MODES = (Mode.COMPILE, Mode.AOT)


def cuda_graphs_notices(options: EngineOptions, device_spec, mode: Mode) -> list[str]:
    """What --cuda-graphs does for `mode` on this device; UnsupportedCombination where it cannot."""
    if not options.recipe.cuda_graphs or not mode.compiled:
        return []
    if mode not in CUDA_GRAPH_MODES:
        return [f"CUDA graphs apply to {' and '.join(CUDA_GRAPH_MODES)}; {mode} runs without them"]
    if not device_spec.cuda_graphs:
        raise UnsupportedCombination(
            f"CUDA graphs (--cuda-graphs) need a CUDA GPU; {device_spec.label} [{device_spec.name}] cannot record "
            f"them. Run {mode} without --cuda-graphs, or on cuda")
    how = 'mode="reduce-overhead"' if mode is Mode.COMPILE else "triton.cudagraphs in the package"
    return [f"CUDA graphs: {mode} replays each step as one graph ({how}); the step callback reads cloned outputs"]


def cuda_graphs_active(options: EngineOptions, device_spec, mode) -> bool:
    return bool(options.recipe.cuda_graphs and device_spec.cuda_graphs and mode in CUDA_GRAPH_MODES)


def graph_safe_outputs(callback_kwargs: dict) -> dict:
    """A step callback's view of the step under CUDA graphs: the next replay overwrites graph outputs in
    place, so the tensors handed on (the latents) are cloned, and the next call starts a new graph step."""
    cloned = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in callback_kwargs.items()}
    torch.compiler.cudagraph_mark_step_begin()
    return cloned


def aot_inductor_configs(options: EngineOptions, device_spec) -> dict:
    """inductor settings an AOTInductor package is compiled with (the global inductor flags apply too)."""
    configs = {"aot_inductor.package_constants_in_so": False}  # weights stay out: one copy, the engine's
    if options.recipe.max_autotune and device_spec.compile_backend == "inductor":
        configs["max_autotune"] = True
    if cuda_graphs_active(options, device_spec, Mode.AOT):
        configs["triton.cudagraphs"] = True
    return configs


def compile_kwargs(options: EngineOptions, device_spec, fullgraph: bool = True,
                   mode: Mode = Mode.COMPILE) -> tuple[dict, list[str]]:
    """torch.compile arguments for this device, options and engine mode, with notices for what was downgraded."""
    notices = []
    kwargs = {"backend": device_spec.compile_backend, "fullgraph": fullgraph}
    if options.recipe.dynamic and device_spec.static_shapes:
        notices.append(f"dynamic shapes are not possible on {device_spec.name} (static-shape compiler); using static")
    if options.recipe.dynamic and not device_spec.static_shapes:
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False  # distinct sizes must not be unified into one symbol
        kwargs["dynamic"] = True
    else:
        kwargs["dynamic"] = False
    if options.recipe.max_autotune:
        if device_spec.compile_backend == "inductor":
            kwargs["mode"] = "max-autotune"
        else:
            notices.append(f"max-autotune is an inductor mode; {device_spec.name} compiles with {device_spec.compile_backend}")
    elif cuda_graphs_active(options, device_spec, mode):
        kwargs["mode"] = "reduce-overhead"  # CUDA graphs (max-autotune records them as well)
    return kwargs, notices


def raise_recompile_limit(n_graphs: int) -> int:
    """Each bucket is one more graph of the same code object; with fullgraph=True the 9th raises."""
    import torch._dynamo.config as dynamo_config

    limit = max(dynamo_config.recompile_limit, n_graphs + 8)
    dynamo_config.recompile_limit = limit
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * limit)
    return limit
