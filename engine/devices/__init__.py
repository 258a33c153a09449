"""Devices as data: one registry says what each accelerator can do (in the spirit of vLLM's platforms).

Every device the showcase serves (cpu, cuda incl. ROCm, mps, xpu, neuron, tpu) is one frozen `DeviceSpec`
built by its own module: how to probe it, why it is unavailable (text shown to users, saying what to
install or do), its torch.compile backend, whether it needs static shapes, its process-group backend and
mesh device type, how to synchronize and read memory, how a tensor-parallel rank binds its device, the
environment it needs. What a device cannot do (a precision, a mode) is refused or downgraded *here*, with
the reason. No module outside this package tests a device name: every difference is a field or a hook
of the spec (tests/test_devices.py scans the sources for `spec.name == ...` and the like).

Layout:

    spec.py         DeviceSpec, Availability, PrecisionPlan: the record and its hook methods
    registry.py     registry(), get_device, resolve_device, device_names; `auto` order
    report.py       describe_device, devices_report (what `python -m engine devices` prints)
    policy.py       plan_precision, precision_support, check_mode, apply_precision
    environment.py  compile-cache and mode variables, worker_environment, apply_environment, enter_eager_mode
    accelerator.py  the generic path through torch.<name> / torch.accelerator when a spec has no hook
    cpu.py cuda.py mps.py xpu.py neuron.py tpu.py   one device kind each: its probe, precision rule,
                    memory and binding hooks, and its `spec()` builder

Rules the rest of the engine relies on:

* Nothing here probes at import time. `import engine.devices` imports torch (the engine needs it
  anyway) but touches no device, imports no vendor package and initialises no driver; probes run
  when `probe()` is called, and never raise: every failure becomes `Availability(False, reason)`.
* Precision policy: a request is *downgraded* (with a visible notice) only when the substitute is
  numerically the same or more precise and costs no extra memory (tf32 -> fp32); everything else a
  device cannot do is *refused* with the reason and what to pick instead (see policy.py).
* `apply_precision` and `apply_environment` change process-wide state: the engine runs one device
  per worker process, so they are applied once, in that worker, before any model is built.

Layer 1, the bottom of the engine: it imports only the contract (engine/protocol/, errors.py,
metrics.py, settings.py) and this folder; every other layer may import it. A new accelerator, or a new
capability that differs by device (a precision, a compile backend, a quantization kernel's support),
goes here as a field or hook of the spec.

The function `registry()` is re-exported under the name of its module, so `engine.devices.registry` is
the function; import the module's other names with `from engine.devices.registry import ...`.
"""

from __future__ import annotations

from engine.devices.cuda import TORCH_BUILDS_HINT
from engine.devices.environment import (
    apply_environment,
    enter_eager_mode,
    folders_in_force,
    worker_environment,
)
from engine.devices.neuron import NEFF_CACHE_VAR, NEURON_INDEX_HINT
from engine.devices.policy import MODE_HINTS, apply_precision, check_mode, plan_precision, precision_support
from engine.devices.registry import AUTO, device_names, get_device, registry, resolve_device
from engine.devices.report import describe_device, devices_report
from engine.devices.spec import (
    DTYPES,
    INDUCTOR_CACHE_VAR,
    Availability,
    DeviceSpec,
    PrecisionPlan,
    Refusal,
    make_plan,
)
from engine.devices.tpu import TPU_DEFER_AND_FUSE_VAR, TPU_INSTALL_HINT

__all__ = [
    "AUTO",
    "DTYPES",
    "INDUCTOR_CACHE_VAR",
    "MODE_HINTS",
    "NEFF_CACHE_VAR",
    "NEURON_INDEX_HINT",
    "TORCH_BUILDS_HINT",
    "TPU_DEFER_AND_FUSE_VAR",
    "TPU_INSTALL_HINT",
    "Availability",
    "DeviceSpec",
    "PrecisionPlan",
    "Refusal",
    "apply_environment",
    "apply_precision",
    "check_mode",
    "device_names",
    "describe_device",
    "devices_report",
    "enter_eager_mode",
    "folders_in_force",
    "get_device",
    "make_plan",
    "plan_precision",
    "precision_support",
    "registry",
    "resolve_device",
    "worker_environment",
]
