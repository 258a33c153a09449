"""The Gradio Blocks app: a header, the Generate, Buckets, Compare and System tabs, one shared timer.

Each tab builds its components and wires its events in its own module; this one puts them
together. API (gradio_client): /generate, /cancel, /compare, /status, /warm, /restart, /system.
UI-only events (timer ticks, redraws, settings changes) are private.
"""

from __future__ import annotations

import gradio as gr

from ui import buckets, compare, generate, system
from ui.common import FAST
from ui.generate import GENERATE_API_PARAMS
from ui.handlers import Handlers, UIDefaults

__all__ = ["GENERATE_API_PARAMS", "build_demo", "launch_kwargs"]

CSS = """
#output-image img { image-rendering: pixelated; object-fit: contain; }
#engine-line { min-height: 1.6em; }
#board { font-variant-numeric: tabular-nums; }
"""


def launch_kwargs(theme: str | None = None) -> dict:
    """Gradio 6 takes theme and css in launch(), not Blocks()."""
    return {"theme": theme or gr.themes.Soft(), "css": CSS}


def build_demo(manager, defaults: UIDefaults | None = None, queue_size: int = 64,
               handlers: Handlers | None = None) -> gr.Blocks:
    """The app. `queue_size` bounds waiting events (beyond it users are told the queue is full)."""
    h = handlers or Handlers(manager, defaults)
    with gr.Blocks(title="Diffusion Showcase", delete_cache=(900, 3600), analytics_enabled=False) as demo:
        gr.Markdown(
            "# ⚡ Diffusion Showcase\n"
            "Diffusers pipelines kept **compiled and warm per resolution bucket** on every device — "
            "and what precision and compilation buy on this machine."
        )
        engine_line = gr.Markdown(elem_id="engine-line")
        with gr.Tabs():
            settings = generate.build(h, demo, engine_line)
            board = buckets.build(h)
            compare.build(h)
            system.build(h)
        gr.api(h.cancel_api, api_name="cancel", concurrency_limit=None)  # runs of both Generate and Compare

        # One status read per second refreshes the board, the engine line and the size labels.
        last = gr.State({})
        gr.on([gr.Timer(h.defaults.poll_s).tick, demo.load], h.tick,
              [settings.preset, settings.device, settings.precision, settings.mode, last, settings.tp],
              [board.board, engine_line, settings.size, board.engine, last], **FAST)
    demo.queue(max_size=queue_size)
    return demo
