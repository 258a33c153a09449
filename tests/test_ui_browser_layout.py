"""The page read on a laptop (1280x800) and a phone (390x844) in a real headless Chromium (Debian's, driven by
PyPI playwright): the Generate button on a phone's first screen, the System tab's words whole, the bucket
board and Compare's price table without inner scrollers, Compare's legend whole and in distinct colours, the
A/B slider's two layers on one box. One app and one page for the module; Compare runs eager configurations
only (no compile). Screenshots land in artifacts/."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import browser_page, launch_demo, require_chromium
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from ui.handlers import UIDefaults

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
# six rows, two engines (fp32, bf16), nothing to compile; the cached steps make four more plot series
CONFIGS = ("eager/fp32; eager/bf16; eager/fp32/first-block:0.2; eager/bf16/first-block:0.2; "
           "eager/fp32/magcache:0.06; eager/bf16/magcache:0.06")

require_chromium()


@pytest.fixture(scope="module")
def manager(cache_dir, tiny_models):
    """The page's own engine manager: the board shows this module's engines only, not every engine earlier
    modules left in the session's manager (a longer board then scrolled inside its 3,200 px)."""
    from helpers import engine_manager

    with engine_manager(cache_dir) as m:
        yield m


@pytest.fixture(scope="module")
def page(manager):
    ARTIFACTS.mkdir(exist_ok=True)
    demo, url = launch_demo(manager, UIDefaults())
    try:
        with browser_page(url, (1280, 800), timeout_ms=60_000) as pg:
            yield pg
    finally:
        demo.close()


def inner_scrollers(page, elem_id: str) -> list:
    """Elements inside `elem_id` that scroll vertically (their content taller than their box)."""
    return page.eval_on_selector(f"#{elem_id}", """el => Array.from(el.querySelectorAll('*'))
        .filter(e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowY) && e.scrollHeight > e.clientHeight + 2)
        .map(e => [e.className, e.scrollHeight, e.clientHeight])""")


def split_words(page, selector: str, paths: bool = False) -> list:
    """Cells whose longest word is wider than their text's room: the browser breaks inside it. Words with a
    / : . _ @ or - (links, paths) may break, unless `paths`."""
    return page.eval_on_selector_all(selector, """(cells, paths) => cells.map(c => {
        const style = getComputedStyle(c);
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
        const words = c.innerText.trim().split(/\\s+/).filter(w => paths || !/[\\/:._@-]/.test(w));
        const widest = words.reduce((a, b) => ctx.measureText(b).width > ctx.measureText(a).width ? b : a, '');
        const room = c.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        return [widest, ctx.measureText(widest).width, room];
    }).filter(([w, width, room]) => w && width > room + 1)""", paths)


def test_on_a_phone_the_generate_button_is_on_the_first_screen(page):
    """It was 2,100 px down the page, under every setting."""
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.wait_for_timeout(300)  # the layout follows the new width
        button, prompt = page.locator("#generate-btn").bounding_box(), page.locator("#prompt").bounding_box()
        page.screenshot(path=str(ARTIFACTS / "ui_phone_390.png"))
        assert button["y"] + button["height"] <= 844, button
        assert prompt["y"] < button["y"]  # what it draws comes first
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})


def test_the_system_tab_splits_no_word(page):
    page.get_by_role("tab", name="System").click()
    page.wait_for_function("document.querySelector('#system')?.innerText.includes('Loaded engines')")
    assert not split_words(page, "#system td, #system th"), split_words(page, "#system td, #system th")


def test_the_board_shows_every_row_without_an_inner_scroller(page):
    page.get_by_role("tab", name="Buckets").click()
    page.wait_for_function("document.querySelectorAll('#board .virtual-body [role=row]').length >= 12", timeout=240_000)
    assert not inner_scrollers(page, "board"), inner_scrollers(page, "board")


def test_compare_at_1280x800_reads_whole(page):
    page.get_by_role("tab", name="Compare").click()
    page.locator("#c-configs textarea").fill(CONFIGS)
    for elem_id, value in (("c-timing", "0"), ("c-fidelity-prompts", "0")):
        box = page.locator(f"#{elem_id} input[type=number]")
        box.fill(value)
        box.press("Enter")
    page.click("#compare-btn")
    page.wait_for_function("document.querySelectorAll('#c-speedup .virtual-body [role=row]').length === 6"
                           " && document.querySelectorAll('#c-plot-legend .legend-item').length >= 6", timeout=600_000)
    # the A/B slider fills in an event of its own after the run (one at a time): minutes on a loaded box
    try:
        page.wait_for_function("Array.from(document.querySelectorAll('#c-ab img'))"
                               ".filter(i => i.complete && i.naturalWidth > 0).length === 2", timeout=300_000)
    except PlaywrightTimeout:  # say why: no image yet, or each image's answer (a 403 or 404 names the cause)
        sources = page.eval_on_selector_all("#c-ab img", "is => is.map(i => i.src)")
        answers = {src[-60:]: page.request.get(src).status for src in sources if src.startswith("http")}
        raise AssertionError(f"the A/B slider's images never showed: {answers or sources or 'no image'}") from None
    # the price table: its six rows without an inner scroller, the speedup column wide enough for its figure
    page.locator("#c-speedup").scroll_into_view_if_needed()
    assert not inner_scrollers(page, "c-speedup"), inner_scrollers(page, "c-speedup")
    widths = dict(page.eval_on_selector_all("#c-speedup [role=columnheader]", "hs => hs.map(h => "
                                            "[h.innerText.trim(), h.getBoundingClientRect().width])"))
    assert widths["× vs eager fp32"] >= 220, widths
    labels = "#c-speedup .virtual-body [role=row] [role=gridcell]:first-child"
    assert not split_words(page, labels, paths=True), split_words(page, labels, paths=True)  # "magcac|he:0.06"
    # the A/B picker's choices and value arrive apart: no "not in the list of choices" refusal in between
    assert not page.locator("[data-testid='toast-body']", has_text="not in the list of choices").count()
    page.screenshot(path=str(ARTIFACTS / "ui_compare_table_1280.png"))
    # the legend: every series, each its own colour, none cut at the edge
    legend = page.locator("#c-plot-legend")
    legend.scroll_into_view_if_needed()
    items = page.eval_on_selector_all("#c-plot-legend .legend-item", """items => items.map(i => [i.innerText.trim(),
        getComputedStyle(i.querySelector('.swatch')).backgroundColor, i.getBoundingClientRect().right])""")
    right = legend.bounding_box()["x"] + legend.bounding_box()["width"]
    assert len(items) >= 6 and len({color for _, color, _ in items}) == len(items), items
    assert all(r <= right + 1 for _, _, r in items), (items, right)
    assert not page.locator("#c-plot g.role-legend").first.is_visible()  # Vega's one-row legend is hidden
    # the A/B slider: both layers on one box (they sat 110 px apart)
    page.locator("#c-ab").scroll_into_view_if_needed()
    boxes = page.eval_on_selector_all("#c-ab img", "is => is.map(i => { const r = i.getBoundingClientRect();"
                                      " return [r.x, r.y, r.width, r.height]; })")
    assert len(boxes) == 2 and all(abs(a - b) <= 2 for a, b in zip(*boxes, strict=True)), boxes
    page.screenshot(path=str(ARTIFACTS / "ui_compare_ab_1280.png"))
