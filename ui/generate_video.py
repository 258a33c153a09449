"""Generate's video mode, shown in a tab of its own ("Video"): a clip from a video preset (text to video, or image
to video from a source image as the first frame, shown only for presets that take one), played
(gr.Video), its frames side by side, and the same figures as Generate (per-step plot, stages with the VAE decode's
share, recompiles, peak memory); `/generate_video` for gradio_client and the MCP tool of that name.

The run is Generate's (ui/generate.py: the one gate, the event stream, cancel between steps), with the clip's
MP4 saved where Gradio serves outputs from (ui/webtemp.py: bounded, removed at shutdown) and its frames read
back from it, so the strip shows what the player plays.
"""

from __future__ import annotations

from contextlib import closing

import gradio as gr
from gradio.utils import get_upload_folder

from engine.errors import ShowcaseError
from engine.protocol import Task, params
from engine.serving import stream
from ui import edit_inputs, generate_views, views, webtemp
from ui.common import ENGINE_QUEUE, FAST, to_gradio_error
from ui.generate import (
    DECLARED,
    GenerateHandlers,
    api_allowed,
    api_file,
    api_text,
    declared_shown,
    declared_widgets,
)
from ui.runs import ProgressBar

# The tab's fields and /generate_video's parameters, in FIELDS' order (gradio_client callers pass them
# positionally; FIELDS is append-only): the declared fields a video family can take (params.clip_fields).
VIDEO_FIELDS = params.clip_fields()
# Those the tab builds no widget of its own for (a negative prompt, a newly declared field): made from the declaration.
VIDEO_DECLARED = tuple(f for f in DECLARED if f.name in VIDEO_FIELDS)
GENERATE_VIDEO_DOC = (
    "Generate one clip with a video preset (default: the embedded tiny-shapes-video; Wan 2.x; tiny-wan-i2v and "
    "wan2.1-i2v-14b-480p start from a source image: images, one file (gradio_client: [handle_file(PATH)]; an agent: "
    "an http(s) or data: URL), the clip's first frame, resized to the size bucket). Returns (video, frames, "
    "timings): the MP4, its frames as images, and the run's figures as JSON (the CLI's --json: preset, frames, fps, "
    "step_ms, encode/denoise/decode/total ms, video_encode_ms, recompiles, peak memory, notices such as a frame "
    "count snapped to its bucket). Only the prompt is needed: every other parameter is text, and '' (or leaving it "
    "out) takes the named preset's own default.")


def clip_summary(result: dict | None) -> str:
    """The clip's own figures: frames and rate, seconds per clip and per frame, the VAE decode's share."""
    if not result or not result.get("frames") or result.get("running"):
        return ""
    f = views.clip_figures(result)
    return (f"**{f['frames']} frames** at {f['fps']} fps ({f['frames'] / f['fps']:.2f} s of video) · "
            f"{f['clip_s']:.2f} s per clip, {f['frame_ms']:.1f} ms per frame · VAE decode {f['decode_ms']:.0f} ms "
            f"({f['decode_share']:.0f} % of the run) · MP4 {result['video_bytes']:,} bytes, encoded in "
            f"{result['video_encode_ms']:.0f} ms")


def frame_strip(result) -> list[tuple]:
    """(frame, caption) of a clip's frames as the MP4 holds them, at most STRIP_FRAMES evenly spread."""
    return views.strip_of(result.frames())


class VideoHandlers(GenerateHandlers):
    """Generate's handlers and the clip's: the run is Generate's, its result shown as a clip."""

    def video_presets(self) -> list[str]:
        return [name for name in self.serving.visitor_presets() if self.serving.preset(name).video]

    def first_video_preset(self):
        """The tab's starting preset: the video task's default (engine/config/defaults.py) among those offered,
        else among every preset (the tab then says none is offered; /generate_video keeps its shape)."""
        return (self.task_preset(Task.VIDEO, self.video_presets())
                or self.task_preset(Task.VIDEO, self.serving.preset_names()))

    def video_defaults(self, preset: str):
        """A video preset's own defaults: its declared widgets (VIDEO_DECLARED: a negative prompt) shown where it
        takes them, its sizes, first frame bucket, rate, steps and guidance."""
        try:
            p = self.serving.preset(preset)
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        sizes = [str(s) for s in p.buckets]
        return (*declared_shown(p, VIDEO_DECLARED), gr.update(choices=sizes, value=sizes[0]),
                gr.update(value=p.frames[0] if p.video else None), gr.update(value=p.fps), gr.update(value=p.steps),
                gr.update(value=p.guidance))

    def generate_video(self, request: gr.Request = None, progress=gr.Progress(), images=None, **form):  # noqa: B008
        """One clip: streams (video, frames, timings) as Generate streams (image, timings); the video and its
        frames come with the result. `images` is named so that the API offers it as optional (text to video
        sends none)."""
        prepared = self._prepare({**form, "images": images}, request, progress)
        feed = self.run_feed(prepared.key, ProgressBar(progress))
        with self._registered(request) as run, closing(stream.blocking(self._events(prepared, run))) as events:
            for event in events:
                if isinstance(event, stream.Finished) and event.result.video_mp4:
                    result = event.result
                    path = webtemp.save_output(result.video_mp4, get_upload_folder(), suffix=".mp4")
                    yield path, frame_strip(result), prepared.view.done(result)
                    continue
                for image, timings in prepared.view.outputs(event, feed, page=True):
                    yield (None if image is None else gr.skip()), gr.skip(), timings


def build(h: VideoHandlers, ready: gr.State | None = None) -> None:
    """The tab (inside gr.Tabs) and its events; `ready`: the engines ready now (the memory labels follow it)."""
    presets = h.video_presets()
    with gr.Tab("Video", id="video"):
        if not presets:  # /generate_video stays (an API's shape does not follow the host's list) and says why
            gr.Markdown("No video preset is offered on this server (a host lists one, e.g. tiny-wan, in its presets).")
        first = h.first_video_preset()
        d = h.defaults
        with gr.Row(elem_id="video-row"):  # a phone puts the prompt, the button and the clip first (ui/blocks.py)
            with gr.Column(scale=2, min_width=320, elem_id="video-controls"):
                form = _controls(h, presets, first, d)
                one_rank = gr.State(1)  # memory_choices' ranks: clips run on one (inside the tab: a child of gr.Tabs is a tab)
                area, capture = _source_image(form, first)
                form = {name: form[name] for name in VIDEO_FIELDS}  # /generate_video's order
            with gr.Column(scale=3, min_width=340, elem_id="video-output"):
                with gr.Row(elem_id="video-buttons"):
                    run_btn = gr.Button("Generate clip", variant="primary", elem_id="video-btn")
                    cancel_btn = gr.Button("Cancel", variant="stop", elem_id="video-cancel-btn")
                player = gr.Video(label="video", interactive=False, autoplay=True, loop=True, height=300,
                                  elem_id="video-player")
                strip = gr.Gallery(label="frames", columns=9, height=200, object_fit="contain", elem_id="video-frames",
                                   interactive=False, preview=False)
                clip_line = gr.Markdown(elem_id="video-summary")
                plot = gr.LinePlot(x="step", y="step_ms", color="steps", title="Per-step latency of this clip",
                                   x_title="step", y_title="ms", color_title="", height=240, elem_id="video-plot",
                                   sort=generate_views.STEP_ORDER)
                summary = gr.Markdown(elem_id="video-run-summary")
                stats = gr.Dataframe(interactive=False, label="Timings (stages: text encode, denoise, VAE decode)",
                                     elem_id="video-stats", wrap=True)
                with gr.Accordion("Timings JSON", open=False):
                    timings = gr.JSON(label="timings", elem_id="video-timings")
        with gr.Column(visible=False):  # /generate_video: the same handler on hidden text inputs
            api_form, api_outputs = _api(h, first)
            api_button = gr.Button(visible=False)
    run_io = dict(concurrency_id=ENGINE_QUEUE, concurrency_limit=h.run_slots())
    run = run_btn.click(h.generate_video, None, [player, strip, timings], inputs_kwargs=form,
                        api_name="generate_video_ui", api_visibility="private", show_progress="full",
                        show_progress_on=[player], **run_io)
    api_button.click(h.generate_video, None, api_outputs, inputs_kwargs=api_form, api_name="generate_video",
                     api_description=GENERATE_VIDEO_DOC, **run_io)
    cancel_btn.click(None, cancels=[run])
    timings.change(h.render_run, timings, [plot, stats, summary], **FAST)
    timings.change(clip_summary, timings, clip_line, **FAST)
    form["preset"].change(h.video_defaults, form["preset"], [*(form[f.name] for f in VIDEO_DECLARED),
                                                             form["size"], form["num_frames"], form["fps"],
                                                             form["steps"], form["guidance"]], **FAST)
    settings = [form[name] for name in ("preset", "device", "precision", "mode")]
    gr.on([c.change for c in settings] + ([ready.change] if ready is not None else []), h.memory_choices,
          [*settings, one_rank, form["memory"]], form["memory"], **FAST)
    edits = edit_inputs.EditInputs(h)  # the source image's area follows the preset's declaration, as Generate's
    form["preset"].change(edits.image_area, form["preset"], [area, form["images"]], **FAST)
    capture.change(edits.add_capture, [capture, form["images"]], [form["images"], capture], **FAST)


def _controls(h: VideoHandlers, presets: list[str], first, d) -> dict:
    """The clip's fields by name (VIDEO_FIELDS); dropdowns take typed values so our checks name what is wrong."""
    form = {"prompt": gr.Textbox(label=params.label("prompt"), value=first.example_prompt, lines=2,
                                 elem_id="video-prompt"),
            **declared_widgets(first, VIDEO_DECLARED, prefix="video-")}
    with gr.Row():
        form["preset"] = gr.Dropdown(presets, value=first.name, label="Video preset", allow_custom_value=True,
                                     elem_id="video-preset")
        form["device"] = gr.Dropdown(views.device_choices(h.devices_report()), value=d.device, label=params.label("device"),
                                     allow_custom_value=True, elem_id="video-device")
    with gr.Row():
        form["precision"] = gr.Dropdown(h.precision_choices(), value=d.precision, label=params.label("precision"),
                                        allow_custom_value=True, elem_id="video-precision")
        form["mode"] = gr.Dropdown(["eager", "compile", "regional"], value="eager", label=params.label("mode"),
                                   allow_custom_value=True, elem_id="video-mode")
    sizes = [str(s) for s in first.buckets]
    with gr.Row():
        form["size"] = gr.Dropdown(sizes, value=sizes[0], label="Size bucket", allow_custom_value=True,
                                   elem_id="video-size")
        form["num_frames"] = gr.Number(value=first.frames[0], precision=0, label="Frames (snapped to a frame bucket)",
                                       elem_id="video-frames-count")
        form["fps"] = gr.Number(value=first.fps, precision=0, label=params.label("fps"), elem_id="video-fps")
    with gr.Row():
        form["steps"] = gr.Number(value=first.steps, precision=0, label=params.label("steps"), elem_id="video-steps")
        form["guidance"] = gr.Number(value=first.guidance, label=params.label("guidance"), elem_id="video-guidance")
        form["seed"] = gr.Number(value=0, precision=0, minimum=0, label=params.label("seed"), elem_id="video-seed")
    form["on_cold"] = gr.Radio(params.choices("on_cold"), value=d.on_cold,
                               label=params.label("on_cold"), elem_id="video-on-cold")
    # Memory levers as Generate offers them (VAE tiling, offloads), each with its estimated peak and price
    levers = h.memory_choices(first.name, d.device, d.precision, "eager")
    public = h.serving.public()
    form["memory"] = gr.Dropdown(levers["choices"], value=levers["value"], info=levers["info"],
                                 allow_custom_value=not public, interactive=not public,
                                 label=params.label("memory"), elem_id="video-memory")
    return form


def _api(h: VideoHandlers, first) -> tuple[dict, list]:
    """/generate_video's hidden inputs, one per VIDEO_FIELDS in its order, and its outputs: the sampling fields
    start empty, so a caller that names another preset gets that preset's steps, guidance, frames and fps."""
    d = h.defaults
    defaults = {"prompt": first.example_prompt, "preset": first.name, "device": d.device, "precision": d.precision,
                "mode": "eager", "seed": "0", "on_cold": d.on_cold}
    allowed = {**api_allowed(h, first.name, d.device),
               "preset": "one of " + (", ".join(h.video_presets()) or "the video presets (none is offered here)")
                         + f" (default: {first.name})"}
    form = {name: api_file(name, "multiple", allowed[name]) if name == "images"
            else api_text(name, defaults.get(name, ""), allowed[name]) for name in VIDEO_FIELDS}
    outputs = [gr.Video(visible=False, label="video"), gr.Gallery(visible=False, label="frames"),
               gr.JSON(visible=False, label="timings")]
    return form, outputs


def _source_image(form: dict, first) -> tuple[gr.Accordion, gr.Image]:
    """The source image of an image-to-video preset (its first frame), as Generate's image area: the file and a
    capture box (webcam, clipboard) that adds to it; shown where the preset takes images (EditInputs.image_area)."""
    shown = first.inputs.takes_images
    with gr.Accordion("Source image (image-to-video presets: the clip's first frame)", open=shown,
                      visible=shown) as area:
        form["images"] = gr.File(file_count="multiple", file_types=["image"], type="filepath", visible=shown,
                                 label=f"Image ({first.inputs.describe(first.video)})", elem_id="video-images")
        capture = edit_inputs.capture_input("video-capture")
    return area, capture
