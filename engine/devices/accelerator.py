"""The generic path to a device: its module `torch.<name>`, then `torch.accelerator`.

What a spec does when it has no hook of its own. Every function here takes the device's name and
touches nothing until called: no driver is initialised and no vendor package imported, so importing
the registry stays free. Out-of-tree backends (torch_neuronx, torch_tpu, the tests' fake device)
register `torch.<name>` through PrivateUse1; the device module is asked first because
torch.accelerator's C++ paths (synchronize, memory stats) need a device guard and allocator that a
Python-registered backend does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Availability:
    """A device probe's answer (defined here, the lowest module of the package, so spec and every
    device module can use it without an import cycle)."""

    available: bool
    reason: str = ""  # when unavailable: why, and what to install or do


def device_module(name: str):
    """torch.<name> if a backend registered it (torch.cuda, torch.xpu, torch.neuron, torch.tpu)."""
    return getattr(torch, name, None)


def registered_accelerator() -> str | None:
    """The accelerator type torch knows of (e.g. "cuda", "neuron", "tpu"), without init.

    `torch.accelerator.current_accelerator()` does not poison fork and does not call the device
    module's is_available() (torch_tpu's raises on torch >= 2.11).
    """
    acc_api = getattr(torch, "accelerator", None)
    if acc_api is None or not hasattr(acc_api, "current_accelerator"):
        return None
    try:
        acc = acc_api.current_accelerator()
    except Exception:
        return None
    return acc.type if acc is not None else None


def accelerator_probe(name: str):
    """If torch already has `name` as its accelerator (backend autoload, or a test's fake device), ask
    its device module: an Availability; None if `name` is not registered."""
    if registered_accelerator() != name:
        return None
    mod = device_module(name)
    count = None
    if mod is not None and hasattr(mod, "device_count"):
        try:
            count = int(mod.device_count())
        except Exception:
            count = None  # registration alone means the backend found devices
    if count == 0:
        return Availability(False, f"the {name} backend is registered but reports no devices")
    return Availability(True)


def module_sync(name: str) -> None:
    mod = device_module(name)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()
        return
    if registered_accelerator() == name:
        torch.accelerator.synchronize()


def module_reset_peak(name: str) -> None:
    mod = device_module(name)
    if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
        mod.reset_peak_memory_stats()
    elif registered_accelerator() == name and hasattr(torch.accelerator, "reset_peak_memory_stats"):
        torch.accelerator.reset_peak_memory_stats()


def module_mem_get_info(name: str) -> tuple[int, int] | None:
    mod = device_module(name)
    if mod is not None and hasattr(mod, "mem_get_info"):
        return tuple(mod.mem_get_info())
    return None


def module_peak(name: str) -> int | None:
    mod = device_module(name)
    if mod is not None and hasattr(mod, "max_memory_allocated"):
        return int(mod.max_memory_allocated())
    if registered_accelerator() == name and hasattr(torch.accelerator, "max_memory_allocated"):
        return int(torch.accelerator.max_memory_allocated())
    return None


def bind_by_local_rank(name: str, torch_device: str, local_rank: int) -> torch.device:
    """One process per chip, the chip picked by LOCAL_RANK (cuda, xpu): set it current and return it."""
    mod = device_module(name)
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(local_rank)
    else:
        torch.accelerator.set_device_index(local_rank)
    return torch.device(torch_device, local_rank)


def runtime_assigned_device(name: str, torch_device: str) -> torch.device:
    """The device the runtime gave this process (Neuron, TPU: each rank sees its own core/chip as its
    current device; the local rank must not pick one)."""
    mod = device_module(name)
    current = mod.current_device() if mod is not None and hasattr(mod, "current_device") else None
    if current is None:
        current = torch.accelerator.current_device_index()
    return current if isinstance(current, torch.device) else torch.device(torch_device, int(current))
