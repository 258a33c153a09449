"""The Compare tab: one prompt on device x precision x mode x step-cache configurations, and /compare.

Every configuration is priced against eager fp32 without a step cache on the first device picked (run
first, and added when it is not among the picks): seconds per image, speedup, drift of every image
against the reference's image of the same prompt and seed (PSNR, SSIM, max pixel difference, a heat map)
and, for a model with a pixel checker, fidelity over several prompts. Drift and fidelity come from
bench/quality.py, the bench's own code, through ui/compare_views.py. On a video preset every configuration
runs the same clip (its frames and fps) and is measured frame by frame against the reference's clip, with the
temporal flicker (ui/compare_clips.py). One handler call's run, its form and phases, is ui/compare_run.py.

The configurations are a typed list (bench/configs.py: "eager/fp32; regional/bf16/first-block:0.2")
or the cross product of the checkboxes. Each is run first for its quality images, which also warm it
(compile and warm-up reported apart); then all are timed round-robin with the reference by the bench's
paired plan (bench/paired.py) until each speedup's spread is known or the timing budget ends.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from itertools import product

import gradio as gr
import pandas as pd

import bench.configs as explicit
from engine.errors import ShowcaseError
from engine.protocol import Mode, Precision, params, parse_lora
from ui import compare_ab, compare_clips, compare_run, compare_views, edit_inputs, views
from ui.common import ENGINE_QUEUE, FAST, HandlerBase, describe_input, to_gradio_error
from ui.compare_run import CompareCall, CompareForm, Comparison

COST_WIDTHS = ["24%", "10%", "11%", "11%", "12%", "11%", "21%"]  # no header narrower than its longest word
MIN_CONFIGS, MAX_CONFIGS = 1, 6  # picked; the reference is added when it is not among them
COMPARE_API_DOC = (
    "Run the same prompt, seed, size and steps on 1-6 configurations: the typed list `configurations` "
    "(\"mode/precision[/step cache][+lora=NAME[:SCALE]][@device]\" separated by \";\", e.g. \"eager/fp32; "
    "compile/fp32; compile/fp32+lora=swap\": one card per adapter), "
    "or else every device x precision x mode x step cache picked, plus eager fp32 without a step cache as the "
    "reference. Each configuration draws its quality images first (they warm it), then all are timed "
    "round-robin with the reference for up to `timing_s` seconds. Returns (images, results): one captioned "
    "image per configuration, and results JSON: per configuration its timings, seconds per image, speedup "
    "against the reference with its spread and image count, drift (PSNR, SSIM, largest pixel difference) and, "
    "on a model with a checker, fidelity; a configuration that cannot run or fails carries a short reason. "
    "On a video preset (num_frames, fps) each configuration runs that clip: seconds per clip, and clip_drift "
    "against eager fp32's clip frame by frame (frame_psnr_db, frame_ssim, worst_frame, median_psnr_db, max_diff) "
    "with flicker: the mean change, in pixel levels, of its difference to the reference from one frame to the next. "
    "/cancel stops it between steps.")


COMPARE_FIELDS = tuple(f.name for f in fields(CompareForm))
# What each /compare parameter takes, for its API schema (view_api, the MCP tool): the lists' values are
# also in their types.
COMPARE_API_PARAMS = {
    "prompt": "what every configuration draws",
    "preset": "a model preset (/system lists those a visitor may choose)",
    "size": "WIDTHxHEIGHT, one of the preset's buckets (null: its first)",
    "steps": "denoising steps, 1-200 (null: the preset's default)",
    "guidance": "guidance scale, 0-50 (null: the preset's default)",
    "seed": "an integer >= 0: every configuration draws this seed",
    "devices": "devices to run on (null: the first available); /system says which are available here",
    "precisions": "precisions to run at; with devices, modes, caches, loras and levers, their cross product is "
                  f"the configurations ({MIN_CONFIGS}-{MAX_CONFIGS})",
    "modes": "modes to run in (compiled modes compile their bucket first)",
    "wait_for_warm": "true: wait for each compiled bucket (its compile reported apart); false: a cold bucket "
                     "runs eagerly",
    "caches": "step caches ('none': without one; each one a configuration can run)",
    "fidelity_prompts": "extra prompts each configuration draws for fidelity and drift, "
                        f"0-{compare_run.MAX_FIDELITY_PROMPTS}",
    "configurations": "a typed list replacing the lists above: mode/precision[/step cache][+lora=NAME[:SCALE]"
                      "[:fused]][+mem=LEVERS][@device] separated by ';', e.g. 'eager/fp32; compile/fp32' "
                      "('' for the lists' cross product)",
    "timing_s": f"seconds of round-robin timing after the quality images, 0-{compare_run.MAX_TIMING_S:g}",
    "loras": "LoRA styles: 'none', NAME or NAME:fused (fused: eager only), one configuration each",
    "levers": "memory lever sets ('none' for the engine as it is), one configuration each",
    "images": "presets that edit: the source (and references) every configuration edits, handle_file(PATH) each",
    # a video preset's clip: each configuration's, as its field declaration says (image presets take none)
    **{name: params.BY_NAME[name].describe() for name in compare_clips.CLIP_FIELDS},
}
# The Compare tab's memory lever sets (any other set: a typed entry's +mem=); one the device cannot run gets a
# card saying why.
MEMORY_CHOICES = ["none", "layerwise:fp8", "group:block:1:disk", "group:leaf", "model-offload",
                  "sequential-offload", "encoders:cpu", "vae-slicing"]


class CompareHandlers(HandlerBase):
    def compare_defaults(self, preset: str):
        """Preset changed: its buckets, steps and guidance."""
        sizes = self.preset_sizes(preset)
        p = self.serving.preset(preset)
        return (gr.update(choices=sizes, value=sizes[0] if sizes else None), gr.update(value=p.steps),
                gr.update(value=p.guidance))

    def compare_clip_fields(self, preset: str):
        """Preset changed: the clip fields (frames, fps) shown, with its first frame bucket and rate, only where
        the family takes them (their declarations)."""
        try:
            p = self.serving.preset(preset)
        except ShowcaseError:
            return gr.update(visible=False), gr.skip(), gr.skip()
        if not compare_clips.takes_clips(p):
            return gr.update(visible=False), gr.skip(), gr.skip()
        return gr.update(visible=True), gr.update(value=p.frames[0]), gr.update(value=p.fps)

    def compare_loras(self, preset: str):
        """Preset changed: its LoRA styles, unfused and fused."""
        try:
            return gr.update(choices=compare_views.compare_lora_choices(self.serving.preset(preset),
                                                                self.serving.lora_slot()), value=["none"])
        except ShowcaseError:
            return gr.update(choices=[("none", "none")], value=["none"])

    def compare_caches(self, preset: str, devices, modes):
        """The step caches the picked preset, devices and modes can use; unusable ones say why."""
        choices: dict[str, str] = {}
        for device in devices or ["auto"]:
            for mode in modes or ["eager"]:
                for label, value in views.step_cache_choices(self.step_cache_rows(preset, device, mode)):
                    if value not in choices or " · unavailable" in choices[value]:
                        choices[value] = label
        return gr.update(choices=[(label, value) for value, label in choices.items()])

    def default_device(self, devices) -> str:
        """The comparison's device when an entry names none: the first device ticked, else the first available."""
        if devices:
            return devices[0]
        available = [r["name"] for r in self.devices_report() if r.get("available")]
        return available[0] if available else "cpu"

    def _configs(self, devices, precisions, modes, caches, configurations: str = "", loras=None, levers=None
                 ) -> tuple[list[str], str, bool]:
        """(every configuration, the reference first; the reference label; whether it was picked). A typed
        list (`configurations`) replaces the checkboxes' cross product."""
        if str(configurations or "").strip():
            try:
                typed = explicit.parse_configurations(configurations)
            except ValueError as exc:
                raise gr.Error(str(exc), title="Invalid request", print_exception=False) from None
            device = self.default_device(devices)
            picked = list(dict.fromkeys(compare_views.typed_label(c, device) for c in typed))
            what, reference_device = "listed", device
            chips = list(dict.fromkeys(compare_views.parse_config(c)[0] for c in picked))  # across chips: each its own
            own = [compare_views.reference_label(chip) for chip in chips if chip != device] if len(chips) > 1 else []
        else:
            try:
                styles = [explicit.lora_suffix(parse_lora(text)) for text in loras or ["none"]]
                mems = [explicit.memory_suffix(explicit.split_levers(f"+mem={text}")[1]) for text in levers or ["none"]]
            except (ShowcaseError, ValueError) as exc:
                raise gr.Error(str(exc), title="Invalid request", print_exception=False) from None
            picked = [compare_views.config_label(d, p, m, c, style + mem) for d, p, m, c, style, mem in
                      product(devices or [], precisions or [], modes or [], caches or [views.NO_CACHE], styles, mems)]
            what, reference_device = "device × precision × mode × step cache × LoRA × memory", (devices or [None])[0]
            own = []
            for p in precisions or []:
                if p not in Precision.values():
                    raise gr.Error(f"unknown precision {p!r}; choose from {', '.join(Precision.values())}",
                                   title="Invalid request", print_exception=False)
        if not MIN_CONFIGS <= len(picked) <= MAX_CONFIGS:
            raise gr.Error(
                f"pick {MIN_CONFIGS}–{MAX_CONFIGS} configurations ({what}); these choices make {len(picked)}",
                title="Invalid request", print_exception=False)
        reference = compare_views.reference_label(reference_device)
        picked += [c for c in own if c not in picked]  # each other chip's eager fp32, priced against too
        return [reference, *(c for c in picked if c != reference)], reference, reference in picked

    def refusal(self, preset: str, config: str) -> str | None:
        """Why a configuration cannot run here, by the engine's own checks (None: it can)."""
        device, precision, mode, cache = compare_views.parse_config(config)
        lora = explicit.split_lora(config)[1]
        try:
            spec = self.serving.device_spec(device)
            return explicit.refusal(self.serving.preset(preset), spec,
                                    explicit.Configuration(mode, precision, cache, None, lora,
                                                           explicit.split_levers(config)[1]),
                                    loras=self.serving.lora_slot())
        except ShowcaseError as exc:
            return explicit.first_line(str(exc))
        except ValueError as exc:  # a mode or precision this engine does not know
            return explicit.first_line(str(exc))

    def check_configurations(self, preset: str, devices, configurations: str) -> str:
        """Markdown under the typed list: each configuration and whether it can run here, or the form's error."""
        if not str(configurations or "").strip():
            return ""
        try:
            typed = explicit.parse_configurations(configurations)
        except ValueError as exc:
            return f"✗ {exc}"
        device = self.default_device(devices)
        lines = []
        for c in typed:
            label = compare_views.typed_label(c, device)
            why = self.refusal(preset, label)
            lines.append(f"- ✗ `{label}`: {why}" if why else f"- ✓ `{label}`")
        return "\n".join(lines)

    def configuration_list(self, which: str, preset: str, devices, size, steps) -> str:
        """A ready-made list for the typed field: the levers one at a time, or the Advisor's frontier (from its
        saved result for this preset, device, size and steps)."""
        if which not in explicit.LISTS:
            return gr.skip()
        device = self.default_device(devices)
        try:
            spec = self.serving.device_spec(device)
            model = self.serving.preset(preset)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        if which == explicit.FRONTIER:
            size_text = str(size or model.buckets[0])
            found = explicit.saved_frontier(self.serving.cache_dir, model.name, spec.name, size_text,
                                            int(steps or model.steps))
            if not found:
                raise gr.Error(f"no Advisor result for {model.name} on {spec.name} at {size_text}, "
                               f"{int(steps or model.steps)} steps: run the Advisor tab with these settings first",
                               title="Nothing to load")
            return "; ".join(c.text() for c in found[:MAX_CONFIGS])
        return "; ".join(c.text() for c in explicit.levers_one_at_a_time(model, spec, MAX_CONFIGS))

    def compare(self, request: gr.Request = None, progress=gr.Progress(), **form):  # noqa: B008
        """The same prompt, seed, size and steps on every configuration (1–6): the typed list
        `configurations` ("mode/precision[/step cache][+lora=NAME[:SCALE][:fused]][@device]; ...",
        bench/configs.py: one entry per adapter gives one card per style) or else every device ×
        precision × mode × step cache × LoRA style picked, plus eager fp32 without a cache on the first device when it is
        not among them. `form`: CompareForm's fields by name.

        Each configuration first draws its quality images (the prompt, then the fidelity prompts), which warm
        it; then every configuration is timed round-robin with the reference for up to `timing_s` seconds
        (bench/paired.py). Streams (gallery, results, thumbnails) at the start and after each
        configuration and round; results = {"configs", "done", "reference", "timing", "results": [...as_dict()
        + config, image_ms (timed), warmup_image_ms, speedup_figure, drift, fidelity, bucket costs],
        "speedup": speedup_table rows}; thumbnails: the cards' images and heat maps as data: URIs, by
        image_index / heatmap_index. A configuration that cannot run here or fails is reported with a short
        reason; the others still run.
        """
        f = CompareForm(**form)
        configs = self._configs(f.devices, f.precisions, f.modes, f.caches, f.configurations, f.loras, f.levers)
        refused = {c: why for c in configs[0] if (why := self.refusal(f.preset, c))}
        call = CompareCall(self.caller(request), self.client_of(request), partial(self.open_run, request),
                           self.key_for, self.run_feed, configs, refused)
        yield from Comparison(self.serving, f, call, progress).run()

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
        return {**payload, "done": True, "results": results, "speedup": compare_views.speedup_table(results)}

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
        frame = views.step_frame(compare_views.compare_step_rows(results), compare_views.COMPARE_STEP_COLUMNS)
        if payload.get("done", True):
            series = list(dict.fromkeys(frame["config"]))
            frame, order = compare_views.steps_as_labels(frame)
            colors = compare_views.series_colors(series)
            plot = gr.update(value=frame, colors_in_legend=series, color_map=colors, sort=order,
                             y_aggregate="mean" if order else None)  # labelled steps: one value per step and series
            legend = compare_views.legend_html(colors)
        else:
            plot = legend = gr.skip()
        price = pd.DataFrame(compare_views.price_rows(results), columns=compare_views.PRICE_COLUMNS)
        costs = pd.DataFrame(compare_views.cost_rows(results), columns=compare_views.COST_COLUMNS)
        thumbnails = thumbnails or []

        def uri(r: dict, key: str):
            i = r.get(key)
            return thumbnails[i] if i is not None and i < len(thumbnails) else None

        strips = [[(thumbnails[i], caption) for i, caption in r.get("strip", []) if i < len(thumbnails)]
                  for r in results]  # a clip card's frames
        cards = compare_views.compare_cards_html(results, [uri(r, "image_index") for r in results],
                                                 heatmaps=[uri(r, "heatmap_index") for r in results], strips=strips)
        return plot, price, costs, cards, legend


def build(h: CompareHandlers) -> None:
    """The tab (inside gr.Tabs), its events and the /compare API."""
    page = ComparePage(h)
    with gr.Tab("Compare", id="compare"):
        gr.Markdown("The same prompt, seed, size and steps on 1–6 configurations (device × precision × mode × "
                    "step cache, or a typed list), each priced against **eager fp32 without a step cache** "
                    "(run first; added when not picked): each draws its quality images first (which warm it), "
                    "then all are timed round-robin with the reference until every speedup's spread is known. "
                    "Seconds per image, speedup with its spread, drift of every image against the reference's "
                    "(with a heat map of the difference), and for the embedded model the checker's fidelity "
                    "over several prompts. On a video preset each configuration runs the same clip (frames, fps): "
                    "its card shows the frames, seconds per clip and per frame, the VAE decode's share, its drift "
                    "against eager fp32's clip frame by frame (median and worst frame) and its **flicker**: how "
                    "much its difference to the reference changes from one frame to the next.")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                page.image_settings()
            with gr.Column(scale=2, min_width=420):
                page.configurations()
        page.results()
    page.wire()


class ComparePage:
    """The Compare tab's widgets, built part by part, then its events. `form` holds /compare's inputs by
    CompareForm field: the handler takes them by name."""

    def __init__(self, h: CompareHandlers):
        self.h = h
        self.preset = h.default_preset()
        self.report = h.devices_report()
        self.form: dict[str, gr.components.Component] = {}

    def image_settings(self) -> None:
        """What every configuration draws: prompt, preset, size, steps, guidance, seed, fidelity prompts."""
        h, preset, form = self.h, self.preset, self.form
        sizes = [str(s) for s in preset.buckets]
        form["prompt"] = gr.Textbox(label="Prompt", value=preset.example_prompt, lines=2, elem_id="c-prompt")
        with gr.Row():
            form["preset"] = gr.Dropdown(h.serving.visitor_presets(), value=preset.name, label="Model preset",
                                         elem_id="c-preset")
            form["size"] = gr.Dropdown(sizes, value=sizes[0], label="Size", allow_custom_value=True,
                                       elem_id="c-size")
        form["images"] = edit_inputs.compare_images(preset.inputs.takes_images)
        self.capture = edit_inputs.capture_input("c-capture", preset.inputs.takes_images)  # joins the images
        clip = compare_clips.takes_clips(preset)
        # A video preset's clip, every configuration's. 0: the preset's own (a value, so /compare's callers may
        # leave them out: gradio_client requires a parameter whose default is None).
        with gr.Row(visible=clip) as self.clip_row:
            form["num_frames"] = gr.Number(value=preset.frames[0] if clip else 0, precision=0, elem_id="c-frames",
                                           label=params.label("num_frames") + " (snapped to a frame bucket)")
            form["fps"] = gr.Number(value=preset.fps if clip else 0, precision=0, label=params.label("fps"),
                                    elem_id="c-fps")
        with gr.Row():
            form["steps"] = gr.Slider(1, 200, value=preset.steps, step=1, label="Steps", elem_id="c-steps")
            form["guidance"] = gr.Slider(0.0, 50.0, value=preset.guidance, step=0.1, label="Guidance",
                                         elem_id="c-guidance")
        with gr.Row():
            form["seed"] = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="c-seed")
            form["fidelity_prompts"] = gr.Slider(0, compare_run.MAX_FIDELITY_PROMPTS,
                                                 value=compare_run.DEFAULT_FIDELITY_PROMPTS, step=1,
                                                 label="Fidelity prompts (models with a checker)",
                                                 elem_id="c-fidelity-prompts")

    def configurations(self) -> None:
        """The buttons and the run's progress first (the cards start below a laptop screen's fold), then the
        configurations: the checkboxes' cross product, or a typed list."""
        h, form = self.h, self.form
        available = [r["name"] for r in self.report if r.get("available")]
        with gr.Row():
            self.compare_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
            self.cancel_btn = gr.Button("Cancel", variant="stop", elem_id="c-cancel-btn")
        self.status = gr.Markdown("Its progress shows here; each configuration's card, price and costs below.",
                                  elem_id="c-status")
        form["devices"] = gr.CheckboxGroup(views.device_choices(self.report, short=True)[1:], value=available[:1],
                                           label="Devices", elem_id="c-devices")
        form["precisions"] = gr.CheckboxGroup(h.precision_choices(), value=["fp32"], label="Precisions",
                                              elem_id="c-precisions")
        form["modes"] = gr.CheckboxGroup(list(Mode.values()), value=["eager", "regional"], label="Modes",
                                         elem_id="c-modes")
        cache_choices = views.step_cache_choices(
            h.step_cache_rows(self.preset.name, (available or ["cpu"])[0], "eager"))
        form["caches"] = gr.CheckboxGroup(cache_choices or [views.NO_CACHE], value=[views.NO_CACHE],
                                          label="Step caches (unavailable ones say why)", elem_id="c-caches")
        form["loras"] = gr.CheckboxGroup(compare_views.compare_lora_choices(self.preset, h.serving.lora_slot()),
                                         value=["none"], label="LoRA styles (one card per style; fused: eager only)",
                                         elem_id="c-loras")
        form["levers"] = gr.CheckboxGroup(MEMORY_CHOICES, value=["none"], label="Memory levers (one card per set, "
                                          "GiB beside seconds; one this device cannot run says why)",
                                          elem_id="c-levers")
        form["wait_for_warm"] = gr.Checkbox(True, label="Wait for compiled buckets (their compile cost is "
                                            "measured); off: cold buckets run eagerly", elem_id="c-wait")
        form["configurations"] = gr.Textbox(
            label="Configurations (replaces the checkboxes when filled): mode/precision[/step cache]"
                  "[+lora=NAME[:SCALE][:fused]][+mem=LEVERS][@device], separated by ; — e.g. eager/fp32; "
                  "compile/fp32; regional/bf16; eager/fp32/first-block:0.2; compile/fp32+lora=swap; "
                  "eager/fp32+mem=layerwise:fp8", value="", lines=2, elem_id="c-configs")
        with gr.Row():
            self.config_list = gr.Dropdown(list(explicit.LISTS), value=None, label="Fill in a list",
                                           elem_id="c-config-list")
            form["timing_s"] = gr.Slider(0, 120, value=compare_run.DEFAULT_TIMING_S, step=5, label="Timing budget (s): "
                                         "round-robin rounds after the quality images", elem_id="c-timing")
        self.config_check = gr.Markdown(elem_id="c-config-check")

    def results(self) -> None:
        self.cards = gr.HTML(elem_id="c-cards", label="Each configuration")
        self.ab_choice, self.ab_slider = compare_ab.add()
        self.speed = gr.Dataframe(headers=compare_views.PRICE_COLUMNS, interactive=False, wrap=True, max_height=1400,
                                  column_widths=compare_views.PRICE_WIDTHS, label="Price of each configuration",
                                  elem_id="c-speedup")
        gr.Markdown("s / image: median of the configuration's timed images; × vs eager fp32: the median of the "
                    "reference's time ÷ this one's, each pair timed in the same round-robin round (the start "
                    "rotating, every configuration warm first), with its interquartile range and the number of "
                    "images; a range across 1.0× reads \"no measurable difference here\"; a figure is marked "
                    "when a compile, another engine's work or a host load spike ran during it; drift: the worst PSNR and largest pixel "
                    "difference (0–255) against the reference's image of the same prompt and seed; fidelity: "
                    "prompts the pixel checker reads as drawn right; steps computed / cached: the step cache's "
                    "share. Cached steps are their own series on the plot. A clip: s / clip with ms per frame; "
                    "its drift is the worst frame's, and flicker is the mean |Δframe − Δframe of eager fp32| in "
                    "pixel levels (0: a difference that stays put; more: one that shimmers from frame to frame).")
        # Each the page's full width: the legend names every series, no costs header breaks inside a word.
        self.plot = gr.LinePlot(x="step", y="step_ms", color="config", title="Per-step latency",
                                x_title="step", y_title="ms", color_title="", height=320, elem_id="c-plot")
        self.legend = gr.HTML(elem_id="c-plot-legend")  # Vega's own legend is hidden (ui/blocks.py CSS)
        self.costs = gr.Dataframe(headers=compare_views.COST_COLUMNS, interactive=False, wrap=True,
                                  column_widths=COST_WIDTHS, label="Compile and warm-up costs", elem_id="c-costs")
        with gr.Accordion("Images at full size", open=False):
            self.gallery = gr.Gallery(label="Images", columns=4, height=260, elem_id="c-gallery", type="pil",
                                      object_fit="contain")
        with gr.Accordion("Results JSON", open=False):
            self.results_json = gr.JSON(elem_id="c-json", label="results", show_label=False)
        self.thumbnails = gr.State([])

    def wire(self) -> None:
        h, f = self.h, self.form
        f["preset"].change(h.compare_defaults, f["preset"], [f["size"], f["steps"], f["guidance"]], **FAST)
        f["preset"].change(h.compare_loras, f["preset"], f["loras"], **FAST)
        f["preset"].change(h.compare_clip_fields, f["preset"], [self.clip_row, f["num_frames"], f["fps"]], **FAST)
        for shown in (f["images"], self.capture):
            f["preset"].change(edit_inputs.EditInputs(h).takes_images, f["preset"], shown, **FAST)
        self.capture.change(edit_inputs.EditInputs.add_capture, [self.capture, f["images"]],
                            [f["images"], self.capture], **FAST)
        self.config_list.input(h.configuration_list, [self.config_list, f["preset"], f["devices"], f["size"],
                                                      f["steps"]], f["configurations"], **FAST)
        gr.on([f["configurations"].change, f["preset"].change, f["devices"].change], h.check_configurations,
              [f["preset"], f["devices"], f["configurations"]], self.config_check, **FAST)
        gr.on([f["preset"].change, f["devices"].change, f["modes"].change], h.compare_caches,
              [f["preset"], f["devices"], f["modes"]], f["caches"], **FAST)
        results = self.results_json
        run = self.compare_btn.click(
            h.compare, None, [self.gallery, results, self.thumbnails],
            inputs_kwargs={name: f[name] for name in COMPARE_FIELDS}, api_name="compare",
            api_description=COMPARE_API_DOC, concurrency_id=ENGINE_QUEUE, concurrency_limit=h.run_slots(),
            show_progress="full", show_progress_on=[self.status, self.cards],
        )
        # Gradio closes the running handler; closing it cancels the engine request between steps.
        self.cancel_btn.click(None, cancels=[run])
        run.then(h.compare_ended, results, results, **FAST)
        for name, allowed in COMPARE_API_PARAMS.items():
            describe_input(f[name], allowed)
        # Not the gallery as an input: Gradio would read its image files back from the shared upload folder,
        # where another process saving an identical image (same content hash, same path) can leave one
        # half-written.
        results.change(h.render_compare, [results, self.thumbnails],
                       [self.plot, self.speed, self.costs, self.cards, self.legend], **FAST)
        compare_ab.wire(self.ab_choice, self.ab_slider, results, self.thumbnails)
