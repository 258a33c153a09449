"""neuron: AWS Trainium through TorchNeuron (torch_neuronx), a PrivateUse1 backend.

A static-shape compiler (every new image size compiles once) whose compiled graphs (NEFFs) go to a
persistent cache folder, and a runtime that gives each process its own NeuronCore. The probe imports
torch_neuronx only when the backend has not registered itself already, and recognises PyPI's
placeholder package, which is not TorchNeuron.
"""

from __future__ import annotations

import importlib

import torch

from engine.devices import accelerator
from engine.devices.spec import Availability, DeviceSpec, PrecisionPlan, make_plan, static_shape_notes
from engine.protocol import Mode, Precision

NAME = "neuron"
# Neuron's default NEFF cache is wiped on reboot: every restart would recompile for minutes.
NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"
NEURON_INDEX_HINT = (
    "install TorchNeuron from AWS's Neuron package index "
    "(pip install --extra-index-url https://pip.repos.neuron.amazonaws.com 'torch-neuronx>=2.13'; "
    "Python 3.12+) on a Trainium instance"
)


def probe() -> Availability:
    found = accelerator.accelerator_probe(NAME)
    if found is not None:
        return found
    # Not registered: backend autoload is off (TORCH_DEVICE_BACKEND_AUTOLOAD=0) or the package is
    # absent/broken. Import it to find out; find_spec() is not enough: PyPI's torch-neuronx is a
    # 1.4 kB placeholder that find_spec finds and whose import raises "WRONG PACKAGE".
    try:
        importlib.import_module("torch_neuronx")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_neuronx":
            return Availability(False, f"torch-neuronx is not installed: {NEURON_INDEX_HINT}")
        return Availability(False, f"importing torch_neuronx failed ({exc}); {NEURON_INDEX_HINT}")
    except (Exception, SystemExit) as exc:  # the PyPI placeholder raises on import
        text = str(exc)
        if "WRONG PACKAGE" in text.upper() or is_placeholder_neuronx():
            return Availability(
                False,
                "the torch-neuronx on PyPI is a placeholder, not TorchNeuron (its import fails: "
                f"{text.strip()[:120] or type(exc).__name__}): pip uninstall torch-neuronx, then {NEURON_INDEX_HINT}",
            )
        return Availability(
            False, f"importing torch_neuronx failed ({type(exc).__name__}: {text}); {NEURON_INDEX_HINT}"
        )
    found = accelerator.accelerator_probe(NAME)
    if found is not None:
        return found
    return Availability(
        False,
        "torch_neuronx is installed but registered no neuron device: no NeuronCore is visible "
        "(run on a Trainium instance; check the Neuron driver with `neuron-ls`)",
    )


def is_placeholder_neuronx() -> bool:
    try:
        from importlib.metadata import version

        return version("torch-neuronx").split(".")[0] in ("0", "1")
    except Exception:
        return False


def precision(requested: str) -> PrecisionPlan:
    if requested == Precision.TF32:
        # TorchNeuron exposes no TF32 switch through PyTorch's matmul-precision flags.
        return make_plan(Precision.TF32, Precision.FP32, "TorchNeuron has no TF32 switch in PyTorch: running fp32.")
    return make_plan(requested)  # Trainium computes fp32, bf16 and fp16


def bind_local_device(local_rank: int) -> torch.device:
    # The Neuron runtime gives each process its core (seed: `device = torch.neuron.current_device()`).
    return accelerator.runtime_assigned_device(NAME, NAME)


# Why mode aot is not offered here (DeviceSpec.aot_refusal).
NEURON_AOT_REFUSAL = (
    "AOTInductor emits C++/Triton code, which Trainium cannot run. Neuron's own ahead-of-time path is the"
    " NEFF cache: mode compile stores each bucket's compiled NEFF under the cache folder "
    "(TORCH_NEURONX_NEFF_CACHE_DIR), so a restart loads it instead of recompiling"
)


def spec() -> DeviceSpec:
    return DeviceSpec(
        name=NAME,
        ray_resource="neuron_cores",
        label="AWS Trainium (TorchNeuron)",
        torch_device=NAME,
        compile_backend="neuron",
        static_shapes=True,
        dist_backend="neuron",
        mesh_device_type=NAME,
        modes=(Mode.EAGER, Mode.COMPILE, Mode.REGIONAL),
        aot_refusal=NEURON_AOT_REFUSAL,
        max_engines=1,  # the runtime gives each core/chip to one process
        max_batch=1,  # every batch size is a neuronx-cc compile of minutes per bucket: opt in with --max-batch
        memory_source="torch.neuron.max_memory_allocated where torch_neuronx provides it, else not reported",
        cache_env=((NEFF_CACHE_VAR, "neff"),),
        probe_fn=probe,
        precision_fn=precision,
        mode_notes_fn=static_shape_notes,
        bind_fn=bind_local_device,
    )
