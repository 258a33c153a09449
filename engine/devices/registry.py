"""The registry: every device kind, best-first, and how a --device value becomes a spec.

The order of `DEVICE_MODULES` is the order `auto` tries: a datacenter accelerator before a laptop GPU
before cpu. Specs are built on each call (cheap, probes nothing) so a label follows the torch build in
use and a test's monkeypatched probe is picked up.
"""

from __future__ import annotations

from engine.devices import cpu, cuda, mps, neuron, tpu, xpu
from engine.devices.spec import DeviceSpec
from engine.errors import DeviceUnavailable, InvalidRequest

AUTO = "auto"

# One module per device kind, each with a `spec()` builder; best first.
DEVICE_MODULES = (cuda, tpu, neuron, xpu, mps, cpu)


def registry() -> dict[str, DeviceSpec]:
    """Every device, ordered best-first (the order `auto` tries): cuda, tpu, neuron, xpu, mps, cpu."""
    specs = [module.spec() for module in DEVICE_MODULES]
    return {spec.name: spec for spec in specs}


def device_names() -> tuple[str, ...]:
    """Valid --device values, "auto" first."""
    return (AUTO, *registry())


def get_device(name: str) -> DeviceSpec:
    """The spec for `name` (no probing). Unknown -> InvalidRequest listing the valid names."""
    key = str(name).strip().lower()
    specs = registry()
    if key in specs:
        return specs[key]
    if key == AUTO:
        return resolve_device(AUTO)
    raise InvalidRequest(f"unknown device {name!r}: choose one of {', '.join(device_names())}")


def resolve_device(name: str) -> DeviceSpec:
    """`auto` -> the best available device; a named device -> its spec if available.

    Raises DeviceUnavailable (with the probe's reason) for an absent device, InvalidRequest for an
    unknown name.
    """
    key = str(name).strip().lower()
    if key == AUTO:
        for spec in registry().values():
            if spec.probe().available:
                return spec
        raise DeviceUnavailable("no device is available, not even cpu")  # unreachable: cpu always is
    spec = get_device(key)
    avail = spec.probe()
    if not avail.available:
        raise DeviceUnavailable(f"{spec.label} [{spec.name}] is not available: {avail.reason}")
    return spec
