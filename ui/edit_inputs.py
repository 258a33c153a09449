"""The Generate tab's input images as the preset declares them (engine/protocol/presets.py `ImageInputs`): the
image area shows where the preset takes images (open), the mask where it inpaints, the strength where it takes
one; a capture box adds a picture from the webcam or the clipboard; "Edit this" puts the image on show into the
image area, choosing a preset that edits when the one chosen
draws from text only; after an edit, an A/B slider shows its source against its result. The request's fields themselves (`images`, `mask`, `strength`) are the form's widgets
(ui/generate.py `_image_inputs`); nothing here decodes an image.
"""

from __future__ import annotations

import gradio as gr

from engine.errors import ShowcaseError
from engine.protocol import ImageInputs, Task
from ui.common import FAST, HandlerBase, to_gradio_error
from ui.uploads import uploads

MAX_SOURCE_PIXELS = 4096 * 4096  # engine/config/images.py MAX_INPUT_PIXELS: what the gate lets through
NOTHING_TO_EDIT = "There is no image to edit yet: generate one first"
CLEARED = {"value": None}  # a hidden field sends nothing: the preset would refuse what it does not take


class EditInputs:
    """The handlers behind the image area's visibility and "Edit this" (`h`: the tab's GenerateHandlers: its
    serving interface's presets and the visitor's)."""

    def __init__(self, h: HandlerBase):
        self.h = h

    def _inputs(self, preset: str):
        try:
            return self.h.serving.preset(preset).inputs
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None

    def image_area(self, preset: str):
        """(image area, images) updates for the preset chosen: shown and open where it takes images, hidden and
        emptied where it takes none (the Generate and Video tabs' areas)."""
        inputs = self._inputs(preset)
        source = "the first is the source to edit" if inputs.needs_source else "references"
        label = (f"Image ({inputs.describe()})" if inputs is ImageInputs.FIRST_FRAME  # one, and no edit
                 else f"Images ({inputs.describe()}; {source})")
        return (gr.update(visible=inputs.takes_images, open=inputs.takes_images),
                gr.update(visible=inputs.takes_images, label=label, **({} if inputs.takes_images else CLEARED)))

    def visibility(self, preset: str):
        """(image area, images, mask, strength) updates for the preset chosen."""
        inputs = self._inputs(preset)
        cleared = CLEARED
        return (*self.image_area(preset),
                gr.update(visible=inputs.takes_mask, **({} if inputs.takes_mask else cleared)),
                gr.update(visible=inputs.takes_strength, **({} if inputs.takes_strength else cleared)))

    def takes_images(self, preset: str):
        """Compare's image input: shown where the preset takes images."""
        return gr.update(visible=self._inputs(preset).takes_images)

    def edit_preset(self, preset: str) -> str:
        """`preset` when it takes images, else the edit task's default among the presets the visitor may choose."""
        if self._inputs(preset).takes_images:
            return preset
        chosen = self.h.task_preset(Task.EDIT)  # an image's edit: a clip's first frame is not one
        if chosen is None:
            raise gr.Error("No preset that edits is offered here; the host adds one (e.g. tiny-shapes-edit)")
        return chosen.name

    def edit_this(self, image, preset: str):
        """The image on show as the image area's one image (written to Gradio's own upload folder, which the app
        tidies), and a preset that edits."""
        from gradio import processing_utils, utils

        if image is None:
            raise gr.Error(NOTHING_TO_EDIT)
        chosen = self.edit_preset(preset)
        path = processing_utils.save_pil_to_cache(image, cache_dir=utils.get_upload_folder(), name="source",
                                                  format="png")
        return [path], gr.update(value=chosen)

    @staticmethod
    def remember(evt: gr.SelectData) -> int | None:
        """The run-history image picked (its index: the image itself is the session's own, never the browser's)."""
        return evt.index if isinstance(evt.index, int) else None

    def edit_history(self, index: int | None, history: list, preset: str):
        """"Edit the picked image" of the run history (a thumbnail, at most 256 px a side)."""
        if index is None or not 0 <= index < len(history or []):
            raise gr.Error("Pick an image of the run history first (click it), then edit it")
        return self.edit_this(history[index][0], preset)


    @staticmethod
    def source_against_result(images, image, preset_inputs_take_images: bool = True):
        """The A/B slider after a run: (source, result) when the run edited a source, else hidden."""
        first = images[0] if isinstance(images, list | tuple) and images else None
        path = first.get("path") if isinstance(first, dict) else getattr(first, "path", first)
        if image is None or not path or not preset_inputs_take_images:
            return gr.update(visible=False, value=None)
        from PIL import Image

        try:  # the source already passed the gate's checks (the run succeeded); a file since gone shows nothing
            with Image.open(path) as source:
                if source.width * source.height > MAX_SOURCE_PIXELS:
                    return gr.update(visible=False, value=None)
                return gr.update(visible=True, value=(source.convert("RGB").resize(image.size), image))
        except (OSError, ValueError, Image.DecompressionBombError):
            return gr.update(visible=False, value=None)

    @staticmethod
    def add_capture(capture: str | None, images):
        """A picture taken with the webcam, pasted or dropped into the capture box, appended to the image area's
        images; the box is emptied for the next one."""
        if not capture:
            return gr.update(), gr.update()
        return [*(images or []), capture], None

    def after_run(self, images, image, preset: str):
        return self.source_against_result(images, image, self._inputs(preset).takes_images)


def sources(files) -> tuple[bytes, ...]:
    """Compare's uploaded images as the request's bytes (read bounded, ui/uploads.py; decoded at the gate)."""
    return uploads(files)


def compare_images(visible: bool) -> gr.File:
    return gr.File(value=[], file_count="multiple", file_types=["image"], type="filepath", visible=visible,
                   elem_id="c-images",
                   label="Images to edit (presets that edit): every configuration edits the same source; drift is "
                         "each edit against eager fp32's edit")


def capture_input(elem_id: str = "input-capture", visible: bool = True) -> gr.Image:
    """A picture from the webcam or the clipboard (or a file) for the image area: added to its images."""
    return gr.Image(sources=["upload", "clipboard", "webcam"], type="filepath", format="png", elem_id=elem_id,
                    label="Add a picture: paste it (clipboard), take it (webcam) or drop a file", height=200,
                    visible=visible)


def ab_slider() -> gr.ImageSlider:
    return gr.ImageSlider(label="Source | result (drag the handle)", type="pil", visible=False, interactive=False,
                          elem_id="edit-ab", height=300)


def edit_button() -> gr.Button:
    return gr.Button("Edit this", size="sm", elem_id="edit-this")


def history_button() -> tuple[gr.Button, gr.State]:
    return gr.Button("Edit the picked image", size="sm", elem_id="edit-history"), gr.State(None)


def wire(page, demo: gr.Blocks) -> None:
    """The image area follows the preset; "Edit this" takes the output image, "Edit the picked image" the run
    history's; the slider shows an edit's source against its result (`page`: GeneratePage)."""
    edits, f = EditInputs(page.h), page.form
    shown = [page.image_area, f["images"], f["mask"], f["strength"]]
    gr.on([f["preset"].change, demo.load], edits.visibility, f["preset"], shown, **FAST)
    page.edit_btn.click(edits.edit_this, [page.image, f["preset"]], [f["images"], f["preset"]], **FAST)
    page.image.change(edits.after_run, [f["images"], page.image, f["preset"]], page.edit_ab, **FAST)
    page.capture.change(edits.add_capture, [page.capture, f["images"]], [f["images"], page.capture], **FAST)
    page.history_gallery.select(edits.remember, None, page.history_pick, **FAST)
    page.history_edit.click(edits.edit_history, [page.history_pick, page.history_state, f["preset"]],
                            [f["images"], f["preset"]], **FAST)
