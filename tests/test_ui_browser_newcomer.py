"""What a newcomer sees, read as a person reads it (controls found by their label and role, geometry measured) in
a real headless Chromium: after a Generate at 1280x800 the output stays in view while the controls scroll, the
precision field no longer says its loaded engine "loads a new engine", and on a phone (390x844) "Edit this" sits
right under its image. One app and one page for the module."""

from __future__ import annotations

import pytest
from helpers import browser_page, launch_demo, require_chromium

from ui.handlers import UIDefaults

pytestmark = pytest.mark.browser

require_chromium()


@pytest.fixture(scope="module")
def manager(cache_dir, tiny_models):
    from helpers import engine_manager

    with engine_manager(cache_dir) as m:
        yield m


@pytest.fixture(scope="module")
def page(manager):
    demo, url = launch_demo(manager, UIDefaults(mode="eager"))
    try:
        with browser_page(url, (1280, 800), timeout_ms=120_000) as pg:
            yield pg
    finally:
        demo.close()


def viewport_box(locator) -> dict:
    """The element's box in viewport pixels (top, bottom, height)."""
    return locator.evaluate("el => { const r = el.getBoundingClientRect(); "
                            "return {top: r.top, bottom: r.bottom, height: r.height}; }")


def generated(page) -> None:
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_function("document.querySelector('#output-image img')?.naturalWidth > 0", timeout=240_000)


def test_the_output_stays_in_view_while_the_controls_scroll(page):
    page.evaluate("window.scrollTo(0, 0)")
    generated(page)
    page.mouse.wheel(0, 700)
    page.wait_for_function("scrollY >= 600")
    image = viewport_box(page.locator("#output-image img"))
    assert image["top"] >= 0 and image["bottom"] <= 800, image  # it was at -453 px


def test_the_loaded_engine_is_not_said_to_load_a_new_one(page):
    """With Device "auto (-> cpu)", the precision picked reads its plain name once its engine is ready."""
    page.evaluate("window.scrollTo(0, 0)")
    precision = page.get_by_label("Precision", exact=False).first
    page.wait_for_function("el => el.value && !el.value.includes('loads a new engine')",
                           arg=precision.element_handle(), timeout=30_000)
    assert precision.input_value() == "fp32"


def test_on_a_phone_edit_this_sits_under_its_image(page):
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.wait_for_timeout(300)  # the layout follows the new width
        image = page.locator("#output-image img").bounding_box()
        edit = page.get_by_role("button", name="Edit this").bounding_box()
        run = page.get_by_role("button", name="Generate", exact=True).bounding_box()
        gap = edit["y"] - (image["y"] + image["height"])
        assert 0 <= gap <= 300, (image, edit)  # it was ~2,000 px below
        assert run["y"] + run["height"] <= 844  # the run button on the first screen, before the controls
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})
