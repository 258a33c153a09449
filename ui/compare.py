"""The Compare tab: one prompt on device x precision x mode x step-cache configurations, and /compare.

Every configuration is priced against eager fp32 without a step cache on the first device picked (run
first, and added when it is not among the picks): seconds per image, speedup, drift of every image
against the reference's image of the same prompt and seed (PSNR, max pixel difference) and, for a model
with a pixel checker, fidelity over several prompts. Drift and fidelity come from engine/bench/quality.py,
the bench's own code, through ui/views.py.
"""

from __future__ import annotations

import base64
import io
import time
from contextlib import ExitStack, closing
from itertools import product

import gradio as gr
import pandas as pd

from engine.config.validation import check_steps
from engine.errors import Cancelled, ShowcaseError
from engine.protocol import Mode, Precision, Size
from ui import views
from ui.common import ENGINE_QUEUE, FAST, HandlerBase, to_gradio_error
from ui.runs import HEARTBEAT_S

COST_WIDTHS = ["24%", "10%", "11%", "11%", "12%", "11%", "21%"]  # no header narrower than its longest word
MIN_CONFIGS, MAX_CONFIGS = 1, 6  # picked; the reference is added when it is not among them
MAX_FIDELITY_PROMPTS = 32
DEFAULT_FIDELITY_PROMPTS = 8
THUMBNAIL_PX = 256
COMPARE_API_DOC = (
    "Run the same prompt, seed, size and steps on every device x precision x mode x step cache picked (1-6), "
    "plus eager fp32 without a step cache as the reference. Returns (images, results): one captioned image per "
    "configuration, and results JSON: per configuration its timings, seconds per image, speedup against the "
    "reference, drift (PSNR, largest pixel difference) and, on a model with a checker, fidelity; a failed "
    "configuration carries its error. /cancel stops it between steps.")


def thumbnail_uri(image) -> str:
    """A PNG data: URI of the image, at most THUMBNAIL_PX on its longer side (the cards are small)."""
    image = image.copy()
    image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class CompareHandlers(HandlerBase):
    def compare_defaults(self, preset: str):
        """Preset changed: its buckets, steps and guidance."""
        sizes = self.preset_sizes(preset)
        p = self.manager.preset(preset)
        return (gr.update(choices=sizes, value=sizes[0] if sizes else None), gr.update(value=p.steps),
                gr.update(value=p.guidance))

    def compare_caches(self, preset: str, devices, modes):
        """The step caches the picked preset, devices and modes can use; unusable ones say why."""
        choices: dict[str, str] = {}
        for device in devices or ["auto"]:
            for mode in modes or ["eager"]:
                for label, value in views.step_cache_choices(self.step_cache_rows(preset, device, mode)):
                    if value not in choices or " · unavailable" in choices[value]:
                        choices[value] = label
        return gr.update(choices=[(label, value) for value, label in choices.items()])

    def _configs(self, devices, precisions, modes, caches) -> tuple[list[str], str, bool]:
        """(every configuration, the reference first; the reference label; whether it was picked)."""
        picked = [views.config_label(d, p, m, c) for d, p, m, c in
                  product(devices or [], precisions or [], modes or [], caches or [views.NO_CACHE])]
        if not MIN_CONFIGS <= len(picked) <= MAX_CONFIGS:
            raise gr.Error(
                f"pick {MIN_CONFIGS}–{MAX_CONFIGS} configurations (device × precision × mode × step cache); "
                f"these choices make {len(picked)}", title="Invalid request")
        for p in precisions:
            if p not in Precision.values():
                raise gr.Error(f"unknown precision {p!r}; choose from {', '.join(Precision.values())}",
                               title="Invalid request")
        reference = views.reference_label(devices[0])
        return [reference, *(c for c in picked if c != reference)], reference, reference in picked

    def compare(self, prompt, preset, size, steps, guidance, seed, devices, precisions, modes,
                wait_for_warm=True, caches=None, fidelity_prompts=DEFAULT_FIDELITY_PROMPTS,
                request: gr.Request = None, progress=gr.Progress()):  # noqa: B008
        """The same prompt, seed, size and steps on every device × precision × mode × step cache picked
        (1–6), plus eager fp32 without a cache on the first device when it is not among them.

        Streams (gallery, results, thumbnails) at the start and after each configuration; results =
        {"configs", "done", "reference", "results": [...as_dict() + config, image_ms, drift, fidelity, bucket
        costs], "speedup": speedup_table rows}; thumbnails: the cards' images as data: URIs, by image_index
        (a State: the cards never read the gallery's files back). A configuration that fails is reported,
        the others still run.
        """
        configs, reference, picked = self._configs(devices, precisions, modes, caches)
        try:
            size_text = str(Size.parse(size)) if size else str(self.manager.preset(preset).buckets[0])
            model = self.manager.preset(preset)
            steps_total = check_steps(steps) if steps else model.steps
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        n_samples = max(0, min(MAX_FIDELITY_PROMPTS, int(fidelity_prompts or 0))) if views.has_checker(model) else 0
        # The main prompt, then the sample prompts (seeded: every configuration draws the same ones).
        prompts = [prompt, *views.fidelity_sample_prompts(model, n_samples, fallback=prompt)]
        seeds = [seed, *(1000 + i for i in range(n_samples))]
        runs_each = len(prompts)
        note = ("the reference, picked" if picked else
                "the reference, added: every speedup and drift is measured against it")
        results: list[dict] = []
        gallery: list[tuple] = []
        thumbnails: list[str] = []
        ref_images: list | None = None

        def payload(done: bool = False):
            return {"configs": configs, "done": done, "reference": reference, "results": results,
                    "speedup": views.speedup_table(results)}

        caller = self.caller(request)
        with ExitStack() as stack:
            try:  # public mode: one running request per visitor
                run = stack.enter_context(self.open_run(request))
            except ShowcaseError as exc:
                raise to_gradio_error(exc) from None
            yield gallery, payload(), thumbnails  # the page shows this comparison from now on
            for index, config in enumerate(configs):
                if run.cancelled:
                    results.append({"config": config, "error": "cancelled before it started"})
                    continue
                device, precision, mode, cache = views.parse_config(config)
                last_yield = time.perf_counter()
                outcomes = []
                try:
                    key = self.key_for(preset, device, precision, caller=caller)
                    for i, (text, sample_seed) in enumerate(zip(prompts, seeds, strict=True)):
                        started = time.perf_counter()
                        kwargs = dict(preset=preset, device=device, precision=precision, mode=mode, size=size_text,
                                      prompt=text, negative_prompt=None, steps=steps_total, guidance=guidance,
                                      seed=sample_seed, on_cold="wait" if wait_for_warm else "eager")
                        if cache != views.NO_CACHE:
                            kwargs["step_cache"] = cache
                        desc = f"{config}: " if i == 0 else f"{config} fidelity prompt {i}/{n_samples}: "
                        with closing(self.runs.stream(
                            run, key, progress, desc_prefix=desc, offset=(index * runs_each + i) * steps_total,
                            grand_total=len(configs) * runs_each * steps_total, caller=caller, **kwargs,
                        )) as stream:
                            for kind, item in stream:
                                if kind == "done":
                                    outcomes.append((item, time.perf_counter() - started))
                                elif time.perf_counter() - last_yield >= HEARTBEAT_S:
                                    last_yield = time.perf_counter()
                                    yield gr.skip(), gr.skip(), gr.skip()  # a heartbeat: Gradio can close the handler here
                except ShowcaseError as exc:
                    if isinstance(exc, Cancelled):
                        gr.Warning(str(exc), title="Cancelled", duration=4)
                    results.append({"config": config, "error": str(exc), "reference": config == reference})
                    yield gallery, payload(), thumbnails
                    continue
                except Exception as exc:
                    results.append({"config": config, "error": f"internal error ({type(exc).__name__})"})
                    yield gallery, payload(done=True), thumbnails  # settled, so it is not taken for a cancel
                    raise to_gradio_error(exc) from None
                result, elapsed = outcomes[0]
                waited_s = max(0.0, elapsed - result.timings.total_ms / 1000)
                entry = {**result.as_dict(), "config": config, "waited_s": waited_s,
                         "image_ms": [r.timings.total_ms for r, _ in outcomes]}
                if config == reference:
                    entry.update(reference=True, reference_note=note)
                bucket = views.find_bucket(self.manager.status(), entry["engine"], mode, entry["bucket"])
                if bucket:
                    entry.update(compile_s=bucket.get("compile_s"), warmup_s=bucket.get("warmup_s"),
                                 bucket_state=bucket.get("state"), cache_hits=bucket.get("cache_hits"))
                images = [r.image() for r, _ in outcomes]
                if config == reference:
                    ref_images = images
                entry.update(views.price_quality(images, prompts, None if config == reference else ref_images,
                                                 model))
                entry["image_index"] = len(gallery)
                results.append(entry)
                caption = " · ".join(filter(None, [
                    config, f"{views.per_image_s(entry):.3f} s / image",
                    f"drift {entry['drift']}" if entry.get("drift") else "",
                    f"fidelity {views.fmt_fidelity(entry)}" if "fidelity" in entry else "",
                    "eager fallback" if result.eager_fallback else ""]))
                gallery.append((images[0], caption))
                thumbnails.append(thumbnail_uri(images[0]))
                yield gallery, payload(), thumbnails
        yield gallery, payload(done=True), thumbnails
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

    def render_compare(self, payload: dict | None, thumbnails: list[str] | None = None):
        """Cards and tables after every configuration; the plot once, when the comparison is done.
        `thumbnails`: compare's third output, the cards' images by image_index.

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
            frame, order = views.steps_as_labels(frame)
            plot = gr.update(value=frame, colors_in_legend=series, color_map=views.series_colors(series), sort=order,
                             y_aggregate="mean" if order else None)  # labelled steps: one value per step and series
        else:
            plot = gr.skip()
        price = pd.DataFrame(views.price_rows(results), columns=views.PRICE_COLUMNS)
        costs = pd.DataFrame(views.cost_rows(results), columns=views.COST_COLUMNS)
        thumbnails = thumbnails or []
        uris = []
        for r in results:
            i = r.get("image_index")
            uris.append(thumbnails[i] if i is not None and i < len(thumbnails) else None)
        return plot, price, costs, views.compare_cards_html(results, uris)


def build(h: CompareHandlers) -> None:
    """The tab (inside gr.Tabs), its events and the /compare API."""
    preset = h.default_preset()
    report = h.devices_report()
    sizes = [str(s) for s in preset.buckets]
    available = [r["name"] for r in report if r.get("available")]
    with gr.Tab("Compare", id="compare"):
        gr.Markdown("The same prompt, seed, size and steps on 1–6 configurations (device × precision × mode × "
                    "step cache), one after another, each priced against **eager fp32 without a step cache** "
                    "(run first; added when not picked): seconds per image, speedup, drift of every image "
                    "against the reference's, and for the embedded model the checker's fidelity over "
                    "several prompts.")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
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
                with gr.Row():
                    seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="c-seed")
                    fidelity = gr.Slider(0, MAX_FIDELITY_PROMPTS, value=DEFAULT_FIDELITY_PROMPTS, step=1,
                                         label="Fidelity prompts (models with a checker)",
                                         elem_id="c-fidelity-prompts")
            with gr.Column(scale=2, min_width=420):
                # The buttons and the run's progress first: the cards start below a laptop screen's fold.
                with gr.Row():
                    compare_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
                    cancel_btn = gr.Button("Cancel", variant="stop", elem_id="c-cancel-btn")
                status = gr.Markdown("Its progress shows here; each configuration's card, price and costs below.",
                                     elem_id="c-status")
                devices = gr.CheckboxGroup(views.device_choices(report, short=True)[1:], value=available[:1],
                                           label="Devices", elem_id="c-devices")
                precisions = gr.CheckboxGroup(h.precision_choices(), value=["fp32"], label="Precisions",
                                              elem_id="c-precisions")
                modes = gr.CheckboxGroup(list(Mode.values()), value=["eager", "regional"], label="Modes",
                                         elem_id="c-modes")
                cache_choices = views.step_cache_choices(
                    h.step_cache_rows(preset.name, (available or ["cpu"])[0], "eager"))
                caches = gr.CheckboxGroup(cache_choices or [views.NO_CACHE], value=[views.NO_CACHE],
                                          label="Step caches (unavailable ones say why)", elem_id="c-caches")
                wait = gr.Checkbox(True, label="Wait for compiled buckets (their compile cost is "
                                   "measured); off: cold buckets run eagerly", elem_id="c-wait")

        cards = gr.HTML(elem_id="c-cards", label="Each configuration")
        speed = gr.Dataframe(headers=views.PRICE_COLUMNS, interactive=False, wrap=True,
                             column_widths=views.PRICE_WIDTHS, label="Price of each configuration",
                             elem_id="c-speedup")
        gr.Markdown("s / image: median over the configuration's images (the prompt and the fidelity prompts); "
                    "× vs eager fp32: the reference's s / image ÷ this; drift: the worst PSNR and largest pixel "
                    "difference (0–255) against the reference's image of the same prompt and seed; fidelity: "
                    "prompts the pixel checker reads as drawn right; steps computed / cached: the step cache's "
                    "share. Cached steps are their own series on the plot.")
        # Each the page's full width: the legend names every series, no costs header breaks inside a word.
        plot = gr.LinePlot(x="step", y="step_ms", color="config", title="Per-step latency",
                           x_title="step", y_title="ms", color_title="", height=320, elem_id="c-plot")
        costs = gr.Dataframe(headers=views.COST_COLUMNS, interactive=False, wrap=True,
                             column_widths=COST_WIDTHS, label="Compile and warm-up costs", elem_id="c-costs")
        with gr.Accordion("Images at full size", open=False):
            gallery = gr.Gallery(label="Images", columns=4, height=260, elem_id="c-gallery", type="pil",
                                 object_fit="contain")
        with gr.Accordion("Results JSON", open=False):
            results = gr.JSON(elem_id="c-json", label="results", show_label=False)
        thumbnails = gr.State([])

    preset_dd.change(h.compare_defaults, preset_dd, [size, steps, guidance], **FAST)
    gr.on([preset_dd.change, devices.change, modes.change], h.compare_caches, [preset_dd, devices, modes], caches,
          **FAST)
    run = compare_btn.click(
        h.compare, [prompt, preset_dd, size, steps, guidance, seed, devices, precisions, modes, wait, caches,
                    fidelity],
        [gallery, results, thumbnails], api_name="compare", api_description=COMPARE_API_DOC, concurrency_id=ENGINE_QUEUE,
        concurrency_limit=h.run_slots(), show_progress="full", show_progress_on=[status, cards],
    )
    # Gradio closes the running handler; closing it cancels the engine request between steps.
    cancel_btn.click(None, cancels=[run])
    run.then(h.compare_ended, results, results, **FAST)
    # Not the gallery as an input: Gradio would read its image files back from the shared upload folder, where
    # another process saving an identical image (same content hash, same path) can leave one half-written.
    results.change(h.render_compare, [results, thumbnails], [plot, speed, costs, cards], **FAST)
