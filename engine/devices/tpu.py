"""tpu: Google Cloud TPU through TorchTPU (torch_tpu), a PrivateUse1 backend.

What sets it apart: a static-shape compiler; no fp16 (the matrix units work in bf16); a fourth mode,
defer-and-fuse (TorchTPU's optimized eager mode), chosen either by TORCH_TPU_DEFER_AND_FUSE at start-up
or by the runtime switch in `enter_eager_mode`; each process gets its own chip from the runtime; and a
multi-process launch needs torch_tpu's launch variables. torch.tpu.is_available() raises on
torch >= 2.11, so the probe asks torch.accelerator instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping

import torch

from engine import settings
from engine.devices import accelerator
from engine.devices.spec import (
    Availability,
    DeviceSpec,
    PrecisionPlan,
    Refusal,
    make_plan,
    static_shape_notes,
)
from engine.errors import UnsupportedCombination
from engine.protocol import Mode, Precision

NAME = "tpu"
TPU_INSTALL_HINT = "pip install 'torch-tpu>=0.2.0' on a Cloud TPU VM (Linux x86_64, torch 2.11-2.15)"
# torch_tpu reads this once, when it is loaded (i.e. at `import torch` through backend autoload),
# so it only works when set in the environment a worker process *starts* with.
TPU_DEFER_AND_FUSE_VAR = "TORCH_TPU_DEFER_AND_FUSE"

# Which runtime eager mode each of our modes runs under (compiled modes do not depend on it).
_EAGER_MODES = {Mode.EAGER: "DEFER_NEVER", Mode.DEFER_AND_FUSE: "DEFER_AND_FUSE"}

# torch_tpu's set_eager_mode is a context manager; when it is the only switch, the entered manager
# is kept here so it is not garbage-collected (which would restore the previous mode).
_ACTIVE_EAGER_MODE: list = []


def probe() -> Availability:
    # torch_tpu autoloads with `import torch` and registers "tpu" only when it finds a chip.
    found = accelerator.accelerator_probe(NAME)
    if found is not None:
        return found
    if importlib.util.find_spec("torch_tpu") is None:
        return Availability(False, f"torch_tpu is not installed: {TPU_INSTALL_HINT}")
    if not settings.device_backend_autoload():
        # Autoload is off, so it was never loaded: load it now and look again.
        try:
            importlib.import_module("torch_tpu")
        except Exception as exc:
            return Availability(False, f"importing torch_tpu failed ({type(exc).__name__}: {exc})")
        found = accelerator.accelerator_probe(NAME)
        if found is not None:
            return found
    return Availability(
        False,
        "torch_tpu is installed but registered no tpu device: no TPU chip is visible on this "
        "machine (run on a Cloud TPU VM, e.g. v5e/v6e)",
    )


def precision(requested: str) -> PrecisionPlan:
    if requested == Precision.TF32:
        return make_plan(Precision.TF32, Precision.FP32, "TPUs have no TF32: running fp32.")
    if requested == Precision.FP16:
        raise Refusal(
            "TPUs have no fp16 arithmetic (the matrix units work in bf16)", (Precision.BF16, Precision.FP32)
        )
    return make_plan(requested)


def mode_notes(mode: str) -> tuple[str, ...]:
    if mode == Mode.DEFER_AND_FUSE:
        return (
            "defer-and-fuse is TorchTPU's optimized eager mode: ops are deferred and fused into graphs "
            "(first calls compile); it applies to the whole worker process.",
        )
    return static_shape_notes(mode)


def enter_eager_mode(mode: str) -> str | None:
    """Switch torch_tpu's eager mode for this process: DEFER_AND_FUSE for "defer-and-fuse", DEFER_NEVER
    (strict eager) for "eager". Returns the mode name set; None for compile/regional."""
    wanted_name = _EAGER_MODES.get(mode)
    if wanted_name is None:
        return None
    tpu = accelerator.device_module(NAME)
    enum = getattr(tpu, "EagerMode", None)
    if enum is None:
        if mode == Mode.EAGER:
            return None
        raise UnsupportedCombination(
            "this torch_tpu has no torch.tpu.EagerMode, so defer-and-fuse cannot be enabled: "
            f"install torch-tpu>=0.2.0 or start the worker with {TPU_DEFER_AND_FUSE_VAR}=1"
        )
    wanted = getattr(enum, wanted_name)
    if hasattr(tpu, "eager_mode"):
        tpu.eager_mode = wanted
    elif hasattr(tpu, "set_eager_mode"):
        result = tpu.set_eager_mode(wanted)
        if hasattr(result, "__enter__"):
            for old in reversed(_ACTIVE_EAGER_MODE):  # leave the previous switch first
                old.__exit__(None, None, None)
            _ACTIVE_EAGER_MODE.clear()
            result.__enter__()
            _ACTIVE_EAGER_MODE.append(result)
    else:
        raise UnsupportedCombination("this torch_tpu offers no way to set the eager mode at runtime")
    return wanted_name


def launch_env(nnodes: int, nproc_per_node: int, set_env: Callable | None = None) -> dict[str, str]:
    """The variables torch_tpu wants for a multi-chip launch, without changing this process's environment.

    `torch.tpu.distributed.set_tpu_launch_env(nnodes=, nproc_per_node=)` writes them into os.environ
    (and may also return them); the app must not keep them, so os.environ is restored and the difference
    (plus anything returned) is what the ranks get. `set_env` replaces torch_tpu's function (tests).
    """
    if set_env is None:
        tpu = accelerator.device_module(NAME)
        set_env = getattr(getattr(tpu, "distributed", None), "set_tpu_launch_env", None)
        if set_env is None:
            raise UnsupportedCombination(
                "torch.tpu.distributed.set_tpu_launch_env is missing: install torch-tpu>=0.2.0 on a Cloud TPU VM "
                f"({TPU_INSTALL_HINT})"
            )
    before = dict(os.environ)
    try:
        returned = set_env(nnodes=nnodes, nproc_per_node=nproc_per_node)
        after = dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(before)
    env = {k: v for k, v in after.items() if before.get(k) != v}
    if isinstance(returned, Mapping):
        env.update({str(k): str(v) for k, v in returned.items()})
    return env


def bind_local_device(local_rank: int) -> torch.device:
    # The TPU runtime gives each process its chip (TPU_VISIBLE_CHIPS from launch_env).
    return accelerator.runtime_assigned_device(NAME, NAME)


# Why mode aot is not offered here (DeviceSpec.aot_refusal).
TPU_AOT_REFUSAL = (
    "AOTInductor emits C++/Triton code, which a TPU cannot run. TorchTPU compiles through its own backend"
    " (mode compile, static shapes) and offers defer-and-fuse; use one of those"
)


def spec() -> DeviceSpec:
    return DeviceSpec(
        name=NAME,
        ray_resource="TPU",
        label="Google Cloud TPU (TorchTPU)",
        torch_device=NAME,
        compile_backend="tpu",
        static_shapes=True,
        dist_backend="tpu_dist",
        mesh_device_type=NAME,
        modes=(Mode.EAGER, Mode.COMPILE, Mode.REGIONAL, Mode.DEFER_AND_FUSE),
        aot_refusal=TPU_AOT_REFUSAL,
        max_engines=1,  # the runtime gives each core/chip to one process
        max_batch=1,  # every batch size is an XLA compile per bucket: opt in with --max-batch
        memory_source="torch.tpu.max_memory_allocated where torch_tpu provides it, else not reported",
        mode_env=((Mode.DEFER_AND_FUSE, TPU_DEFER_AND_FUSE_VAR, "1"),),
        probe_fn=probe,
        precision_fn=precision,
        mode_notes_fn=mode_notes,
        eager_mode_fn=enter_eager_mode,
        launch_env_fn=launch_env,
        bind_fn=bind_local_device,
    )
