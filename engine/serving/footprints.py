"""What engines cost and what each device may hold: the budgets of the devices, the footprints engines
measured (remembered across evictions) and the estimate for an engine not loaded yet."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from engine import devices
from engine.config.resolve import resolve_source
from engine.errors import ShowcaseError
from engine.metrics import median
from engine.models.weights import CorruptWeights
from engine.protocol import EngineConfig, EngineKey, Footprint, Parallel
from engine.serving import budget, fit
from engine.serving.hosting import HostingConfig

ACTIVATION_SHARE = 0.25  # before an engine has run: activations estimated as this share of its weights


class DeviceBudgets:
    """One DeviceBudget per device (the host's --memory-budget / --max-engines, else the device's default)
    and the footprints engines measured."""

    def __init__(self, hosting: HostingConfig, source_config: Callable[[EngineKey], EngineConfig]):
        self.memory_budget = hosting.memory_budget
        self.max_engines = hosting.max_engines
        self.fleet = hosting.fleet is not None  # engines on a Ray cluster's nodes: budgets from what Ray reports
        self.source_config = source_config  # key -> a config to find its weights with
        self._lock = threading.Lock()
        self._budgets: dict[str, budget.DeviceBudget] = {}
        self._footprints: dict[EngineKey, Footprint] = {}  # measured, remembered across evictions

    def device_budget(self, device: str) -> budget.DeviceBudget:
        with self._lock:
            if self.fleet:  # nodes join and leave: asked each time
                self._budgets[device] = self._fleet_budget(device)
            elif device not in self._budgets:
                self._budgets[device] = self._make_budget(device)
            return self._budgets[device]

    def _fleet_budget(self, device: str) -> budget.DeviceBudget:
        """Under --ray: as many engines as the cluster's nodes hold units of the device's resource (Ray places
        each on a node with a free one); no byte limit unless the host gave --memory-budget."""
        from engine.fleet.cluster import resource_units

        resource = devices.get_device(device).ray_resource
        units = resource_units(resource)
        count = self.max_engines if self.max_engines is not None else max(1, int(units))
        return budget.DeviceBudget(device, self.memory_budget, count,
                                   f"the Ray cluster: {units:g} {resource} on its nodes")

    def _make_budget(self, device: str) -> budget.DeviceBudget:
        spec = devices.get_device(device)
        if self.memory_budget is not None:
            limit, source = self.memory_budget, "--memory-budget"
        else:
            limit, source = spec.default_memory_budget()
        count = self.max_engines if self.max_engines is not None else spec.max_engines
        return budget.DeviceBudget(device, limit, count, source + ("" if self.max_engines is None else
                                                                 "; --max-engines"))

    def devices(self) -> set[str]:
        """The devices whose budget was asked for."""
        with self._lock:
            return set(self._budgets)

    def remember(self, engine) -> None:
        """Keep what `engine` measured (if it did) for its key, across evictions."""
        if engine.footprint is not None:
            self._footprints[engine.key] = engine.footprint

    def footprint_of(self, engine) -> Footprint:
        """What an engine counts against its budget: measured once loaded, estimated before."""
        return engine.footprint or self._footprints.get(engine.key) or self.estimate(engine.key)

    def estimate(self, key: EngineKey) -> Footprint:
        if key in self._footprints:
            return self._footprints[key]
        spec = devices.get_device(key.device)
        try:
            source = Path(resolve_source(self.source_config(key)))
            weights = budget.weights_bytes(source, key.precision) if source.is_dir() else 0
        except CorruptWeights:
            raise  # the load would fail the same way: say which component now
        except ShowcaseError:
            weights = 0
        if key.memory:  # memory levers: what stays on the device (engine/serving/fit.py)
            weights = fit.lever_weights(self.source_config(key), weights)
        if Parallel(key.parallel) is Parallel.TENSOR:  # context parallel keeps the whole denoiser on every rank
            weights //= max(1, key.tp)  # each rank holds its shard (the rest is replicated: an underestimate)
        overhead = self._measured_overhead(key.device) or spec.process_overhead_bytes
        return budget.estimate(weights, overhead, ACTIVATION_SHARE)

    def _measured_overhead(self, device: str) -> int | None:
        """What a process of this device measured beyond its weights (the median over loaded engines)."""
        seen = [f.device_bytes - f.weights_bytes for k, f in self._footprints.items() if k.device == device]
        return int(median(seen)) if seen else None

    def app_bytes(self, device: str) -> int:
        """What this process (the web server, its sessions and queues) holds of `device`'s budget: its
        resident memory where the device's memory is the host's (cpu), else nothing."""
        try:
            if self.fleet or not devices.get_device(device).host_memory_is_device_memory:
                return 0  # the engines run on the cluster's nodes, not beside this process
            import psutil

            return psutil.Process().memory_info().rss
        except Exception:  # an unknown device or no /proc: count nothing rather than refuse
            return 0
