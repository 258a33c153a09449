"""The Video tab makes a clip from an uploaded picture, in a real headless Chromium: the source image area shows
only for a preset that takes one (tiny-wan-i2v, not tiny-wan), the picture uploaded there becomes the clip's
first frame at the size bucket, and the clip plays with the frames asked for. Eager on cpu: nothing compiles."""

from __future__ import annotations

import pytest
from helpers import app_page, require_chromium
from PIL import Image

from ui.handlers import UIDefaults

pytestmark = pytest.mark.browser

require_chromium()


@pytest.fixture(scope="module")
def page(cache_dir):
    with app_page(cache_dir, UIDefaults(preset="tiny-wan", device="cpu", mode="eager")) as pg:
        yield pg


def test_a_clip_starts_from_an_uploaded_picture(page, tmp_path):
    page.get_by_role("tab", name="Video").click()
    page.wait_for_selector("#video-btn", state="visible")
    assert not page.locator("#video-images").is_visible()  # tiny-wan: text to video, no source image
    page.click("#video-preset input")
    page.locator('#video-preset [role=option][aria-label="tiny-wan-i2v"]').first.click()
    page.wait_for_selector("#video-images", state="visible")
    label = page.locator("#video-images").inner_text()
    assert "one source image, the clip's first frame" in label, label
    assert page.locator("#video-capture").is_visible()

    Image.new("RGB", (48, 40), (220, 30, 30)).save(tmp_path / "first.png")
    page.locator("#video-images input[type=file]").set_input_files(str(tmp_path / "first.png"))
    page.wait_for_function("document.querySelector('#video-images')?.innerText.includes('first')", timeout=60_000)
    page.locator("#video-frames-count input[type=number]").fill("9")
    page.locator("#video-steps input[type=number]").fill("2")
    page.click("#video-btn")
    # the line itself, not a pending event's timer over it ("0.1s"): on a loaded box a later event may still run
    page.wait_for_function("/^\\d+ frames at/.test((document.querySelector('#video-summary')?.innerText || '').trim())",
                           timeout=300_000)
    summary = page.locator("#video-summary").inner_text().strip()
    notices = page.locator("#video-run-summary").inner_text() + page.locator("#video-stats").inner_text()
    print(f"the clip's line: {summary!r}")
    assert summary.startswith("9 frames at 16 fps"), summary
    assert page.locator("#video-player video").get_attribute("src")
    assert page.locator("#video-frames img").count() == 9
    print(f"the run's summary and stages: {notices!r}")
    assert "image 1 (48x40) resized to 32x32" in notices, notices

    page.click("#video-preset input")  # back to text to video: the area hides and sends nothing
    page.locator('#video-preset [role=option][aria-label="tiny-wan"]').first.click()
    page.wait_for_selector("#video-images", state="hidden")
