"""What `python -m engine devices` (and the System tab) shows: every device, probed, with its reasons."""

from __future__ import annotations

from engine.devices.policy import precision_support
from engine.devices.registry import registry
from engine.devices.spec import DeviceSpec
from engine.protocol import Mode
from engine.settings import cache_dir


def describe_device(spec: DeviceSpec) -> dict:
    """JSON-able: every field, plus available/reason (this probes the device)."""
    avail = spec.probe()
    try:
        env = spec.environment(cache_dir())
    except Exception:  # a bad cache setting must not hide the device list
        env = {}
    return {
        "name": spec.name,
        "label": spec.label,
        "torch_device": spec.torch_device,
        "compile_backend": spec.compile_backend,
        "static_shapes": spec.static_shapes,
        "dist_backend": spec.dist_backend,
        "mesh_device_type": spec.mesh_device_type,
        "tensor_parallel": spec.tensor_parallel,
        "modes": list(spec.modes),
        "aot": {"available": Mode.AOT in spec.modes, "reason": spec.aot_refusal},
        "cuda_graphs": spec.cuda_graphs,
        "attention_kernels": list(spec.attention_kernels),
        "precisions": precision_support(spec) if avail.available else None,
        "memory": spec.describe_memory(),
        "environment": env,
        "available": avail.available,
        "reason": avail.reason,
    }


def devices_report() -> list[dict]:
    """What `python -m engine devices --json` prints: every device, best-first, with the reason
    an absent one is absent, and which one `auto` picks."""
    rows = [describe_device(spec) for spec in registry().values()]
    auto = next((row["name"] for row in rows if row["available"]), None)
    for row in rows:
        row["auto"] = row["name"] == auto
    return rows
