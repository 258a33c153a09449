"""What the host decides once, at start-up: the runtime, the budgets, the compile jobs and what visitors may do.

`HostingConfig` is built once (app.py from its flags, the bench and the tests by hand) and handed to
EngineManager; `HostPolicy` is the visitors' part of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.errors import ShowcaseError
from engine.fleet.config import FleetConfig
from engine.protocol import Mode, Precision
from engine.serving.cost import CostBudget


class Runtime(enum.StrEnum):
    WORKERS = "workers"  # one worker process per engine
    INPROCESS = "inprocess"  # engines in this process, device work in GPU calls (engine/serving/inprocess.py)

    @classmethod
    def parse(cls, value) -> Runtime:
        try:
            return cls(str(value))
        except ValueError:
            raise ShowcaseError(f"runtime {value!r}: use workers or inprocess") from None


@dataclass(frozen=True)
class HostPolicy:
    """What visitors may do. Without `public`, a developer's machine: visitors may do anything the host can."""

    public: bool = False
    presets: tuple[str, ...] | None = None  # visitors choose only these (None: every shipped preset)
    precisions: tuple[Precision, ...] | None = None
    modes: tuple[Mode, ...] | None = None
    # Public mode: loading an engine may evict an idle one only if nobody used it for this long (a client's
    # recent use protects at most half a device's engines: engine/serving/shares.py).
    evict_idle_after_s: float = 60.0
    # Public mode: an engine a visitor started (not the default one) is unloaded after this long idle (0: never).
    visitor_idle_unload_s: float = 300.0
    # Public mode: the most a visitor's request may cost, and a visitor may hold queued and running
    # (token-steps, engine/serving/cost.py).
    cost: CostBudget = CostBudget()
    # Public mode: presets whose engines a visitor's engine never evicts (the default engine always is pinned).
    pinned: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostingConfig:
    """How this host runs its engines. None: the device's own default (budget, engine count, threads)."""

    memory_budget: int | None = None  # bytes the engines of one device may hold
    max_engines: int | None = None  # engines per device at once
    compile_jobs: int | None = None  # bucket compiles at once on this host (None: settings' default)
    idle_unload_s: float | None = None  # unload an engine nobody used for this long (None/0: never)
    worker_threads: int | None = None  # compute threads per cpu engine
    runtime: Runtime = Runtime.WORKERS
    auto_restart: bool = True  # restart a crashed engine (bounded, see residency.RestartLimiter)
    policy: HostPolicy = field(default_factory=HostPolicy)
    fleet: FleetConfig | None = None  # --ray: engines run as Ray actors on the cluster's nodes (engine/fleet/)

    def __post_init__(self):
        object.__setattr__(self, "runtime", Runtime.parse(self.runtime))
