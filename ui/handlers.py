"""Event handlers: the UI's only contact with the engine is the EngineManager client API.

Engine calls block (a request waits for its worker process), so each run executes in a thread and
the handler — a generator — streams its StepProgress messages to gr.Progress and to the outputs.
Engine errors (ShowcaseError) become gr.Error / gr.Warning with the engine's own message; the
server keeps serving. Bucket and engine states come from manager.status(), which only reads
states the worker processes pushed, so polling it stays fast while a bucket compiles.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from itertools import product

import gradio as gr
import pandas as pd

from engine import devices as engine_devices
from engine.errors import Cancelled, DeviceUnavailable, InvalidRequest, ShowcaseError, UnsupportedCombination
from engine.protocol import Mode, Precision, Size
from ui import views
from ui.system import system_markdown, system_report

log = logging.getLogger(__name__)

MAX_UI_SEED = 2**31 - 1  # browsers hold integers exactly only up to 2**53; keep seeds readable
PARTIAL_EVERY_S = 0.2  # stream a partial result at most this often (each one redraws the plot)
MIN_CONFIGS, MAX_CONFIGS = 2, 4

ERROR_TITLES = {
    InvalidRequest: "Invalid request",
    DeviceUnavailable: "Device unavailable",
    UnsupportedCombination: "Not supported on this device",
}


@dataclass(frozen=True)
class UIDefaults:
    preset: str = "tiny-flux"
    device: str = "auto"
    precision: str = "fp32"
    mode: str = "compile"
    on_cold: str = "eager"
    tp: int = 1
    poll_s: float = 1.0


@dataclass
class _Run:
    """The run a session has in flight, so Cancel (a separate event) can reach it."""

    request_id: str | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def to_gradio_error(exc: Exception) -> gr.Error:
    if isinstance(exc, ShowcaseError):
        title = next((t for cls, t in ERROR_TITLES.items() if isinstance(exc, cls)), type(exc).__name__)
        return gr.Error(str(exc), title=title, print_exception=False)
    log.exception("unexpected error in a UI handler", exc_info=exc)
    return gr.Error(f"internal error ({type(exc).__name__}): {exc}; the server keeps serving", print_exception=False)


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "default"


class Handlers:
    def __init__(self, manager, defaults: UIDefaults | None = None):
        self.manager = manager
        self.defaults = defaults or UIDefaults()
        self._runs: dict[str, _Run] = {}
        self._keys: dict[tuple, object] = {}  # (preset, device, precision) -> EngineKey or ShowcaseError
        self._devices_report: list[dict] | None = None
        self._lock = threading.Lock()

    # -- lookups (memoised: device probes do not change while the server runs) -------------------
    def devices_report(self, refresh: bool = False) -> list[dict]:
        if self._devices_report is None or refresh:
            self._devices_report = engine_devices.devices_report()
        return self._devices_report

    def key_for(self, preset: str, device: str, precision: str, tp=1):
        """EngineKey for the settings, or raise the ShowcaseError saying why not (memoised)."""
        try:
            tp = 1 if tp in (None, "") else int(tp)
        except (TypeError, ValueError):
            raise InvalidRequest(f"tp must be a whole number >= 1, got {tp!r}") from None
        cache_key = (preset, device, precision, tp)
        with self._lock:
            found = self._keys.get(cache_key)
        if found is None:
            try:
                found = self.manager.make_key(preset, device, precision, tp)
            except ShowcaseError as exc:
                found = exc
            with self._lock:
                self._keys[cache_key] = found
        if isinstance(found, ShowcaseError):
            raise found
        return found

    def preset_names(self) -> list[str]:
        return list(self.manager.presets)

    def preset_sizes(self, preset: str) -> list[str]:
        try:
            return [str(s) for s in self.manager.preset(preset).buckets]
        except ShowcaseError:
            return []

    def device_modes(self, device: str) -> list[str]:
        try:
            return list(engine_devices.resolve_device(device).modes)
        except ShowcaseError:
            try:
                return list(engine_devices.get_device(device).modes)
            except ShowcaseError:
                return list(Mode.values())

    # -- settings --------------------------------------------------------------------------------
    def preset_defaults(self, preset: str):
        """Preset changed: negative prompt shown only where the pipeline takes one; its steps/guidance."""
        try:
            p = self.manager.preset(preset)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        return (
            gr.update(visible=p.negative_prompt),
            gr.update(value=p.steps),
            gr.update(value=p.guidance),
        )

    def select_engine(self, preset: str, device: str, precision: str, mode: str, size: str | None = None, tp=1):
        """Settings that need another engine start it now (in the background) and say it is loading.

        Returns (engine status line, size choices, mode choices). Never blocks: manager.engine()
        only spawns the worker process.
        """
        modes = self.device_modes(device)
        mode_update = gr.update(choices=modes, value=mode if mode in modes else "eager")
        sizes = self.preset_sizes(preset)
        try:
            key = self.key_for(preset, device, precision, tp)
            self.manager.engine(key)
        except ShowcaseError as exc:
            gr.Warning(str(exc), duration=6)
            line = views.engine_line(None, None, error=str(exc))
            return line, gr.update(choices=views.size_choices(sizes, mode, None)), mode_update
        status = self.manager.status()
        engine = views.engine_state(status, str(key))
        size_update = gr.update(choices=views.size_choices(sizes, mode, engine))
        if size not in sizes and sizes:
            size_update = gr.update(choices=views.size_choices(sizes, mode, engine), value=sizes[0])
        return views.engine_line(str(key), engine), size_update, mode_update

    # -- polling ---------------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """Every engine and its buckets (the /status API). Reads cached states only."""
        return self.manager.status()

    def board_frame(self, status: list[dict] | None = None) -> pd.DataFrame:
        return pd.DataFrame(views.board_rows(self.status() if status is None else status), columns=views.BOARD_COLUMNS)

    def tick(self, preset, device, precision, mode, last: dict | None, tp=1):
        """The gr.Timer poll: bucket board, engine line, size labels and the board's engine list.

        Outputs that did not change are skipped, so an open dropdown is not redrawn every second.
        """
        last = dict(last or {})
        status = self.status()
        rows = views.board_rows(status)
        try:
            key = str(self.key_for(preset, device, precision, tp))
            line = views.engine_line(key, views.engine_state(status, key))
            engine = views.engine_state(status, key)
        except ShowcaseError as exc:
            line, engine = views.engine_line(None, None, error=str(exc)), None
        sizes = views.size_choices(self.preset_sizes(preset), mode, engine)
        engines = [e["engine"] for e in status]

        def changed(name, value):
            if last.get(name) == value:
                return False
            last[name] = value
            return True

        board = (pd.DataFrame(rows, columns=views.BOARD_COLUMNS) if changed("board", repr(rows)) else gr.skip())
        line_out = line if changed("line", line) else gr.skip()
        size_out = gr.update(choices=sizes) if changed("sizes", repr(sizes)) else gr.skip()
        engines_out = gr.update(choices=engines) if changed("engines", repr(engines)) else gr.skip()
        return board, line_out, size_out, engines_out, last

    # -- generate --------------------------------------------------------------------------------
    def randomize_seed(self, seed, randomize: bool):
        return random.randint(0, MAX_UI_SEED) if randomize else seed

    def _stream(self, session: str, progress, desc_prefix: str = "", offset: int = 0, grand_total: int | None = None,
                **kwargs):
        """Run manager.generate in a thread; yield ("step", StepProgress) ... then ("done", result).

        Raises the run's exception. A client that goes away (GeneratorExit) cancels the request.
        """
        run = self._runs.setdefault(session, _Run())
        events: queue.Queue = queue.Queue()
        finished = threading.Event()

        def on_submit(request_id: str) -> None:
            with run.lock:
                run.request_id = request_id
                cancel_now = run.cancelled
            if cancel_now:  # Cancel was pressed while the engine was still loading
                self.manager.cancel(request_id)

        def work() -> None:
            try:
                result = self.manager.generate(on_progress=lambda p: events.put(("step", p)), on_submit=on_submit,
                                               **kwargs)
                events.put(("done", result))
            except BaseException as exc:  # noqa: BLE001 - handed to the handler thread
                events.put(("error", exc))
            finally:
                finished.set()

        key = self.key_for(kwargs["preset"], kwargs["device"], kwargs["precision"], kwargs.get("tp", 1))
        engine = self.manager.engine(key)
        thread = threading.Thread(target=work, name=f"ui-run-{session[:8]}", daemon=True)
        thread.start()
        stepping = False
        try:
            while True:
                try:
                    kind, payload = events.get(timeout=0.25)
                except queue.Empty:
                    if stepping:
                        continue
                    if not engine.ready.is_set():
                        desc = f"loading engine {key} (a new model, device or precision)…"
                    elif run.request_id is None:
                        desc = f"waiting for engine {key}…"
                    else:  # submitted: earlier requests run first, or it waits for its bucket's compile
                        desc = f"queued on {key} (earlier requests, or the bucket's compile with on_cold=wait)…"
                    progress((offset, grand_total) if grand_total else 0, desc=desc_prefix + desc)
                    continue
                if kind == "step":
                    stepping = True
                    total = grand_total or payload.total
                    progress((offset + payload.step, total), desc=f"{desc_prefix}step {payload.step}/{payload.total}",
                             unit="steps")
                    yield "step", payload
                elif kind == "done":
                    yield "done", payload
                    return
                else:
                    raise payload
        finally:
            if not finished.is_set():  # the client went away (or the generator was closed): stop the run
                with run.lock:
                    request_id = run.request_id
                if request_id:
                    self.manager.cancel(request_id)
            with run.lock:
                run.request_id = None

    def generate(self, prompt, negative_prompt, preset, device, precision, mode, size, steps, guidance, seed,
                 on_cold="eager", tp=1, request: gr.Request = None, progress=gr.Progress()):  # noqa: B008
        """One image (tp > 1: on the tensor-parallel torchrun sidecar with that many ranks). Streams (image, timings) — a partial timings dict per step, then the result's
        as_dict() (the CLI's --json). Cancel ends it with cancelled=true and no image."""
        session = _session(request)
        run = self._runs.setdefault(session, _Run())
        with run.lock:
            run.cancelled = False
        def given(value):  # the API sends text; "" (or nothing) means the preset's default
            return None if value is None or (isinstance(value, str) and not value.strip()) else value

        kwargs = dict(
            preset=preset, device=device, precision=precision, mode=mode, size=size or None, prompt=prompt,
            negative_prompt=negative_prompt or None, steps=given(steps), guidance=given(guidance),
            seed=0 if given(seed) is None else seed,
            on_cold=on_cold or self.defaults.on_cold,
        )
        try:
            key = self.key_for(preset, device, precision, tp)
            kwargs["tp"] = key.tp
            size_text = str(Size.parse(size)) if size else ""
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        partial = {"running": True, "engine": str(key), "preset": key.preset, "device": key.device,
                   "precision": key.precision, "mode": mode, "bucket": size_text, "steps": steps,
                   "timings": {"step_ms": []}}
        progress(0, desc=f"queued on {key}")
        last_sent = 0.0
        try:
            for kind, payload in self._stream(session, progress, **kwargs):
                if kind == "step":
                    partial["timings"]["step_ms"].append(payload.step_ms)
                    partial["steps"] = payload.total
                    now = time.monotonic()
                    if now - last_sent >= PARTIAL_EVERY_S and payload.step < payload.total:
                        last_sent = now
                        yield gr.skip(), dict(partial, timings=dict(step_ms=list(partial["timings"]["step_ms"])))
                else:
                    result = payload
                    yield result.image(), result.as_dict()
        except Cancelled as exc:
            gr.Warning(str(exc), title="Cancelled", duration=4)
            yield None, dict(partial, running=False, cancelled=True, message=str(exc))
        except Exception as exc:
            raise to_gradio_error(exc) from None

    def cancel(self, request: gr.Request = None) -> str:
        """Stop this session's run between steps (or before it starts, if its engine is loading)."""
        run = self._runs.get(_session(request))
        if run is None:
            return "nothing to cancel"
        with run.lock:
            run.cancelled = True
            request_id = run.request_id
        if request_id and self.manager.cancel(request_id):
            return f"cancelling {request_id}"
        return "cancel requested"

    def cancel_clicked(self, request: gr.Request = None) -> None:
        """The Cancel buttons and /cancel (the run's own output then says it was cancelled)."""
        self.cancel(request)

    # -- warm ------------------------------------------------------------------------------------
    def warm(self, preset: str, device: str, precision: str, mode: str = "compile", size: str = "", tp=1) -> dict:
        """Queue compile + warm-up of one bucket (size 'WxH') or of every bucket (size '' or 'all').

        Returns at once; the board shows the bucket going queued -> compiling -> warm.
        """
        try:
            key = self.key_for(preset, device, precision, tp)
            p = self.manager.preset(key.preset)
            engine_devices.check_mode(engine_devices.get_device(key.device), mode)
            if mode == "eager":
                raise InvalidRequest("eager buckets need no warm-up; pick mode compile or regional")
            if size and size != "all":
                wanted = Size.parse(size)
                if wanted not in p.buckets:
                    raise InvalidRequest(f"{wanted} is not a bucket of {p.name}; buckets: "
                                         f"{', '.join(str(b) for b in p.buckets)}")
                sizes = [str(wanted)]
            else:
                sizes = [str(b) for b in p.buckets]
            self.manager.engine(key)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None

        def work() -> None:
            for s in sizes:
                try:
                    self.manager.warm(key.preset, key.device, key.precision, mode=mode, size=s, tp=key.tp)
                except ShowcaseError as exc:
                    log.warning("warm-up of %s %s:%s failed: %s", key, mode, s, exc)
                    return

        threading.Thread(target=work, name=f"ui-warm-{key}", daemon=True).start()
        return {"engine": str(key), "mode": mode, "queued": sizes}

    def warm_from_board(self, engine: str, mode: str, size: str):
        """The board's buttons: `engine` is one of the loaded engines' names."""
        match = next((e for e in self.manager.engines() if str(e.key) == engine), None)
        if match is None:
            raise gr.Error("pick a loaded engine first (the board lists them)", title="Invalid request")
        result = self.warm(match.key.preset, match.key.device, match.key.precision, mode, size, tp=match.key.tp)
        gr.Info(f"queued warm-up of {mode} {', '.join(result['queued'])} on {result['engine']}", duration=3)

    def restart(self, engine: str) -> None:
        match = next((e for e in self.manager.engines() if str(e.key) == engine), None)
        if match is None:
            raise gr.Error(f"no loaded engine named {engine!r}", title="Invalid request")
        try:
            self.manager.restart(match.key)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        gr.Info(f"restarting {engine}: its worker loads again and re-warms from the compile cache", duration=4)

    def board_select(self, evt: gr.SelectData):
        """Clicking a board row fills the warm controls with its engine, mode and size."""
        row = getattr(evt, "row_value", None) or []
        if len(row) < 5 or not row[0]:
            return gr.skip(), gr.skip(), gr.skip()
        mode = row[3] if row[3] in Mode.values() and row[3] != "eager" else gr.skip()
        size = row[4] if row[4] else gr.skip()
        return row[0], mode, size

    # -- compare ---------------------------------------------------------------------------------
    def compare(self, prompt, preset, size, steps, guidance, seed, devices, precisions, modes, wait_for_warm=True,
                request: gr.Request = None, progress=gr.Progress()):  # noqa: B008
        """The same prompt, seed, size and steps on every device × precision × mode picked (2–4 runs).

        Streams (gallery, results); results = {"results": [...as_dict() + config and bucket costs],
        "speedup": speedup_table rows}. A configuration that fails is reported, the others still run.
        """
        session = _session(request)
        run = self._runs.setdefault(session, _Run())
        with run.lock:
            run.cancelled = False
        configs = [views.config_label(d, p, m) for d, p, m in product(devices or [], precisions or [], modes or [])]
        if not MIN_CONFIGS <= len(configs) <= MAX_CONFIGS:
            raise gr.Error(
                f"pick {MIN_CONFIGS}–{MAX_CONFIGS} configurations (device × precision × mode); "
                f"these choices make {len(configs)}", title="Invalid request")
        for p in precisions:
            if p not in Precision.values():
                raise gr.Error(f"unknown precision {p!r}; choose from {', '.join(Precision.values())}", title="Invalid request")
        try:
            size_text = str(Size.parse(size)) if size else str(self.manager.preset(preset).buckets[0])
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        steps_total = int(steps) if steps else self.manager.preset(preset).steps
        results: list[dict] = []
        gallery: list[tuple] = []

        def payload(done: bool = False):
            return {"configs": configs, "done": done, "results": results, "speedup": views.speedup_table(results)}

        for index, config in enumerate(configs):
            with run.lock:
                if run.cancelled:
                    results.append({"config": config, "error": "cancelled before it started"})
                    continue
            device, precision, mode = config.split("/")
            started = time.perf_counter()
            try:
                result = None
                for kind, item in self._stream(
                    session, progress, desc_prefix=f"{config}: ", offset=index * steps_total,
                    grand_total=len(configs) * steps_total,
                    preset=preset, device=device, precision=precision, mode=mode, size=size_text, prompt=prompt,
                    negative_prompt=None, steps=steps_total, guidance=guidance, seed=seed,
                    on_cold="wait" if wait_for_warm else "eager",
                ):
                    if kind == "done":
                        result = item
            except ShowcaseError as exc:
                if isinstance(exc, Cancelled):
                    gr.Warning(str(exc), title="Cancelled", duration=4)
                results.append({"config": config, "error": str(exc)})
                yield gallery, payload()
                continue
            except Exception as exc:
                raise to_gradio_error(exc) from None
            waited_s = max(0.0, time.perf_counter() - started - result.timings.total_ms / 1000)
            entry = {**result.as_dict(), "config": config, "waited_s": waited_s}
            bucket = views.find_bucket(self.manager.status(), entry["engine"], mode, entry["bucket"])
            if bucket:
                entry.update(compile_s=bucket.get("compile_s"), warmup_s=bucket.get("warmup_s"),
                             bucket_state=bucket.get("state"), cache_hits=bucket.get("cache_hits"))
            results.append(entry)
            gallery.append((result.image(), f"{config} · {result.timings.total_ms:.0f} ms"
                            + (" · eager fallback" if result.eager_fallback else "")))
            yield gallery, payload()
        yield gallery, payload(done=True)
        if all(r.get("error") for r in results):
            raise gr.Error("every configuration failed: " + "; ".join(f"{r['config']}: {r['error']}" for r in results),
                           title="Compare failed")

    # -- typed API endpoints (gr.api derives their schema from these hints) -----------------------
    def status_api(self) -> list[dict]:
        """Every engine (state, load time, notices) and every bucket with its state, compile s, warm-up s."""
        return self.status()

    def warm_api(self, preset: str, device: str, precision: str, mode: str = "compile", size: str = "") -> dict:
        """Compile and warm one bucket ('WxH') or all of them ('' / 'all'); returns at once."""
        return self.warm(preset, device, precision, mode, size)

    def restart_api(self, preset: str, device: str, precision: str) -> dict:
        """Restart an engine (a new worker process; its buckets warm again from the compile cache)."""
        try:
            key = self.key_for(preset, device, precision)
            self.manager.restart(key)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        return {"engine": str(key), "restarted": True}

    def system_api(self) -> dict:
        """Devices (and why others are missing), versions, cache folders, environment in force."""
        return self.system(refresh=False)

    # -- rendering of results (UI only) ----------------------------------------------------------
    def render_run(self, result: dict | None):
        """Per-step plot and stats table of one run (also of a partial, still-running result)."""
        rows = views.step_rows(result)
        plot = pd.DataFrame(rows, columns=views.STEP_COLUMNS)
        stats = pd.DataFrame(views.stats_rows(result), columns=views.STATS_COLUMNS)
        return plot, stats

    def render_compare(self, payload: dict | None):
        """Tables after every configuration; the plot once, when the comparison is done.

        A LinePlot rebuilds its colour scale only when certain props change, not when a new series
        arrives in the data (design.md §4). Measured in Chromium: updating colors_in_legend rebuilds it
        (color_map alone does not), but two rebuilds in quick succession race and the older one can
        win, so the plot is drawn once per comparison, with every series.
        """
        payload = payload or {}
        results = payload.get("results", [])
        frame = pd.DataFrame(views.compare_step_rows(results), columns=views.COMPARE_STEP_COLUMNS)
        if payload.get("done", True):
            series = list(dict.fromkeys(frame["config"]))
            plot = gr.update(value=frame, colors_in_legend=series, color_map=views.series_colors(series))
        else:
            plot = gr.skip()
        speed = pd.DataFrame(views.speedup_display_rows(views.speedup_table(results)), columns=views.SPEEDUP_COLUMNS)
        costs = pd.DataFrame(views.cost_rows(results), columns=views.COST_COLUMNS)
        return plot, speed, costs

    # -- system ----------------------------------------------------------------------------------
    def system(self, refresh: bool = True) -> dict:
        return system_report(self.manager, self.devices_report(refresh=refresh))

    def system_panel(self) -> str:
        return system_markdown(self.system(refresh=False))
