"""What the UI may use of the engines: one typed serving interface (Serving) and its implementation.

The app hands the UI a Serving, never the EngineManager: the UI admits and runs requests, reads their events,
cancels them, reads the engines' status and looks presets, keys and the host's policy up, all named for what
they mean. EngineServing implements it from the manager's parts (catalog, gate, residency, ...), each member
bound to the part that does the work, so the UI depends on this interface alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from engine.config.placement import split_device
from engine.config.request import Caller, ImageRequest
from engine.serving import stream
from engine.serving.admission import Ticket
from engine.serving.cost import Uploads
from engine.serving.gate import Admitted

if TYPE_CHECKING:
    from engine.config.caches import CacheDir
    from engine.config.resolve import Catalog
    from engine.protocol import BucketKey, EngineKey, EngineOptions, GenerateResult, ModelPreset
    from engine.serving.admission import RequestFlow
    from engine.serving.fit import EngineLevers
    from engine.serving.footprints import DeviceBudgets
    from engine.serving.gate import Gate
    from engine.serving.hosting import HostingConfig, HostPolicy
    from engine.serving.launch import EngineLauncher
    from engine.serving.residency import Residency
    from engine.serving.scheduler import CompileScheduler
    from engine.serving.shares import VisitorShares
    from engine.serving.telemetry import Telemetry
    from engine.worker.client import EngineClient

__all__ = ["Admitted", "Caller", "EngineServing", "ManagerCalls", "Serving", "ServingParts", "Ticket", "Uploads"]


class Serving(Protocol):
    """The UI's one way to the engines (implemented by EngineServing)."""

    # -- admit and generate -------------------------------------------------------------------------
    def admit(self, spec: ImageRequest, ticket: Ticket | None = None) -> Admitted:
        """The request checked, routed and priced, or the ShowcaseError saying what to change."""

    def generate(self, spec: ImageRequest | Admitted, *, on_progress=None, timeout: float | None = None,
                 on_submit=None, ticket: Ticket | None = None, on_admitted=None) -> GenerateResult:
        """Run one request to its result (raises a ShowcaseError with what to change)."""

    def engine(self, key: EngineKey, options: EngineOptions | None = None,
               caller: Caller = Caller.HOST) -> EngineClient:
        """The engine for a key, started if needed (it may still be loading)."""

    def warm(self, preset: str, device: str, precision: str, mode: str = ..., size: str | None = None,
             tp: int = 1, caller: Caller = Caller.HOST, parallel: str = "tensor") -> None:
        """Queue a bucket's compile (or, for the host, the start-up list)."""

    def restart(self, key: EngineKey, options: EngineOptions | None = None) -> EngineClient:
        """A new worker for `key` (with other options when given)."""

    def engine_options(self, key: EngineKey) -> EngineOptions:
        """The options engine `key` runs (or would start) with."""

    def batch_limit(self, key: EngineKey) -> int:
        """The most requests engine `key` runs as one pipeline call."""

    def priced(self, caller: Caller) -> bool:
        """Whether this caller's requests are priced against the host's cost budgets."""

    def price_compare(self, preset: str, size, steps: int, configurations: int, prompts: int, guidance=None,
                      caller: Caller = Caller.HOST, num_frames=None) -> int:
        """A Compare's price in token-steps (0 when not priced); a video preset's at its clips' frame count."""

    def price_uploads(self, preset: str, size, steps: int, images: int, price: int, uploads: Uploads,
                      caller: Caller = Caller.HOST) -> int:
        """`price` (a Compare's) with its uploads' references over `images` images and their one decoding added
        (0 when not priced), or NotAllowed when together they are over the request budget."""

    def admission(self, client: str, price: int, caller: Caller = Caller.HOST) -> contextlib.AbstractContextManager:
        """Hold `price` against the client's budget while the block runs (yields its Ticket)."""

    def check_images(self, admitted: Admitted, images: int, held: int) -> None:
        """EngineBusy when one call's `images` images together do not fit the visitor's budget now."""

    def held(self, client: str) -> int:
        """Token-steps the client has queued or running."""

    def check_warm(self, client: str, engine: EngineClient, bucket: BucketKey) -> None:
        """NotAllowed when a visitor may not warm this bucket of this engine."""

    # -- events and cancel ------------------------------------------------------------------------
    def events(self, spec: ImageRequest | Admitted, *, key: EngineKey | None = None, run: stream.Run | None = None,
               ticket: Ticket | None = None) -> AsyncIterator[stream.Event]:
        """One request's run as its stream of typed events (engine/serving/stream.py)."""

    def cancel(self, request_id: str) -> bool:
        """Stop a running or waiting request (False if unknown)."""

    # -- status -----------------------------------------------------------------------------------
    def status_rows(self) -> list[dict]:
        """Every engine's and bucket's state, evicted engines included."""

    def engines(self) -> list[EngineClient]:
        """The engines loaded or loading now."""

    def loaded_engine(self, key: EngineKey) -> EngineClient | None:
        """Engine `key` when it is loaded or loading (None: it is not)."""

    def host_status(self) -> dict:
        """Budgets, use, evictions, compiles and the policy: the host's view."""

    def compiles(self) -> dict:
        """The compile scheduler's state."""

    def devices_report(self) -> list[dict]:
        """Every device (under --ray, where the cluster's nodes have it)."""

    def max_engines(self, device: str) -> int:
        """How many engines the device's budget holds."""

    def app_bytes(self, device: str) -> int:
        """The memory the app itself is counted for on the device's budget."""

    def worker_cache_env(self, device: str) -> dict[str, str]:
        """The cache variables the device's workers are started with."""

    telemetry: Telemetry  # the Prometheus metrics (/metrics)
    cache_dir: Path  # where compiled artifacts, models and the web folder live
    cache_persistent: bool  # False: a temporary fallback, removed at shutdown

    # -- catalog view ------------------------------------------------------------------------------
    def preset(self, name: str) -> ModelPreset:
        """The preset of a name (a Hub id or local folder resolves to one), or the ShowcaseError why not."""

    def preset_names(self) -> list[str]:
        """Every preset the app knows, the host's order."""

    def make_key(self, preset: str, device: str, precision: str, tp: int = 1, caller: Caller = Caller.HOST,
                 parallel: str = "tensor", levers: str | None = None) -> EngineKey:
        """The engine key for these settings (a visitor in public mode: only what the host offers)."""

    def device_spec(self, device: str) -> Any:
        """The DeviceSpec a device field resolves to."""

    def lora_slot(self) -> bool:
        """Whether the engines start with a LoRA slot (a preset's LoRAs can then be chosen per request)."""

    def lever_choices(self, key: EngineKey, mode) -> list[dict]:
        """The memory lever sets engine `key` can take, fastest first, each with why not where it cannot."""

    def host_levers(self) -> str:
        """The memory levers an engine gets where nobody names any."""

    # -- policy view -------------------------------------------------------------------------------
    def public(self) -> bool:
        """Whether the host serves visitors in public mode."""

    def visitor_presets(self) -> list[str]:
        """The presets visitors may pick."""

    def offered_precisions(self) -> list | None:
        """Public mode: the precisions the host offers visitors (None: every one)."""

    def offered_modes(self) -> list | None:
        """Public mode: the modes the host offers visitors (None: every one)."""

    def fleet(self) -> bool:
        """Whether engines run on a Ray cluster (--ray)."""

    def memory_budget(self) -> int | None:
        """The bytes the engines of one device may hold (None: no budget)."""


class ManagerCalls(NamedTuple):
    """The manager's own request paths the interface hands on (its methods, not a part's)."""

    generate: Callable
    engine: Callable
    warm: Callable
    restart: Callable
    engine_options: Callable
    batch_limit: Callable
    price_compare: Callable
    price_uploads: Callable
    admission: Callable
    cancel: Callable
    host_status: Callable


class ServingParts(NamedTuple):
    """The manager's parts the interface reads."""

    catalog: Catalog
    gate: Gate
    residency: Residency
    budgets: DeviceBudgets
    levers: EngineLevers
    scheduler: CompileScheduler
    launcher: EngineLauncher
    flow: RequestFlow
    shares: VisitorShares
    options: EngineOptions
    hosting: HostingConfig
    cache: CacheDir
    telemetry: Telemetry


class EngineServing:
    """Serving built from the parts it reads: each member is the part's own (a bound method), so nothing here
    holds the manager. `policy`: the host's policy, read at each call (the bench may swap it)."""

    def __init__(self, calls: ManagerCalls, parts: ServingParts, policy: Callable[[], HostPolicy]):
        (self.generate, self.engine, self.warm, self.restart, self.engine_options, self.batch_limit,
         self.price_compare, self.price_uploads, self.admission, self.cancel, self.host_status) = calls
        gate, residency, levers = parts.gate, parts.residency, parts.levers
        self.admit, self.make_key, self.priced = gate.admit, gate.make_key, gate.priced
        self.check_images, self.visitor_presets = gate.check_images, gate.visitor_presets
        self.held, self.check_warm = parts.flow.held, parts.shares.check_warm
        self.status_rows, self.engines, self.loaded_engine = residency.status_rows, residency.engines, residency.get
        self.compiles, self.app_bytes = parts.scheduler.snapshot, parts.budgets.app_bytes
        self.worker_cache_env = parts.launcher.worker_cache_env
        self.lever_choices, self.host_levers = levers.choices, levers.host_choice
        self.preset = parts.catalog.preset
        self.cache_dir, self.cache_persistent = parts.cache.path, parts.cache.persistent
        self.telemetry = parts.telemetry
        self._catalog, self._budgets, self._options, self._hosting = (parts.catalog, parts.budgets, parts.options,
                                                                       parts.hosting)
        self._policy = policy

    def events(self, spec, *, key=None, run=None, ticket=None) -> AsyncIterator[stream.Event]:
        return stream.request_events(self, spec, key=key, run=run, ticket=ticket)

    def devices_report(self) -> list[dict]:
        from engine import devices

        report = devices.devices_report()
        if self._hosting.fleet is None:
            return report
        from engine.fleet.cluster import fleet_report

        return fleet_report(report)

    def device_spec(self, device: str):
        name, placement = split_device(device)
        return self._catalog.device(name, placement)

    def max_engines(self, device: str) -> int:
        return self._budgets.device_budget(device).max_engines

    def preset_names(self) -> list[str]:
        return list(self._catalog.presets)

    def lora_slot(self) -> bool:
        return self._options.loras

    def public(self) -> bool:
        return self._policy().public

    def offered_precisions(self) -> list | None:
        policy = self._policy()
        return list(policy.precisions) if policy.public and policy.precisions else None

    def offered_modes(self) -> list | None:
        policy = self._policy()
        return list(policy.modes) if policy.public and policy.modes else None

    def fleet(self) -> bool:
        return self._hosting.fleet is not None

    def memory_budget(self) -> int | None:
        return self._hosting.memory_budget
