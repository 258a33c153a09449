"""Helpers shared by the tests (import as `from helpers import ...`): waiting, ports and processes, engine
configs, runners, managers and requests, and launching the app in this process.

Heavy imports (torch, gradio, the engine's runner) happen inside the helpers that need them, so a module
that only waits or picks a port stays cheap to import.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psutil

from bench.app_process import free_port  # noqa: F401 - one port picker for tests and the benches
from bench.soak import BAD_INPUTS  # noqa: F401 - one table of bad inputs for tests and soak

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy or `timeout` passes;
    returns its last value (falsy on timeout), for callers that gather diagnostics before they assert."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05,
               message: str | Callable[[], str] = "") -> T:
    """poll(), failing the test on timeout with `message` (a callable is asked only then)."""
    value = poll(predicate, timeout, interval)
    if not value:
        text = message() if callable(message) else message
        raise AssertionError(f"{text or 'condition'} not met within {timeout:g} s (last: {value!r})")
    return value


class FakeClock:
    """A clock that moves only when slept on, for code that waits in `time.sleep` and reads `time.monotonic`:
    patch it over the module's `time` (monkeypatch.setattr(module, "time", clock)). `at(delay, fn)` runs fn
    when a sleep passes that moment, so "the other side lets go after 0.1 s" is exact on any machine."""

    def __init__(self, start: float = 0.0):
        self.t = start
        self._due: list[tuple[float, int, Callable[[], object]]] = []
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self.t

    perf_counter = time = monotonic

    def at(self, delay: float, fn: Callable[[], object]) -> None:
        with self._lock:
            self._due.append((self.t + delay, len(self._due), fn))
            self._due.sort()

    def sleep(self, seconds: float) -> None:
        target = self.t + max(0.0, seconds)
        while True:
            with self._lock:
                if not self._due or self._due[0][0] > target:
                    break
                when, _, fn = self._due.pop(0)
            self.t = max(self.t, when)
            fn()
        self.t = target

    def __getattr__(self, name: str):  # the rest of the time module (strftime, ...) as it is
        return getattr(time, name)


def waits_in(thread: threading.Thread, function: Callable) -> bool:
    """Whether `thread` is inside `function` now (read from its Python frames): "it is blocked there" as a
    condition to wait on, where a sleep would guess how long getting there takes."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


def process_gone(process: int | psutil.Process) -> bool:
    """Whether a process has exited (a zombie waiting to be reaped counts as exited)."""
    try:
        p = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def own_processes(text: str) -> list[dict]:
    """This test process's descendants whose command line holds `text` (pid, cmdline): a Ray cluster or a
    torchrun group it started, never another pytest worker's."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if text in cmdline and child.status() != psutil.STATUS_ZOMBIE:
                found.append({"pid": child.pid, "cmdline": cmdline})
        except psutil.Error:  # gone meanwhile
            continue
    return found


# -- engines -------------------------------------------------------------------------------------------
REQUEST_DEFAULTS = dict(prompt="a red fox", width=64, height=64, steps=4, guidance=3.5, seed=0, mode="eager")


def engine_config(cache_dir, preset: str = "tiny-flux", precision: str = "fp32", device: str = "cpu", **options):
    """An EngineConfig for a tiny preset; no start-up warm-up unless asked (tests warm what they need)."""
    from engine.config.presets import get_preset
    from engine.protocol import EngineConfig, EngineKey, EngineOptions

    options.setdefault("warm_sizes", ())
    return EngineConfig(EngineKey(preset, device, precision), get_preset(preset), EngineOptions(**options),
                        str(cache_dir))


def make_runner(cache_dir, preset: str = "tiny-flux", precision: str = "fp32", *, listener=None, load: bool = True,
                **options):
    """A PipelineRunner in this process (loaded unless load=False)."""
    from engine.pipeline.runner import PipelineRunner

    runner = PipelineRunner(engine_config(cache_dir, preset, precision, **options), listener)
    if load:
        runner.load()
    return runner


@contextmanager
def engine_manager(cache_dir, options: dict | None = None, **hosting) -> Iterator:
    """An EngineManager for the tests, shut down when the block ends. `options` are EngineOptions fields (no
    start-up warm-up unless given: tests warm what they need); `hosting` are EngineManager's other arguments
    (policy, max_engines, idle_unload_s, runtime, allowed_roots, ...)."""
    from engine.protocol import EngineOptions
    from engine.serving.manager import EngineManager

    manager = EngineManager(cache_dir=cache_dir, options=EngineOptions(**{"warm_sizes": (), **(options or {})}),
                            **hosting)
    try:
        yield manager
    finally:
        manager.shutdown()


def fake_gate(make_key):
    """The gate of a stand-in manager: admits any request, keyed by `make_key`, built as the real gate builds it."""
    from types import SimpleNamespace

    from engine.config.presets import get_preset
    from engine.config.validation import build_request
    from engine.serving.gate import Admitted

    def admit(spec):
        request, notices = build_request(get_preset(spec.preset), spec)
        key = make_key(spec.preset, spec.device, spec.precision, spec.tp, parallel=spec.parallel)
        return Admitted(key, request, notices, 0, spec.caller)

    return SimpleNamespace(make_key=make_key, admit=admit)


def make_request(**fields):
    """A GenerateRequest for the tiny pipelines: REQUEST_DEFAULTS with `fields` on top."""
    from engine.protocol import GenerateRequest

    return GenerateRequest.checked(**{**REQUEST_DEFAULTS, **fields})


# -- the app -------------------------------------------------------------------------------------------
def launch_demo(manager, defaults=None, queue_size: int = 8, edge=None, **launch):
    """Build and launch the app in this process on a free loopback port; returns (demo, url). `launch`: more
    arguments of demo.launch (e.g. mcp_server=True)."""
    from ui import build_demo, launch_kwargs

    demo = build_demo(manager.serving(), defaults, queue_size=queue_size, edge=edge)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, ssr_mode=False, quiet=True,
                **launch_kwargs(demo=demo), **launch)
    return demo, f"http://127.0.0.1:{port}/"


def spy_generate(manager, monkeypatch) -> list:
    """How each manager.generate call ends (its result or its exception), in the order they end."""
    outcomes, real = [], manager.generate

    def spy(spec, **hooks):
        try:
            outcomes.append(real(spec, **hooks))
        except Exception as exc:
            outcomes.append(exc)
            raise
        return outcomes[-1]

    monkeypatch.setattr(manager, "generate", spy)
    return outcomes


@contextmanager
def torch_configs_restored() -> Iterator[None]:
    """Inductor's and functorch's process-wide configs as they were before the block. pytest's monkeypatch
    cannot do it: its undo deletes the entry from torch's config module ("... does not exist" afterwards)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    saved = [(module, module.save_config()) for module in (inductor_config, functorch_config)]
    try:
        yield
    finally:
        for module, snapshot in saved:
            module.load_config(snapshot)


def max_pixel_difference(image_a, image_b) -> int:
    """The largest per-channel difference of two images of one size (0-255). Concurrent requests may share
    one pipeline call (engine/pipeline/batching.py): equal to their solo runs within rounding, not bit for bit."""
    import numpy as np

    a = np.asarray(image_a.convert("RGB"), dtype=np.int16)
    b = np.asarray(image_b.convert("RGB"), dtype=np.int16)
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a - b).max())


# -- the fleet (engine/fleet/) -------------------------------------------------------------------------
def fleet_node_args(name: str) -> dict:
    """A simulated Ray node called `name`: 2 CPUs, a custom resource and a `showcase-node` label of that name."""
    return {"num_cpus": 2, "resources": {name: 1}, "labels": {"showcase-node": name},
            "object_store_memory": 80 * 2**20}


def fleet_actors_alive() -> list[dict]:
    """The cluster's alive EngineActor actors, from Ray's actor table (the GCS, as Ray's state API reads it)."""
    from ray._private.state import actors

    return [a for a in actors().values() if a["State"] == "ALIVE" and "EngineActor" in a["ActorClassName"]]


def chromium_env() -> dict:
    """The browser's environment with TMPDIR at /tmp: an earlier in-process engine may have pointed TMPDIR into
    a test's folder, and Chromium's singleton socket there passes AF_UNIX's 107-byte path limit."""
    import os

    return {**os.environ, "TMPDIR": "/tmp"}


CHROMIUM = Path("/usr/bin/chromium")  # Debian's, installed by `make browser` (never `playwright install`)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]


def require_chromium() -> None:
    """Skip the calling browser-test module where Chromium is missing."""
    import pytest

    if not CHROMIUM.exists():
        pytest.skip("Chromium is missing: run `make browser` (apt-get install -y chromium)", allow_module_level=True)


@contextmanager
def browser_page(url: str | None, size: tuple[int, int] = (1400, 1000), timeout_ms: int = 30_000) -> Iterator:
    """A headless Chromium page, with the app at `url` loaded (its Generate button drawn; None: a blank page);
    the browser is closed when the block ends."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=chromium_env())
        try:
            page = browser.new_page(viewport={"width": size[0], "height": size[1]})
            page.set_default_timeout(timeout_ms)
            if url is not None:
                page.goto(url)
                page.wait_for_selector("#generate-btn")
            yield page
        finally:
            browser.close()


@contextmanager
def app_page(cache_dir, defaults, size: tuple[int, int] = (1400, 1000)) -> Iterator:
    """A browser page on an app of its own (an engine manager and the launched demo, shut down after)."""
    with engine_manager(cache_dir) as manager:
        demo, url = launch_demo(manager, defaults)
        try:
            with browser_page(url, size) as page:
                yield page
        finally:
            demo.close()


def png_bytes(size: tuple[int, int] = (64, 64), colour=(200, 30, 30), seed: int | None = None) -> bytes:
    """A PNG upload: one colour, or (with `seed`) a different noise picture per seed."""
    import io

    import numpy as np
    from PIL import Image

    if seed is None:
        image = Image.new("RGB", size, colour)
    else:
        image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


class NoProgress:
    """A gr.Progress stand-in for handlers called directly: shows nothing."""

    def __call__(self, progress, desc=None, total=None, unit="steps"):
        pass
