"""Compare's A/B slider: one configuration's image over the reference's (eager fp32) at the same prompt and
seed, a handle to drag between them, where the cards show them side by side and a heat map.

It reads the images the cards already hold (compare's thumbnails, data: URIs at card size), not the
gallery: Gradio would read gallery images back from the shared upload folder (see ui/compare.py).
"""

from __future__ import annotations

import base64
import io

import gradio as gr
from PIL import Image

from ui.common import FAST

NONE_YET = "run Compare first"


def slider_choices(payload: dict | None, current: str | None):
    """The configurations with an image beside the reference's; the current pick kept while it is one."""
    payload = payload or {}
    results = payload.get("results", [])
    if not any(r.get("reference") and "image_index" in r for r in results):
        return gr.update(choices=[NONE_YET], value=NONE_YET)
    labels = [r["config"] for r in results if not r.get("reference") and "image_index" in r]
    if not labels:
        return gr.update(choices=[NONE_YET], value=NONE_YET)
    return gr.update(choices=labels, value=current if current in labels else labels[0])


def slider_images(choice: str | None, payload: dict | None, thumbnails: list[str] | None):
    """(reference image, `choice`'s image) for the slider; nothing while either is missing."""
    results = (payload or {}).get("results", [])
    reference = next((r for r in results if r.get("reference") and "image_index" in r), None)
    picked = next((r for r in results if r.get("config") == choice and "image_index" in r), None)
    thumbnails = thumbnails or []
    if reference is None or picked is None or max(reference["image_index"], picked["image_index"]) >= len(thumbnails):
        return None
    return image_of(thumbnails[reference["image_index"]]), image_of(thumbnails[picked["image_index"]])


def image_of(uri: str) -> Image.Image:
    """A PNG data: URI (compare's thumbnails) as a PIL image."""
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def add() -> tuple[gr.Dropdown, gr.ImageSlider]:
    """The picker and the slider (under the cards); `wire` fills them from a comparison's results."""
    with gr.Row(equal_height=True):
        # allow_custom_value: the images' event can read the picker between its new choices and its new value
        # (Gradio then refused "run Compare first is not in the list of choices" in a toast)
        choice = gr.Dropdown([NONE_YET], value=NONE_YET, label="A/B: eager fp32 (left) against",
                             elem_id="c-ab-choice", scale=1, min_width=200, allow_custom_value=True)
        slider = gr.ImageSlider(label="Drag the handle: eager fp32 | the configuration (card size)", type="pil",
                                format="png",  # lossless: a lossy copy would add its own differences
                                interactive=False, height=280, elem_id="c-ab", scale=2, min_width=240)
    return choice, slider


def wire(choice: gr.Dropdown, slider: gr.ImageSlider, results: gr.JSON, thumbnails: gr.State) -> None:
    results.change(slider_choices, [results, choice], choice, **FAST)
    # One at a time, in the order sent: the thumbnails' event carries the picker's old value and answers
    # "nothing"; run beside the picker's own event it could finish last and empty the slider.
    gr.on([choice.change, thumbnails.change], slider_images, [choice, results, thumbnails], slider,
          **{**FAST, "concurrency_limit": 1, "concurrency_id": "compare-ab"})
