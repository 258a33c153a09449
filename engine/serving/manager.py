"""The engine manager: one engine per (model, device, precision, tp), started on demand, within budget.

Everything user-facing goes through here: its gate (gate.py) checks a request once, up front (so bad
input is answered at once with what to change; the host's policy, what visitors may choose in public mode;
the visitor's price), then the manager routes it to its engine and reports every bucket -- including
evicted engines and why. Which engines are loaded, within what budget, is its Residency's job (residency.py); how an
engine is started, the launcher's (launch.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import NamedTuple

from engine import devices, settings
from engine.config.caches import prepare_cache_dir, remove_orphaned_folders
from engine.config.flags import presets_from_args
from engine.config.request import Caller, ImageRequest
from engine.config.resolve import Catalog
from engine.config.video import warm_bucket
from engine.errors import EngineBusy, NotAllowed, ShowcaseError
from engine.pipeline.batching import max_batch_for
from engine.protocol import (
    BucketKey,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateResult,
    Mode,
    ModelPreset,
    Size,
)
from engine.serving import cost, fit, policy
from engine.serving.admission import RequestFlow, Ticket, price_compare
from engine.serving.footprints import DeviceBudgets
from engine.serving.gate import Admitted, Gate
from engine.serving.hosting import HostingConfig, HostPolicy
from engine.serving.interface import EngineServing, ManagerCalls, Serving, ServingParts
from engine.serving.launch import EngineLauncher, cpu_worker_threads
from engine.serving.residency import Residency
from engine.serving.scheduler import CompileScheduler
from engine.serving.shares import VisitorShares
from engine.serving.telemetry import Telemetry
from engine.serving.turns import InFlight, Turns
from engine.worker import logs
from engine.worker.client import EngineClient

__all__ = ["Admitted", "Caller", "EngineManager", "HostPolicy", "HostingConfig", "Ticket", "cpu_worker_threads", "make_manager"]

log = logging.getLogger(__name__)


class _RunHooks(NamedTuple):
    """What generate()'s caller hears of its run: each step, the request id once sent, its time limit, and the
    request id once admitted (a cancel from then on stops it, sent or not)."""

    on_progress: Callable | None
    on_submit: Callable | None
    timeout: float | None
    on_admitted: Callable | None = None


def fleet_lacks(device: str, placement) -> str | None:
    """Why no node of the Ray cluster has `device` at `placement` (None: one has): the device list under --ray."""
    from engine.fleet.cluster import why_lacking

    return why_lacking(device, placement)


# A worker with requests that says nothing and uses no CPU time for this long is stuck (stopped, frozen) and is
# killed: its requests fail with the reason, and it restarts. A compile or a long step uses CPU.
WORKER_STALL_S = 30.0


class EngineManager:
    def __init__(self, cache_dir: Path | None = None, options: EngineOptions | None = None,
                 allowed_roots: list[Path] | None = None, extra_presets: dict[str, ModelPreset] | None = None, *,
                 hosting: HostingConfig | None = None, **hosting_fields):
        """`hosting`: how this host runs engines; single HostingConfig fields (memory_budget=..., policy=...)
        may be given instead or on top."""
        self.hosting = dataclasses.replace(hosting or HostingConfig(), **hosting_fields)
        self.cache = prepare_cache_dir(Path(cache_dir) if cache_dir else settings.cache_dir())
        self.cache_dir = self.cache.path
        self.options = options or EngineOptions()
        self.catalog = Catalog(allowed_roots, extra_presets)
        if self.hosting.fleet is not None:
            self.catalog.fleet_lacks = fleet_lacks
        self.allowed_roots = self.catalog.allowed_roots
        self.presets = self.catalog.presets
        self.policy = self.hosting.policy  # the bench may swap it for a run
        self.default_key: EngineKey | None = None
        self.scheduler = CompileScheduler(self.hosting.compile_jobs or settings.default_compile_jobs())
        self.budgets = DeviceBudgets(self.hosting, lambda key: self.catalog.config(key, self.options, self.cache_dir))
        self.levers = fit.EngineLevers(self.options.recipe, self.budgets,  # memory levers of each key
                                       lambda key: self.catalog.config(key, self.options, self.cache_dir))
        self.launcher = EngineLauncher(self.hosting, self.cache,
                                       lambda device: self.budgets.device_budget(device).max_engines)
        self.residency = Residency(self.launcher, self.budgets, self.scheduler, config_for=self._config,
                                   is_default=self._is_default, auto_restart=self.hosting.auto_restart)
        self._options: dict[EngineKey, EngineOptions] = {}  # per engine, when started with its own
        self.flow = RequestFlow()
        self.turns = Turns()  # places at each engine, in turns between clients by cost (turns.py)
        self.in_flight = InFlight(self.turns)  # where each request is, for cancel()
        # cancel(request_id): stop a request between steps, or before it is sent (Cancelled); False if unknown
        self.cancel = self.in_flight.cancel
        self.telemetry = Telemetry(self.residency.status_rows, self.host_status)  # Prometheus metrics (/metrics)
        self.gate = Gate(self.catalog, self.levers, lambda: self.policy, self.hosting.runtime, self.residency.get,
                         self.telemetry.request_ended)  # every Generate is checked here, once
        self.shares = VisitorShares(self.policy.evict_idle_after_s)  # public mode: engines and compiles per visitor
        if self.hosting.idle_unload_s:
            threading.Thread(target=self.residency.unload_idle_forever, args=(self.hosting.idle_unload_s,),
                             name="idle-unload", daemon=True).start()
        threading.Thread(target=self.residency.watch_stalls_forever, args=(WORKER_STALL_S,), name="stall-watch",
                         daemon=True).start()
        if self.policy.public and self.policy.visitor_idle_unload_s:
            threading.Thread(target=self.residency.unload_idle_forever, name="visitor-idle-unload", daemon=True,
                             args=(self.policy.visitor_idle_unload_s, self._visitor_started,
                                   "started by a visitor, public mode")).start()

    # -- engines ---------------------------------------------------------------------------------
    def engine_options(self, key: EngineKey) -> EngineOptions:
        """Manager defaults (or the options an engine was started with), then the preset's per-device ones.
        Only the default engine warms a start-up list; others compile only what requests ask for."""
        base = self._options.get(key)
        if base is None:
            base = self.options if self._is_default(key) else dataclasses.replace(self.options, warm_sizes=())
        return self.catalog.options_for(key, base)

    def _is_default(self, key: EngineKey) -> bool:
        return self.default_key is None or key == self.default_key

    def _config(self, key: EngineKey) -> EngineConfig:
        return self.catalog.config(key, self.engine_options(key), self.cache_dir)

    def engine(self, key: EngineKey, options: EngineOptions | None = None,
               caller: Caller = Caller.HOST) -> EngineClient:
        """The engine for a key, started if needed (returns once it is admitted; it may still be loading).
        A visitor in public mode may not start a tensor-parallel engine, nor evict an engine used recently,
        unless one client's recent use alone holds more than its share of the device's engines (shares.py)."""
        if options is not None:
            self._options[key] = options
        visitor = caller is Caller.VISITOR and self.policy.public
        if not visitor:
            self.shares.visitor_started.discard(key)  # the host's engine: unloaded only as the host says
            return self.residency.load(key)
        if self.residency.serving(key) is not None:
            return self.residency.load(key)
        if key.tp > 1:
            raise NotAllowed(f"{key} is not loaded, and starting a tensor-parallel engine is up to the host")
        if self.pinned(key):  # the host's engine, asked for by a visitor: it makes room as the host's would
            return self.residency.load(key, kept=lambda other: other != key and self.pinned(other))
        same_device = [k for k in self.residency.engines_keys() if k.device == key.device]
        overheld = self.shares.overheld(same_device, self.budgets.device_budget(key.device).max_engines)
        engine = self.residency.load(key, self.policy.evict_idle_after_s, unprotected=frozenset(overheld),
                                     kept=self.pinned)
        if not self._is_default(key):
            self.shares.visitor_started.add(key)
        return engine

    def pinned(self, key: EngineKey) -> bool:
        """Whether a visitor's engine may never evict `key`'s: the default engine and the host's --pin presets."""
        return key == self.default_key or key.preset in self.policy.pinned

    def _visitor_started(self, key: EngineKey) -> bool:
        return key in self.shares.visitor_started and not self._is_default(key) and not self.pinned(key)

    def adopt(self, engine: EngineClient) -> EngineClient:
        """Serve an engine the app did not start (a tensor-parallel sidecar attached with --tp-address):
        same board, timings, cancel and compile scheduling; counted in its device's budget, but never
        evicted or restarted by the app (it belongs to whoever started it). `engine` must be ready."""
        if engine.info is None:
            raise ShowcaseError("an engine is adopted once it has said it is ready")
        self.residency.adopt(engine)
        if engine.info.preset is not None:  # a sidecar may serve a model this app has no preset for
            self.presets.setdefault(engine.key.preset, engine.info.preset)
        log.info("adopted engine %s (%s)", engine.key, engine.kind)
        return engine

    def restart(self, key: EngineKey, options: EngineOptions | None = None) -> EngineClient:
        """A new worker for `key` (with `options`, e.g. another attention backend, when given)."""
        if options is not None:
            policy.check_attention(key, options)
            self._options[key] = options
        adopted = self.residency.get(key)
        if adopted is not None and not adopted.evictable:
            raise NotAllowed(f"engine {key} was not started by this app (an attached sidecar): restart it where "
                             "it runs; the app re-attaches by itself")
        self.residency.unload(key)
        return self.engine(key)

    # -- cost (public mode: engine/serving/cost.py) -----------------------------------------------
    def price_compare(self, preset: str, size, steps: int, configurations: int, prompts: int, guidance=None,
                      caller: Caller = Caller.HOST, num_frames=None) -> int:
        """A Compare's price in token-steps (0 when not priced), or NotAllowed saying what fits."""
        if not self.gate.priced(caller):
            return 0
        return price_compare(self.policy.cost, self.catalog.preset(preset), size, steps, configurations, prompts,
                             guidance, num_frames)

    def price_uploads(self, preset: str, size, steps: int, images: int, price: int, uploads: cost.Uploads,
                      caller: Caller = Caller.HOST) -> int:
        """`price` (a Compare's) with its uploads' references and their one decoding added (0 when not priced),
        or NotAllowed when together they are over the request budget."""
        if not self.gate.priced(caller):
            return 0
        model = self.catalog.preset(preset)
        size = size if isinstance(size, Size) else Size.parse(size) if size else model.buckets[0]
        return cost.check_uploads(self.policy.cost, model, size, steps, images, price, uploads)

    def batch_limit(self, key: EngineKey) -> int:
        """The most requests engine `key` runs as one pipeline call (1: it does not batch)."""
        return max_batch_for(self.engine_options(key).max_batch, devices.get_device(key.device), key.tp)

    @contextlib.contextmanager
    def admission(self, client: str, price: int, caller: Caller = Caller.HOST):
        """Hold `price` against the visitor's budget of queued and running cost while the block runs; EngineBusy
        at once when it does not fit. Yields the Ticket (of cost 0, holding nothing, when the caller is not
        priced: a Compare's images still run on it and yield to Generates)."""
        if not self.gate.priced(caller):
            yield Ticket(client, 0)
            return
        with self.flow.hold(self.policy.cost, client, price) as ticket:
            yield ticket

    # -- requests --------------------------------------------------------------------------------
    def generate(self, spec: ImageRequest | Admitted, *, on_progress=None, timeout: float | None = None,
                 on_submit=None, ticket: Ticket | None = None, on_admitted=None) -> GenerateResult:
        """Run one request; raises a ShowcaseError with what to change. `spec`: the edge's request, checked
        here by the gate, or what the gate already admitted (`manager.gate.admit(spec)`: the page checks a
        request before its run starts). `spec.client` (a visitor's address) gets its turn at the engine among
        the waiting clients; in public mode a visitor's request holds its price against the host's cost
        budgets while it runs, unless it runs on a `ticket` (one image of a Compare, which also waits while
        other clients' Generates run on its device). Hooks: `on_progress` gets each StepProgress,
        `on_submit` the request id once sent, `on_admitted` once admitted; `timeout` cancels it after that many seconds. Counted in
        self.telemetry; the log lines of its thread carry its request id."""
        admitted = spec if isinstance(spec, Admitted) else self.gate.admit(spec, ticket)
        logged_as = logs.REQUEST_ID.set(admitted.request.request_id)
        try:
            with self.in_flight.admitted(admitted.request.request_id, on_admitted):
                result = self._run(admitted, _RunHooks(on_progress, on_submit, timeout, on_admitted))
        except BaseException as exc:
            self.telemetry.request_ended(admitted.labels(), error=exc)
            raise
        finally:
            logs.REQUEST_ID.reset(logged_as)
        self.telemetry.request_ended(admitted.labels(), result=result)
        return result

    def _run(self, admitted: Admitted, hooks: _RunHooks) -> GenerateResult:
        """The admitted request on its engine: its price held, its turn among the device's Generates."""
        key, client = admitted.key, admitted.request.client
        with contextlib.ExitStack() as stack:
            if admitted.ticket is None:
                if admitted.price:
                    stack.enter_context(self.flow.hold(self.policy.cost, client, admitted.price))
                stack.enter_context(self.flow.generate_in_flight(key.device, client))
            else:
                self.flow.yield_to_generates(key.device, client)
            result = self._submit(admitted, hooks)
        notices = admitted.notices
        return dataclasses.replace(result, notices=notices + result.notices) if notices else result

    def _submit(self, admitted: Admitted, hooks: _RunHooks) -> GenerateResult:
        timeout = hooks.timeout
        key, request = admitted.key, admitted.request
        engine = self.engine(key, caller=admitted.caller)
        if self.gate.priced(admitted.caller):
            self.shares.used(key, request.client)
        self.in_flight.check(request.request_id)  # stopped while its engine loaded or its device was busy
        price = turn_cost(self.catalog, admitted)
        with self.turns.turn(key, request.client, price, self.engine_options(key).max_queue, request.request_id, timeout):
            if not engine.alive:  # it went (evicted, crashed) while this request waited for its turn
                engine = self.engine(key, caller=admitted.caller)
            return self._send(engine, admitted, hooks)

    def _send(self, engine: EngineClient, admitted: Admitted, hooks: _RunHooks) -> GenerateResult:
        on_progress, on_submit, timeout, _ = hooks
        request = admitted.request
        engine.wait_ready(timeout=600)
        # Registered before it is sent, so a cancel in between reaches the engine (it keeps cancels of
        # requests it has not received yet); a cancel before that was marked, and stops it here.
        self.in_flight.sent[request.request_id] = engine
        try:
            self.in_flight.check(request.request_id)
            future = engine.submit(request, on_progress)
        except BaseException:
            self.in_flight.sent.pop(request.request_id, None)
            raise
        if on_submit:
            on_submit(request.request_id)
        try:
            result: GenerateResult = future.result(timeout)
        except FutureTimeout:
            engine.cancel(request.request_id)
            raise EngineBusy(f"request {request.request_id} did not finish within {timeout}s and was cancelled") from None
        finally:
            self.in_flight.sent.pop(request.request_id, None)
        node_of = getattr(engine, "node_of", None)  # an engine on Ray nodes (engine/fleet/client.py, replicas.py)
        node = node_of(request.request_id) if node_of is not None else None
        return dataclasses.replace(result, node=node) if isinstance(node, str) and node else result

    def warm(self, preset: str, device: str, precision: str, mode: str = Mode.COMPILE, size: str | None = None,
             tp: int = 1, caller: Caller = Caller.HOST, parallel: str = "tensor") -> None:
        """Queue a bucket's compile (or the start-up list). Visitors in public mode: one bucket of an engine
        that is already loaded (theirs)."""
        visitor = caller is Caller.VISITOR and self.policy.public
        if visitor and not size:
            raise NotAllowed("warming every bucket is up to the host; warm one bucket of your engine")
        key = self.gate.make_key(preset, device, precision, tp, caller=caller, parallel=parallel)
        bucket = self._bucket(key, mode, size) if size else None
        if visitor:
            self._check_visitor_warm(key, bucket)
        policy.check_runtime(self.hosting.runtime, key, bucket.mode if bucket else None)
        engine = self.engine(key, caller=caller)
        engine.wait_ready(timeout=600)
        engine.warm(bucket)

    def _bucket(self, key: EngineKey, mode, size: str) -> BucketKey:
        """The bucket warming `size` compiles ("WxH", or a video preset's "WxHxF"): with the preset's default
        references (an edit's one reference)."""
        preset = self.catalog.preset(key.preset)
        bucket = warm_bucket(preset, mode, size)
        return dataclasses.replace(bucket, refs=preset.reference_layouts(bucket.size)[0])

    def _check_visitor_warm(self, key: EngineKey, bucket: BucketKey) -> None:
        self.gate.check_visitor_choice(mode=bucket.mode)
        policy.check_visitor_warm(self.policy, key, bucket, self.catalog.preset(key.preset), self.residency.get(key))

    # -- status (each engine's rows: residency.status_rows()) ------------------------------------
    def host_status(self) -> dict:
        """Budgets, use, evictions and the compile scheduler: the host's view (/system, the soak)."""
        p = self.policy
        return {
            "devices": self.residency.device_use(),
            "engines_started": self.residency.engines_started,
            "evictions": self.residency.evictions,
            "compiles": self.scheduler.snapshot(),
            "idle_unload_s": self.hosting.idle_unload_s,
            "policy": {"public": p.public, "presets": self.gate.visitor_presets(),
                       "precisions": [str(x) for x in p.precisions] if p.precisions else None,
                       "modes": [str(x) for x in p.modes] if p.modes else None,
                       "evict_idle_after_s": p.evict_idle_after_s, **p.cost.describe()},
            **({"cluster": self.cluster()} if self.hosting.fleet is not None else {}),
        }

    def serving(self) -> Serving:
        """What the UI may use (engine/serving/interface.py): built from the parts; generate is read at each
        call, so a test's spy on this manager's generate is seen."""
        calls = ManagerCalls(lambda spec, **hooks: self.generate(spec, **hooks), self.engine, self.warm,
                             self.restart, self.engine_options, self.batch_limit, self.price_compare,
                             self.price_uploads,
                             self.admission, self.cancel, self.host_status)
        parts = ServingParts(self.catalog, self.gate, self.residency, self.budgets, self.levers, self.scheduler,
                             self.launcher, self.flow, self.shares, self.options, self.hosting, self.cache,
                             self.telemetry)
        return EngineServing(calls, parts, policy=lambda: self.policy)

    def cluster(self) -> dict | None:
        """Under --ray: the cluster's nodes, their resources and what each device has (None without)."""
        if self.hosting.fleet is None:
            return None
        from engine.fleet.cluster import summary

        return summary()

    def shutdown(self) -> None:
        """Stop every engine at once: ask, wait a few seconds, then kill their process groups; then remove the
        temporary compile caches they left (the cache folder's own, when it was a temporary fallback)."""
        self.residency.shutdown()
        self.cache.remove_if_temporary()
        remove_orphaned_folders()


def turn_cost(catalog: Catalog, admitted: Admitted) -> int:
    """What a request costs its client's turns: its price, or (not priced) the same token-steps unpriced."""
    if admitted.price:
        return admitted.price
    request = admitted.request
    try:
        return cost.price(catalog.preset(admitted.key.preset), request.size, request.denoise_steps,
                          request.guidance, refs=request.refs, frames=request.num_frames)
    except ShowcaseError:
        return 1


def make_manager(args, options: EngineOptions, hosting: HostingConfig | None = None, **fields) -> EngineManager:
    """An EngineManager for a command line (--model becomes a preset of its own); `hosting` (or its single
    `fields`): the budget, compile-scheduler and policy settings."""
    roots, extra = presets_from_args(args)
    return EngineManager(cache_dir=args.cache_dir or settings.cache_dir(), options=options, allowed_roots=roots,
                         extra_presets=extra, hosting=hosting, **fields)
