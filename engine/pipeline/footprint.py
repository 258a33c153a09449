"""What an engine holds: its weights' bytes, and its device and host memory with a run's measured peak."""

from __future__ import annotations

import weakref

import torch

from engine import devices
from engine.protocol import Footprint


def weights_bytes(pipe) -> int:
    """The bytes of every Parameter and buffer of the pipeline's modules, each tensor counted once."""
    seen, total = set(), 0
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for tensor in (*component.parameters(), *component.buffers()):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    return total


_BY_COMPONENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def component_bytes(pipe) -> tuple[tuple[str, int], ...]:
    """Each component's Parameters and buffers in bytes as stored (counted once per loaded pipeline)."""
    if pipe not in _BY_COMPONENT:
        _BY_COMPONENT[pipe] = tuple(
            (name, sum(t.numel() * t.element_size() for t in (*c.parameters(), *c.buffers())))
            for name, c in pipe.components.items() if isinstance(c, torch.nn.Module))
    return _BY_COMPONENT[pipe]


def engine_footprint(spec: devices.DeviceSpec, weights: int, peak: int | None) -> Footprint:
    """Device memory (weights + the measured run peak; the resident memory where host RAM is the device)
    and the process's resident memory."""
    import psutil

    rss = psutil.Process().memory_info().rss
    if spec.host_memory_is_device_memory:
        device = max(rss, peak or 0)
    else:
        device = max(weights, peak or 0) + spec.process_overhead_bytes
    return Footprint(device_bytes=int(device), host_rss_bytes=int(rss), weights_bytes=int(weights))
