"""The Generate tab edits what it shows, in a real headless Chromium: the image area follows the preset, "Edit
this" puts the output into it (choosing the preset that edits), "make the circle green" runs as an edit and the
embedded checker (training/shapes/fidelity.py) reads the result. Eager on cpu: nothing compiles."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from helpers import app_page, require_chromium
from PIL import Image

from ui.handlers import UIDefaults

pytestmark = pytest.mark.browser

EDIT_MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-shapes-edit"

require_chromium()


@pytest.fixture(scope="module")
def page(cache_dir, tiny_models):
    with app_page(cache_dir, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager")) as pg:
        yield pg


def output_image(page) -> Image.Image:
    """The output as the page shows it (its img element's pixels, read back through a canvas)."""
    page.wait_for_function("(() => { const img = document.querySelector('#output-image img');"
                           " return img && img.complete && img.naturalWidth > 0; })()", timeout=30_000)
    data = page.evaluate("""() => { const img = document.querySelector('#output-image img');
        const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
        c.getContext('2d').drawImage(img, 0, 0); return c.toDataURL('image/png'); }""")
    return Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1]))).convert("RGB")


def test_an_uploaded_picture_is_edited(page, tmp_path):
    """A visitor picks the preset that edits, uploads a picture into the image area and runs an instruction."""
    from PIL import ImageDraw

    from training.shapes.fidelity import read

    assert not page.locator("#input-images").is_visible()  # tiny-shapes draws from text: no image area
    assert not page.locator("#edit-ab").is_visible()
    page.click("#preset input")
    page.locator('#preset [role=option][aria-label^="tiny-shapes-edit"]').first.click()
    page.wait_for_selector("#input-images", state="visible")

    picture = Image.new("RGB", (64, 64), (240, 240, 240))
    ImageDraw.Draw(picture).rectangle((18, 18, 46, 46), fill=(220, 30, 30))
    picture.save(tmp_path / "upload.png")
    page.locator("#input-images input[type=file]").set_input_files(str(tmp_path / "upload.png"))
    page.wait_for_function("document.querySelector('#input-images')?.innerText.includes('upload')", timeout=60_000)
    page.locator("#steps input[type=number]").fill("4")
    page.fill("#prompt textarea", "make the square green")
    page.click("#generate-btn")
    page.wait_for_function("document.querySelector('#history')?.querySelectorAll('img').length === 1",
                           timeout=300_000)
    edited = output_image(page)
    print(f"the uploaded picture read as {read(picture)}; its edit read as {read(edited)}")
    assert edited.size == (64, 64) and read(edited).background is not None
    page.wait_for_function("document.querySelectorAll('#edit-ab img').length === 2", timeout=30_000)  # A/B


def test_a_pasted_or_captured_picture_joins_the_images(page, tmp_path):
    """The capture box (webcam, clipboard or a dropped file; the browser here has neither camera nor clipboard, so
    it takes a file, which runs the same handler) adds its picture to the image area's images and empties."""
    if not page.locator("#input-images").is_visible():
        page.click("#preset input")
        page.locator('#preset [role=option][aria-label^="tiny-shapes-edit"]').first.click()
        page.wait_for_selector("#input-images", state="visible")
    assert page.locator("#input-capture").is_visible()
    Image.new("RGB", (64, 64), (30, 30, 220)).save(tmp_path / "pasted.png")
    page.locator("#input-capture input[type=file]").set_input_files(str(tmp_path / "pasted.png"))
    page.wait_for_function("document.querySelector('#input-images')?.innerText.includes('pasted')", timeout=60_000)
    page.wait_for_function("!document.querySelector('#input-capture img')", timeout=30_000)  # ready for the next
    names = page.locator("#input-images").inner_text()
    print(f"the image area lists: {names!r}")
    assert "pasted" in names


def test_edit_this_then_make_the_circle_green(page):
    from training.shapes.fidelity import read

    page.click("#preset input")
    page.locator('#preset [role=option][aria-label="tiny-shapes"]').first.click()
    page.wait_for_selector("#input-images", state="hidden")
    page.fill("#prompt textarea", "a red circle on a blue background")
    page.locator("#steps input[type=number]").fill("4")
    page.click("#generate-btn")
    page.wait_for_function("document.querySelector('#output-image img')?.naturalWidth === 64", timeout=180_000)
    page.wait_for_function("document.querySelector('#history')?.querySelectorAll('img').length === 2",
                           timeout=180_000)
    source = output_image(page)

    page.click("#edit-this")
    page.wait_for_function("document.querySelector('#preset input')?.value === 'tiny-shapes-edit'", timeout=30_000)
    page.wait_for_selector("#input-images", state="visible")
    page.wait_for_function("document.querySelector('#input-images')?.innerText.includes('source')", timeout=30_000)
    assert not page.locator("#input-mask").is_visible()  # an instruction edit takes no mask, no strength
    assert not page.locator("#strength").is_visible()

    page.fill("#prompt textarea", "make the circle green")
    page.click("#generate-btn")
    page.wait_for_function("document.querySelector('#history')?.querySelectorAll('img').length === 3",
                           timeout=300_000)
    # The history can redraw before the summary and stats of the same run do: wait for the run's own line.
    page.wait_for_function("['#run-summary', '#stats'].some(s => document.querySelector(s)?.innerText"
                           ".includes('tiny-shapes-edit@'))", timeout=60_000)
    page.wait_for_function("document.querySelectorAll('#edit-ab img').length === 2", timeout=30_000)  # A/B
    edited = output_image(page)
    assert edited.size == (64, 64) and edited.tobytes() != source.tobytes()
    reading = read(edited)
    print(f"source read as {read(source)}; the edit read as {reading}")
    assert reading.background is not None  # the checker reads what the page shows
    trained = "edit" in (EDIT_MODEL / "training.json").read_text().lower()
    if trained:  # the trained Kontext model (not a placeholder with the text-to-image weights)
        assert reading.colour == "green", reading



def test_compares_capture_box_adds_a_picture_to_the_source_every_configuration_edits(page, tmp_path):
    """Compare's image input has the same capture box: shown with it for a preset that edits, its picture joins the
    images every configuration edits, and the box empties for the next one."""
    page.get_by_role("tab", name="Compare").click()
    page.wait_for_selector("#compare-btn")
    page.click("#c-preset input")
    page.locator('#c-preset [role=option][aria-label="tiny-shapes"]').first.click()
    page.wait_for_selector("#c-capture", state="hidden")  # draws from text: neither images nor capture box
    page.click("#c-preset input")
    page.locator('#c-preset [role=option][aria-label^="tiny-shapes-edit"]').first.click()
    page.wait_for_selector("#c-capture", state="visible")
    Image.new("RGB", (64, 64), (30, 200, 30)).save(tmp_path / "captured.png")
    page.locator("#c-capture input[type=file]").set_input_files(str(tmp_path / "captured.png"))
    page.wait_for_function("document.querySelector('#c-images')?.innerText.includes('captured')", timeout=60_000)
    page.wait_for_function("!document.querySelector('#c-capture img')", timeout=30_000)
    names = page.locator("#c-images").inner_text()
    print(f"Compare's images list: {names!r}")
    assert "captured" in names
