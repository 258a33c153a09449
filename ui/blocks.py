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
from ui import advisor, buckets, compare, generate, mcp, system
from ui.common import FAST
from ui.edge import CLIENT_EVENTS, EdgeConfig, EdgeGuard
from ui.generate import GENERATE_API_PARAMS
from ui.handlers import Handlers, UIDefaults
from ui.metrics import MetricsRoute
from ui.openai_api import ApiKeys, OpenAIRoutes
from ui.sockets import install_server_hook, public_bounds

__all__ = ["GENERATE_API_PARAMS", "build_demo", "launch_kwargs"]

CSS = """
#output-image img { image-rendering: pixelated; object-fit: contain; }
#history img { image-rendering: pixelated; }
#history .grid-container { grid-template-columns: repeat(auto-fill, minmax(120px, 180px)) !important; }
/* Wide screens: the output column stays in view while the controls scroll; a phone stacks the columns. */
@media (min-width: 1024px) {
  #gen-output { position: sticky; top: 8px; align-self: flex-start; }
}
#run-summary { min-height: 2.4em; font-variant-numeric: tabular-nums; }
#a-status { min-height: 3.2em; }
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
              "state_session_capacity": STATE_SESSIONS, "max_file_size": 1}
    guard = getattr(demo, "edge", None)
    if guard is not None:
        kwargs["app_kwargs"] = {"middleware": [guard.middleware()]}
        if guard.sockets is not None:
            install_server_hook()  # the server launch() builds serves this app with its socket bounds
    for route in (getattr(demo, "metrics", None), getattr(demo, "openai", None)):  # /metrics, /v1 (ui/openai_api.py)
        if route is not None:
            kwargs.setdefault("app_kwargs", {}).setdefault("middleware", []).append(route.middleware())
    return kwargs


def build_demo(manager, defaults: UIDefaults | None = None, queue_size: int = 64,
               handlers: Handlers | None = None, edge: EdgeConfig | None = None) -> gr.Blocks:
    """The app. `queue_size` bounds the events waiting for each action (beyond it users are told the
    queue is full); `edge`: the web edge's bounds (default: per-client bounds in public mode only)."""
    h = handlers or Handlers(manager, defaults)
    if edge is None:
        edge = EdgeConfig(client_events=CLIENT_EVENTS if manager.policy.public else None,
                          **({"sockets": public_bounds()} if manager.policy.public else {}))
    guard = EdgeGuard(EdgeConfig(**{**edge.__dict__, "group_queue": queue_size}))
    h.edge = guard
    queue_statistics_off()  # read by Gradio's queue when demo.queue() creates it
    with gr.Blocks(title="Diffusion Showcase", delete_cache=(900, 3600), analytics_enabled=False) as demo:
        gr.Markdown(
            "# ⚡ Diffusion Showcase\n"
            "Diffusers pipelines kept **compiled and warm per resolution bucket** on every device — "
            "and what precision and compilation buy on this machine."
        )
        engine_line = gr.Markdown(elem_id="engine-line")
        with gr.Tabs() as tabs:
            settings = generate.build(h, demo, engine_line)
            buckets_tab = buckets.build(h)
            compare.build(h)
            advisor.build(h, settings, tabs)
            system.build(h)
        gr.api(h.cancel_api, api_name="cancel", concurrency_limit=None)  # runs of both Generate and Compare
        demo.advice_jobs = mcp.advisor_api(h)  # the advisor as a start/poll pair (API and MCP tools)

        # One status read per second refreshes the board, the engine line and the size labels.
        last = gr.State({})
        gr.on([gr.Timer(h.defaults.poll_s).tick, demo.load], h.tick,
              [settings.preset, settings.device, settings.precision, settings.mode, last, settings.tp],
              [buckets_tab.board, engine_line, settings.size, buckets_tab.engine, last], **FAST)
    # Queue positions are sent every QUEUE_STATUS_S, not to every waiting event each time one starts (a burst
    # of n visitors made n²/2 messages at its start, when the web server is busiest).
    demo.queue(max_size=queue_size, status_update_rate=QUEUE_STATUS_S)
    poll_queue_less_often(demo)
    guard.install(demo)
    demo.edge = guard
    telemetry = getattr(manager, "telemetry", None)
    if telemetry is not None:
        demo.metrics = MetricsRoute(telemetry, h.public, h.defaults.admin_token, edge=guard)
    demo.openai = OpenAIRoutes(h, ApiKeys(h.defaults.api_keys, h.defaults.admin_token))
    atexit.register(demo.openai.close)  # the images its "url" answers point at
    mcp.describe_tools(demo)
    return demo


# Gradio's idle queue loop polls every millisecond (Queue.sleep_when_free, not a public setting), and each
# wake-up preempts a request computing on that core; polling less often delays an event by at most this.
# The figures: docs/hosting.md.
QUEUE_POLL_S = 0.005
QUEUE_STATUS_S = 1.0


def poll_queue_less_often(demo: gr.Blocks) -> None:
    queue = getattr(demo, "_queue", None)
    if queue is not None and isinstance(getattr(queue, "sleep_when_free", None), float):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
