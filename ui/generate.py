"""The Generate tab: one image with live per-step timings, and the /generate API.

/generate takes every parameter as plain text (hidden components), so *our* validation answers bad
input with the field's name and what to change (Gradio's slider/dropdown checks say neither).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, aclosing, closing, contextmanager, suppress
from dataclasses import dataclass
from types import MappingProxyType

import gradio as gr
import pandas as pd
from gradio.utils import get_upload_folder
from PIL import Image

from engine.config.request import API_FIELDS, FORM_FIELDS, ImageRequest
from engine.errors import ShowcaseError
from engine.protocol import EngineKey, Parallel, Size, params, parse_lora, ranks_choice
from engine.serving import stream
from engine.serving.gate import Admitted
from ui import edit_inputs, generate_views, memory_views, views, waiting, webtemp
from ui.common import ENGINE_QUEUE, FAST, HandlerBase, key_fields, to_gradio_error
from ui.runs import ProgressBar, RunFeed
from ui.uploads import upload, uploads

# The ranks selector: one process, or N ranks in each layout (engine.protocol.Parallel).
RANK_CHOICES = [1] + [ranks_choice(n, layout) for n in (2, 4, 8) for layout in Parallel]
MAX_UI_SEED = 2**31 - 1  # browsers hold integers exactly only up to 2**53; keep seeds readable
PARTIAL_EVERY_S = 0.2  # stream a partial result at most this often (each one redraws the plot)
# The /generate API's parameters, in order: the request form's fields an API caller sets.
GENERATE_API_PARAMS = API_FIELDS
API_FILES = ("images", "mask")  # /generate's file inputs (handle_file); the others are text
# Fields read as sent (the gate names what is wrong with them); any other left '' takes its default.
AS_SENT = ("prompt", "preset", "device", "precision", "mode")
HISTORY_PX = 256  # a history image's longer side: the history keeps thumbnails, not every full image
GENERATE_API_DOC = (
    "Generate one image. Returns (image, timings): image is the PNG (None in partial results and when the "
    "run was cancelled); timings is the run's figures as JSON, as the CLI's --json prints them: step_ms "
    "(one per step), encode/denoise/decode/total ms, seed, bucket, notices (e.g. a size snapped to its "
    "bucket), peak memory. With client.submit() partial timings (\"running\": true) stream while it runs; "
    "/cancel or job.cancel() stops it between steps (then \"cancelled\": true). Every parameter is text; "
    "'' takes the default.")


def api_text(name: str, value: str, allowed: str) -> gr.Textbox:
    """A hidden text parameter of /generate whose API schema says which values it takes (a Textbox's own says
    only "string"). Not a Textbox subclass: Gradio would write a .pyi stub beside this module for one."""
    box = gr.Textbox(value=value, visible=False, label=name)
    box.api_info = lambda: {"type": "string", "description": allowed, "additional_description": allowed}
    return box


def api_file(name: str, count: str, allowed: str) -> gr.File:
    """A hidden file parameter of /generate (gradio_client: handle_file(PATH)) whose schema says what it takes."""
    box = gr.File(file_count=count, visible=False, label=name)
    info = box.api_info

    def described() -> dict:
        return {**info(), "description": allowed, "additional_description": allowed}

    box.api_info = described
    return box


class RunView:
    """A run's timings as its handler streams them: the partial dict, grown step by step and sent at the
    start and at most every PARTIAL_EVERY_S, then the result's (the page's and the API's handler share it)."""

    def __init__(self, partial: dict):
        self.partial = partial
        self.entered = time.perf_counter()
        self.last_sent = 0.0

    def started(self) -> dict:
        self.last_sent = time.monotonic()
        return dict(self.partial, timings={"step_ms": []})

    def step(self, payload) -> dict | None:
        """The partial to send after this step, or None (sent one less than PARTIAL_EVERY_S ago)."""
        partial = self.partial
        partial["timings"]["step_ms"].append(payload.step_ms)
        if payload.cached:
            partial["cached_steps"].append(payload.step)
        partial["steps"] = payload.total
        now = time.monotonic()
        if now - self.last_sent < PARTIAL_EVERY_S or payload.step >= payload.total:
            return None
        self.last_sent = now
        return dict(partial, timings=dict(step_ms=list(partial["timings"]["step_ms"])),
                    cached_steps=list(partial["cached_steps"]))

    def done(self, result) -> dict:
        # handler_ms: the app's own share of the round trip (dispatch + engine), which the soak and the load
        # tool tell apart from the web side (queue, events, transfer)
        return dict(result.as_dict(), handler_ms=round((time.perf_counter() - self.entered) * 1000, 1))

    def cancelled(self, exc: BaseException) -> dict:
        return dict(self.partial, running=False, cancelled=True, message=str(exc))

    def failed(self, exc: BaseException) -> dict:
        """Settled (running=false), so generate_ended does not take it for a cancel."""
        return dict(self.partial, running=False, error=str(exc))

    def outputs(self, event, feed: RunFeed, page: bool) -> Iterator[tuple]:
        """What a handler yields for one event of its request's stream (none, one, or one then a raised
        gr.Error), and the event shown on its progress bar. The page gets a partial at the start, heartbeats
        and gr.skip() for the image it keeps; /generate (`page` False, the wire's form) none of those, None
        for no image and the result's PNG file as it is."""
        heartbeat = feed.see(event)
        keep = gr.skip() if page else None
        if isinstance(event, stream.Started):
            update = self.started()  # /generate: no message yet, at a burst's start the server has every join
            if page:  # to admit; the page shows this run from now on
                yield keep, update
        elif isinstance(event, stream.Idle) and heartbeat and page:
            yield keep, keep  # a heartbeat: Gradio can close the handler here
        elif isinstance(event, stream.Step):
            if (update := self.step(event.progress)) is not None:
                yield keep, update
        elif isinstance(event, stream.Finished):
            try:
                image = event.result.image() if page else png_file(event.result)
            except Exception as exc:
                yield keep, self.failed(exc)
                raise to_gradio_error(exc) from None
            yield image, self.done(event.result)
        elif isinstance(event, stream.Stopped):
            gr.Warning(str(event.error), title="Cancelled", duration=4)
            yield None, self.cancelled(event.error)
        elif isinstance(event, stream.Failed):
            yield keep, self.failed(event.error)
            raise to_gradio_error(event.error) from None


def png_file(result) -> dict:
    """The result's PNG as a file in Gradio's temporary folder (under the cache folder: ui/webtemp.py), in the
    FileData form an output with postprocess=False sends: Gradio serves it from there as it is; the folder's
    bounds remove it later."""
    path = webtemp.save_output(result.image_png, get_upload_folder())
    return {"path": path, "orig_name": f"{result.request_id or 'image'}.png", "mime_type": "image/png",
           "meta": {"_type": "gradio.FileData"}}


def _given(value):
    """None for a field left empty: the API sends text, and '' (or nothing) takes the default."""
    return None if value is None or (isinstance(value, str) and not value.strip()) else value


def _chosen(value):
    """None for an empty field or "none" (no step cache, no LoRA)."""
    value = _given(value)
    return None if value == "none" else value


@dataclass(frozen=True)
class PreparedRun:
    """What a Generate handler runs: the request, its engine and the view that streams its timings."""

    spec: Admitted  # what the gate let through: serving.generate runs it as it is
    key: EngineKey
    view: RunView

    def compile_bucket(self) -> str | None:
        request = self.spec.request
        return waiting.compile_bucket(request.mode, request.size, request.on_cold)


# The fields the Generate page builds by hand (their own widgets and events); every other declared field gets a
# plain widget made from its declaration (today the negative prompt), so a newly declared field shows with no edit.
HAND_BUILT = frozenset({"prompt", "preset", "device", "precision", "mode", "size", "steps", "guidance", "seed",
                        "on_cold", "tp", "step_cache", "lora", "lora_scale", "lora_fused", "memory", "num_frames", "fps",
                        "images", "mask", "strength"})
DECLARED = tuple(f for f in params.FIELDS if f.name not in HAND_BUILT)


def declared_widgets(preset, fields=DECLARED, prefix: str = "") -> dict:
    """A plain widget for each of `fields` by name, from its declaration: a checkbox for a switch, a number box for
    a number, else a one-line text box; its label and help; shown where `preset`'s family takes it. elem_id:
    `prefix` and the name in kebab case."""
    widgets = {}
    for f in fields:
        kind = gr.Checkbox if f.type is bool else gr.Number if f.type in (int, float) else gr.Textbox
        widgets[f.name] = kind(label=f.label, info=f.describe(preset), visible=f.taken_by(preset),
                               elem_id=prefix + f.name.replace("_", "-"), **({"lines": 1} if kind is gr.Textbox else {}))
    return widgets


def declared_shown(preset, fields=DECLARED) -> list:
    """Their visibility updates for `preset`, in `fields`' order."""
    return [gr.update(visible=f.taken_by(preset)) for f in fields]


class GenerateHandlers(HandlerBase):
    # -- settings --------------------------------------------------------------------------------
    def preset_defaults(self, preset: str):
        """Preset changed: the declared widgets (DECLARED: a negative prompt) shown where its family takes them; its
        steps/guidance."""
        try:
            p = self.serving.preset(preset)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        return *declared_shown(p), gr.update(value=p.steps), gr.update(value=p.guidance)

    def select_engine(self, preset: str, device: str, precision: str, mode: str, size: str | None = None,
                      tp=1, memory: str | None = None):
        """Settings that need another engine start it now (in the background) and say it is loading.

        Returns (engine status line, size choices, mode choices). Never blocks: serving.engine()
        only spawns the worker process.
        """
        modes = self.device_modes(device)
        mode_update = gr.update(choices=modes, value=mode if mode in modes else "eager")
        sizes = self.preset_sizes(preset)
        try:
            key = self.key_for(preset, device, precision, tp, levers=_given(memory))
            self.serving.engine(key, caller=self.caller())
        except ShowcaseError as exc:
            gr.Warning(str(exc), duration=6)
            line = views.engine_line(None, None, error=str(exc))
            return line, gr.update(choices=views.size_choices(sizes, mode, None)), mode_update
        engine = views.engine_state(self.serving.status_rows(), str(key))
        size_update = gr.update(choices=views.size_choices(sizes, mode, engine))
        if size not in sizes and sizes:
            size_update = gr.update(choices=views.size_choices(sizes, mode, engine), value=sizes[0])
        load_s = waiting.load_estimate_s([r.get("load_s") for r in self.serving.status_rows()])
        return views.engine_line(str(key), engine, load_s=load_s), size_update, mode_update

    def step_cache_choices(self, preset: str, device: str, mode: str, current: str | None = None):
        """The step caches this preset, device and mode can use; unusable ones say why. A choice the
        new settings cannot run falls back to none."""
        rows = self.step_cache_rows(preset, device, mode)
        choices = views.step_cache_choices(rows, short=True) or [("none", "none")]
        usable = {value for label, value in choices if " · unavailable" not in label}
        return gr.update(choices=choices, value=current if current in usable else "none",
                         info=generate_views.step_cache_note(rows))

    def why_not(self, preset: str, device: str, precision: str, mode: str, tp=1) -> str:
        """The accordion under the memory and step cache fields: why each unavailable choice cannot run here."""
        try:
            levers = memory_views.memory_why(self.serving.lever_choices(self.key_for(preset, device, precision, tp),
                                                                         mode))
        except ShowcaseError:
            levers = ""
        caches = generate_views.step_cache_reasons(self.step_cache_rows(preset, device, mode), sep="\n- step caches ")
        lines = [levers, f"- step caches {caches}" if caches else ""]
        return "\n".join(filter(None, lines)) or "Every choice can run with these settings."

    def memory_choices(self, preset: str, device: str, precision: str, mode: str, tp=1, current: str | None = None):
        """The memory lever sets this engine can take on its device, each with its estimated peak and price in
        time (ui/memory_views.py); a choice the new settings cannot run falls back to the first."""
        host = self.serving.host_levers()
        try:
            rows = self.serving.lever_choices(self.key_for(preset, device, precision, tp), mode)
        except ShowcaseError:
            rows = []
        keys = {}
        for value in (r["levers"] for r in rows):
            with suppress(ShowcaseError):  # a set these settings cannot take: its row says why
                keys[value] = self.key_for(preset, device, precision, tp, levers=_given(value))
        loads = self.new_engine_loads(keys)
        choices = memory_views.memory_choices(rows, host, self.serving.public(), loads) or [("none", "none")]
        usable = memory_views.usable_values(rows) & {value for _, value in choices}
        return gr.update(choices=choices, value=current if current in usable else choices[0][1],
                         info=memory_views.memory_info(rows, host))

    def precision_field(self, preset: str, device: str, tp=1, memory: str | None = None):
        """The precision choices relabelled for new settings (which need a new engine); the value stays."""
        return gr.update(choices=self.precision_labels(preset, device, tp, memory))

    def clip_fields(self, preset: str):
        """Frames and fps shown only for a video preset (its declaration: ModelPreset.frames)."""
        try:
            return gr.update(visible=self.serving.preset(preset).video)
        except ShowcaseError:
            return gr.update(visible=False)

    def lora_choices(self, preset: str):
        """The new preset's LoRA adapters (none selected)."""
        try:
            return gr.update(choices=views.lora_choices(self.serving.preset(preset), self.serving.lora_slot()),
                             value="none")
        except ShowcaseError:
            return gr.update(choices=[("none", "none")], value="none")

    def style_scale(self, preset: str, lora: str | None):
        """A style picked: the slider moves to that style's own scale (the preset's), which it then overrides."""
        try:
            scale = next((s.scale for s in self.serving.preset(preset).loras if s.name == lora), None)
        except ShowcaseError:
            scale = None
        return gr.skip() if scale is None else gr.update(value=scale)

    def randomize_seed(self, seed, randomize: bool):
        return random.randint(0, MAX_UI_SEED) if randomize else seed

    # -- the run ---------------------------------------------------------------------------------
    def generate(self, request: gr.Request = None, progress=gr.Progress(), **form):  # noqa: B008
        """One image (tp > 1: on the tensor-parallel torchrun sidecar with that many ranks). `form`: the
        request's fields by name (engine.config.request.FORM), as the page's widgets or the API send them.

        Streams (image, timings): a partial timings dict ("running": true) at the start and at most
        every PARTIAL_EVERY_S, then the result's as_dict() (the CLI's --json). /cancel ends it with
        cancelled=true and no image; a failure settles the partial (running=false) before the error.
        Partials leave the page's image as it is (gr.skip()). A sync generator (Gradio runs each of its
        steps in a worker thread) reading the request's event stream through stream.blocking: closing it
        stops the engine request between steps.
        """
        with self._registered(request) as run:  # the visitor's one run first: nothing is decoded for a refused one
            prepared = self._prepare(form, request, progress)
            feed = self.run_feed(prepared.key, ProgressBar(progress), bucket=prepared.compile_bucket())
            with closing(stream.blocking(self._events(prepared, run))) as events:
                for event in events:
                    yield from prepared.view.outputs(event, feed, page=True)

    async def generate_api(self, request: gr.Request = None, progress=gr.Progress(), images=None, mask=None,  # noqa: B008
                           **form):
        """/generate: what `generate` streams, for callers that read the result, as cheaply for the web
        server as Gradio allows (in a burst, its time per request bounds how fast results go out):
        - an async generator: Gradio runs each step of a sync one in a worker thread;
        - wired with preprocess=False and postprocess=False (its inputs are plain text; it yields what goes
          on the wire): no thread hop per input and per output;
        - partials carry no image (None): a gr.skip() makes Gradio rebuild the output component; the first
          comes PARTIAL_EVERY_S into the run (none at its start, and no "queued" progress text unless it
          waits): each message costs the web server time that, at a burst's start, delays the others;
        - the image is the worker's PNG as it is (a file Gradio copies into its cache), not decoded and
          encoded again.
        Cancelling the handler (a closed page, job.cancel()) stops the engine request at any await. `images` and
        `mask` are named so that Gradio's API page offers them as optional (None: no upload)."""
        import anyio

        try:
            await self.await_listener(request)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        with self._registered(request, listener_checked=True) as run:  # its one run first, then the decode
            prepared = await anyio.to_thread.run_sync(
                lambda: self._prepare({**form, "images": images, "mask": mask}, request, progress, for_page=False))
            feed = self.run_feed(prepared.key, ProgressBar(progress), bucket=prepared.compile_bucket())
            async with aclosing(self._events(prepared, run)) as events:
                async for event in events:
                    for output in prepared.view.outputs(event, feed, page=False):
                        yield output

    @contextmanager
    def _registered(self, request: gr.Request | None, listener_checked: bool = False):
        """The handler's run (HandlerBase.open_run); a refusal (public mode: one running request per visitor)
        as the gr.Error a visitor reads."""
        with ExitStack() as stack:
            try:
                run = stack.enter_context(self.open_run(request, listener_checked=listener_checked))
            except ShowcaseError as exc:
                raise to_gradio_error(exc) from None
            yield run

    def _events(self, prepared: PreparedRun, run):
        """The request's one event stream (engine/serving/stream.py)."""
        return self.serving.events(prepared.spec, key=prepared.key, run=run)

    def form_request(self, form: dict, request: gr.Request | None) -> ImageRequest:
        """The ImageRequest a form asks for, before its engine is resolved: text as the API sends it, where
        '' (or nothing) takes the default and "none" picks no step cache or LoRA; caller and client from
        the connection."""
        fields = {name: form.get(name) if name in AS_SENT else _given(form.get(name)) for name in FORM_FIELDS}
        return ImageRequest(**{
            **fields, "seed": 0 if fields["seed"] is None else fields["seed"],
            "on_cold": fields["on_cold"] or self.defaults.on_cold, "step_cache": _chosen(form.get("step_cache")),
            # "NAME[:SCALE][:fused]" (the page's slider and fused box, when sent, win: they apply to a style only)
            "lora": _chosen(form.get("lora")),
            "images": uploads(form.get("images")), "mask": upload(form.get("mask")),
            "tp": 1,  # the engine key's ranks: resolved by _prepare (key_fields)
        }, caller=self.caller(request), client=self.client_of(request))

    def _prepare(self, form: dict, request, progress, for_page: bool = True) -> PreparedRun:
        """A run's request, engine key and view from the handler's form; bad input raises gr.Error naming
        the field."""
        try:
            spec = self.form_request(form, request)  # an upload is read here (bounded)
            tp, parallel = key_fields(spec.preset, spec.device, spec.precision, form.get("tp", 1))
            # the one gate: the key resolved, the request checked, routed and priced, before its engine starts
            admitted = self.serving.admit(spec.replace(tp=tp, parallel=parallel))
            key = admitted.key
            size_text = str(Size.parse(spec.size)) if spec.size else ""
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        self.remember_engine(request, key)
        if for_page:  # the page shows it at once; an API caller sees the engine's own waiting text if it waits
            progress(0, desc=f"queued on {key}")
        view = RunView({"running": True, "engine": str(key), "preset": key.preset, "device": key.device,
                        "precision": key.precision, "mode": form.get("mode"), "bucket": size_text,
                        "steps": form.get("steps"), "step_cache": spec.step_cache or "none", "cached_steps": [],
                        "lora": spec.lora, "timings": {"step_ms": []}})
        return PreparedRun(admitted, key, view)

    def generate_ended(self, timings: dict | None):
        """After the Generate event, however it ended. A partial still "running" means Gradio closed
        the handler (the Cancel button; a result or a failure settles it): show it cancelled, as
        /cancel does."""
        if not (timings or {}).get("running"):
            return gr.skip(), gr.skip()
        message = f"cancelled after step {len(timings['timings']['step_ms'])} of {timings.get('steps')}"
        gr.Warning(message, title="Cancelled", duration=4)
        return None, dict(timings, running=False, cancelled=True, message=message)

    def render_run(self, result: dict | None):
        """Per-step plot, stats table and summary line of one run (also of a partial, still-running one)."""
        rows = views.step_rows(result)
        frame = views.step_frame(rows + generate_views.steps_to_come(result, rows), generate_views.STEP_COLUMNS,
                                 series=(views.COMPUTED, views.CACHED))
        # The x axis (the steps as labels, STEP_ORDER) spans the run's steps from the start. No y_lim, ever: Vega
        # takes the y range from the data. The browser keeps a LinePlot's last y_lim when an update sets it to
        # None (an empty partial's [0, 1] stayed for the whole run and drew the line far above the chart), and a
        # y_lim that follows the data rebuilds the chart on every step, and racing rebuilds leave a stale line.
        plot = gr.update(value=frame.astype({"step": "string"}), elem_classes=generate_views.plot_classes(rows))
        stats = pd.DataFrame(generate_views.stats_rows(result), columns=generate_views.STATS_COLUMNS)
        return plot, stats, generate_views.run_summary(result)

    def generate_page(self, history, request: gr.Request = None, progress=gr.Progress(), **form):  # noqa: B008
        """The page's run: what `generate` streams, and with the image the run history (this session's last
        HISTORY_RUNS images, newest first, each captioned with its configuration and figures)."""
        for image, timings in self.generate(request=request, progress=progress, **form):
            if isinstance(image, Image.Image) and isinstance(timings, dict):
                history = self.remember(history, image, timings)
                yield image, timings, [(thumb, caption) for thumb, caption, _ in history], history
            else:
                yield image, timings, gr.skip(), gr.skip()

    @staticmethod
    def remember(history: list | None, image: Image.Image, timings: dict) -> list:
        """The history with this image first; bounded (HISTORY_RUNS thumbnails per session)."""
        history = list(history or [])
        number = history[0][2] + 1 if history else 1
        thumb = image.copy()
        thumb.thumbnail((HISTORY_PX, HISTORY_PX))
        caption = generate_views.history_caption(number, timings)
        return [(thumb, caption, number), *history][:generate_views.HISTORY_RUNS]


def api_allowed(h: GenerateHandlers, preset: str, device: str) -> dict[str, str]:
    """What each /generate parameter takes, for its API schema: each field's declared help
    (engine/protocol/params.py) with the default preset's values, and what this host offers for the engine's."""
    presets = ", ".join(h.serving.visitor_presets())
    caches = [value for _, value in views.step_cache_choices(h.step_cache_rows(preset, device, "eager"))]
    allowed = params.field_help(h.serving.preset(preset), GENERATE_API_PARAMS)
    uploads = {name: "handle_file(PATH)" + (" each" if name == "images" else "") + ": " + allowed[name]
               for name in API_FILES}
    return {**allowed, **uploads,
            "preset": f"one of {presets}" + ("" if h.serving.public() else ", or a Hub id / local diffusers folder"),
            "device": "auto, or one of " + ", ".join(r["name"] for r in h.devices_report())
                      + " (/system says which are available here)",
            "precision": "one of " + ", ".join(h.precision_choices()),
            "tp": "ranks: " + ", ".join(str(c) for c in RANK_CHOICES) + " (> 1 runs on the torchrun sidecar)",
            "step_cache": "none, or one of " + ", ".join(c for c in caches if c != "none")
                          + " (/status and the page say which can run on an engine)"}


def build(h: GenerateHandlers, demo: gr.Blocks, engine_line: gr.Markdown,
          ready: gr.State | None = None) -> Mapping[str, gr.components.Component]:
    """The tab (inside gr.Tabs) and its events; `engine_line` is the header's engine status, `ready` the engines
    ready now (set by the shared timer: the precision and memory labels follow it). Returns the request's
    widgets by field name (read-only): the shared timer and the Advisor's "apply" read and set them."""
    page = GeneratePage(h)
    with gr.Tab("Generate", id="generate"):
        # Controls on the left; on a wide screen the output column (buttons, image, progress, plot, summary)
        # stays in view while they scroll (sticky, ui/blocks.py CSS); on a phone it follows them.
        with gr.Row(elem_id="gen-row"):
            with gr.Column(scale=2, min_width=320, elem_id="gen-controls"):
                page.controls()
            with gr.Column(scale=3, min_width=340, elem_id="gen-output"):
                page.outputs()
        page.history()
        with gr.Column(visible=False):  # /generate: the same handler on hidden text inputs (module docstring)
            page.api()
    page.wire_runs()
    page.wire_settings(demo, engine_line)
    if ready is not None:
        page.follow_engines(ready)
    edit_inputs.wire(page, demo)
    return MappingProxyType(page.form)


class GeneratePage:
    """The Generate tab's widgets, built part by part, then its events. `form` holds the request's widgets by
    field name (engine.config.request.FORM): the run's handlers take them as keyword inputs."""

    def __init__(self, h: GenerateHandlers):
        self.h, self.d = h, h.defaults
        self.preset = h.default_preset()
        self.report = h.devices_report()
        self.modes = h.device_modes(self.d.device)
        self.first_mode = self.d.mode if self.d.mode in self.modes else "eager"
        self.form: dict[str, gr.components.Component] = {}

    def controls(self) -> None:
        """The request's settings, each one a field of the form."""
        h, d, preset, form = self.h, self.d, self.preset, self.form
        form["prompt"] = gr.Textbox(label=params.label("prompt"), value=preset.example_prompt, lines=2, elem_id="prompt")
        if preset.examples:  # prompts the default model draws well (its grammar)
            gr.Examples([[e] for e in preset.examples], inputs=[form["prompt"]],
                        label=f"Prompts {preset.name} can draw", elem_id="examples")
        form.update(declared_widgets(preset))
        with gr.Row():
            public = h.serving.public()
            form["preset"] = gr.Dropdown(h.serving.visitor_presets(), value=preset.name,
                                         allow_custom_value=not public,
                                         label="Model preset" if public else
                                         "Model preset (or a Hub id / local diffusers folder)", elem_id="preset")
            form["device"] = gr.Dropdown(views.device_choices(self.report), value=d.device, label=params.label("device"),
                                         elem_id="device")
        with gr.Row():
            form["precision"] = gr.Dropdown(h.precision_labels(preset.name, d.device, ranks_choice(d.tp, d.parallel)),
                                            value=d.precision, label=params.label("precision"),
                                            elem_id="precision")
            form["mode"] = gr.Dropdown(self.modes, value=self.first_mode, label=params.label("mode"), elem_id="mode")
        sizes = [str(s) for s in preset.buckets]
        form["size"] = gr.Dropdown(views.size_choices(sizes, d.mode, None), value=sizes[0],
                                   label=params.label("size"), allow_custom_value=True, elem_id="size")
        self._step_cache_and_lora()
        form["memory"] = self._memory_field()
        form["steps"] = gr.Slider(1, params.MAX_STEPS, value=preset.steps, step=1, label=params.label("steps"), elem_id="steps")
        form["guidance"] = gr.Slider(0.0, params.MAX_GUIDANCE, value=preset.guidance, step=0.1, label=params.label("guidance"),
                                     elem_id="guidance")
        with gr.Row():
            form["seed"] = gr.Number(value=0, precision=0, minimum=0, label=params.label("seed"), elem_id="seed")
            self.randomize = gr.Checkbox(False, label="New random seed each run", elem_id="randomize")
        form["tp"] = gr.Dropdown(RANK_CHOICES, value=ranks_choice(d.tp, d.parallel),
                                 label="Ranks · layout (>1: torchrun sidecar; tensor shards the weights, "
                                 "ulysses / ring split the tokens)", elem_id="tp")
        with gr.Row(visible=preset.video) as self.clip_row:  # a video preset's fields (its poster shows here)
            form["num_frames"] = gr.Number(value=None, precision=0, label=params.label("num_frames"), elem_id="frames")
            form["fps"] = gr.Number(value=None, precision=0, label=params.label("fps"), elem_id="fps")
        self._image_inputs()
        form["on_cold"] = gr.Radio(params.choices("on_cold"),
                                   value=d.on_cold, label=params.label("on_cold"), elem_id="on-cold")
        with gr.Accordion("Devices on this machine", open=False):
            gr.Markdown(generate_views.device_notes(self.report))

    def _image_inputs(self) -> None:
        """Input images for presets that edit (engine/config/images.py): the source or references, a mask, a
        strength; a preset refuses what its family does not take."""
        form = self.form
        with gr.Accordion("Input images (edit, img2img, inpaint, references)", open=False) as self.image_area:
            form["images"] = gr.File(file_count="multiple", file_types=["image"], type="filepath",
                                     label=params.label("images"),
                                     elem_id="input-images")
            self.capture = edit_inputs.capture_input()  # webcam or paste: added to the images above
            with gr.Row():
                form["mask"] = gr.File(file_types=["image"], type="filepath", elem_id="input-mask",
                                       label=params.label("mask"))
                form["strength"] = gr.Number(value=None, minimum=0.0, maximum=1.0, elem_id="strength",
                                             label=params.label("strength"))

    def _step_cache_and_lora(self) -> None:
        h, d, form = self.h, self.d, self.form
        cache_rows = h.step_cache_rows(self.preset.name, d.device, self.first_mode)
        cache_choices = views.step_cache_choices(cache_rows, short=True)
        form["step_cache"] = gr.Dropdown(cache_choices or [("none", "none")],
                                         value=d.step_cache if d.step_cache in {v for _, v in cache_choices}
                                         else "none", label=params.label("step_cache"),
                                         info=generate_views.step_cache_note(cache_rows), elem_id="step-cache")
        with gr.Accordion(memory_views.WHY_NOT_TITLE, open=False):
            self.why_not = gr.Markdown(h.why_not(self.preset.name, d.device, d.precision, self.first_mode,
                                                 ranks_choice(d.tp, d.parallel)), elem_id="why-not")
        with gr.Row():  # LoRA styles the preset lists: hot-swapped on warm graphs (engine/pipeline/lora.py)
            slot = h.serving.lora_slot()
            choices = views.lora_choices(self.preset, slot)
            start = parse_lora(d.lora)  # app.py --lora
            name = start.name if start.name in {value for _, value in choices} else "none"
            scale = start.scale if start.scale is not None else next(
                (lora.scale for lora in self.preset.loras if lora.name == name), 1.0)
            form["lora"] = gr.Dropdown(choices, value=name, elem_id="lora",
                                       label="LoRA style (hot-swapped: no recompile)" if slot else
                                       "LoRA style (off: the host starts the app with --loras)")
            form["lora_scale"] = gr.Slider(0.0, 2.0, value=scale, step=0.05, label=params.label("lora_scale"),
                                           elem_id="lora-scale")
            form["lora_fused"] = gr.Checkbox(start.fused and name != "none", label=params.label("lora_fused"), elem_id="lora-fused")

    def _memory_field(self) -> gr.Dropdown:
        """Memory levers: the sets this engine can take here, each with its price; a private host's may type any."""
        h = self.h
        update = h.memory_choices(self.preset.name, self.d.device, self.d.precision, self.first_mode,
                                  ranks_choice(self.d.tp, self.d.parallel))
        public = h.serving.public()
        return gr.Dropdown(update["choices"], value=update["value"], info=update["info"], allow_custom_value=not public,
                           interactive=not public, label="Memory levers (where the weights live: estimated peak "
                           "and time beside each)", elem_id="memory")

    def outputs(self) -> None:
        with gr.Row(elem_id="gen-buttons"):
            self.generate_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn")
            self.cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel-btn")
        with gr.Row(equal_height=True, elem_id="gen-image-row"):
            self.image = gr.Image(label="Image", type="pil", format="png", interactive=False, height=300,
                                  elem_id="output-image", buttons=["download"], min_width=200)
            # Created empty; every value names both series first (views.step_frame says why).
            self.step_plot = gr.LinePlot(x="step", y="step_ms", color="steps", title="Per-step latency of this run",
                                         x_title="step", y_title="ms", color_title="", height=300,
                                         elem_id="step-plot", min_width=200, sort=generate_views.STEP_ORDER,
                                         color_map={views.COMPUTED: views.SERIES_PALETTE[0],
                                                    views.CACHED: views.SERIES_PALETTE[1]})
        self.edit_btn = edit_inputs.edit_button()  # the output into the image area (ui/edit_inputs.py)
        self.edit_ab = edit_inputs.ab_slider()  # an edit's source against its result
        self.summary = gr.Markdown(generate_views.run_summary(None), elem_id="run-summary")
        self.stats = gr.Dataframe(headers=generate_views.STATS_COLUMNS, interactive=False, label="Timings",
                                  elem_id="stats", wrap=True, column_widths=["32%", "68%"], max_height=900)
        with gr.Accordion("Timings JSON (the CLI's --json)", open=False):
            self.timings = gr.JSON(elem_id="timings-json")

    def history(self) -> None:
        self.history_gallery = gr.Gallery(label=f"Run history (this page's last {generate_views.HISTORY_RUNS} images; "
                                          "click one to flip through them)", columns=6, object_fit="contain",
                                          elem_id="history", type="pil", interactive=False, preview=False)
        self.history_state = gr.State([])
        self.history_edit, self.history_pick = edit_inputs.history_button()  # its picked image to the image area

    def api(self) -> None:
        """/generate's hidden text inputs, one per API field, and its outputs."""
        d, preset = self.d, self.preset
        defaults = {"prompt": preset.example_prompt, "preset": preset.name, "device": d.device,
                    "precision": d.precision, "mode": d.mode, "seed": "0", "on_cold": d.on_cold,
                    "tp": str(ranks_choice(d.tp, d.parallel)),
                    "step_cache": d.step_cache}  # size/steps/guidance/memory: "" means the preset's (host's) default
        allowed = api_allowed(self.h, preset.name, d.device)
        self.api_form = {name: api_text(name, defaults.get(name, ""), allowed[name]) for name in GENERATE_API_PARAMS
                         if name not in API_FILES}
        # uploads: gradio_client's handle_file(PATH) (a list of them for images)
        for name, count in (("images", "multiple"), ("mask", "single")):
            self.api_form[name] = api_file(name, count, allowed[name])
        self.api_form = {name: self.api_form[name] for name in GENERATE_API_PARAMS}  # FORM's order
        self.api_image = gr.Image(type="pil", format="png", visible=False, label="image")
        self.api_timings = gr.JSON(visible=False, label="timings")
        self.api_button = gr.Button(visible=False)

    def wire_runs(self) -> None:
        """Generate, Cancel and /generate: the run's handlers take the form's fields by name."""
        h = self.h
        run_io = dict(concurrency_id=ENGINE_QUEUE, concurrency_limit=h.run_slots())
        seed = self.form["seed"]
        seeded = self.generate_btn.click(h.randomize_seed, [seed, self.randomize], seed, queue=False,
                                         api_visibility="private")
        form = {name: self.form[name] for name in FORM_FIELDS}  # every field has its widget
        run = seeded.then(h.generate_page, [self.history_state],
                          [self.image, self.timings, self.history_gallery, self.history_state],
                          inputs_kwargs=form, api_name="generate_ui", api_visibility="private",
                          show_progress="full", show_progress_on=[self.image], **run_io)
        # Gradio closes the running handler; closing it cancels the engine request between steps.
        self.cancel_btn.click(None, cancels=[run])
        run.then(h.generate_ended, self.timings, [self.image, self.timings], **FAST)
        # Plain text in, the wire's form out (see generate_api)
        self.api_button.click(h.generate_api, None, [self.api_image, self.api_timings], inputs_kwargs=self.api_form,
                              api_name="generate", api_description=GENERATE_API_DOC, preprocess=False,
                              postprocess=False, **run_io)
        self.timings.change(h.render_run, self.timings, [self.step_plot, self.stats, self.summary], **FAST)

    def follow_engines(self, ready: gr.State) -> None:
        """An engine loaded or unloaded: the precision and memory choices say again which need a new engine."""
        h, f = self.h, self.form
        ready.change(h.precision_field, [f["preset"], f["device"], f["tp"], f["memory"]], f["precision"], **FAST)
        ready.change(h.memory_choices, [f["preset"], f["device"], f["precision"], f["mode"], f["tp"], f["memory"]],
                     f["memory"], **FAST)

    def wire_settings(self, demo: gr.Blocks, engine_line: gr.Markdown) -> None:
        """A new preset's defaults and styles; the engine the settings point at, started with the page (app.py
        has usually started it already); the step caches they can use."""
        h, f = self.h, self.form
        f["preset"].change(h.preset_defaults, f["preset"], [*(f[t.name] for t in DECLARED), f["steps"],
                                                             f["guidance"]], **FAST)
        f["preset"].change(h.lora_choices, f["preset"], f["lora"], **FAST)
        f["preset"].change(h.clip_fields, f["preset"], self.clip_row, **FAST)
        f["lora"].input(h.style_scale, [f["preset"], f["lora"]], f["lora_scale"], **FAST)
        engine_settings = [f["preset"], f["device"], f["precision"], f["mode"], f["tp"], f["memory"]]
        gr.on([c.change for c in engine_settings] + [demo.load], h.select_engine,
              [f["preset"], f["device"], f["precision"], f["mode"], f["size"], f["tp"], f["memory"]],
              [engine_line, f["size"], f["mode"]], **FAST)
        gr.on([f[name].change for name in ("preset", "device", "precision", "mode", "tp")], h.memory_choices,
              [f["preset"], f["device"], f["precision"], f["mode"], f["tp"], f["memory"]], f["memory"], **FAST)
        gr.on([f[name].change for name in ("preset", "device", "precision", "tp", "memory")], h.precision_field,
              [f["preset"], f["device"], f["tp"], f["memory"]], f["precision"], **FAST)
        gr.on([f[name].change for name in ("preset", "device", "precision", "mode", "tp")], h.why_not,
              [f["preset"], f["device"], f["precision"], f["mode"], f["tp"]], self.why_not, **FAST)
        gr.on([f["preset"].change, f["device"].change, f["mode"].change], h.step_cache_choices,
              [f["preset"], f["device"], f["mode"], f["step_cache"]], f["step_cache"], **FAST)
