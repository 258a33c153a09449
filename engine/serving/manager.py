"""The engine manager: one engine per (model, device, precision, tp), started on demand, within budget.

Everything user-facing goes through here: it validates up front (so bad input is answered at once
with what to change), applies the host's policy (what visitors may choose in public mode), keeps the
engines of each device within a memory budget and an engine count (evicting the least recently used
idle engines; never a busy one), schedules compiles host-wide, starts and restarts engines, routes
requests and reports every bucket -- including evicted engines and why.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from engine import devices, settings
from engine.config.caches import prepare_cache_dir
from engine.config.flags import presets_from_args
from engine.config.presets import looks_like_model_ref
from engine.config.request import Caller, ImageRequest
from engine.config.resolve import Catalog, resolve_source
from engine.config.validation import build_request
from engine.errors import (
    BudgetExceeded,
    EngineBusy,
    InvalidRequest,
    NotAllowed,
    ShowcaseError,
    UnsupportedCombination,
)
from engine.metrics import median
from engine.models.weights import CorruptWeights
from engine.pipeline import stepcache
from engine.protocol import (
    BucketKey,
    BucketState,
    EngineConfig,
    EngineKey,
    EngineOptions,
    Footprint,
    GenerateRequest,
    GenerateResult,
    Mode,
    ModelPreset,
    Precision,
    Size,
)
from engine.serving import budget, cost
from engine.serving.cost import CostBudget
from engine.serving.scheduler import CompileScheduler
from engine.serving.telemetry import Telemetry
from engine.worker import logs
from engine.worker.client import ConnectionClient, ProcessClient
from engine.worker.priority import ShortRunSlots

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 3
CLOSE_TIMEOUT_S = 3.0  # a worker asked to shut down gets this long before its process group is killed
ACTIVATION_SHARE = 0.25  # before an engine has run: activations estimated as this share of its weights
# A Compare's next image waits at most this long while other clients' Generates run on its device, so a
# steady stream of them delays it without stopping it.
COMPARE_YIELD_MAX_S = 30.0


@dataclass(frozen=True)
class HostPolicy:
    """What visitors may do. Without `public`, a developer's machine: visitors may do anything the host can."""

    public: bool = False
    presets: tuple[str, ...] | None = None  # visitors choose only these (None: every shipped preset)
    precisions: tuple[Precision, ...] | None = None
    modes: tuple[Mode, ...] | None = None
    # Public mode: loading an engine may evict an idle one only if nobody used it for this long.
    evict_idle_after_s: float = 60.0
    # Public mode: the most a visitor's request may cost, and a visitor may hold queued and running
    # (token-steps, engine/serving/cost.py).
    cost: CostBudget = CostBudget()


@dataclass(frozen=True)
class Ticket:
    """A visitor's admitted cost (manager.admission): held until the block that took it ends. A Compare
    takes one for all its images; each image's generate() then runs on it instead of its own."""

    client: str
    cost: int


class _RunHooks(NamedTuple):
    """What generate()'s caller hears of its run: each step, the request id once sent, its time limit."""

    on_progress: Callable | None
    on_submit: Callable | None
    timeout: float | None


@dataclass(frozen=True)
class Eviction:
    key: EngineKey
    reason: str
    at: float
    footprint: Footprint | None



def cpu_worker_threads(max_engines: int) -> int:
    """Threads per worker on the host's CPU: its cores shared by the engines the budget allows."""
    return max(1, (os.cpu_count() or 1) // max_engines)

class EngineManager:
    def __init__(
        self,
        cache_dir: Path | None = None,
        options: EngineOptions | None = None,
        allowed_roots: list[Path] | None = None,
        extra_presets: dict[str, ModelPreset] | None = None,
        auto_restart: bool = True,
        *,
        memory_budget: int | None = None,
        max_engines: int | None = None,
        compile_jobs: int | None = None,
        idle_unload_s: float | None = None,
        policy: HostPolicy | None = None,
        default_key: EngineKey | None = None,
        worker_threads: int | None = None,
        runtime: str = "workers",
    ):
        self.cache = prepare_cache_dir(Path(cache_dir) if cache_dir else settings.cache_dir())
        self.cache_dir = self.cache.path
        self.options = options or EngineOptions()
        self.catalog = Catalog(allowed_roots, extra_presets)
        self.allowed_roots = self.catalog.allowed_roots
        self.presets = self.catalog.presets
        self.auto_restart = auto_restart
        self.policy = policy or HostPolicy()
        self.default_key = default_key
        self.memory_budget = memory_budget
        self.max_engines = max_engines
        self.idle_unload_s = idle_unload_s
        self.worker_threads = worker_threads
        if runtime not in ("workers", "inprocess"):
            raise ShowcaseError(f"runtime {runtime!r}: use workers or inprocess")
        self.runtime = runtime  # inprocess: engines in this process, device work in GPU calls (engine/serving/inprocess.py)
        self.scheduler = CompileScheduler(compile_jobs or settings.default_compile_jobs())
        self._short_runs: ShortRunSlots | None = None  # made with the first engine on the host's cores
        self._short_run_slot: dict[int, int] = {}  # id(engine) -> its slot in that file
        self._budgets: dict[str, budget.DeviceBudget] = {}
        self._engines: dict[EngineKey, ConnectionClient] = {}
        self._options: dict[EngineKey, EngineOptions] = {}
        self._restarts: dict[EngineKey, list[float]] = {}
        self._footprints: dict[EngineKey, Footprint] = {}  # measured, remembered across evictions
        self._evicted: dict[EngineKey, Eviction] = {}
        self._running: dict[str, ConnectionClient] = {}  # request id -> engine, for cancel()
        self._lock = threading.RLock()
        self._admission = threading.Lock()  # one engine admitted (planned, room made, started) at a time
        self._flow = threading.Condition()  # guards the two below; notified when a Generate ends
        self._held: collections.Counter[str] = collections.Counter()  # visitor -> token-steps queued or running
        self._generates: dict[str, collections.Counter[str]] = {}  # device -> client -> Generates in flight
        self._closing = False
        self.engines_started = 0
        self.evictions = 0
        self.telemetry = Telemetry(self)  # Prometheus metrics (the app's /metrics)
        if idle_unload_s:
            threading.Thread(target=self._unload_idle_forever, name="idle-unload", daemon=True).start()

    # -- lookup and validation -------------------------------------------------------------------
    def preset(self, name: str) -> ModelPreset:
        """A preset by name, or any Hub id / local diffusers folder under the allowed model roots."""
        return self.catalog.preset(name)

    def make_key(self, preset: str, device: str, precision: str, tp: int = 1,
                 caller: Caller = Caller.HOST, parallel: str = "tensor") -> EngineKey:
        """Validate and resolve an engine key ("auto" -> the best available device); in public mode a
        visitor may only pick what the host offers."""
        if caller is Caller.VISITOR:
            self._check_visitor_choice(preset=preset, precision=precision)
        return self.catalog.make_key(preset, device, precision, tp, parallel)

    def _check_visitor_choice(self, *, preset=None, precision=None, mode=None) -> None:
        p = self.policy
        if not p.public:
            return
        offered = self.visitor_presets()
        if preset is not None:
            if isinstance(preset, str) and looks_like_model_ref(preset):
                raise NotAllowed(f"this server does not load Hub ids or local folders ({preset!r}); "
                                 f"choose one of its presets: {', '.join(offered)}")
            if preset not in offered:
                raise NotAllowed(f"preset {preset!r} is not offered here; choose one of: {', '.join(offered)}")
        if precision is not None and p.precisions is not None:
            choice = Precision.parse(precision, "precision")
            if choice not in p.precisions:
                raise NotAllowed(f"precision {choice} is not offered here; choose one of: "
                                 f"{', '.join(map(str, p.precisions))}")
        if mode is not None and p.modes is not None:
            choice = Mode.parse(mode, "mode")
            if choice not in p.modes:
                raise NotAllowed(f"mode {choice} is not offered here; choose one of: {', '.join(map(str, p.modes))}")

    def visitor_presets(self) -> list[str]:
        """The presets visitors may pick (public mode: the host's list)."""
        if self.policy.public and self.policy.presets is not None:
            return [p for p in self.policy.presets if p in self.presets]
        return list(self.presets)

    def engine_options(self, key: EngineKey) -> EngineOptions:
        """Manager defaults (or the options an engine was started with), then the preset's per-device ones.
        Only the default engine warms a start-up list; others compile only what requests ask for."""
        base = self._options.get(key)
        if base is None:
            base = self.options if self._is_default(key) else dataclasses.replace(self.options, warm_sizes=())
        return self.catalog.options_for(key, base)

    def _is_default(self, key: EngineKey) -> bool:
        return self.default_key is None or key == self.default_key

    # -- budgets ---------------------------------------------------------------------------------
    def device_budget(self, device: str) -> budget.DeviceBudget:
        with self._lock:
            if device not in self._budgets:
                spec = devices.get_device(device)
                if self.memory_budget is not None:
                    limit, source = self.memory_budget, "--memory-budget"
                else:
                    limit, source = spec.default_memory_budget()
                count = self.max_engines if self.max_engines is not None else spec.max_engines
                self._budgets[device] = budget.DeviceBudget(device, limit, count,
                                                            source + ("" if self.max_engines is None else
                                                                      "; --max-engines"))
            return self._budgets[device]

    def footprint_of(self, engine: ConnectionClient) -> Footprint:
        """What an engine counts against its budget: measured once loaded, estimated before."""
        return engine.footprint or self._footprints.get(engine.key) or self.estimate(engine.key)

    def estimate(self, key: EngineKey) -> Footprint:
        if key in self._footprints:
            return self._footprints[key]
        spec = devices.get_device(key.device)
        try:
            source = Path(resolve_source(self.catalog.config(key, self.options, self.cache_dir)))
            weights = budget.weights_bytes(source, key.precision) if source.is_dir() else 0
        except CorruptWeights:
            raise  # the load would fail the same way: say which component now
        except ShowcaseError:
            weights = 0
        if key.parallel == "tensor":  # context parallel keeps the whole denoiser on every rank
            weights //= max(1, key.tp)  # each rank holds its shard (the rest is replicated: an underestimate)
        overhead = self._measured_overhead(key.device) or spec.process_overhead_bytes
        return budget.estimate(weights, overhead, ACTIVATION_SHARE)

    def _measured_overhead(self, device: str) -> int | None:
        """What a process of this device measured beyond its weights (the median over loaded engines)."""
        seen = [f.device_bytes - f.weights_bytes for k, f in self._footprints.items() if k.device == device]
        return int(median(seen)) if seen else None

    def _residents(self, device: str, exclude: ConnectionClient | None = None) -> list[budget.Resident]:
        with self._lock:
            engines = [e for e in self._engines.values() if e.key.device == device and e is not exclude]
        return [budget.Resident(str(e.key), self.footprint_of(e).device_bytes, e.busy(), e.last_used,
                                evictable=e.evictable) for e in engines]

    def app_bytes(self, device: str) -> int:
        """What this process (the web server, its sessions and queues) holds of `device`'s budget: its
        resident memory where the device's memory is the host's (cpu), else nothing."""
        try:
            if not devices.get_device(device).host_memory_is_device_memory:
                return 0
            import psutil

            return psutil.Process().memory_info().rss
        except Exception:  # an unknown device or no /proc: count nothing rather than refuse
            return 0

    def _make_room(self, key: EngineKey, need: int, caller: Caller, exclude=None) -> None:
        """Evict least-recently-used idle engines so `need` fits; raise BudgetExceeded when it cannot."""
        limits = self.device_budget(key.device)
        residents = self._residents(key.device, exclude)
        if caller is Caller.VISITOR and self.policy.public:
            # A visitor may only push out engines nobody has used for a while ("the budget is full").
            cutoff = time.monotonic() - self.policy.evict_idle_after_s
            residents = [dataclasses.replace(r, busy=r.busy or r.last_used > cutoff) for r in residents]
        plan = budget.plan_room(need, limits, residents, reserved=self.app_bytes(key.device))
        if not plan.fits:
            loaded = [str(k) for k in self._engines if k.device == key.device]
            hint = ("pick one of the loaded engines (" + ", ".join(loaded) + "), " if loaded else "") + \
                "a smaller precision (bf16/fp16 halve the weights), or ask the host for a bigger budget " \
                "(--memory-budget / --max-engines)"
            if caller is Caller.VISITOR and self.policy.public:
                hint += f"; engines idle for {self.policy.evict_idle_after_s:.0f} s make room by themselves"
            raise BudgetExceeded(
                f"engine {key} needs about {need / budget.GIB:.2f} GiB but the {key.device} budget "
                f"({limits.describe()}) has no room: {plan.reason}. Try {hint}")
        for name in plan.evict:
            victim = next((e for e in self.engines() if str(e.key) == name), None)
            if victim is not None:
                self._evict(victim, f"evicted (least recently used, idle) to make room for {key}")

    def _evict(self, engine: ConnectionClient, reason: str) -> None:
        with self._lock:
            if self._engines.get(engine.key) is not engine:
                return
            del self._engines[engine.key]
            if engine.footprint is not None:
                self._footprints[engine.key] = engine.footprint
            self._evicted[engine.key] = Eviction(engine.key, reason, time.time(), engine.footprint)
            self.evictions += 1
        self._drop_engine(engine)
        log.info("engine %s: %s", engine.key, reason)
        engine.close()  # waits until its processes are gone, so the memory is really free

    def _unload_idle_forever(self) -> None:
        while not self._closing:
            time.sleep(min(5.0, max(0.5, self.idle_unload_s / 4)))
            cutoff = time.monotonic() - self.idle_unload_s
            for engine in self.engines():
                if engine.ready.is_set() and not engine.busy() and engine.last_used < cutoff and engine.evictable:
                    self._evict(engine, f"unloaded after {self.idle_unload_s:.0f} s idle (--idle-unload)")

    # -- engines ---------------------------------------------------------------------------------
    def engine(self, key: EngineKey, options: EngineOptions | None = None,
               caller: Caller = Caller.HOST) -> ConnectionClient:
        """The engine for a key, started if needed (returns once it is admitted; it may still be loading)."""
        with self._lock:
            if self._closing:
                raise ShowcaseError("the server is shutting down")
            if options is not None:
                self._options[key] = options
            engine = self._engines.get(key)
            # An adopted engine that is down stays the answer (its error says why): the app must not start
            # its own engine under that key, nor a local sidecar in place of one that spans several machines.
            if engine is not None and (engine.alive or not engine.ready.is_set() or not engine.evictable):
                return engine
        if caller is Caller.VISITOR and self.policy.public and key.tp > 1:
            raise NotAllowed(f"{key} is not loaded, and starting a tensor-parallel engine is up to the host")
        with self._admission:
            with self._lock:
                engine = self._engines.get(key)
                if engine is not None and (engine.alive or not engine.ready.is_set() or not engine.evictable):
                    return engine
            self._make_room(key, self.estimate(key).device_bytes, caller)
            with self._lock:
                if self._closing:
                    raise ShowcaseError("the server is shutting down")
                engine = self._start(key)
                self._engines[key] = engine
                self._evicted.pop(key, None)
                self.engines_started += 1
            return engine

    def _start(self, key: EngineKey) -> ConnectionClient:
        options = self.engine_options(key)
        if self.runtime == "inprocess":
            from engine.serving.inprocess import InProcessClient

            engine = InProcessClient(self._config(key, options),
                                     threads=self.worker_threads_for(devices.get_device(key.device))).start()
        elif key.tp > 1:
            from engine.tp.client import SidecarClient

            engine = SidecarClient(self._config(key, options)).start()
        else:
            spec = devices.get_device(key.device)
            mode = Mode.DEFER_AND_FUSE if Mode.DEFER_AND_FUSE in options.warm_modes else None
            env = devices.worker_environment(spec, self.cache_dir, mode=mode)
            env.update(self.cache.worker_env())
            threads = self.worker_threads_for(spec)
            if threads:  # a value the user exported wins
                env.setdefault("OMP_NUM_THREADS", str(threads))
            short_runs = self._take_short_run_slot() if spec.host_memory_is_device_memory else None
            if short_runs is not None:
                env["SHOWCASE_SHORT_RUNS"] = short_runs.env_value()
            engine = ProcessClient(self._config(key, options), env=env).start()
            if short_runs is not None:
                self._short_run_slot[id(engine)] = short_runs.slot
        self._attach(engine)
        log.info("started engine %s", key)
        return engine

    def worker_cache_env(self, device: str) -> dict[str, str]:
        """The cache variables a worker of `device` is started with (/system shows these, not the app's)."""
        spec = devices.get_device(device)
        env = devices.worker_environment(spec, self.cache_dir)
        env.update(self.cache.worker_env())
        names = {var for var, _ in spec.cache_env} | set(self.cache.worker_env())
        return {name: env[name] for name in sorted(names) if name in env}

    def _take_short_run_slot(self):
        """A slot in the host's file of engines running a short request (engine/worker/priority.py ShortRuns)."""
        with self._lock:
            if self._short_runs is None:
                try:
                    self._short_runs = ShortRunSlots(tempfile.gettempdir())
                except OSError as exc:
                    log.warning("no short-run slots (%s): cpu requests are ordered by niceness alone", exc)
                    return None
            return self._short_runs.take()

    def _drop_engine(self, engine: ConnectionClient) -> None:
        """An engine is gone or going: its queued compiles are dropped, its short-run slot freed."""
        self.scheduler.drop_engine(engine)
        slot = self._short_run_slot.pop(id(engine), None)
        if slot is not None and self._short_runs is not None:
            self._short_runs.release(slot)

    def adopt(self, engine: ConnectionClient) -> ConnectionClient:
        """Serve an engine the app did not start (a tensor-parallel sidecar attached with --tp-address):
        same board, timings, cancel and compile scheduling; counted in its device's budget, but never
        evicted or restarted by the app (it belongs to whoever started it). `engine` must be ready."""
        if engine.info is None:
            raise ShowcaseError("an engine is adopted once it has said it is ready")
        engine.key = engine.info.key
        engine.evictable = False
        self._attach(engine)
        with self._lock:
            self._engines[engine.key] = engine
            self._evicted.pop(engine.key, None)
            if engine.info.preset is not None:  # a sidecar may serve a model this app has no preset for
                self.presets.setdefault(engine.key.preset, engine.info.preset)
        if engine.footprint is not None:
            self._footprints[engine.key] = engine.footprint
        log.info("adopted engine %s (%s)", engine.key, engine.kind)
        return engine

    def worker_threads_for(self, spec) -> int | None:
        """Compute threads per worker where the device is the host's CPU: its cores shared by the engines
        the budget allows (--worker-threads overrides). Several workers each spinning on every core
        made a 50 ms request take 200-500 ms on a busy 2-core box (OpenMP threads waiting for a core
        another process holds); one thread each kept it at 50 ms. None on accelerators."""
        if not spec.host_memory_is_device_memory:
            return None
        if self.worker_threads:
            return self.worker_threads
        return cpu_worker_threads(self.device_budget(spec.name).max_engines)

    def _attach(self, engine: ConnectionClient) -> None:
        engine.on_down = self._on_down
        engine.compile_gate = self._compile_wanted
        engine.on_compile_finished = self.scheduler.finished
        engine.on_ready = self._on_ready
        engine.on_footprint = self._on_footprint

    def _compile_wanted(self, engine: ConnectionClient, wish) -> None:
        startup = wish.startup_rank if self._is_default(engine.key) else None
        self.scheduler.want(engine, wish.bucket, waiting=wish.waiting, hits=wish.hits, startup_rank=startup)

    def _on_ready(self, engine: ConnectionClient) -> None:
        """Loaded: remember what it really costs, and keep the device within budget."""
        if engine.footprint is None:
            return
        self._footprints[engine.key] = engine.footprint
        threading.Thread(target=self._settle_budget, args=(engine, True), name="budget-settle", daemon=True).start()

    def _on_footprint(self, engine: ConnectionClient) -> None:
        """It grew (compiled graphs, their code): make room by evicting idle others, never itself."""
        self._footprints[engine.key] = engine.footprint
        threading.Thread(target=self._settle_budget, args=(engine, False), name="budget-settle", daemon=True).start()

    def _settle_budget(self, engine: ConnectionClient, just_loaded: bool) -> None:
        limits = self.device_budget(engine.key.device)
        with self._admission:
            residents = self._residents(engine.key.device, exclude=engine)
            used = sum(r.footprint for r in residents) + engine.footprint.device_bytes
            if limits.bytes is None or used <= limits.bytes:
                return
            try:
                self._make_room(engine.key, engine.footprint.device_bytes, Caller.HOST, exclude=engine)
            except BudgetExceeded as exc:
                if not just_loaded or not engine.evictable:
                    log.warning("engine %s grew to %.2f GiB: %s over budget until an engine is idle", engine.key,
                                engine.footprint.device_bytes / budget.GIB, engine.key.device)
                    return
                log.warning("engine %s measured %.2f GiB, over budget: unloading it", engine.key,
                            engine.footprint.device_bytes / budget.GIB)
                engine.error = exc
                self._evict(engine, f"unloaded right after loading: {exc}")

    def _config(self, key: EngineKey, options: EngineOptions) -> EngineConfig:
        return self.catalog.config(key, options, self.cache_dir)

    def _on_down(self, engine: ConnectionClient) -> None:
        """Restart a crashed engine in the background (bounded, so a crash loop stops)."""
        self._drop_engine(engine)
        if not engine.evictable:
            return  # adopted: its owner restarts it; the board shows it down with the reason
        if self._closing or not self.auto_restart or not engine.info:
            return  # a load failure is not retried: its error stays on the board
        now = time.time()
        recent = [t for t in self._restarts.get(engine.key, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS_IN_WINDOW:
            log.error("engine %s crashed %d times in %ds; not restarting", engine.key, len(recent), RESTART_WINDOW_S)
            return
        self._restarts[engine.key] = [*recent, now]
        log.warning("engine %s went down (%s); restarting", engine.key, engine.error)

        def restart():
            with self._lock:
                if self._closing or self._engines.get(engine.key) is not engine:
                    return
                self._engines[engine.key] = self._start(engine.key)

        threading.Thread(target=restart, daemon=True).start()

    def restart(self, key: EngineKey, options: EngineOptions | None = None) -> ConnectionClient:
        """A new worker for `key` (with `options`, e.g. another attention backend, when given)."""
        if options is not None:
            from engine.pipeline import attention

            spec = devices.get_device(key.device)
            plan = devices.plan_precision(spec, key.precision)  # quantized engines attend in their base dtype
            attention.check_backend(options.attention_backend, spec, plan.base or plan.precision)
            with self._lock:
                self._options[key] = options
        with self._lock:
            adopted = self._engines.get(key)
            if adopted is not None and not adopted.evictable:
                raise NotAllowed(f"engine {key} was not started by this app (an attached sidecar): restart it where "
                                 "it runs; the app re-attaches by itself")
            old = self._engines.pop(key, None)
        if old is not None:
            self._drop_engine(old)
            old.close()
        return self.engine(key)

    def engines(self) -> list[ConnectionClient]:
        with self._lock:
            return list(self._engines.values())

    # -- cost (public mode: engine/serving/cost.py) -----------------------------------------------
    def priced(self, caller: Caller) -> bool:
        """Whether this caller's requests are priced against the host's cost budgets (visitors, public mode)."""
        return caller is Caller.VISITOR and self.policy.public

    def price_compare(self, preset: str, size, steps: int, configurations: int, prompts: int, guidance=None,
                      caller: Caller = Caller.HOST) -> int:
        """A Compare's price in token-steps (0 when not priced), or NotAllowed saying what fits."""
        if not self.priced(caller):
            return 0
        p = self.preset(preset)
        size = size if isinstance(size, Size) else Size.parse(size) if size else p.buckets[0]
        if guidance is not None and str(guidance).strip() != "":
            try:
                guidance = float(guidance)
            except (TypeError, ValueError):
                raise InvalidRequest(f"guidance must be a number, got {guidance!r}") from None
        else:
            guidance = None
        return cost.check_compare(self.policy.cost, p, size, steps, configurations, prompts, guidance)

    def price_generate(self, spec: ImageRequest) -> int:
        """A Generate's price in token-steps (0 when its caller is not priced), or NotAllowed saying what fits;
        bad input raises InvalidRequest naming the field. Checked by the UI before it starts an engine for it."""
        if not self.priced(spec.caller):
            return 0
        p = self.preset(spec.preset)
        # priced on its size, steps and guidance alone: the rest is checked (and named) when it runs
        sized = ImageRequest(p.name, size=spec.size, width=spec.width, height=spec.height, steps=spec.steps,
                             guidance=spec.guidance)
        request, _ = build_request(p, sized)
        return cost.check_generate(self.policy.cost, p, request.size, request.steps, request.guidance)

    @contextlib.contextmanager
    def admission(self, client: str, price: int, caller: Caller = Caller.HOST):
        """Hold `price` against the visitor's budget of queued and running cost while the block runs; EngineBusy
        at once when it does not fit. Yields the Ticket (of cost 0, holding nothing, when the caller is not
        priced: a Compare's images still run on it and yield to Generates)."""
        if not self.priced(caller):
            yield Ticket(client, 0)
            return
        with self._flow:
            cost.check_visitor(self.policy.cost, self._held[client], price)
            self._held[client] += price
        try:
            yield Ticket(client, price)
        finally:
            with self._flow:
                self._held[client] -= price
                if self._held[client] <= 0:
                    del self._held[client]

    def held_cost(self, client: str) -> int:
        """Token-steps the visitor has queued or running now."""
        with self._flow:
            return self._held.get(client, 0)

    @contextlib.contextmanager
    def _generate_in_flight(self, device: str, client: str):
        with self._flow:
            self._generates.setdefault(device, collections.Counter())[client] += 1
        try:
            yield
        finally:
            with self._flow:
                flights = self._generates[device]
                flights[client] -= 1
                if flights[client] <= 0:
                    del flights[client]
                self._flow.notify_all()

    def _yield_to_generates(self, device: str, client: str) -> float:
        """A Compare's next image waits while other clients' Generates are queued or running on `device` (at
        most COMPARE_YIELD_MAX_S); returns the seconds waited."""
        start = time.monotonic()
        deadline = start + COMPARE_YIELD_MAX_S
        with self._flow:
            while any(n > 0 for c, n in self._generates.get(device, {}).items() if c != client):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._flow.wait(left)
        return time.monotonic() - start

    def _check_visitor_aot(self, key: EngineKey, bucket: BucketKey) -> None:
        """Public mode: a visitor is served aot only from a package already loaded (warm); building one costs
        minutes of compiling and hundreds of MiB of disk, which is the host's call."""
        with self._lock:
            engine = self._engines.get(key)
        if engine is not None:
            engine.wait_ready(timeout=600)  # the default engine loads its start-up packages as it starts
            if any(info.bucket == bucket and info.state == BucketState.WARM for info in engine.buckets()):
                return
        others = [str(m) for m in devices.get_device(key.device).modes
                  if m != Mode.AOT and (self.policy.modes is None or m in self.policy.modes)]
        raise NotAllowed(f"mode aot at {bucket.size}: no package of this bucket is loaded on {key}, and building "
                         "one (minutes of compiling, hundreds of MiB of disk) is up to the host here (the admin "
                         "token, or `python -m engine export` ahead of time)"
                         + (f"; pick mode {' or '.join(others)} meanwhile" if others else ""))

    # -- requests --------------------------------------------------------------------------------
    def generate(self, spec: ImageRequest, *, on_progress=None, timeout: float | None = None, on_submit=None,
                 ticket: Ticket | None = None) -> GenerateResult:
        """Validate, route and run one request; raises a ShowcaseError with what to change. `spec.client` (a
        visitor's address) gets its turn at the engine among the waiting clients; in public mode a visitor's
        request is priced against the host's cost budgets first, unless it runs on a `ticket` (one image of a
        Compare, which also waits while other clients' Generates run on its device). Hooks: `on_progress`
        gets each StepProgress, `on_submit` the request id once sent; `timeout` cancels it after that many
        seconds. Counted in self.telemetry; the log lines of its thread carry its request id."""
        seen: dict = {}
        logged_as = logs.REQUEST_ID.set(None)  # _generate sets the id once the request is built
        try:
            result = self._generate(spec, seen, _RunHooks(on_progress, on_submit, timeout), ticket)
        except BaseException as exc:
            self.telemetry.request_ended(seen, error=exc)
            raise
        finally:
            logs.REQUEST_ID.reset(logged_as)
        self.telemetry.request_ended(seen, result=result)
        return result

    def _generate(self, spec: ImageRequest, seen: dict, hooks: _RunHooks, ticket: Ticket | None) -> GenerateResult:
        caller = spec.caller
        key = self.make_key(spec.preset, spec.device, spec.precision, spec.tp, caller=caller, parallel=spec.parallel)
        seen["engine"] = str(key)
        if caller is Caller.VISITOR:
            self._check_visitor_choice(mode=spec.mode)
        p = self.preset(key.preset)
        client = ticket.client if ticket is not None else spec.client
        request, notices = build_request(p, spec.replace(client=client))
        seen.update(mode=str(request.mode), bucket=str(request.bucket.size))
        logs.REQUEST_ID.set(request.request_id)
        self._check_routable(key, p, request)
        with contextlib.ExitStack() as stack:
            if ticket is None and self.priced(caller):
                price = cost.check_generate(self.policy.cost, p, request.size, request.steps, request.guidance)
                stack.enter_context(self.admission(client, price, caller))
            if request.mode is Mode.AOT and self.priced(caller):
                self._check_visitor_aot(key, request.bucket)
            if ticket is None:
                stack.enter_context(self._generate_in_flight(key.device, client))
            else:
                self._yield_to_generates(key.device, client)
            result = self._run(key, request, caller, hooks)
        return dataclasses.replace(result, notices=tuple(notices) + result.notices) if notices else result

    def _check_routable(self, key: EngineKey, preset: ModelPreset, request: GenerateRequest) -> None:
        """What the engine's device or runtime cannot run is refused before any engine starts."""
        device = devices.get_device(key.device)
        devices.check_mode(device, request.mode)  # refused here; its notices come with the result
        self._check_runtime(key, request.mode)
        if request.step_cache.enabled:
            stepcache.check_step_cache(request.step_cache, preset, device, request.mode)

    def _run(self, key: EngineKey, request: GenerateRequest, caller: Caller, hooks: _RunHooks) -> GenerateResult:
        on_progress, on_submit, timeout = hooks
        engine = self.engine(key, caller=caller)
        if engine.pending() >= self.engine_options(key).max_queue:
            raise EngineBusy(f"engine {key} has {engine.pending()} requests waiting; retry in a few seconds")
        engine.wait_ready(timeout=600)
        # Registered before it is sent, so a cancel in between reaches the engine (it keeps cancels of
        # requests it has not received yet).
        self._running[request.request_id] = engine
        try:
            future = engine.submit(request, on_progress)
        except BaseException:
            self._running.pop(request.request_id, None)
            raise
        if on_submit:
            on_submit(request.request_id)
        try:
            result: GenerateResult = future.result(timeout)
        except FutureTimeout:
            engine.cancel(request.request_id)
            raise EngineBusy(f"request {request.request_id} did not finish within {timeout}s and was cancelled") from None
        finally:
            self._running.pop(request.request_id, None)
        return result

    def cancel(self, request_id: str) -> bool:
        """Stop a running request between steps (it then fails with Cancelled). False if unknown."""
        engine = self._running.get(request_id)
        if engine is None:
            return False
        engine.cancel(request_id)
        return True

    def warm(self, preset: str, device: str, precision: str, mode: str = Mode.COMPILE, size: str | None = None,
             tp: int = 1, caller: Caller = Caller.HOST, parallel: str = "tensor") -> None:
        """Queue a bucket's compile (or the start-up list). Visitors in public mode: one bucket of an engine
        that is already loaded (theirs)."""
        visitor = caller is Caller.VISITOR and self.policy.public
        if visitor and not size:
            raise NotAllowed("warming every bucket is up to the host; warm one bucket of your engine")
        key = self.make_key(preset, device, precision, tp, caller=caller, parallel=parallel)
        bucket = BucketKey(Mode.parse(mode, "mode"), Size.parse(size)) if size else None
        if visitor:
            self._check_visitor_choice(mode=mode)
            if bucket.size not in self.preset(key.preset).buckets:
                raise InvalidRequest(f"{bucket.size} is not a bucket of {key.preset}")
            if bucket.mode is Mode.AOT:
                self._check_visitor_aot(key, bucket)  # warming a loaded package is a no-op; building is the host's
            with self._lock:
                if key not in self._engines:
                    raise NotAllowed(f"{key} is not loaded; generate with it first, then warm its buckets")
        self._check_runtime(key, bucket.mode if bucket else None)
        engine = self.engine(key, caller=caller)
        engine.wait_ready(timeout=600)
        engine.warm(bucket)

    def _check_runtime(self, key: EngineKey, mode: Mode | None) -> None:
        """What the in-process runtime cannot run is refused before an engine starts, with the reason."""
        if self.runtime != "inprocess":
            return
        from engine.serving.inprocess import REFUSED_MODES, check_inprocess_key

        check_inprocess_key(key)
        if mode in REFUSED_MODES:
            raise UnsupportedCombination(f"mode {mode}: {REFUSED_MODES[mode]}")

    def status(self) -> list[dict]:
        with self._lock:
            evicted = list(self._evicted.values())
        rows = [engine.status() for engine in self.engines()]
        for engine, row in zip(self.engines(), rows, strict=False):
            row["footprint"] = self.footprint_of(engine).as_dict()
        rows += [{"engine": str(e.key), "kind": "evicted", "state": "evicted", "error": e.reason,
                  "evicted_at": e.at, "pending": 0, "buckets": [], "modes": [], "notices": [],
                  "footprint": e.footprint.as_dict() if e.footprint else None} for e in evicted]
        return rows

    def host_status(self) -> dict:
        """Budgets, use, evictions and the compile scheduler: the host's view (/system, the soak)."""
        per_device = {}
        for device in sorted({e.key.device for e in self.engines()} | set(self._budgets)):
            limits = self.device_budget(device)
            residents = self._residents(device)
            app = self.app_bytes(device)
            per_device[device] = {
                "budget_gib": None if limits.bytes is None else round(limits.bytes / budget.GIB, 3),
                "max_engines": limits.max_engines, "source": limits.source,
                "used_gib": round((app + sum(r.footprint for r in residents)) / budget.GIB, 3),
                "engines": len(residents),
                "web_server_gib": round(app / budget.GIB, 3),  # counted in used_gib
            }
        p = self.policy
        return {
            "devices": per_device,
            "engines_started": self.engines_started,
            "evictions": self.evictions,
            "compiles": self.scheduler.snapshot(),
            "idle_unload_s": self.idle_unload_s,
            "policy": {"public": p.public, "presets": self.visitor_presets(),
                       "precisions": [str(x) for x in p.precisions] if p.precisions else None,
                       "modes": [str(x) for x in p.modes] if p.modes else None,
                       "evict_idle_after_s": p.evict_idle_after_s, **p.cost.describe()},
        }

    def shutdown(self) -> None:
        """Stop every engine at once: ask, wait CLOSE_TIMEOUT_S, then kill their process groups."""
        with self._lock:
            self._closing = True
            engines, self._engines = list(self._engines.values()), {}
        threads = [threading.Thread(target=e.close, name=f"close-{e.key}", daemon=True) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CLOSE_TIMEOUT_S + 5)
        if self._short_runs is not None:
            self._short_runs.remove()


def make_manager(args, options: EngineOptions, **hosting) -> EngineManager:
    """An EngineManager for a command line (--model becomes a preset of its own); `hosting`: the budget,
    compile-scheduler and policy arguments of EngineManager."""
    roots, extra = presets_from_args(args)
    return EngineManager(cache_dir=args.cache_dir or settings.cache_dir(), options=options, allowed_roots=roots,
                         extra_presets=extra, **hosting)
