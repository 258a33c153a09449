"""The engine manager: one engine per (model, device, precision, tp), started on demand.

Everything user-facing goes through here: it validates up front (so bad input is answered at once
with what to change), starts and restarts engines, routes requests and reports every bucket.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from engine import devices, settings
from engine.caches import prepare_cache_dir
from engine.client import ConnectionEngine, ProcessEngine
from engine.errors import EngineBusy, ShowcaseError
from engine.protocol import (
    BucketKey,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateResult,
    Mode,
    ModelPreset,
    OnCold,
    Size,
)
from engine.resolve import Catalog
from engine.validation import build_request

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 3


class EngineManager:
    def __init__(
        self,
        cache_dir: Path | None = None,
        options: EngineOptions | None = None,
        allowed_roots: list[Path] | None = None,
        extra_presets: dict[str, ModelPreset] | None = None,
        auto_restart: bool = True,
    ):
        self.cache = prepare_cache_dir(Path(cache_dir) if cache_dir else settings.cache_dir())
        self.cache_dir = self.cache.path
        self.options = options or EngineOptions()
        self.catalog = Catalog(allowed_roots, extra_presets)
        self.allowed_roots = self.catalog.allowed_roots
        self.presets = self.catalog.presets
        self.auto_restart = auto_restart
        self._engines: dict[EngineKey, ConnectionEngine] = {}
        self._options: dict[EngineKey, EngineOptions] = {}
        self._restarts: dict[EngineKey, list[float]] = {}
        self._running: dict[str, ConnectionEngine] = {}  # request id -> engine, for cancel()
        self._lock = threading.RLock()
        self._closing = False

    # -- lookup and validation -------------------------------------------------------------------
    def preset(self, name: str) -> ModelPreset:
        """A preset by name, or any Hub id / local diffusers folder under the allowed model roots."""
        return self.catalog.preset(name)

    def make_key(self, preset: str, device: str, precision: str, tp: int = 1) -> EngineKey:
        """Validate and resolve an engine key ("auto" -> the best available device)."""
        return self.catalog.make_key(preset, device, precision, tp)

    def engine_options(self, key: EngineKey) -> EngineOptions:
        """Manager defaults (or the options an engine was started with), then the preset's per-device ones."""
        return self.catalog.options_for(key, self._options.get(key, self.options))

    # -- engines ---------------------------------------------------------------------------------
    def engine(self, key: EngineKey, options: EngineOptions | None = None) -> ConnectionEngine:
        """The engine for a key, started if needed (returns at once; it may still be loading)."""
        with self._lock:
            if self._closing:
                raise ShowcaseError("the server is shutting down")
            if options is not None:
                self._options[key] = options
            engine = self._engines.get(key)
            if engine is not None and engine.alive:
                return engine
            if engine is not None and not engine.ready.is_set():
                return engine  # still loading
            engine = self._start(key)
            self._engines[key] = engine
            return engine

    def _start(self, key: EngineKey) -> ConnectionEngine:
        options = self.engine_options(key)
        if key.tp > 1:
            from engine.tp.client import SidecarEngine

            engine = SidecarEngine(self._config(key, options)).start()
        else:
            spec = devices.get_device(key.device)
            mode = Mode.DEFER_AND_FUSE if Mode.DEFER_AND_FUSE in options.warm_modes else None
            env = devices.worker_environment(spec, self.cache_dir, mode=mode)
            env.update(self.cache.worker_env())
            engine = ProcessEngine(self._config(key, options), env=env).start()
        engine.on_down = self._on_down
        log.info("started engine %s", key)
        return engine

    def _config(self, key: EngineKey, options: EngineOptions) -> EngineConfig:
        return self.catalog.config(key, options, self.cache_dir)

    def _on_down(self, engine: ConnectionEngine) -> None:
        """Restart a crashed engine in the background (bounded, so a crash loop stops)."""
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

    def restart(self, key: EngineKey) -> ConnectionEngine:
        with self._lock:
            old = self._engines.pop(key, None)
        if old is not None:
            old.close()
        return self.engine(key)

    def engines(self) -> list[ConnectionEngine]:
        with self._lock:
            return list(self._engines.values())

    # -- requests --------------------------------------------------------------------------------
    def generate(
        self,
        *,
        preset: str,
        device: str = "auto",
        precision: str = "fp32",
        mode: str | Mode = Mode.EAGER,
        size: str | Size | None = None,
        width=None,
        height=None,
        prompt: str = "",
        negative_prompt: str | None = None,
        steps=None,
        guidance=None,
        seed=0,
        tp: int = 1,
        snap: bool = True,
        on_cold: str | OnCold = OnCold.EAGER,
        on_progress=None,
        timeout: float | None = None,
        on_submit=None,
    ) -> GenerateResult:
        """Validate, route and run one request; raises a ShowcaseError with what to change."""
        key = self.make_key(preset, device, precision, tp)
        p = self.preset(key.preset)
        if size is not None:
            parsed = size if isinstance(size, Size) else Size.parse(size)
            width, height = parsed.width, parsed.height
        if width is None or height is None:
            width, height = p.buckets[0].width, p.buckets[0].height
        request, notices = build_request(
            p, prompt=prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
            guidance=guidance, seed=seed, mode=mode, snap=snap, on_cold=on_cold,
        )
        devices.check_mode(devices.get_device(key.device), request.mode)  # refused here; its notices come with the result
        engine = self.engine(key)
        if engine.pending() >= self.engine_options(key).max_queue:
            raise EngineBusy(f"engine {key} has {engine.pending()} requests waiting; retry in a few seconds")
        engine.wait_ready(timeout=600)
        future = engine.submit(request, on_progress)
        self._running[request.request_id] = engine
        if on_submit:
            on_submit(request.request_id)
        try:
            result: GenerateResult = future.result(timeout)
        except FutureTimeout:
            engine.cancel(request.request_id)
            raise EngineBusy(f"request {request.request_id} did not finish within {timeout}s and was cancelled") from None
        finally:
            self._running.pop(request.request_id, None)
        return dataclasses.replace(result, notices=tuple(notices) + result.notices) if notices else result

    def cancel(self, request_id: str) -> bool:
        """Stop a running request between steps (it then fails with Cancelled). False if unknown."""
        engine = self._running.get(request_id)
        if engine is None:
            return False
        engine.cancel(request_id)
        return True

    def warm(self, preset: str, device: str, precision: str, mode: str = Mode.COMPILE, size: str | None = None,
             tp: int = 1) -> None:
        key = self.make_key(preset, device, precision, tp)
        bucket = BucketKey(Mode.parse(mode, "mode"), Size.parse(size)) if size else None
        engine = self.engine(key)
        engine.wait_ready(timeout=600)
        engine.warm(bucket)

    def status(self) -> list[dict]:
        return [engine.status() for engine in self.engines()]

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.close()
