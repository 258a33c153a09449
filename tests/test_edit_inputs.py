"""The Generate tab's image area handlers (ui/edit_inputs.py): what shows for which preset, "Edit this" on the
output and on a run-history image, and the A/B slider's source against result. No engine runs here."""

from __future__ import annotations

import gradio as gr
import pytest
from PIL import Image

from ui.edit_inputs import EditInputs
from ui.handlers import Handlers, UIDefaults


@pytest.fixture(scope="module")
def edits(manager):
    return EditInputs(Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager")))


def test_the_image_area_follows_what_the_preset_takes(edits):
    area, images, mask, strength = edits.visibility("tiny-shapes")
    assert area["visible"] is False and images["visible"] is False
    assert images["value"] is None and mask["value"] is None  # hidden fields send nothing the preset refuses
    area, images, mask, strength = edits.visibility("tiny-shapes-edit")
    assert area["visible"] is True and area["open"] is True and "source" in images["label"]
    assert mask["visible"] is False and strength["visible"] is False
    _, _, mask, strength = edits.visibility("tiny-shapes-inpaint")
    assert mask["visible"] is True and strength["visible"] is True
    _, _, mask, strength = edits.visibility("tiny-shapes-img2img")
    assert mask["visible"] is False and strength["visible"] is True


def test_edit_this_puts_the_image_in_the_area_and_picks_a_preset_that_edits(edits):
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    (path,), preset = edits.edit_this(image, "tiny-shapes")
    assert preset["value"] == edits.edit_preset("tiny-shapes") and edits.visibility(preset["value"])[0]["visible"]
    with Image.open(path) as saved:
        assert saved.size == (64, 64) and saved.convert("RGB").tobytes() == image.tobytes()
    _, kept = edits.edit_this(image, "tiny-shapes-inpaint")
    assert kept["value"] == "tiny-shapes-inpaint"  # a preset that takes images stays
    with pytest.raises(gr.Error, match="no image to edit yet"):
        edits.edit_this(None, "tiny-shapes")


def test_a_run_history_image_is_edited_by_its_index_in_the_sessions_history(edits):
    history = [(Image.new("RGB", (64, 64), (0, 200, 0)), "newest", 2), (Image.new("RGB", (64, 64), (0, 0, 200)),
                                                                        "older", 1)]
    (path,), _ = edits.edit_history(1, history, "tiny-shapes-edit")
    with Image.open(path) as saved:
        assert saved.convert("RGB").getpixel((5, 5)) == (0, 0, 200)
    for index in (None, 2, -1):
        with pytest.raises(gr.Error, match="Pick an image of the run history first"):
            edits.edit_history(index, history, "tiny-shapes-edit")


def test_the_ab_slider_shows_an_edits_source_against_its_result(edits, tmp_path):
    source = tmp_path / "s.png"
    Image.new("RGB", (32, 32), (9, 9, 9)).save(source)
    result = Image.new("RGB", (64, 64), (0, 200, 0))
    shown = edits.after_run([str(source)], result, "tiny-shapes-edit")
    assert shown["visible"] is True and shown["value"][0].size == (64, 64) and shown["value"][1] is result
    assert edits.after_run([str(source)], result, "tiny-shapes")["visible"] is False  # text to image
    assert edits.after_run([], result, "tiny-shapes-edit")["visible"] is False
    (tmp_path / "words.png").write_bytes(b"not a picture")
    assert edits.after_run([str(tmp_path / "words.png")], result, "tiny-shapes-edit")["visible"] is False


def test_a_captured_picture_is_appended_and_the_capture_box_empties():
    images, capture = EditInputs.add_capture("/tmp/gradio/pasted.png", ["/tmp/gradio/source.png"])
    assert images == ["/tmp/gradio/source.png", "/tmp/gradio/pasted.png"] and capture is None
    images, capture = EditInputs.add_capture("/tmp/gradio/webcam.png", None)  # the first picture
    assert images == ["/tmp/gradio/webcam.png"]
    unchanged, box = EditInputs.add_capture(None, ["/tmp/gradio/source.png"])  # the box emptied: nothing to add
    assert unchanged == gr.update() and box == gr.update()


def test_the_video_tabs_source_image_shows_for_image_to_video_presets_only(edits):
    area, image = edits.image_area("tiny-wan-i2v")
    assert area["visible"] is True and area["open"] is True and image["visible"] is True
    assert image["label"] == "Image (one source image, the clip's first frame)"
    area, image = edits.image_area("tiny-wan")
    assert area["visible"] is False and image["visible"] is False and image["value"] is None
    assert edits.edit_preset("tiny-wan") != "tiny-wan-i2v"  # "Edit this" picks an image's edit, not a clip
