"""The Gradio Blocks app: Generate, Buckets, Compare and System tabs on one EngineManager.

Wiring only: every handler lives in ui/handlers.py, every table and label in ui/views.py.

API (gradio_client): /generate, /cancel, /compare, /status, /warm, /restart, /system. UI-only
events (timer ticks, redraws, settings changes) are private.
"""

from __future__ import annotations

import gradio as gr

from engine.errors import ShowcaseError
from engine.protocol import Mode, Precision
from ui import views
from ui.handlers import Handlers, UIDefaults

DEFAULT_PROMPT = "a red fox in the snow, golden hour"
CSS = """
#output-image img { image-rendering: pixelated; object-fit: contain; }
#engine-line { min-height: 1.6em; }
#board { font-variant-numeric: tabular-nums; }
"""
ENGINE_QUEUE = "engines"  # generate and compare share one queue: they occupy the devices
# The /generate API's parameters, in the handler's order (Handlers.generate).
GENERATE_API_PARAMS = ("prompt", "negative_prompt", "preset", "device", "precision", "mode", "size", "steps",
                       "guidance", "seed", "on_cold", "tp")


def launch_kwargs(theme: str | None = None) -> dict:
    """Gradio 6 takes theme and css in launch(), not Blocks()."""
    return {"theme": theme or gr.themes.Soft(), "css": CSS}


def build_demo(manager, defaults: UIDefaults | None = None, queue_size: int = 64,
               handlers: Handlers | None = None) -> gr.Blocks:
    """The app. `queue_size` bounds waiting events (beyond it users are told the queue is full)."""
    h = handlers or Handlers(manager, defaults)
    d = h.defaults
    report = h.devices_report()
    # One request at a time per device runs in its worker; this many handler slots keep every
    # available device busy while further requests wait in Gradio's queue with their position shown.
    device_slots = max(1, sum(1 for r in report if r.get("available")))
    try:
        preset = manager.preset(d.preset)
    except ShowcaseError:
        preset = next(iter(manager.presets.values()))
    sizes = [str(s) for s in preset.buckets]
    modes = h.device_modes(d.device)

    with gr.Blocks(title="Diffusion Showcase", delete_cache=(900, 3600), analytics_enabled=False) as demo:
        gr.Markdown(
            "# ⚡ Diffusion Showcase\n"
            "Diffusers pipelines kept **compiled and warm per resolution bucket** on every device — "
            "and what precision and compilation buy on this machine."
        )
        engine_line = gr.Markdown(elem_id="engine-line")
        tick_state = gr.State({})

        with gr.Tabs():
            # -- Generate ------------------------------------------------------------------------
            with gr.Tab("Generate", id="generate"):
                with gr.Row():
                    with gr.Column(scale=2, min_width=320):
                        prompt = gr.Textbox(label="Prompt", value=DEFAULT_PROMPT, lines=2, elem_id="prompt")
                        negative = gr.Textbox(label="Negative prompt", lines=1, visible=preset.negative_prompt,
                                              elem_id="negative-prompt")
                        with gr.Row():
                            preset_dd = gr.Dropdown(h.preset_names(), value=preset.name, allow_custom_value=True,
                                                    label="Model preset (or a Hub id / local diffusers folder)",
                                                    elem_id="preset")
                            device_dd = gr.Dropdown(views.device_choices(report), value=d.device, label="Device",
                                                    elem_id="device")
                        with gr.Row():
                            precision_dd = gr.Dropdown(list(Precision.values()), value=d.precision, label="Precision",
                                                       elem_id="precision")
                            mode_dd = gr.Dropdown(modes, value=d.mode if d.mode in modes else "eager", label="Mode",
                                                  elem_id="mode")
                        size_dd = gr.Dropdown(views.size_choices(sizes, d.mode, None), value=sizes[0],
                                              label="Resolution bucket", allow_custom_value=True, elem_id="size")
                        steps = gr.Slider(1, 200, value=preset.steps, step=1, label="Steps", elem_id="steps")
                        guidance = gr.Slider(0.0, 50.0, value=preset.guidance, step=0.1, label="Guidance",
                                             elem_id="guidance")
                        with gr.Row():
                            seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
                            randomize = gr.Checkbox(False, label="New random seed each run", elem_id="randomize")
                        tp_dd = gr.Dropdown([1, 2, 4, 8], value=d.tp, label="Tensor-parallel ranks "
                                            "(>1: torchrun sidecar; presets with a TP plan)", elem_id="tp")
                        on_cold = gr.Radio([("serve eagerly now", "eager"), ("wait for its compile", "wait")],
                                           value=d.on_cold, label="At a bucket that is not warm yet", elem_id="on-cold")
                        with gr.Row():
                            generate_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn")
                            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel-btn")
                        with gr.Accordion("Devices on this machine", open=False):
                            gr.Markdown(views.device_notes(report))
                    with gr.Column(scale=3, min_width=420):
                        with gr.Row(equal_height=True):
                            image = gr.Image(label="Image", type="pil", format="png", interactive=False, height=300,
                                             elem_id="output-image", buttons=["download"])
                            step_plot = gr.LinePlot(x="step", y="step_ms", title="Per-step latency of this run",
                                                    x_title="step", y_title="ms", height=280, elem_id="step-plot")
                        stats = gr.Dataframe(headers=views.STATS_COLUMNS, interactive=False, label="Timings",
                                             elem_id="stats", wrap=True, column_widths=["32%", "68%"])
                        with gr.Accordion("Timings JSON (the CLI's --json)", open=False):
                            timings = gr.JSON(elem_id="timings-json")

            # -- Buckets -------------------------------------------------------------------------
            with gr.Tab("Buckets", id="buckets"):
                gr.Markdown("Every bucket of every loaded engine, refreshed every second. "
                            "Click a row to pick it, then warm it (compile + warm-up run in the engine's "
                            "worker process; the page keeps working).")
                board = gr.Dataframe(headers=views.BOARD_COLUMNS, interactive=False, elem_id="board", wrap=True,
                                     label="Bucket board")
                with gr.Row():
                    board_engine = gr.Dropdown([], label="Engine", elem_id="board-engine", allow_custom_value=True)
                    board_mode = gr.Dropdown([m for m in Mode.values() if m != "eager"], value="regional", label="Mode",
                                             elem_id="board-mode")
                    board_size = gr.Dropdown(sizes, value=sizes[0], label="Size", allow_custom_value=True,
                                             elem_id="board-size")
                with gr.Row():
                    warm_btn = gr.Button("Warm bucket", variant="primary", elem_id="warm-btn")
                    warm_all_btn = gr.Button("Warm all buckets", elem_id="warm-all-btn")
                    restart_btn = gr.Button("Restart engine", elem_id="restart-btn")

            # -- Compare -------------------------------------------------------------------------
            with gr.Tab("Compare", id="compare"):
                gr.Markdown("The same prompt, seed, size and steps on 2–4 configurations "
                            "(device × precision × mode), one after another.")
                with gr.Row():
                    with gr.Column(scale=2, min_width=320):
                        c_prompt = gr.Textbox(label="Prompt", value=DEFAULT_PROMPT, lines=2, elem_id="c-prompt")
                        with gr.Row():
                            c_preset = gr.Dropdown(h.preset_names(), value=preset.name, label="Model preset",
                                                   elem_id="c-preset")
                            c_size = gr.Dropdown(sizes, value=sizes[0], label="Size", allow_custom_value=True,
                                                 elem_id="c-size")
                        with gr.Row():
                            c_steps = gr.Slider(1, 200, value=preset.steps, step=1, label="Steps", elem_id="c-steps")
                            c_guidance = gr.Slider(0.0, 50.0, value=preset.guidance, step=0.1, label="Guidance",
                                                   elem_id="c-guidance")
                        c_seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="c-seed")
                        available = [r["name"] for r in report if r.get("available")]
                        c_devices = gr.CheckboxGroup(views.device_choices(report, short=True)[1:], value=available[:1],
                                                     label="Devices", elem_id="c-devices")
                        c_precisions = gr.CheckboxGroup(list(Precision.values()), value=[d.precision], label="Precisions",
                                                        elem_id="c-precisions")
                        c_modes = gr.CheckboxGroup(list(Mode.values()), value=["eager", "regional"], label="Modes",
                                                   elem_id="c-modes")
                        c_wait = gr.Checkbox(True, label="Wait for compiled buckets (their compile cost is "
                                             "measured); off: cold buckets run eagerly", elem_id="c-wait")
                        with gr.Row():
                            compare_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
                            c_cancel_btn = gr.Button("Cancel", variant="stop", elem_id="c-cancel-btn")
                    with gr.Column(scale=3, min_width=420):
                        c_gallery = gr.Gallery(label="Images", columns=4, height=220, elem_id="c-gallery",
                                               object_fit="contain")
                        c_plot = gr.LinePlot(x="step", y="step_ms", color="config", title="Per-step latency",
                                             x_title="step", y_title="ms", height=280, elem_id="c-plot")
                        c_speed = gr.Dataframe(headers=views.SPEEDUP_COLUMNS, interactive=False,
                                               label="Speedup against eager on the same engine", elem_id="c-speedup")
                        gr.Markdown("× step: eager median step ÷ this median step; × total: the same for the whole "
                                    "image; break-even: images until the compile and warm-up cost is paid back.")
                        c_costs = gr.Dataframe(headers=views.COST_COLUMNS, interactive=False, wrap=True,
                                               label="Compile and warm-up costs", elem_id="c-costs")
                        with gr.Accordion("Results JSON", open=False):
                            c_json = gr.JSON(elem_id="c-json")

            # -- System --------------------------------------------------------------------------
            with gr.Tab("System", id="system") as system_tab:
                refresh_btn = gr.Button("Refresh", size="sm", elem_id="system-refresh")
                system_md = gr.Markdown("Loading…", elem_id="system")

        # -- API-only inputs -----------------------------------------------------------------
        # /generate takes every parameter as plain text, so *our* validation answers bad input
        # with the field's name and what to change (Gradio's slider/dropdown checks say neither).
        with gr.Column(visible=False):
            api_defaults = {"prompt": DEFAULT_PROMPT, "preset": preset.name, "device": d.device,
                            "precision": d.precision, "mode": d.mode, "seed": "0", "on_cold": d.on_cold,
                            "tp": str(d.tp)}  # size/steps/guidance: "" means the preset's default
            api_inputs = [gr.Textbox(value=api_defaults.get(name, ""), visible=False, label=name)
                          for name in GENERATE_API_PARAMS]
            api_image = gr.Image(type="pil", format="png", visible=False)
            api_timings = gr.JSON(visible=False)
            api_button = gr.Button(visible=False)


        # -- events ------------------------------------------------------------------------------
        fast = dict(concurrency_limit=None, api_visibility="private", show_progress="hidden")
        gen_inputs = [prompt, negative, preset_dd, device_dd, precision_dd, mode_dd, size_dd, steps, guidance, seed,
                      on_cold, tp_dd]
        generate_btn.click(h.randomize_seed, [seed, randomize], seed, queue=False, api_visibility="private").then(
            h.generate, gen_inputs, [image, timings], api_name="generate_ui", api_visibility="private",
            concurrency_id=ENGINE_QUEUE,
            concurrency_limit=device_slots, show_progress="full", show_progress_on=[image],
        )
        api_button.click(h.generate, api_inputs, [api_image, api_timings], api_name="generate",
                         concurrency_id=ENGINE_QUEUE, concurrency_limit=device_slots)
        timings.change(h.render_run, timings, [step_plot, stats], **fast)
        cancel_btn.click(h.cancel_clicked, None, None, api_name="cancel", concurrency_limit=None, show_progress="hidden")
        c_cancel_btn.click(h.cancel_clicked, None, None, api_visibility="private", concurrency_limit=None,
                           show_progress="hidden")

        preset_dd.change(h.preset_defaults, preset_dd, [negative, steps, guidance], **fast)
        for control in (preset_dd, device_dd, precision_dd, mode_dd, tp_dd):
            control.change(h.select_engine, [preset_dd, device_dd, precision_dd, mode_dd, size_dd, tp_dd],
                           [engine_line, size_dd, mode_dd], **fast)

        # The engine the settings point at starts with the page (app.py has usually started it already).
        demo.load(h.select_engine, [preset_dd, device_dd, precision_dd, mode_dd, size_dd, tp_dd],
                  [engine_line, size_dd, mode_dd], **fast)
        timer = gr.Timer(d.poll_s)
        tick_io = dict(inputs=[preset_dd, device_dd, precision_dd, mode_dd, tick_state, tp_dd],
                       outputs=[board, engine_line, size_dd, board_engine, tick_state])
        timer.tick(h.tick, **tick_io, **fast)
        demo.load(h.tick, **tick_io, **fast)

        board.select(h.board_select, None, [board_engine, board_mode, board_size], **fast)
        board_engine.change(lambda e: gr.update(choices=_engine_sizes(h, e)), board_engine, board_size, **fast)
        warm_btn.click(h.warm_from_board, [board_engine, board_mode, board_size], None, **fast)
        warm_all_btn.click(lambda e, m: h.warm_from_board(e, m, "all"), [board_engine, board_mode], None, **fast)
        restart_btn.click(h.restart, board_engine, None, api_name="restart_from_board", **fast)

        c_preset.change(lambda p: _preset_compare_defaults(h, p), c_preset, [c_size, c_steps, c_guidance], **fast)
        compare_btn.click(
            h.compare, [c_prompt, c_preset, c_size, c_steps, c_guidance, c_seed, c_devices, c_precisions, c_modes,
                        c_wait],
            [c_gallery, c_json], api_name="compare", concurrency_id=ENGINE_QUEUE, concurrency_limit=device_slots,
            show_progress="full", show_progress_on=[c_gallery],
        )
        c_json.change(h.render_compare, c_json, [c_plot, c_speed, c_costs], **fast)

        system_tab.select(h.system_panel, None, system_md, **fast)
        refresh_btn.click(lambda: _system_refresh(h), None, system_md, **fast)

        # API-only endpoints (typed; no components).
        gr.api(h.status_api, api_name="status", concurrency_limit=None)
        gr.api(h.warm_api, api_name="warm", concurrency_limit=None)
        gr.api(h.restart_api, api_name="restart", concurrency_limit=None)
        gr.api(h.system_api, api_name="system", concurrency_limit=None)

    demo.queue(max_size=queue_size)
    return demo


def _engine_sizes(h: Handlers, engine: str) -> list[str]:
    preset = (engine or "").split("@", 1)[0]
    return h.preset_sizes(preset) if preset in h.manager.presets else []


def _preset_compare_defaults(h: Handlers, preset: str):
    sizes = h.preset_sizes(preset)
    p = h.manager.preset(preset)
    return gr.update(choices=sizes, value=sizes[0] if sizes else None), gr.update(value=p.steps), \
        gr.update(value=p.guidance)


def _system_refresh(h: Handlers) -> str:
    from ui.system import system_markdown

    return system_markdown(h.system(refresh=True))
