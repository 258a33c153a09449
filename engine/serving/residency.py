"""Which engines are resident on each device: loaded on demand within the device's budget, evicted least
recently used (never a busy one), unloaded when idle, restarted after a crash, remembered when gone.

`Residency` hears its engines through EngineEvents (engine/worker/client.py): ready and grown engines
settle their device's budget, crashed ones restart (bounded), compile wishes go to the host's scheduler.
What a visitor may load is the manager's call; it passes the outcome in (`protect_used_within_s`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import BudgetExceeded, ShowcaseError
from engine.protocol import BucketKey, CompileWanted, EngineConfig, EngineKey, Footprint
from engine.serving import budget
from engine.serving.footprints import DeviceBudgets
from engine.serving.launch import EngineLauncher
from engine.serving.scheduler import CompileScheduler
from engine.worker.client import EngineClient, EngineEvents

log = logging.getLogger(__name__)
# A line per compile that ends, on the console at the app's default level (app.py sets it to INFO).
compiles_log = logging.getLogger("engine.serving.compiles")

RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 3
CLOSE_TIMEOUT_S = 3.0  # a worker asked to shut down gets this long before its process group is killed


@dataclass(frozen=True)
class Eviction:
    key: EngineKey
    reason: str
    at: float
    footprint: Footprint | None


class RestartLimiter:
    """At most MAX_RESTARTS_IN_WINDOW restarts of one key per RESTART_WINDOW_S, so a crash loop stops."""

    def __init__(self):
        self._restarts: dict[EngineKey, list[float]] = {}

    def allow(self, key: EngineKey) -> bool:
        now = time.time()
        recent = [t for t in self._restarts.get(key, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS_IN_WINDOW:
            log.error("engine %s crashed %d times in %ds; not restarting", key, len(recent), RESTART_WINDOW_S)
            return False
        self._restarts[key] = [*recent, now]
        return True


class Residency(EngineEvents):
    """The engines loaded now (one per key), the evicted ones and why, and the device budgets they fit."""

    def __init__(self, launcher: EngineLauncher, budgets: DeviceBudgets, scheduler: CompileScheduler, *,
                 config_for: Callable[[EngineKey], EngineConfig], is_default: Callable[[EngineKey], bool],
                 auto_restart: bool = True):
        self.launcher = launcher
        self.budgets = budgets
        self.scheduler = scheduler
        self.config_for = config_for  # key -> what its engine is started with
        self.is_default = is_default  # the default engine compiles its start-up list first
        self.auto_restart = auto_restart
        self.loaded: dict[EngineKey, EngineClient] = {}
        self.evicted: dict[EngineKey, Eviction] = {}
        self.restarts = RestartLimiter()
        self.lock = threading.RLock()
        self.admission = threading.Lock()  # one engine admitted (planned, room made, started) at a time
        self.closing = False
        self.engines_started = 0
        self.evictions = 0

    # -- lookup ----------------------------------------------------------------------------------
    def engines(self) -> list[EngineClient]:
        with self.lock:
            return list(self.loaded.values())

    def get(self, key: EngineKey) -> EngineClient | None:
        with self.lock:
            return self.loaded.get(key)

    def serving(self, key: EngineKey) -> EngineClient | None:
        """The loaded engine that answers for `key`. An adopted engine that is down stays the answer (its error
        says why): the app must not start its own engine under that key, nor a local sidecar in place of one
        that spans several machines."""
        engine = self.loaded.get(key)
        if engine is not None and (engine.alive or not engine.ready.is_set() or not engine.evictable):
            return engine
        return None

    def residents(self, device: str, exclude: EngineClient | None = None) -> list[budget.Resident]:
        engines = [e for e in self.engines() if e.key.device == device and e is not exclude]
        return [budget.Resident(str(e.key), self.budgets.footprint_of(e).device_bytes, e.busy(), e.last_used,
                                evictable=e.evictable) for e in engines]

    # -- loading ---------------------------------------------------------------------------------
    def load(self, key: EngineKey, protect_used_within_s: float | None = None,
             unprotected: frozenset = frozenset(), kept: Callable[[EngineKey], bool] | None = None) -> EngineClient:
        """The engine for `key`, started if needed, making room by evicting idle engines (not those used within
        `protect_used_within_s`, but for the `unprotected` ones, and never those `kept` says: the host's pinned
        engines, for a visitor's); returns once it is admitted (it may still be loading)."""
        with self.lock:
            self._check_open()
            if (engine := self.serving(key)) is not None:
                return engine
        with self.admission:
            with self.lock:
                if (engine := self.serving(key)) is not None:
                    return engine
            self.make_room(key, self.budgets.estimate(key).device_bytes, protect_used_within_s,
                           unprotected=unprotected, kept=kept)
            with self.lock:
                self._check_open()
                engine = self._start(key)
                self.loaded[key] = engine
                self.evicted.pop(key, None)
                self.engines_started += 1
            return engine

    def _check_open(self) -> None:
        if self.closing:
            raise ShowcaseError("the server is shutting down")

    def _start(self, key: EngineKey) -> EngineClient:
        engine = self.launcher.make_client(self.config_for(key), events=self)
        log.info("started engine %s", key)
        return engine

    def adopt(self, engine: EngineClient) -> None:
        """Serve a ready engine the app did not start (its key from its Ready), counted in its device's budget."""
        engine.subscribe(self)
        with self.lock:
            self.loaded[engine.key] = engine
            self.evicted.pop(engine.key, None)
        self.budgets.remember(engine)

    def unload(self, key: EngineKey) -> None:
        """Stop `key`'s engine now (a restart follows)."""
        with self.lock:
            old = self.loaded.pop(key, None)
        if old is not None:
            self._drop(old)
            old.close()

    def _drop(self, engine: EngineClient) -> None:
        """An engine is gone or going: its queued compiles are dropped, its short-run slot freed."""
        self.scheduler.drop_engine(engine)
        self.launcher.release(engine)

    # -- room and eviction -----------------------------------------------------------------------
    def make_room(self, key: EngineKey, need: int, protect_used_within_s: float | None = None,
                  exclude: EngineClient | None = None, unprotected: frozenset = frozenset(),
                  kept: Callable[[EngineKey], bool] | None = None) -> None:
        """Evict least-recently-used idle engines so `need` fits (never one `kept` says); raise BudgetExceeded
        when it cannot."""
        limits = self.budgets.device_budget(key.device)
        residents = self.residents(key.device, exclude)
        if kept is not None:
            pinned = {str(e.key) for e in self.engines() if kept(e.key)}
            residents = [dataclasses.replace(r, evictable=False) if r.name in pinned else r for r in residents]
        if protect_used_within_s is not None:
            cutoff = time.monotonic() - protect_used_within_s
            names = {str(k) for k in unprotected}
            residents = [dataclasses.replace(r, busy=r.busy or (r.last_used > cutoff and r.name not in names))
                         for r in residents]
        plan = budget.plan_room(need, limits, residents, reserved=self.budgets.app_bytes(key.device))
        if not plan.fits:
            loaded = [str(k) for k in self.engines_keys() if k.device == key.device]
            hint = ("pick one of the loaded engines (" + ", ".join(loaded) + "), " if loaded else "") + \
                "a smaller precision (bf16/fp16 halve the weights), or ask the host for a bigger budget " \
                "(--memory-budget / --max-engines)"
            if protect_used_within_s is not None:
                hint += f"; engines idle for {protect_used_within_s:.0f} s make room by themselves"
            raise BudgetExceeded(
                f"engine {key} needs about {need / budget.GIB:.2f} GiB but the {key.device} budget "
                f"({limits.describe()}) has no room: {plan.reason}. Try {hint}")
        for name in plan.evict:
            victim = next((e for e in self.engines() if str(e.key) == name), None)
            if victim is not None:
                self.evict(victim, f"evicted (least recently used, idle) to make room for {key}")

    def engines_keys(self) -> list[EngineKey]:
        with self.lock:
            return list(self.loaded)

    def evict(self, engine: EngineClient, reason: str) -> None:
        with self.lock:
            if self.loaded.get(engine.key) is not engine:
                return
            del self.loaded[engine.key]
            self.budgets.remember(engine)
            self.evicted[engine.key] = Eviction(engine.key, reason, time.time(), engine.footprint)
            self.evictions += 1
        self._drop(engine)
        log.info("engine %s: %s", engine.key, reason)
        engine.close()  # waits until its processes are gone, so the memory is really free

    def unload_idle_forever(self, idle_unload_s: float, which: Callable[[EngineKey], bool] = lambda key: True,
                            why: str = "--idle-unload") -> None:
        while not self.closing:
            time.sleep(min(5.0, max(0.5, idle_unload_s / 4)))
            cutoff = time.monotonic() - idle_unload_s
            for engine in self.engines():
                if engine.ready.is_set() and not engine.busy() and engine.last_used < cutoff and engine.evictable \
                        and which(engine.key):
                    self.evict(engine, f"unloaded after {idle_unload_s:.0f} s idle ({why})")

    def watch_stalls_forever(self, stall_s: float) -> None:
        """A worker that stops making progress while it has requests (stopped, frozen) is killed, so its
        requests fail with the reason instead of hanging, and it restarts (engine_down)."""
        while not self.closing:
            time.sleep(min(2.0, stall_s / 4))
            for engine in self.engines():
                stalled = getattr(engine, "stalled", None)
                reason = stalled(stall_s) if stalled is not None else None
                if reason:
                    engine.stop_stalled(reason)

    # -- what engines tell us (EngineEvents) -----------------------------------------------------
    def compile_wanted(self, engine: EngineClient, wish: CompileWanted) -> None:
        startup = wish.startup_rank if self.is_default(engine.key) else None
        self.scheduler.want(engine, wish.bucket, waiting=wish.waiting, hits=wish.hits, startup_rank=startup)

    def compile_finished(self, engine: EngineClient, bucket: BucketKey) -> None:
        self.scheduler.finished(engine, bucket)
        info = next((b for b in engine.buckets() if b.bucket == bucket), None)
        if info is None:
            return
        compiles_log.info("%s on %s: %s; host: %s", bucket, engine.key, compile_outcome(info),
                          self.compile_counts())

    def compile_counts(self) -> str:
        """The host's compiles running (the next one granted already) and queued, as the Buckets tab shows
        them once the engines have started what they were granted."""
        snapshot = self.scheduler.snapshot()
        return f"{len(snapshot['running'])} compiling, {len(snapshot['queued'])} queued"

    def engine_ready(self, engine: EngineClient) -> None:
        """Loaded: remember what it really costs, and keep the device within budget."""
        if engine.footprint is None:
            return
        self.budgets.remember(engine)
        threading.Thread(target=self._settle_budget, args=(engine, True), name="budget-settle", daemon=True).start()

    def footprint_changed(self, engine: EngineClient) -> None:
        """It grew (compiled graphs, their code): make room by evicting idle others, never itself."""
        self.budgets.remember(engine)
        threading.Thread(target=self._settle_budget, args=(engine, False), name="budget-settle", daemon=True).start()

    def _settle_budget(self, engine: EngineClient, just_loaded: bool) -> None:
        limits = self.budgets.device_budget(engine.key.device)
        with self.admission:
            residents = self.residents(engine.key.device, exclude=engine)
            used = sum(r.footprint for r in residents) + engine.footprint.device_bytes
            if limits.bytes is None or used <= limits.bytes:
                return
            try:
                self.make_room(engine.key, engine.footprint.device_bytes, exclude=engine)
            except BudgetExceeded as exc:
                if not just_loaded or not engine.evictable:
                    log.warning("engine %s grew to %.2f GiB: %s over budget until an engine is idle", engine.key,
                                engine.footprint.device_bytes / budget.GIB, engine.key.device)
                    return
                log.warning("engine %s measured %.2f GiB, over budget: unloading it", engine.key,
                            engine.footprint.device_bytes / budget.GIB)
                engine.error = exc
                self.evict(engine, f"unloaded right after loading: {exc}")

    def engine_down(self, engine: EngineClient) -> None:
        """Restart a crashed engine in the background (bounded, so a crash loop stops)."""
        self._drop(engine)
        if not engine.evictable:
            return  # adopted: its owner restarts it; the board shows it down with the reason
        if self.closing or not self.auto_restart or not engine.info:
            return  # a load failure is not retried: its error stays on the board
        if not self.restarts.allow(engine.key):
            return
        log.warning("engine %s went down (%s); restarting", engine.key, engine.error)
        threading.Thread(target=self._replace, args=(engine,), daemon=True).start()

    def _replace(self, engine: EngineClient) -> None:
        with self.lock:
            if self.closing or self.loaded.get(engine.key) is not engine:
                return
            self.loaded[engine.key] = self._start(engine.key)

    # -- status ----------------------------------------------------------------------------------
    def status_rows(self) -> list[dict]:
        """A row per loaded engine (its footprint with it), then one per evicted engine saying why."""
        with self.lock:
            evicted = list(self.evicted.values())
        engines = self.engines()
        rows = [engine.status() for engine in engines]
        for engine, row in zip(engines, rows, strict=True):
            row["footprint"] = self.budgets.footprint_of(engine).as_dict()
        rows += [{"engine": str(e.key), "kind": "evicted", "state": "evicted", "error": e.reason,
                  "evicted_at": e.at, "pending": 0, "buckets": [], "modes": [], "notices": [],
                  "footprint": e.footprint.as_dict() if e.footprint else None} for e in evicted]
        return rows

    def device_use(self) -> dict[str, dict]:
        """Each device's budget and what its engines and this process use of it."""
        return {device: self._use_of(device) for device in
                sorted({e.key.device for e in self.engines()} | self.budgets.devices())}

    def _use_of(self, device: str) -> dict:
        limits = self.budgets.device_budget(device)
        residents = self.residents(device)
        app = self.budgets.app_bytes(device)
        return {
            "budget_gib": None if limits.bytes is None else round(limits.bytes / budget.GIB, 3),
            "max_engines": limits.max_engines, "source": limits.source,
            "used_gib": round((app + sum(r.footprint for r in residents)) / budget.GIB, 3),
            "engines": len(residents),
            "web_server_gib": round(app / budget.GIB, 3),  # counted in used_gib
        }

    # -- the end ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every engine at once: ask, wait CLOSE_TIMEOUT_S, then kill their process groups."""
        with self.lock:
            self.closing = True
            engines = list(self.loaded.values())
            self.loaded.clear()
        threads = [threading.Thread(target=e.close, name=f"close-{e.key}", daemon=True) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CLOSE_TIMEOUT_S + 5)
        self.launcher.close()


def compile_outcome(info) -> str:
    """How a compile ended, as the console says it: warm in how long, failed and why, or back in the queue."""
    state = str(info.state)
    if state == "warm":
        return f"compiled in {info.compile_s:.1f} s" if info.compile_s else "warm"
    if state == "failed":
        return f"compile failed: {info.error}"
    if state == "queued":
        return "compile set aside for a request waiting for another bucket; queued again"
    return state
