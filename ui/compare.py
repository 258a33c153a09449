"""The Compare tab: one prompt on 2-4 configurations (device x precision x mode), and the /compare API.

The speedup rows come from the benchmark's own speedup_table (via ui.views), so the UI, the CLI
bench and docs/benchmarks.md agree.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, closing
from itertools import product

import gradio as gr
import pandas as pd

from engine.errors import Cancelled, ShowcaseError
from engine.protocol import Mode, Precision, Size
from ui import views
from ui.common import ENGINE_QUEUE, FAST, HandlerBase, session_id, to_gradio_error
from ui.runs import HEARTBEAT_S

MIN_CONFIGS, MAX_CONFIGS = 2, 4


class CompareHandlers(HandlerBase):
    def compare_defaults(self, preset: str):
        """Preset changed: its buckets, steps and guidance."""
        sizes = self.preset_sizes(preset)
        p = self.manager.preset(preset)
        return (gr.update(choices=sizes, value=sizes[0] if sizes else None), gr.update(value=p.steps),
                gr.update(value=p.guidance))

    def compare(self, prompt, preset, size, steps, guidance, seed, devices, precisions, modes,
                wait_for_warm=True, request: gr.Request = None, progress=gr.Progress()):  # noqa: B008
        """The same prompt, seed, size and steps on every device × precision × mode picked (2–4 runs).

        Streams (gallery, results) at the start and after each configuration; results = {"configs", "done",
        "results": [...as_dict() + config and bucket costs], "speedup": speedup_table rows}. A
        configuration that fails is reported, the others still run.
        """
        configs = [views.config_label(d, p, m)
                   for d, p, m in product(devices or [], precisions or [], modes or [])]
        if not MIN_CONFIGS <= len(configs) <= MAX_CONFIGS:
            raise gr.Error(
                f"pick {MIN_CONFIGS}–{MAX_CONFIGS} configurations (device × precision × mode); "
                f"these choices make {len(configs)}", title="Invalid request")
        for p in precisions:
            if p not in Precision.values():
                raise gr.Error(f"unknown precision {p!r}; choose from {', '.join(Precision.values())}",
                               title="Invalid request")
        try:
            size_text = str(Size.parse(size)) if size else str(self.manager.preset(preset).buckets[0])
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        steps_total = int(steps) if steps else self.manager.preset(preset).steps
        results: list[dict] = []
        gallery: list[tuple] = []

        def payload(done: bool = False):
            return {"configs": configs, "done": done, "results": results,
                    "speedup": views.speedup_table(results)}

        caller = self.caller(request)
        with ExitStack() as stack:
            try:  # public mode: one running request per visitor
                run = stack.enter_context(self.runs.open(session_id(request), exclusive=self.public))
            except ShowcaseError as exc:
                raise to_gradio_error(exc) from None
            yield gallery, payload()  # the page shows this comparison from now on
            for index, config in enumerate(configs):
                if run.cancelled:
                    results.append({"config": config, "error": "cancelled before it started"})
                    continue
                device, precision, mode = config.split("/")
                started = last_yield = time.perf_counter()
                result = None
                try:
                    key = self.key_for(preset, device, precision, caller=caller)
                    with closing(self.runs.stream(
                        run, key, progress, desc_prefix=f"{config}: ", offset=index * steps_total,
                        grand_total=len(configs) * steps_total, caller=caller,
                        preset=preset, device=device, precision=precision, mode=mode, size=size_text,
                        prompt=prompt, negative_prompt=None, steps=steps_total, guidance=guidance, seed=seed,
                        on_cold="wait" if wait_for_warm else "eager",
                    )) as stream:
                        for kind, item in stream:
                            if kind == "done":
                                result = item
                            elif time.perf_counter() - last_yield >= HEARTBEAT_S:
                                last_yield = time.perf_counter()
                                yield gr.skip(), gr.skip()  # a heartbeat: Gradio can close the handler here
                except ShowcaseError as exc:
                    if isinstance(exc, Cancelled):
                        gr.Warning(str(exc), title="Cancelled", duration=4)
                    results.append({"config": config, "error": str(exc)})
                    yield gallery, payload()
                    continue
                except Exception as exc:
                    results.append({"config": config, "error": f"internal error: {exc}"})
                    yield gallery, payload(done=True)  # settled, so it is not taken for a cancel
                    raise to_gradio_error(exc) from None
                waited_s = max(0.0, time.perf_counter() - started - result.timings.total_ms / 1000)
                entry = {**result.as_dict(), "config": config, "waited_s": waited_s}
                bucket = views.find_bucket(self.manager.status(), entry["engine"], mode, entry["bucket"])
                if bucket:
                    entry.update(compile_s=bucket.get("compile_s"), warmup_s=bucket.get("warmup_s"),
                                 bucket_state=bucket.get("state"), cache_hits=bucket.get("cache_hits"))
                image = result.image()
                first_image = next((g[0] for g in gallery), None)
                quality = views.image_quality(image, first_image, self.manager.preset(key.preset), prompt)
                entry.update(quality)
                results.append(entry)
                caption = " · ".join(filter(None, [
                    config, f"{result.timings.total_ms:.0f} ms", "eager fallback" if result.eager_fallback else "",
                    views.quality_caption(quality)]))
                gallery.append((image, caption))
                yield gallery, payload()
        yield gallery, payload(done=True)
        if all(r.get("error") for r in results):
            failures = "; ".join(f"{r['config']}: {r['error']}" for r in results)
            raise gr.Error(f"every configuration failed: {failures}", title="Compare failed")

    def compare_ended(self, payload: dict | None):
        """After the Compare event, however it ended. Results not "done" mean Gradio closed the handler
        (the Cancel button): the configurations without a result are marked cancelled, and it is done."""
        if not payload or payload.get("done", True):
            return gr.skip()
        finished = {r.get("config") for r in payload.get("results", [])}
        missing = [c for c in payload.get("configs", []) if c not in finished]
        results = [*payload.get("results", []),
                   *({"config": c, "error": "cancelled" if i == 0 else "cancelled before it started"}
                     for i, c in enumerate(missing))]
        gr.Warning(f"cancelled: {', '.join(missing) or 'nothing'} left without a result", title="Cancelled",
                   duration=4)
        return {**payload, "done": True, "results": results, "speedup": views.speedup_table(results)}

    def render_compare(self, payload: dict | None):
        """Tables after every configuration; the plot once, when the comparison is done.

        A LinePlot rebuilds its colour scale only when certain props change, not when a new series
        arrives in the data. Measured in Chromium: updating colors_in_legend rebuilds it (color_map
        alone does not), but two rebuilds in quick succession race and the older one can win, so the
        plot is drawn once per comparison, with every series.
        """
        payload = payload or {}
        results = payload.get("results", [])
        frame = views.step_frame(views.compare_step_rows(results), views.COMPARE_STEP_COLUMNS)
        if payload.get("done", True):
            series = list(dict.fromkeys(frame["config"]))
            plot = gr.update(value=frame, colors_in_legend=series, color_map=views.series_colors(series))
        else:
            plot = gr.skip()
        speed = pd.DataFrame(views.speedup_display_rows(views.speedup_table(results)),
                             columns=views.SPEEDUP_COLUMNS)
        costs = pd.DataFrame(views.cost_rows(results), columns=views.COST_COLUMNS)
        return plot, speed, costs


def build(h: CompareHandlers) -> None:
    """The tab (inside gr.Tabs), its events and the /compare API."""
    d = h.defaults
    preset = h.default_preset()
    report = h.devices_report()
    sizes = [str(s) for s in preset.buckets]
    with gr.Tab("Compare", id="compare"):
        gr.Markdown("The same prompt, seed, size and steps on 2–4 configurations "
                    "(device × precision × mode), one after another.")
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                prompt = gr.Textbox(label="Prompt", value=preset.example_prompt, lines=2, elem_id="c-prompt")
                with gr.Row():
                    preset_dd = gr.Dropdown(h.preset_names(), value=preset.name, label="Model preset",
                                            elem_id="c-preset")
                    size = gr.Dropdown(sizes, value=sizes[0], label="Size", allow_custom_value=True,
                                       elem_id="c-size")
                with gr.Row():
                    steps = gr.Slider(1, 200, value=preset.steps, step=1, label="Steps", elem_id="c-steps")
                    guidance = gr.Slider(0.0, 50.0, value=preset.guidance, step=0.1, label="Guidance",
                                         elem_id="c-guidance")
                seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="c-seed")
                available = [r["name"] for r in report if r.get("available")]
                devices = gr.CheckboxGroup(views.device_choices(report, short=True)[1:], value=available[:1],
                                           label="Devices", elem_id="c-devices")
                precisions = gr.CheckboxGroup(list(Precision.values()), value=[d.precision],
                                              label="Precisions", elem_id="c-precisions")
                modes = gr.CheckboxGroup(list(Mode.values()), value=["eager", "regional"], label="Modes",
                                         elem_id="c-modes")
                wait = gr.Checkbox(True, label="Wait for compiled buckets (their compile cost is "
                                   "measured); off: cold buckets run eagerly", elem_id="c-wait")
                with gr.Row():
                    compare_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
                    cancel_btn = gr.Button("Cancel", variant="stop", elem_id="c-cancel-btn")
            with gr.Column(scale=3, min_width=420):
                gallery = gr.Gallery(label="Images", columns=4, height=220, elem_id="c-gallery",
                                     object_fit="contain")
                plot = gr.LinePlot(x="step", y="step_ms", color="config", title="Per-step latency",
                                   x_title="step", y_title="ms", height=280, elem_id="c-plot")
                speed = gr.Dataframe(headers=views.SPEEDUP_COLUMNS, interactive=False,
                                     label="Speedup against eager on the same engine", elem_id="c-speedup")
                gr.Markdown("× step: eager median step ÷ this median step; × total: the same for the whole "
                            "image; break-even: images until the compile and warm-up cost is paid back.")
                costs = gr.Dataframe(headers=views.COST_COLUMNS, interactive=False, wrap=True,
                                     label="Compile and warm-up costs", elem_id="c-costs")
                with gr.Accordion("Results JSON", open=False):
                    results = gr.JSON(elem_id="c-json")

    preset_dd.change(h.compare_defaults, preset_dd, [size, steps, guidance], **FAST)
    run = compare_btn.click(
        h.compare, [prompt, preset_dd, size, steps, guidance, seed, devices, precisions, modes, wait],
        [gallery, results], api_name="compare", concurrency_id=ENGINE_QUEUE,
        concurrency_limit=h.run_slots(), show_progress="full", show_progress_on=[gallery],
    )
    # Gradio closes the running handler; closing it cancels the engine request between steps.
    cancel_btn.click(None, cancels=[run])
    run.then(h.compare_ended, results, results, **FAST)
    results.change(h.render_compare, results, [plot, speed, costs], **FAST)
