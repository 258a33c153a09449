"""The per-step plots in a real headless Chromium: every drawn point of a line lies inside its plot area.

A test that only finds a path passes when the y axis stays at 0-1 ms and the line is drawn thousands of
pixels above the chart; this one reads the path's vertices in screen coordinates and the plot frame's box.
One app and one page (eager by default, so no Generate queues a background compile); Generate three times
at different step counts, then a Compare at the shared regional graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import chromium_env, launch_demo

from ui.handlers import UIDefaults

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]
WATCHED = "64x64"

if not CHROMIUM.exists():
    pytest.skip("Chromium is missing: run `make browser` (apt-get install -y chromium)", allow_module_level=True)

# Each drawn line's vertices in client pixels (the path's own transform applied) and the plot frame's box.
POINTS_AND_FRAME = """root => {
    const frame = root.querySelector('g.mark-group.role-frame path.background, g.mark-group.role-frame rect');
    const box = frame ? frame.getBoundingClientRect() : null;
    const lines = Array.from(root.querySelectorAll('g.mark-line path'))
        .filter(p => (p.getAttribute('d') || '') && p.getAttribute('d') !== 'M0,0')
        .map(p => {
            const ctm = p.getScreenCTM();
            const d = p.getAttribute('d');
            return Array.from(d.matchAll(/[ML]\\s*(-?[\\d.e+-]+)[ ,](-?[\\d.e+-]+)/g)).map(m => {
                const pt = new DOMPoint(parseFloat(m[1]), parseFloat(m[2])).matrixTransform(ctm);
                return [pt.x, pt.y];
            });
        });
    return {box: box && [box.left, box.top, box.right, box.bottom], lines};
}"""


@pytest.fixture(scope="module")
def manager(cache_dir, tiny_models):
    from helpers import engine_manager

    with engine_manager(cache_dir) as m:
        yield m


@pytest.fixture(scope="module")
def page(manager):
    from playwright.sync_api import sync_playwright

    demo, url = launch_demo(manager, UIDefaults(mode="eager"))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=chromium_env())
            pg = browser.new_page(viewport={"width": 1280, "height": 800})
            pg.set_default_timeout(60_000)
            pg.goto(url)
            pg.wait_for_selector("#generate-btn")
            pg.wait_for_function("document.querySelector('#engine-line').innerText.includes('Ready')",
                                 timeout=180_000)
            yield pg
            browser.close()
    finally:
        demo.close()


def outside_points(page, elem_id: str) -> tuple[list, list]:
    """(the drawn lines' vertex counts, the vertices outside the plot frame, 1 px of slack)."""
    drawn = page.eval_on_selector(f"#{elem_id}", POINTS_AND_FRAME)
    assert drawn["box"], f"#{elem_id} has no plot frame"
    left, top, right, bottom = drawn["box"]
    outside = [(round(x), round(y)) for line in drawn["lines"] for x, y in line
               if not (left - 1 <= x <= right + 1 and top - 1 <= y <= bottom + 1)]
    return [len(line) for line in drawn["lines"]], outside + ([] if drawn["lines"] else ["no line drawn"])


def line_of(page, elem_id: str, points: int) -> str:
    """JS: a line of `points` vertices is drawn in the plot."""
    return (f"Array.from(document.querySelectorAll('#{elem_id} g.mark-line path')).some(p => "
            f"(p.getAttribute('d') || '').split(/[ML]/).length - 1 === {points})")


@pytest.mark.parametrize("steps", [5, 9, 3])
def test_generate_draws_every_point_inside_the_plot(page, steps):
    """Three runs in a row at different step counts (the y range and the x axis change every run)."""
    page.get_by_role("tab", name="Generate").click()
    box = page.locator("#steps input[type=number]")
    box.fill(str(steps))
    box.press("Enter")
    page.click("#generate-btn")
    page.wait_for_function(f"document.querySelector('#stats')?.innerText.includes('({steps} steps)')",
                           timeout=180_000)
    try:
        page.wait_for_function(line_of(page, "step-plot", steps))
    except Exception:
        print(page.eval_on_selector_all("#step-plot g.mark-line path", "ps => ps.map(p => p.getAttribute('d'))"))
        raise
    page.wait_for_timeout(300)  # Vega draws the last update's axes with the line
    counts, outside = outside_points(page, "step-plot")
    assert counts == [steps] and not outside, (counts, outside)


def test_compare_draws_every_point_inside_the_plot(page):
    page.get_by_role("tab", name="Compare").click()
    page.click("#c-size input")
    page.locator(f'#c-size [role=option][aria-label^="{WATCHED}"]').first.click()
    page.keyboard.press("Escape")
    page.click("#compare-btn")
    page.wait_for_function("document.querySelectorAll('#c-speedup .virtual-body [role=row]').length === 2",
                           timeout=300_000)
    page.wait_for_function("document.querySelectorAll('#c-plot g.mark-line path').length >= 2")
    page.wait_for_timeout(300)
    counts, outside = outside_points(page, "c-plot")
    assert len(counts) >= 2 and not outside, (counts, outside)
