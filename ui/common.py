"""What every tab's handlers share: defaults, error mapping, the caller's session, engine lookups.

The UI reaches the engine through the Serving interface it is given (engine/serving/interface.py), the
typed protocol and the engine's error classes. Devices are looked up in engine.devices, here only, where
the interface has no device query of its own. Each tab's handlers subclass HandlerBase (ui/handlers.py
combines them).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import gradio as gr

from engine import devices as engine_devices
from engine.config import strict
from engine.config.defaults import task_default
from engine.config.placement import split_device
from engine.errors import (
    BudgetExceeded,
    Cancelled,
    DeviceOutOfMemory,
    DeviceUnavailable,
    EngineBusy,
    EngineCrashed,
    InvalidRequest,
    ModelLoadError,
    NotAllowed,
    ShowcaseError,
    UnsupportedCombination,
    scrub_paths,
)
from engine.pipeline.attention import DEFAULT as DEFAULT_ATTENTION  # noqa: F401 - the tabs import it from here
from engine.pipeline.attention import attention_table
from engine.protocol import DEFAULT_PRESET, MemoryLevers, Mode, Precision, parse_ranks
from engine.serving.interface import Caller, Serving
from ui import memory_views, quietlog, waiting
from ui.runs import ProgressBar, RunFeed, RunRegistry

log = logging.getLogger(__name__)

RUNS_PER_ENGINE = 4  # handler slots per engine the devices may hold (see HandlerBase.run_slots)
# Queue groups (docs/hosting.md "Queue groups"): Gradio keeps the lowest limit of a shared group, so every event
# of a group has the same limit (ui/blocks.py settle_queue_groups refuses an app where they differ).
ENGINE_QUEUE = "engines"  # Generate and Compare, page and API: run_slots() handlers, so the engines can batch
ADVISOR_QUEUE = "advisor"  # the Advisor tab: one run at a time host-wide, never the engines' limit
# UI-only events (redraws, settings, polls): never queued behind a run, no API, no spinner.
FAST = dict(concurrency_limit=None, api_visibility="private", show_progress="hidden")

ERROR_TITLES = {
    InvalidRequest: "Invalid request",
    DeviceUnavailable: "Device unavailable",
    UnsupportedCombination: "Not supported on this device",
    NotAllowed: "Not offered on this server",
    BudgetExceeded: "No room on this server",
    EngineBusy: "Busy",
    Cancelled: "Cancelled",
    DeviceOutOfMemory: "Out of memory",
    EngineCrashed: "Engine stopped",
    ModelLoadError: "Model could not load",
}
# A ShowcaseError of no kind above: the engine's wrapper around a library's error (e.g. diffusers' own
# ValueError from inside a pipeline call), never titled by a class name.
FAILED_TITLE = "Generation failed"
MEMO_ENTRIES = 256  # visitor input memoised (engine keys, each session's engine): least recently used go first

def _unexpected_message(exc: BaseException) -> tuple[str, str]:
    """(title, message) for an exception the engine did not raise on purpose: the condition, never a
    traceback or a path."""
    if isinstance(exc, MemoryError):
        return "Out of memory", "the server ran out of memory for this request; try a smaller size or fewer steps"
    if isinstance(exc, OSError):
        reason = exc.strerror or type(exc).__name__
        return "Server storage problem", (f"the server could not read or write its files ({reason}); the host "
                                          "has to fix this, other requests keep being served")
    if isinstance(exc, UnicodeError):
        return "Invalid request", "the request contains text that is not valid Unicode; remove odd characters"
    if isinstance(exc, (TypeError, ValueError, ArithmeticError, KeyError, IndexError)):
        return "Invalid request", (f"a value in the request has the wrong type or is out of range "
                                   f"({type(exc).__name__}: {scrub_paths(exc)}); send each field as text")
    return "Internal error", f"unexpected {type(exc).__name__} on the server; it was logged and the server keeps serving"


@dataclass(frozen=True)
class UIDefaults:
    preset: str = DEFAULT_PRESET
    device: str = "auto"
    precision: str = "fp32"
    mode: str = "compile"
    on_cold: str = "eager"
    tp: int = 1
    parallel: str = "tensor"  # how tp > 1 ranks split the transformer (tensor, ulysses, ring)
    step_cache: str = "none"
    lora: str = "none"  # NAME[:SCALE][:fused] (app.py --lora)
    poll_s: float = 1.0
    admin_token: str | None = None  # public mode: unlocks host operations (restart, warm everything)
    api_keys: str | None = None  # the /v1 API's keys: a file, "admin-token", or None (no key needed)


def to_gradio_error(exc: BaseException, public: bool = True) -> gr.Error:
    """The one place a handler's exception becomes what a visitor reads: the engine's own message,
    titled by its kind; anything else as the condition it stands for (the log keeps the detail).
    Server paths are scrubbed from every message, in public mode from the engine's too."""
    if isinstance(exc, gr.Error):
        return exc
    if isinstance(exc, ShowcaseError):
        title = next((t for cls, t in ERROR_TITLES.items() if isinstance(exc, cls)), FAILED_TITLE)
        message = str(exc)
        if public:
            scrubbed = scrub_paths(message)
            if scrubbed != message:
                log.warning("%s (a path was scrubbed from what the visitor reads)", message)
            message = scrubbed
        return gr.Error(message, title=title, print_exception=False)
    quietlog.unexpected("a UI handler", exc)
    title, message = _unexpected_message(exc)
    return gr.Error(message, title=title, print_exception=False)


def _steps_or_none(steps) -> int | None:
    """The steps a form asked for, when they are a whole number ("²" passes isdigit() and fails int()); else
    None (the request's own check names the field)."""
    try:
        return strict.whole(steps, "steps")
    except InvalidRequest:
        return None


class LRU(OrderedDict):
    """A dict that keeps only its `size` most recently used entries (not thread-safe: hold a lock)."""

    def __init__(self, size: int = MEMO_ENTRIES):
        super().__init__()
        self.size = size

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def joined_at(request: gr.Request | None) -> float | None:
    """When the request's event joined Gradio's queue (ui/edge.py stamps it), if known."""
    state = getattr(getattr(request, "request", None), "state", None)
    return getattr(state, "joined_at", None) if state is not None else None


def session_id(request: gr.Request | None) -> str:
    """Whose runs these are (for /cancel and the one-run rule): a browser tab's or gradio_client's session
    ("default" when a test calls a handler directly), or an MCP agent, named by the address ui/edge.py signed
    for its tool call. The two never meet: a visitor chooses its session hash, so it is always prefixed."""
    state = getattr(getattr(request, "request", None), "state", None)
    agent = getattr(state, "mcp_caller", None) if state is not None else None
    if agent:
        return f"mcp:{agent}"
    return "page:" + (getattr(request, "session_hash", None) or "default")


def key_fields(preset, device, precision, tp) -> tuple[int, str]:
    """(tp, parallel) of an engine's settings as a form sends them, the names checked to be text."""
    for name, value in (("preset", preset), ("device", device), ("precision", precision)):
        if not isinstance(value, str):
            raise InvalidRequest(f"{name} must be text, got {type(value).__name__}")
    tp, parallel = parse_ranks(tp)  # 2, "2" or a ranks choice such as "2 · ulysses"
    return tp, str(parallel) if tp > 1 and parallel.context else "tensor"


class UIState:
    """What every page's handlers share: the runs in flight (one /cancel stops a session's Generate and
    Compare alike), memoised engine keys, each session's engine and the device report."""

    def __init__(self, cancel):
        self.runs = RunRegistry(cancel)
        # Both hold what visitors typed: bounded, so a visitor who types a million names costs nothing.
        self.keys = LRU()  # (preset, device, precision, tp, caller, levers) -> EngineKey or error
        self.current = LRU(4 * MEMO_ENTRIES)  # session -> the EngineKey of its last request (public: its own)
        self.devices_report: list[dict] | None = None
        self.lock = threading.Lock()


class HandlerBase:
    """The serving interface, the UI defaults and the state the pages share (`state`: a page's own when None)."""

    def __init__(self, serving: Serving, defaults: UIDefaults | None = None, state: UIState | None = None):
        self.serving = serving
        self.defaults = defaults or UIDefaults()
        self.state = state or UIState(serving.cancel)
        self.runs = self.state.runs
        self._keys, self._current, self._lock = self.state.keys, self.state.current, self.state.lock
        self.edge = None  # the web edge (ui/edge.py EdgeGuard), set by build_demo

    # -- lookups (memoised: device probes do not change while the server runs) -------------------
    def devices_report(self, refresh: bool = False) -> list[dict]:
        state = self.state
        if state.devices_report is None or refresh:
            state.devices_report = self.serving.devices_report()  # under --ray: the cluster's
        return state.devices_report

    def run_slots(self) -> int:
        """Handlers that may run requests at once. Each engine runs one request at a time in its worker
        and queues the rest (up to its max_queue), so Gradio's own queue only has to keep the app's
        threads bounded: RUNS_PER_ENGINE per engine the devices may hold. Fewer slots made a request
        for an idle engine wait in Gradio's queue behind requests queued on another engine."""
        slots = 0
        for r in self.devices_report():
            if r.get("available"):
                try:
                    slots += self.serving.max_engines(r["name"])
                except ShowcaseError:
                    slots += 1
        return max(1, slots) * RUNS_PER_ENGINE

    # -- who is asking ------------------------------------------------------------------------------
    def caller(self, request: gr.Request | None = None, admin_token: str | None = None) -> Caller:
        """HOST with the admin token or a Gradio login (--auth); everyone else is a VISITOR (which only
        matters in public mode: without it visitors may do what the host can)."""
        token = self.defaults.admin_token
        if admin_token and token and hmac.compare_digest(str(admin_token).encode(), token.encode()):
            return Caller.HOST
        if getattr(request, "username", None):
            return Caller.HOST
        return Caller.VISITOR

    def client_of(self, request: gr.Request | None) -> str:
        """Who the engines take turns between and the cost budget is held against: the client's address
        (ui/edge.py), or its session where no connection is known (a test calling a handler)."""
        if self.edge is not None and getattr(request, "request", None) is not None:
            return self.edge.callers.client_of(request)
        return f"session {session_id(request)}"

    def remember_engine(self, request: gr.Request | None, key) -> None:
        with self._lock:
            self._current[session_id(request)] = key

    def current_engine(self, request: gr.Request | None):
        with self._lock:
            return self._current.get(session_id(request))

    def key_for(self, preset: str, device: str, precision: str, tp=1, caller: Caller = Caller.VISITOR,
                levers: str | None = None):
        """EngineKey for the settings, or raise the ShowcaseError saying why not (memoised). `levers`: memory
        levers (None: the host's)."""
        tp, parallel = key_fields(preset, device, precision, tp)
        if levers is not None:  # bad text is refused here, never remembered
            levers = str(MemoryLevers.parse(levers).engine_part())
        cache_key = (preset, device, precision, tp, parallel, caller, levers)
        with self._lock:
            found = self._keys.get(cache_key)
        if found is None:
            try:
                named = {"levers": levers} if levers is not None else {}  # None: the host's default
                found = self.serving.make_key(preset, device, precision, tp, caller=caller, parallel=parallel,
                                                   **named)
            except ShowcaseError as exc:
                found = exc
            with self._lock:
                self._keys[cache_key] = found
        if isinstance(found, ShowcaseError):
            raise found
        return found

    def default_preset(self):
        """The defaults' preset, or the first one when that name does not resolve."""
        try:
            return self.serving.preset(self.defaults.preset)
        except ShowcaseError:
            return self.serving.preset(self.serving.preset_names()[0])

    def task_preset(self, task, names: list[str] | None = None):
        """The task's default model (engine/config/defaults.py) among `names` (the presets visitors may pick, by
        default), or None where none of them makes it."""
        served = []
        for name in self.serving.visitor_presets() if names is None else names:
            try:
                served.append(self.serving.preset(name))
            except ShowcaseError:
                continue
        return task_default(served, task, preferred=self.defaults.preset)

    def precision_choices(self) -> list[str]:
        offered = self.serving.offered_precisions()
        return [str(p) for p in offered] if offered else list(Precision.values())

    def precision_labels(self, preset: str, device: str, tp=1, memory: str | None = None) -> list[tuple[str, str]]:
        """The precision field's (label, value) choices: a precision whose engine (with these settings and memory
        levers, "" or None the host's) is not loaded says so before the click, with about how long a load takes
        here; the value stays the precision's name."""
        levers = memory if memory and str(memory).strip() else None
        keys = {}
        for precision in self.precision_choices():
            try:
                keys[precision] = self.key_for(preset, device, precision, tp, levers=levers)
            except ShowcaseError:
                continue  # not offered with these settings: selecting it says why (select_engine)
        loads = self.new_engine_loads(keys)
        return [(p + memory_views.new_engine_note(loads.get(p)), p) for p in self.precision_choices()]

    def new_engine_loads(self, keys: dict) -> dict:
        """Of the choices (value -> the EngineKey it selects), those whose engine is not loaded (choosing one
        starts it), each with about how long a load takes here (the median of this host's loads)."""
        serving = self.serving
        estimate = waiting.load_estimate_s([r.get("load_s") for r in serving.status_rows()])
        loaded = {value: serving.loaded_engine(key) for value, key in keys.items()}
        return {value: estimate for value, engine in loaded.items() if engine is None or not engine.ready.is_set()}

    def preset_sizes(self, preset: str) -> list[str]:
        try:
            return [str(s) for s in self.serving.preset(preset).buckets]
        except ShowcaseError:
            return []

    def step_cache_rows(self, preset: str, device: str, mode: str) -> list[dict]:
        """Every step cache for a preset, device and mode: usable, or why not (engine/pipeline/stepcache.py)."""
        from engine.pipeline.stepcache import available_step_caches

        try:
            spec = self.serving.device_spec(device)
            return available_step_caches(self.serving.preset(preset), spec, mode)
        except ShowcaseError:
            return []

    def attention_rows(self, key) -> list[dict]:
        """Every attention backend for an engine's device and precision: usable, or why not."""
        return attention_table(engine_devices.get_device(key.device), str(key.precision))

    def cuda_graphs_possible(self, device: str) -> bool:
        return engine_devices.get_device(split_device(device)[0]).cuda_graphs

    def check_mode(self, device: str, mode: str) -> None:
        """Raise the ShowcaseError saying why `device` cannot run `mode` (e.g. defer-and-fuse off TPU)."""
        engine_devices.check_mode(engine_devices.get_device(split_device(device)[0]), mode)

    def device_modes(self, device: str) -> list[str]:
        """The modes the device runs (public mode: of those, the ones the host offers)."""
        try:
            modes = list(self.serving.device_spec(device).modes)
        except ShowcaseError:
            try:
                modes = list(engine_devices.get_device(split_device(device)[0]).modes)
            except ShowcaseError:
                modes = list(Mode.values())
        offered = self.serving.offered_modes()
        return [str(m) for m in modes if not offered or m in offered]

    # -- a run ------------------------------------------------------------------------------------
    @contextmanager
    def open_run(self, request: gr.Request | None, listener_checked: bool = False):
        """The handler's run, registered for /cancel. Dropped at once (ClientGone) when its client is
        not listening for the result (unless `listener_checked`: the caller awaited await_listener);
        already cancelled when the session's /cancel came after it joined the queue; public mode: one
        running request per session."""
        if not listener_checked:
            self._require_listener(request)
        with self.runs.open(session_id(request), exclusive=self.serving.public(),
                            joined_at=joined_at(request)) as run:
            yield run

    def run_feed(self, key, bar: ProgressBar, steps=None, bucket: str | None = None) -> RunFeed:
        """What a run on engine `key` shows on `bar` while it waits and steps (ui/runs.py); `bucket`: the one
        it waits for the compile of (waiting.compile_bucket)."""
        serving = self.serving
        return RunFeed(bar, key, _steps_or_none(steps), serving.status_rows, serving.compiles, serving.loaded_engine, bucket)

    async def await_listener(self, request: gr.Request | None) -> None:
        """open_run's listener check for an async handler: the wait runs in a worker thread."""
        if self.edge is not None and getattr(request, "session_hash", None) \
                and not self.edge.streams.listening(request.session_hash):
            import anyio

            await anyio.to_thread.run_sync(self._require_listener, request)

    def _require_listener(self, request: gr.Request | None) -> None:
        if self.edge is not None and getattr(request, "session_hash", None):
            from ui.edge import ClientGone

            session = request.session_hash  # its event stream's, also for an MCP call
            if not self.edge.streams.await_listener(session):
                log.info("dropped an event of session %s: its client is not listening", session[:12])
                raise ClientGone("nobody is listening for this request's result; it was dropped")

    # -- /cancel ---------------------------------------------------------------------------------
    def cancel(self, request: gr.Request = None) -> str:
        """Stop this session's runs between steps (or before they start, if their engine is loading)."""
        return self.runs.cancel(session_id(request))

    def cancel_api(self, request: gr.Request):  # no return hint: /cancel returns nothing, as it always did
        """Cancel the caller's own /generate or /compare between steps; the run then returns with
        cancelled=true. (gradio_client's job.cancel() stops one job the way the Cancel buttons do.)"""
        log.info("/cancel: %s", self.cancel(request))


def document_api(dependency, params: dict[str, str] | None = None, returns: tuple[str, str] | None = None,
                 schema: dict | None = None) -> None:
    """Name a gr.api endpoint's parameters and result in its API page and schema (Gradio labels them "1st",
    "2nd", ...) and say what each takes: `params` maps a parameter to its allowed values, `returns` is the
    result's (name, what it holds), `schema` its JSON schema (ui/schemas.py; a dict hint alone shows "Any")."""
    from gradio.context import get_blocks_context

    blocks = get_blocks_context().blocks
    for block_id, (name, allowed) in zip(dependency["inputs"], (params or {}).items(), strict=True):
        component = blocks[block_id]
        component.label = name
        component._api_info = {**component._api_info, "description": allowed, "additional_description": allowed}
    if returns is not None:
        (block_id,) = dependency["outputs"]
        component = blocks[block_id]
        component.label = returns[0]
        component._api_info = {**component._api_info, **(schema or {}), "description": returns[1]}


def describe_input(component, allowed: str) -> None:
    """Say in a page component's API schema what its parameter takes (view_api's description, the MCP tool's),
    leaving its label, its type and the page as they are."""
    info = component.api_info()
    component.api_info = lambda: {**info, "description": allowed, "additional_description": allowed}
