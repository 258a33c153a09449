"""The Buckets tab: every bucket of every loaded engine, warm-up and restart; /status, /warm, /restart.

Bucket and engine states come from the serving interface's status_rows(), which only reads states the worker processes
pushed, so polling it stays fast while a bucket compiles. Warm-ups run in the engine's worker; the
handlers return at once and the board shows the bucket going queued -> compiling -> warm.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from engine.errors import InvalidRequest, NotAllowed, ShowcaseError
from engine.protocol import BucketKey, Mode, Size, ranks_choice
from engine.serving.interface import Caller
from ui import buckets_views, schemas, views, waiting
from ui.common import DEFAULT_ATTENTION, FAST, HandlerBase, document_api, to_gradio_error

log = logging.getLogger(__name__)


class BucketsHandlers(HandlerBase):
    def tick(self, preset, device, precision, mode, last: dict | None, tp=1, memory: str | None = None):
        """The shared timer's poll: the bucket board and its engine list, and, from the same status
        read, the header's engine line and the Generate tab's size labels; `ready` (the engines ready now) changes
        when one loads or unloads, and the fields whose labels say "loads a new engine" follow it.

        Outputs that did not change are skipped, so an open dropdown is not redrawn every second.
        """
        last = dict(last or {})
        status = self.serving.status_rows()
        rows = buckets_views.board_rows(status)
        try:
            key = str(self.key_for(preset, device, precision, tp, levers=memory or None))
            engine = views.engine_state(status, key)
            line = views.engine_line(key, engine, load_s=waiting.load_estimate_s([r.get("load_s") for r in status]))
        except ShowcaseError as exc:
            line, engine = views.engine_line(None, None, error=str(exc)), None
        sizes = views.size_choices(self.preset_sizes(preset), mode, engine)
        engines = [e["engine"] for e in status]

        def changed(name, value):
            if last.get(name) == value:
                return False
            last[name] = value
            return True

        board = pd.DataFrame(rows, columns=buckets_views.BOARD_COLUMNS) if changed("board", repr(rows)) else gr.skip()
        line_out = line if changed("line", line) else gr.skip()
        size_out = gr.update(choices=sizes) if changed("sizes", repr(sizes)) else gr.skip()
        engines_out = gr.update(choices=engines) if changed("engines", repr(engines)) else gr.skip()
        ready = sorted(e["engine"] for e in status if e.get("state") == "ready")
        ready_out = ready if changed("ready", ready) else gr.skip()
        return board, line_out, size_out, engines_out, ready_out, last

    def warm(self, preset: str, device: str, precision: str, mode: str = "compile", size: str = "",
             tp=1, caller: Caller = Caller.HOST, request: gr.Request | None = None) -> dict:
        """Queue compile + warm-up of one bucket (size 'WxH') or of every bucket (size '' or 'all').
        Public mode, a visitor: one bucket of the engine they are using, nothing else."""
        try:
            key = self.key_for(preset, device, precision, tp, caller=caller)
            if caller is Caller.VISITOR and self.serving.public():
                if not size or size == "all":
                    raise NotAllowed("warming every bucket is up to the host; warm one bucket of your engine")
                if key != self.current_engine(request):
                    raise NotAllowed(f"{key} is not the engine you are using; you may warm buckets of the engine "
                                     "your last request ran on (other engines are up to the host)")
            p = self.serving.preset(key.preset)
            self.check_mode(key.device, mode)
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
            engine = self.serving.engine(key, caller=caller)
            # at most one compile queued per visitor at once
            if caller is Caller.VISITOR and self.serving.public():
                bucket = BucketKey(Mode.parse(mode, "mode"), Size.parse(sizes[0]))
                self.serving.check_warm(self.client_of(request), engine, bucket)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None

        def work() -> None:
            for s in sizes:
                try:
                    layout = {"parallel": key.parallel} if key.parallel.context else {}
                    self.serving.warm(key.preset, key.device, key.precision, mode=mode, size=s, tp=key.tp,
                                      caller=caller, **layout)
                except ShowcaseError as exc:
                    log.warning("warm-up of %s %s:%s failed: %s", key, mode, s, exc)
                    return

        threading.Thread(target=work, name=f"ui-warm-{key}", daemon=True).start()
        return {"engine": str(key), "mode": mode, "queued": sizes}

    def _loaded(self, engine: str):
        """The loaded engine the board names `engine`, or None."""
        return next((e for e in self.serving.engines() if str(e.key) == engine), None)

    def warm_from_board(self, engine: str, mode: str, size: str = "all", admin_token: str = "",
                        request: gr.Request = None):
        """The board's Warm buttons (Warm all passes no size)."""
        match = self._loaded(engine)
        if match is None:
            raise gr.Error("pick a loaded engine first (the board lists them)", title="Invalid request")
        key = match.key
        result = self.warm(key.preset, key.device, key.precision, mode, size, tp=ranks_choice(key.tp, key.parallel),
                           caller=self.caller(request, admin_token), request=request)
        gr.Info(f"queued warm-up of {', '.join(f'{mode}:{size}' for size in result['queued'])} on {result['engine']}",
                duration=3)

    def warm_all_from_board(self, engine: str, mode: str, admin_token: str = "", request: gr.Request = None):
        self.warm_from_board(engine, mode, "all", admin_token, request)

    def _check_host(self, caller: Caller, what: str) -> None:
        if self.serving.public() and caller is not Caller.HOST:
            raise to_gradio_error(NotAllowed(f"{what} is up to the host on this server (it interrupts other "
                                             "visitors); it needs the admin token"))

    def restart(self, engine: str, admin_token: str = "", request: gr.Request = None) -> None:
        self._check_host(self.caller(request, admin_token), "restarting an engine")
        match = self._loaded(engine)
        if match is None:
            raise gr.Error(f"no loaded engine named {engine!r}", title="Invalid request")
        try:
            self.serving.restart(match.key)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        gr.Info(f"restarting {engine}: its worker loads again and re-warms from the compile cache",
                duration=4)

    def board_select(self, evt: gr.SelectData):
        """Clicking a board row fills the warm controls with its engine, mode and size."""
        row = getattr(evt, "row_value", None) or []
        if len(row) < 5 or not row[0] or row[3] == buckets_views.LORA_SLOT:
            return gr.skip(), gr.skip(), gr.skip()
        picked = str(row[3]).split(" · ", 1)[0]  # "aot · loaded from package" -> "aot"
        mode = picked if picked in Mode.values() and picked != "eager" else gr.skip()
        size = row[4] if row[4] else gr.skip()
        return row[0], mode, size

    # -- engine options (attention backend, CUDA graphs): a restart with them ------------------------
    def engine_options_view(self, engine: str):
        """The picked engine's attention backends (each usable or why not) and whether CUDA graphs exist."""
        match = self._loaded(engine)
        if match is None:
            return (gr.update(choices=[DEFAULT_ATTENTION], value=DEFAULT_ATTENTION),
                    "Pick a loaded engine to see which attention backends can run on it.", gr.update(visible=False))
        rows = self.attention_rows(match.key)
        current = self.serving.engine_options(match.key)
        choices = [(r["name"] if r["usable"] else f"{r['name']} (cannot run: {r['reason']})", r["name"])
                   for r in rows]
        return (gr.update(choices=choices, value=current.attention_backend), buckets_views.attention_markdown(rows),
                gr.update(visible=self.cuda_graphs_possible(match.key.device), value=current.cuda_graphs))

    def restart_with_options(self, engine: str, backend: str, cuda_graphs: bool, admin_token: str = "",
                             request: gr.Request = None) -> None:
        """Restart the engine with another attention backend / CUDA graphs (an engine-wide setting)."""
        self._check_host(self.caller(request, admin_token), "changing an engine's options")
        match = self._loaded(engine)
        if match is None:
            raise gr.Error(f"no loaded engine named {engine!r}", title="Invalid request")
        options = dataclasses.replace(self.serving.engine_options(match.key), attention_backend=backend or "native",
                                      cuda_graphs=bool(cuda_graphs))
        try:
            self.serving.restart(match.key, options=options)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        gr.Info(f"restarting {engine} with attention backend {options.attention_backend}"
                + (", CUDA graphs" if options.cuda_graphs else ""), duration=4)

    def board_sizes(self, engine: str):
        """The picked engine's buckets for the Size dropdown."""
        preset = (engine or "").split("@", 1)[0]
        return gr.update(choices=self.preset_sizes(preset) if preset in self.serving.preset_names() else [])

    # -- typed API endpoints (gr.api derives their schema from these hints) -----------------------
    def status_api(self) -> list[dict]:
        """Every engine (state, load time, notices) and every bucket with its state, compile s, warm-up s."""
        # kept: the /status endpoint; gr.api and MCP read its hints and docstring for the client's API page
        return self.serving.status_rows()

    def warm_api(self, preset: str, device: str, precision: str, mode: str = "compile",
                 size: str = "", admin_token: str = "", request: gr.Request = None) -> dict:
        """Compile and warm one bucket ('WxH') or all of them ('' / 'all'); returns at once. On a public
        server a visitor may warm one bucket of the engine they are using; the rest needs admin_token."""
        return self.warm(preset, device, precision, mode, size, caller=self.caller(request, admin_token),
                         request=request)

    def restart_api(self, preset: str, device: str, precision: str, admin_token: str = "",
                    request: gr.Request = None) -> dict:
        """Restart an engine (a new worker process; its buckets warm again from the compile cache). On a
        public server: the host's, with admin_token."""
        caller = self.caller(request, admin_token)
        self._check_host(caller, "restarting an engine")
        try:
            key = self.key_for(preset, device, precision, caller=caller)
            self.serving.restart(key)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        return {"engine": str(key), "restarted": True}


@dataclass
class BucketsTab:
    """What the shared timer refreshes (build_demo wires it)."""

    board: gr.Dataframe
    engine: gr.Dropdown


def build(h: BucketsHandlers) -> BucketsTab:
    """The tab (inside gr.Tabs), its events, and the /status, /warm and /restart APIs."""
    sizes = [str(s) for s in h.default_preset().buckets]
    with gr.Tab("Buckets", id="buckets"):
        gr.Markdown("Every bucket of every loaded engine, refreshed every second. "
                    "Click a row to pick it, then warm it (compile + warm-up run in the engine's "
                    "worker process; the page keeps working).")
        # Tall enough for every bucket of a few engines (the default engine alone has about 38 rows): the
        # board is the tab; an inner scroller showed 12 of them.
        board = gr.Dataframe(headers=buckets_views.BOARD_COLUMNS, interactive=False, elem_id="board", wrap=True,
                             label="Bucket board", max_height=3200)
        with gr.Row():
            engine = gr.Dropdown([], label="Engine", elem_id="board-engine", allow_custom_value=True)
            mode = gr.Dropdown([m for m in Mode.values() if m != "eager"], value="regional", label="Mode",
                               elem_id="board-mode")
            size = gr.Dropdown(sizes, value=sizes[0], label="Size", allow_custom_value=True,
                               elem_id="board-size")
        with gr.Row():
            warm_btn = gr.Button("Warm bucket", variant="primary", elem_id="warm-btn")
            warm_all_btn = gr.Button("Warm all buckets", elem_id="warm-all-btn")
            restart_btn = gr.Button("Restart engine", elem_id="restart-btn")
        # Public mode: warming everything and restarting are the host's (they interrupt other visitors).
        with gr.Accordion("Engine options: attention backend, CUDA graphs (restarts the engine)", open=False):
            with gr.Row():
                backend = gr.Dropdown([DEFAULT_ATTENTION], value=DEFAULT_ATTENTION, label="Attention backend",
                                      elem_id="attention-backend")
                cuda_graphs = gr.Checkbox(False, label="CUDA graphs (reduce-overhead)", visible=False,
                                          elem_id="cuda-graphs")
                options_btn = gr.Button("Restart engine with these options", elem_id="restart-options-btn")
            backends_md = gr.Markdown("Pick a loaded engine to see which attention backends can run on it.",
                                      elem_id="attention-table")
        admin_token = gr.Textbox(label="Admin token (host operations on this public server)", type="password",
                                 visible=h.serving.public(), elem_id="admin-token")
        engine_params = {
            "preset": "one of " + ", ".join(h.serving.visitor_presets()),
            "device": "auto, or a device /system lists as available",
            "precision": "one of " + ", ".join(h.precision_choices()),
        }
        document_api(gr.api(h.status_api, api_name="status", concurrency_limit=None),
                     returns=("engines", "one object per engine: engine, state (loading / ready / down), load_s, "
                              "notices, and buckets: [{mode, size, state (cold / queued / compiling / warm / "
                              "failed), compile_s, warmup_s, requests_served, error}]"), schema=schemas.STATUS)
        document_api(gr.api(h.warm_api, api_name="warm", concurrency_limit=None),
                     {**engine_params, "mode": "a compiled mode: " + ", ".join(m for m in Mode.values() if m != "eager"),
                      "size": "WIDTHxHEIGHT of one bucket, or '' / 'all' for every bucket",
                      "admin_token": "public servers only: the host's token (visitors may warm one bucket of "
                                     "their own engine without it)"},
                     returns=("queued", "{engine, mode, queued: the sizes it compiles now}; /status shows them warm"),
                     schema=schemas.WARMED)
        document_api(gr.api(h.restart_api, api_name="restart", concurrency_limit=None,
                            api_visibility="undocumented" if h.serving.public() else "public"),
                     {**engine_params, "admin_token": "public servers only: the host's token"},
                     returns=("restarted", "{engine, restarted: true}"), schema=schemas.RESTARTED)

    board.select(h.board_select, None, [engine, mode, size], **FAST)
    engine.change(h.board_sizes, engine, size, **FAST)
    engine.change(h.engine_options_view, engine, [backend, backends_md, cuda_graphs], **FAST)
    options_btn.click(h.restart_with_options, [engine, backend, cuda_graphs, admin_token], None, **FAST)
    warm_btn.click(h.warm_from_board, [engine, mode, size, admin_token], None, **FAST)
    warm_all_btn.click(h.warm_all_from_board, [engine, mode, admin_token], None, **FAST)
    restart_btn.click(h.restart, [engine, admin_token], None, api_name="restart_from_board", **FAST)
    return BucketsTab(board, engine)
