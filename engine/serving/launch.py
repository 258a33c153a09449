"""Starting engines: `make_client` picks the client for a key and the runtime (a worker process, a
tensor-parallel sidecar, the in-process runtime, or a Ray actor on a node of the fleet under `--ray`) and
starts it with the environment it needs.

Every client speaks the same interface (engine/worker/client.py EngineClient) and tells its owner what
happens through the EngineEvents it was built with.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable

from engine import devices
from engine.config.caches import CacheDir
from engine.config.placement import Placement
from engine.protocol import EngineConfig, Mode
from engine.serving.hosting import HostingConfig, Runtime
from engine.worker.client import EngineClient, EngineEvents, ProcessClient
from engine.worker.priority import ShortRunSlots

log = logging.getLogger(__name__)


def cpu_worker_threads(max_engines: int) -> int:
    """Threads per worker on the host's CPU: its cores shared by the engines the budget allows."""
    return max(1, (os.cpu_count() or 1) // max_engines)


class EngineLauncher:
    """Builds and starts the client of each engine; owns what engines share on the host (the short-run slots
    of the engines on its cores)."""

    def __init__(self, hosting: HostingConfig, cache: CacheDir, max_engines_of: Callable[[str], int]):
        self.hosting = hosting
        self.cache = cache
        self.max_engines_of = max_engines_of  # device -> engines its budget allows
        self._lock = threading.Lock()
        self._short_runs: ShortRunSlots | None = None  # made with the first engine on the host's cores
        self._short_run_slot: dict[int, int] = {}  # id(engine) -> its slot in that file

    def make_client(self, config: EngineConfig, events: EngineEvents) -> EngineClient:
        """The started client of `config.key` for this host's runtime (it may still be loading)."""
        key = config.key
        if self.hosting.runtime is Runtime.INPROCESS:
            from engine.serving.inprocess import InProcessClient

            threads = self.worker_threads_for(devices.get_device(key.device))
            return InProcessClient(config, threads=threads, events=events).start()
        if key.tp > 1 and self.hosting.fleet is None:
            from engine.tp.client import SidecarClient

            return SidecarClient(config, events=events).start()
        if self.hosting.fleet is not None:  # a tensor-parallel engine too: its ranks on one node
            from engine.fleet.replicas import start_on_fleet

            env = self.worker_env(config, devices.get_device(key.device))
            return start_on_fleet(config, env, self.hosting.fleet, events, Placement.parse(key.place))
        return self._start_worker(config, events)

    def worker_env(self, config: EngineConfig, spec) -> dict[str, str]:
        """The environment an engine of `config` is started with (a worker process, a Ray actor)."""
        mode = Mode.DEFER_AND_FUSE if Mode.DEFER_AND_FUSE in config.options.warm_modes else None
        env = devices.worker_environment(spec, self.cache.path, mode=mode)
        env.update(self.cache.worker_env())
        threads = self.worker_threads_for(spec)
        if threads:  # a value the user exported wins
            env.setdefault("OMP_NUM_THREADS", str(threads))
        return env

    def _start_worker(self, config: EngineConfig, events: EngineEvents) -> EngineClient:
        spec = devices.get_device(config.key.device)
        env = self.worker_env(config, spec)
        short_runs = self.take_short_run_slot() if spec.host_memory_is_device_memory else None
        if short_runs is not None:
            env["SHOWCASE_SHORT_RUNS"] = short_runs.env_value()
        engine = ProcessClient(config, env=env, events=events).start()
        if short_runs is not None:
            self.hold_slot(engine, short_runs.slot)
        return engine

    def worker_threads_for(self, spec) -> int | None:
        """Compute threads per worker where the device is the host's CPU: its cores shared by the engines
        the budget allows (--worker-threads overrides). Several workers each spinning on every core wait
        for a core another process holds; one thread each does not. None on accelerators."""
        if not spec.host_memory_is_device_memory:
            return None
        if self.hosting.worker_threads:
            return self.hosting.worker_threads
        return cpu_worker_threads(self.max_engines_of(spec.name))

    def worker_cache_env(self, device: str) -> dict[str, str]:
        """The cache variables a worker of `device` is started with (/system shows these, not the app's)."""
        spec = devices.get_device(device)
        env = devices.worker_environment(spec, self.cache.path)
        env.update(self.cache.worker_env())
        names = {var for var, _ in spec.cache_env} | set(self.cache.worker_env())
        return {name: env[name] for name in sorted(names) if name in env}

    # -- short-run slots (engine/worker/priority.py ShortRuns) -----------------------------------
    def take_short_run_slot(self):
        """A slot in the host's file of engines running a short request; None when there can be no file."""
        with self._lock:
            if self._short_runs is None:
                try:
                    self._short_runs = ShortRunSlots(tempfile.gettempdir())
                except OSError as exc:
                    log.warning("no short-run slots (%s): cpu requests are ordered by niceness alone", exc)
                    return None
            return self._short_runs.take()

    def hold_slot(self, engine, slot: int) -> None:
        """`engine` runs with short-run `slot` until release(engine)."""
        with self._lock:
            self._short_run_slot[id(engine)] = slot

    def release(self, engine) -> None:
        """An engine is gone or going: its short-run slot is cleared and free again."""
        with self._lock:
            slot = self._short_run_slot.pop(id(engine), None)
        if slot is not None and self._short_runs is not None:
            self._short_runs.release(slot)

    def close(self) -> None:
        if self._short_runs is not None:
            self._short_runs.remove()
