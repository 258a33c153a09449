"""Memory budgets: what an engine costs, what a device may hold, and whom to evict to make room.

Every engine reports its footprint once loaded (`Footprint`: the device memory it holds -- weights
plus the peak of a warm-up run -- and its process's resident memory). The manager keeps the engines
of each device within a budget (`DeviceBudget`: bytes and an engine count) by evicting the least
recently used *idle* engines; a busy engine is never evicted. Before an engine is loaded its
footprint is estimated from its weights (safetensors headers: exact parameter counts, no tensor is
read) plus what a process of that device costs, or taken from what the same engine measured before.

The planning here is pure (no processes), so eviction order and refusals are tested directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidRequest
from engine.protocol import Footprint

log = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20
# Bytes per element of the weights once loaded in each precision (tf32 keeps fp32 weights).
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class DeviceBudget:
    device: str
    bytes: int | None  # None: no byte limit known (the device reports no memory)
    max_engines: int
    source: str = ""  # how the default was chosen, shown on /status

    def describe(self) -> str:
        limit = "no byte limit" if self.bytes is None else f"{self.bytes / GIB:.1f} GiB"
        return f"{self.device}: {limit}, at most {self.max_engines} engines ({self.source})"


MAX_SIZE = 2**60  # 1 EiB: past it a size is a typo (or inf)


def parse_size(text: str | int | float | None) -> int | None:
    """'3GiB', '512MiB', '2.5G', '1000000' -> bytes. None/'' -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, int | float):
        return int(text)
    raw = str(text).strip()
    units = {"gib": GIB, "gb": 10**9, "g": GIB, "mib": MIB, "mb": 10**6, "m": MIB, "kib": 1024, "kb": 1000, "k": 1024,
             "b": 1, "": 1}
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = raw[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        raise InvalidRequest(f"memory size {text!r} is not a number with a unit, e.g. '3GiB' or '512MiB'") from None
    if unit not in units or not value > 0:  # (NaN is not > 0)
        raise InvalidRequest(f"memory size {text!r} is not a positive number with a unit, e.g. '3GiB' or '512MiB'")
    if value * units[unit] > MAX_SIZE:  # 1e400 is inf: int() of it would raise OverflowError
        raise InvalidRequest(f"memory size {str(text)[:40]!r} is larger than any machine's memory (at most 1EiB)")
    return int(value * units[unit])


def safetensors_parameters(folder: Path) -> int:
    """Elements stored in every *.safetensors under `folder` (read from the headers only). A corrupt header
    raises CorruptWeights naming the component (its length is bounded by the file's size, never trusted)."""
    from engine.models.weights import parameter_count, read_header

    return sum(parameter_count(read_header(path)) for path in sorted(Path(folder).rglob("*.safetensors")))


def weights_bytes(folder: Path, precision: str) -> int:
    return safetensors_parameters(folder) * PRECISION_BYTES.get(str(precision), 4)


def estimate(weights: int, process_overhead: int, activation_factor: float) -> Footprint:
    """Before loading: weights, plus a process's fixed cost on this device, plus activations as a share
    of the weights (replaced by the measured footprint once the engine has loaded)."""
    device = int(weights * (1 + activation_factor)) + process_overhead
    return Footprint(device_bytes=device, host_rss_bytes=process_overhead, weights_bytes=weights, measured=False)


@dataclass(frozen=True)
class Resident:
    """An engine the planner may consider: its footprint, whether it is busy, when it was last used."""

    name: str
    footprint: int
    busy: bool
    last_used: float
    evictable: bool = True  # False: e.g. an attached sidecar the app did not start


@dataclass(frozen=True)
class RoomPlan:
    fits: bool
    evict: tuple[str, ...]  # names, least recently used first
    used_after: int
    reason: str = ""  # when it does not fit: why, in words


def plan_room(need: int, budget: DeviceBudget, residents: list[Resident], reserved: int = 0) -> RoomPlan:
    """Which idle engines to evict (least recently used first) so that `need` more bytes and one more
    engine fit in `budget`. Busy engines are never chosen. `reserved`: bytes held by what is no engine
    (the web server's own memory, on a device whose memory is the host's)."""
    used = reserved + sum(r.footprint for r in residents)
    count = len(residents)
    candidates = sorted((r for r in residents if not r.busy and r.evictable), key=lambda r: r.last_used)
    evict: list[str] = []

    def fits() -> bool:
        return (budget.bytes is None or used + need <= budget.bytes) and count + 1 <= budget.max_engines

    for r in candidates:
        if fits():
            break
        evict.append(r.name)
        used -= r.footprint
        count -= 1
    if fits():
        return RoomPlan(True, tuple(evict), used + need)
    busy = [r.name for r in residents if r.busy or not r.evictable]
    if budget.bytes is not None and need > budget.bytes:
        reason = f"it alone needs about {need / GIB:.2f} GiB, more than the whole budget"
    elif count + 1 > budget.max_engines:
        reason = f"{count} engines that cannot be unloaded now ({', '.join(busy)}) already use the " \
                 f"{budget.max_engines}-engine limit"
    else:
        held = f" and the web server ({reserved / GIB:.2f} GiB)" if reserved else ""
        reason = (f"the engines that cannot be unloaded now ({', '.join(busy) or 'none'}){held} hold "
                  f"{used / GIB:.2f} GiB, leaving {(budget.bytes - used) / GIB:.2f} GiB")
    return RoomPlan(False, (), used, reason)
