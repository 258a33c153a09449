"""The Gradio Blocks app: a header, the Generate, Buckets, Compare and System tabs, one shared timer.

Each tab builds its components and wires its events in its own module; this one puts them
together. API (gradio_client): /generate, /cancel, /compare, /status, /warm, /restart, /system; the
OpenAI-compatible images API under /v1 (ui/openai_api.py).
UI-only events (timer ticks, redraws, settings changes) are private.
"""

from __future__ import annotations

import atexit
import os

import gradio as gr

from engine import settings
from engine.serving.interface import Serving
from ui import advisor, buckets, compare, generate, generate_video, mcp, system
from ui.bodies import public_body_bounds
from ui.common import FAST
from ui.edge import CLIENT_EVENTS, EdgeConfig, EdgeGuard
from ui.generate import GENERATE_API_PARAMS
from ui.handlers import PAGE_KINDS, PageHandlers, UIDefaults, UIState
from ui.metrics import MetricsRoute
from ui.openai_api import ApiKeys, OpenAIRoutes
from ui.openai_edits import read_edit_call
from ui.openai_videos import VideoJobs
from ui.sessions import bound_sessions
from ui.sockets import install_server_hook, public_bounds
from ui.uploads import MAX_UPLOAD_BYTES

__all__ = ["GENERATE_API_PARAMS", "build_demo", "launch_kwargs"]

CSS = """
#output-image img { image-rendering: pixelated; object-fit: contain; }
#history img { image-rendering: pixelated; }
#history .grid-container { grid-template-columns: repeat(auto-fill, minmax(120px, 180px)) !important; }
/* Wide screens: the output column stays in view while the controls scroll; a phone stacks the columns. Gradio's
   container hides its overflow, which makes it the sticky column's scroller (it never scrolls): clip instead. */
.gradio-container { overflow: clip !important; }
@media (min-width: 1024px) {
  /* at most a screen tall (its timings scroll inside it), so the controls' end cannot push the image out */
  #gen-output { position: sticky; top: 8px; align-self: flex-start; max-height: calc(100vh - 16px); overflow-y: auto; }
}
/* A run without cached steps: its plot's legend has no "cached" entry (generate_views.plot_classes). */
.no-cached g.role-legend .role-scope > g:nth-of-type(2) { display: none; }
#run-summary { min-height: 2.4em; font-variant-numeric: tabular-nums; }
#a-status { min-height: 4.5em; }
/* A run's progress drawn over its status line covers it (Gradio draws a Markdown's progress translucent: the
   Advisor's bar text ran over the status words beneath it). */
#a-status .wrap.translucent, #c-status .wrap.translucent { background: var(--block-background-fill); }
#c-cards, #c-status { min-height: 4em; }
#engine-line { min-height: 1.6em; }
#board { font-variant-numeric: tabular-nums; }
#c-cards .c-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 12px; }
#c-cards .c-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px;
  font-size: 0.9em; font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
#c-cards .c-card img { width: 100%; max-width: 256px; image-rendering: pixelated; display: block; margin: 4px 0; }
#c-cards .c-card-title { font-weight: 600; }
#c-cards .c-pair, #a-cards .c-pair { display: grid; grid-template-columns: 1fr 1fr; gap: 4px; }
#a-cards .c-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(240px, 1fr)); gap: 12px; }
#a-cards .c-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px; font-size: 0.9em; }
#a-cards .a-triple { grid-template-columns: 1fr 1fr 1fr; }
#a-cards img { width: 100%; image-rendering: pixelated; }
#c-cards .c-card-tag, #c-cards .c-note { color: var(--body-text-color-subdued); font-size: 0.9em; }
#c-cards .c-card-error { color: var(--error-text-color); }
/* A clip card's frame strip (ui/compare_clips.py): its frames side by side, a row or two, then its worst frame's
   heat map at half the card's width. */
#c-cards .c-strip { display: grid; grid-template-columns: repeat(auto-fill, minmax(36px, 1fr)); gap: 2px; margin: 4px 0; }
#c-cards .c-strip img { margin: 0; }
#c-cards .c-card > img.c-heat { width: 50%; }
/* The A/B slider's two layers fill the same box (Gradio sized them 500 px tall, one centred in the 280 px
   frame, one at its top: identical images looked different). */
#c-ab .slider-wrap { height: 100%; }
#c-ab .slider-wrap img { position: absolute; inset: 0; width: 100%; height: 100%; max-height: none;
  object-fit: contain; margin: 0; image-rendering: pixelated; }
/* Compare's legend is HTML under the plot, wrapping (Vega's one row of entries was cut at the edge). */
#c-plot g.role-legend { display: none; }
#c-plot-legend .legend { display: flex; flex-wrap: wrap; gap: 4px 18px; font-size: 0.9em; }
#c-plot-legend .swatch { display: inline-block; width: 18px; height: 4px; margin-right: 6px; vertical-align: middle; }
/* Compare's price table in the page's font: a configuration's label fits its column on one line. */
#c-speedup [role=gridcell], #c-speedup [role=columnheader] { font-family: var(--font); font-variant-numeric: tabular-nums; }
/* Words stay whole in the System tab's tables (a link or a path may still break anywhere). */
#system td, #system th { overflow-wrap: normal; word-break: normal; hyphens: none; }
#system td a, #system td code { overflow-wrap: anywhere; }
/* A clip's frames wrap onto rows at any width (a fixed 9 columns cut the middle frames off on a phone). */
#video-frames .grid-container { grid-template-columns: repeat(auto-fill, minmax(48px, 1fr)) !important; }
/* A phone: the prompt, the run button and the output first, each output's buttons and timings right under it; the
   other settings follow. */
@media (max-width: 767px) {
  #gen-row, #video-row { flex-direction: column; }
  #gen-controls, #gen-output, #gen-image-row, #video-controls, #video-output { display: contents; }
  #gen-controls > .form:has(#prompt), #video-controls > .form:has(#video-prompt) { order: -9; }  /* Gradio wraps a textbox in a .form */
  #gen-buttons, #video-buttons { order: -8; }
  #output-image, #video-player { order: -7; }
  #output-image, #step-plot { flex: none; }  /* a row's items grow from 0: in a column that is their height */
  #edit-this, #edit-ab, #video-frames { order: -6; }
  #run-summary, #video-summary { order: -5; }
  #stats { order: -4; }
  #step-plot { order: -3; }
  /* tables wider than the phone scroll sideways inside their own box */
  #board, #c-speedup, #system { overflow-x: auto; }
  #c-speedup [role=columnheader] { word-break: normal; overflow-wrap: normal; white-space: nowrap; }
}
"""


# Gradio's queue statistics (for /monitoring) rebuild a table of recent events after every event while
# holding the GIL, so a server slows down as it ages (docs/hosting.md); a host who wants the dashboard sets
# these variables itself (then monitoring stays on).
QUEUE_STATISTICS_OFF = {"GRADIO_ANALYTICS_CACHE_FREQUENCY": str(10**9), "GRADIO_ANALYTICS_MAX_EVENTS": "1"}


def queue_statistics_off() -> bool:
    """Turn Gradio's per-event queue statistics off, unless the host configured them; True if off."""
    if settings.gradio_statistics_configured():
        return False
    os.environ.update(QUEUE_STATISTICS_OFF)
    return True


# Sessions whose state (a copy of every component's config, the board's last status) Gradio keeps; the
# oldest go first. Bounded because a client may mint session hashes at will (docs/hosting.md).
STATE_SESSIONS = 500


def launch_kwargs(theme: str | None = None, demo: gr.Blocks | None = None) -> dict:
    """Gradio 6 takes theme and css in launch(), not Blocks(). Its /monitoring dashboard is off while its
    statistics are (build_demo turns them off unless the host set them). With `demo`, its edge guard
    (ui/edge.py: body size, no uploads; ui/sockets.py: connections and headers) wraps the server, and nothing
    uploaded is ever kept."""
    monitoring = settings.gradio_analytics_cache_frequency() != QUEUE_STATISTICS_OFF[
        "GRADIO_ANALYTICS_CACHE_FREQUENCY"]
    kwargs = {"theme": theme or gr.themes.Soft(), "css": CSS, "enable_monitoring": monitoring,
              "state_session_capacity": STATE_SESSIONS,
              "max_file_size": MAX_UPLOAD_BYTES}  # input images (edits); ui/edge.py bounds the request
    guard = getattr(demo, "edge", None)
    if guard is not None:
        kwargs["app_kwargs"] = {"middleware": [guard.middleware()]}
        if guard.sockets is not None:
            install_server_hook()  # the server launch() builds serves this app with its socket bounds
    for route in (getattr(demo, "metrics", None), getattr(demo, "openai", None)):  # /metrics, /v1 (ui/openai_api.py)
        if route is not None:
            kwargs.setdefault("app_kwargs", {}).setdefault("middleware", []).append(route.middleware())
    return kwargs


def page_handlers(serving: Serving, defaults: UIDefaults | None, guard: EdgeGuard) -> PageHandlers:
    """Each page's own handlers, sharing one UIState (runs for /cancel, memoised keys, the device report)."""
    state = UIState(serving.cancel)
    pages = PageHandlers(*(kind(serving, defaults, state) for kind in PAGE_KINDS))
    for handlers in pages:
        handlers.edge = guard
    return pages


def build_demo(serving: Serving, defaults: UIDefaults | None = None, queue_size: int = 64,
               edge: EdgeConfig | None = None) -> gr.Blocks:
    """The app. `queue_size` bounds the events waiting for each action (beyond it users are told the
    queue is full); `edge`: the web edge's bounds (default: per-client bounds in public mode only)."""
    if edge is None:
        edge = EdgeConfig(client_events=CLIENT_EVENTS if serving.public() else None,
                          **({"sockets": public_bounds(), "bodies": public_body_bounds()} if serving.public() else {}))
    guard = EdgeGuard(EdgeConfig(**{**edge.__dict__, "group_queue": queue_size}))
    pages = page_handlers(serving, defaults, guard)
    h = pages.shared
    queue_statistics_off()  # read by Gradio's queue when demo.queue() creates it
    with gr.Blocks(title="Diffusion Showcase", delete_cache=(900, 3600), analytics_enabled=False) as demo:
        gr.Markdown(
            "# ⚡ Diffusion Showcase\n"
            "Diffusers pipelines kept **compiled and warm per resolution bucket** on every device — "
            "and what precision and compilation buy on this machine."
        )
        engine_line = gr.Markdown(elem_id="engine-line")
        ready = gr.State([])  # the engines ready now (the timer's tick): labels saying "loads a new engine" follow it
        with gr.Tabs() as tabs:
            form = generate.build(pages.generate, demo, engine_line, ready)
            generate_video.build(pages.generate, ready)  # clips from the video presets (ui/generate_video.py)
            buckets_tab = buckets.build(pages.buckets)
            compare.build(pages.compare)
            advisor.build(pages.advisor, form, tabs)
            system.build(pages.system)
        gr.api(h.cancel_api, api_name="cancel", concurrency_limit=None)  # runs of both Generate and Compare
        demo.advice_jobs = mcp.advisor_api(pages.advisor)  # the advisor as a start/poll pair (API and MCP tools)

        # One status read per second refreshes the board, the engine line and the size labels.
        last = gr.State({})
        gr.on([gr.Timer(h.defaults.poll_s).tick, demo.load], pages.buckets.tick,
              [*(form[name] for name in ("preset", "device", "precision", "mode")), last, form["tp"], form["memory"]],
              [buckets_tab.board, engine_line, form["size"], buckets_tab.engine, ready, last], **FAST)
    # Queue positions are sent every QUEUE_STATUS_S, not to every waiting event each time one starts (a burst
    # of n visitors made n²/2 messages at its start, when the web server is busiest).
    demo.queue(max_size=queue_size, status_update_rate=QUEUE_STATUS_S)
    poll_queue_less_often(demo)
    bound_sessions(demo, STATE_SESSIONS)  # Gradio's other per-session tables (ui/sessions.py)
    settle_queue_groups(demo)
    guard.install(demo)
    demo.edge = guard
    telemetry = getattr(serving, "telemetry", None)  # a stand-in serving in tests may have none
    if telemetry is not None:
        demo.metrics = MetricsRoute(telemetry, h.serving.public(), h.defaults.admin_token, edge=guard)
    demo.openai = OpenAIRoutes(h, ApiKeys(h.defaults.api_keys, h.defaults.admin_token, guard.keys), VideoJobs(h),
                               read_edit=read_edit_call)
    atexit.register(demo.openai.store.close)  # the images its "url" answers point at
    mcp.describe_tools(demo)
    return demo


# Gradio's idle queue loop polls every millisecond (Queue.sleep_when_free, not a public setting), and each
# wake-up preempts a request computing on that core; polling less often delays an event by at most this.
# The figures: docs/hosting.md.
QUEUE_POLL_S = 0.005
QUEUE_STATUS_S = 1.0


def queue_groups(demo: gr.Blocks) -> dict[str, dict[str, int | None]]:
    """Each concurrency group that several queued events share: {group: {event's api name: its limit}}."""
    queue = demo._queue
    groups: dict[str, dict[str, int | None]] = {}
    for index, fn in demo.fns.items():
        if not fn.queue:
            continue
        limit = queue.default_concurrency_limit if fn.concurrency_limit == "default" else fn.concurrency_limit
        groups.setdefault(fn.concurrency_id, {})[fn.api_name or f"fn {index}"] = limit
    return {group: events for group, events in groups.items() if len(events) > 1}


def settle_queue_groups(demo: gr.Blocks) -> None:
    """Gradio creates a group's queue at its first event and lowers the group's limit for good whenever an
    event with a lower limit joins (gradio/queueing.py `create_event_queue_for_fn`): one event of a lower
    limit, even one refused later by its handler, made the engines run one request at a time. So every
    event of a shared group has the same limit (else the app is not built), and the groups' queues are
    created now, with that limit, whatever joins first."""
    groups = queue_groups(demo)
    for group, events in groups.items():
        if len(set(events.values())) > 1:
            raise ValueError(f"queue group {group!r} mixes concurrency limits {events}: Gradio would keep the "
                             "lowest for every event of the group; give the event its own concurrency_id")
    for fn in demo.fns.values():
        if fn.queue and fn.concurrency_id in groups:
            demo._queue.create_event_queue_for_fn(fn)


def poll_queue_less_often(demo: gr.Blocks) -> None:
    queue = getattr(demo, "_queue", None)
    if queue is not None and isinstance(getattr(queue, "sleep_when_free", None), float):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
