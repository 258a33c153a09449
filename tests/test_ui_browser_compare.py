"""The Compare tab's price at 1280x800 in a real headless Chromium (Debian's, via PyPI playwright): the
drift and fidelity under each image are in view after scrolling to the results, and no table is clipped."""

from __future__ import annotations

import pytest
from helpers import launch_demo
from test_ui_browser import CHROMIUM, CHROMIUM_ARGS

from ui.handlers import UIDefaults

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def page(manager):
    from playwright.sync_api import sync_playwright

    demo, url = launch_demo(manager, UIDefaults(device="cpu", mode="eager"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 800})
        pg.set_default_timeout(30_000)
        pg.goto(url)
        pg.wait_for_selector("#compare-btn", state="attached")
        yield pg
        browser.close()
    demo.close()


def in_view(page, selector: str) -> bool:
    """The element's box lies inside the viewport and inside every clipping ancestor."""
    return page.eval_on_selector(selector, """el => {
        const r = el.getBoundingClientRect();
        if (r.width === 0 || r.top < 0 || r.bottom > innerHeight || r.left < 0 || r.right > innerWidth) return false;
        for (let a = el.parentElement; a; a = a.parentElement) {
            const s = getComputedStyle(a);
            if (s.overflow === 'visible' && s.overflowX === 'visible') continue;
            const b = a.getBoundingClientRect();
            if (r.left < b.left - 1 || r.right > b.right + 1) return false;
        }
        return true;
    }""")


def test_drift_and_fidelity_are_visible_under_each_image(page):
    page.get_by_role("tab", name="Compare").click()
    page.locator("#c-modes label", has_text="regional").click()  # uncheck: eager only
    page.locator("#c-precisions label", has_text="bf16").click()  # fp32 (reference) and bf16
    page.click("#compare-btn")
    page.wait_for_function("document.querySelectorAll('#c-cards .c-card .c-drift').length === 2", timeout=300_000)
    page.wait_for_function("document.querySelectorAll('#c-speedup .virtual-body [role=row]').length === 2")
    page.locator("#c-cards").scroll_into_view_if_needed()
    cards = page.locator("#c-cards .c-card")
    assert cards.count() == 2
    bf16 = cards.nth(1)
    assert "cpu/bf16/eager" in bf16.inner_text()
    assert "dB" in bf16.locator(".c-drift").inner_text() or "identical" in bf16.locator(".c-drift").inner_text()
    assert "prompts)" in bf16.locator(".c-fidelity").inner_text()
    for part in (".c-time", ".c-drift", ".c-fidelity"):
        assert in_view(page, f"#c-cards .c-card:nth-child(2) {part}"), part
    assert in_view(page, "#c-cards .c-card:nth-child(2) img")
    # The price table fits its column: no horizontal scrolling hides its right-hand columns.
    overflow = page.eval_on_selector("#c-speedup", """el => Array.from(el.querySelectorAll('*'))
        .filter(e => getComputedStyle(e).overflowX !== 'visible').map(e => e.scrollWidth - e.clientWidth)""")
    assert max(overflow or [0]) <= 2, overflow
