"""Compare on a video preset in a real headless Chromium: the frame and fps fields appear only for a video preset,
and a comparison of eager fp32 and bf16 clips shows each card's frame strip (drawn, with a size) and its drift
against eager fp32's clip frame by frame with the flicker, the reference's card saying it is the reference.
Eager on cpu: nothing compiles."""

from __future__ import annotations

import pytest
from helpers import app_page, require_chromium

from ui.handlers import UIDefaults

pytestmark = [pytest.mark.browser, pytest.mark.slow]


require_chromium()


@pytest.fixture(scope="module")
def page(cache_dir, tiny_models):
    with app_page(cache_dir, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager")) as pg:
        yield pg


def pick(page, elem_id: str, label: str) -> None:
    page.click(f"#{elem_id} input")
    page.locator(f'#{elem_id} [role=option][aria-label="{label}"]').first.click()
    page.keyboard.press("Escape")


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def test_compare_on_tiny_wan_shows_each_clip_and_its_drift(page):
    page.get_by_role("tab", name="Compare").click()
    page.wait_for_selector("#compare-btn")
    assert not page.locator("#c-frames").is_visible()  # tiny-shapes makes images: no frame count
    pick(page, "c-preset", "tiny-wan")
    page.wait_for_selector("#c-frames", state="visible")
    page.wait_for_function("document.querySelector('#c-frames input')?.value === '17'")  # its first frame bucket
    page.wait_for_function("document.querySelector('#c-steps input[type=number]')?.value === '4'")
    pick(page, "c-size", "16x16")
    set_number(page, "c-frames", 9)
    set_number(page, "c-steps", 2)
    set_number(page, "c-timing", 0)
    page.fill("#c-configs textarea", "eager/fp32; eager/bf16")
    page.click("#compare-btn")
    page.wait_for_function("document.querySelectorAll('#c-cards .c-card').length === 2"
                           " && document.querySelector('#c-cards').innerText.includes('flicker')", timeout=120_000)
    reference, bf16 = page.locator("#c-cards .c-card").all_inner_texts()
    print(f"reference card: {reference!r}\nbf16 card: {bf16!r}")
    assert "cpu/fp32/eager" in reference and "the reference" in reference and "drift: reference" in reference
    assert "cpu/bf16/eager" in bf16 and "drift per frame: PSNR median" in bf16 and "worst" in bf16
    assert "flicker:" in bf16 and "px against eager fp32" in bf16
    for card in (reference, bf16):
        assert "s / clip" in card and "ms / frame" in card and "VAE decode" in card and "9 frames" in card
    boxes = page.eval_on_selector_all("#c-cards .c-strip img", "imgs => imgs.map(i => { const r = "
                                      "i.getBoundingClientRect(); return [r.width, r.height, i.naturalWidth]; })")
    assert len(boxes) == 2 * 9, boxes  # every frame of each 9-frame clip
    assert all(w > 0 and h > 0 and natural == 16 for w, h, natural in boxes), boxes
    page.locator("#c-cards .c-strip").first.scroll_into_view_if_needed()
    assert page.locator("#c-cards .c-strip").first.is_visible()
