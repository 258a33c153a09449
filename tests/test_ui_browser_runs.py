"""What a run shows in a real headless Chromium: every drawn point of a per-step line lies inside its plot
area, and a Compare that waits on a compile says which one while it waits, the words moving.

A test that only finds a path passes when the y axis stays at 0-1 ms and the line is drawn thousands of
pixels above the chart; this one reads the path's vertices in screen coordinates and the plot frame's box.
One app and one page (eager by default, so no Generate queues a background compile); Generate three times
at different step counts, then a Compare whose regional compile waits in line, then the plot of a Compare.
"""

from __future__ import annotations

import itertools

import pytest
from helpers import browser_page, launch_demo, require_chromium

from ui.handlers import UIDefaults

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WATCHED = "64x64"

require_chromium()

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
    demo, url = launch_demo(manager, UIDefaults(mode="eager"))
    try:
        with browser_page(url, (1280, 800), timeout_ms=60_000) as pg:
            pg.wait_for_function("document.querySelector('#engine-line').innerText.includes('Ready')",
                                 timeout=180_000)
            yield pg
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


class _Held:
    """A compile that holds the host's compile slots as a waited-for one (the scheduler's public `want`), so
    the Compare's own compile waits in line behind it until the test lets it go."""

    key = "a held compile"

    def grant_compile(self, bucket) -> None:
        pass


def progress_text(page) -> str:
    """The Compare's progress as drawn over its status line (Gradio's progress overlay)."""
    return page.evaluate("() => (document.querySelector('#c-status')?.innerText || '').replace(/\\s+/g, ' ')")


def open_compare(page) -> None:
    page.get_by_role("tab", name="Compare").click()
    page.click("#c-size input")
    page.locator(f'#c-size [role=option][aria-label^="{WATCHED}"]').first.click()
    page.keyboard.press("Escape")


def test_a_compare_waiting_on_a_compile_names_it_and_its_words_move(page, manager):
    """The issue: 20 s into a Compare that waited 79 s for a regional compile, the page read only
    "queued on …: 0 earlier requests ahead" (or its placeholder). Sampled once a second, the progress names
    the compile (regional:64x64) and never reads the same for 5 samples in a row."""
    from engine.protocol import BucketKey, Mode, Size

    open_compare(page)
    for elem_id in ("c-timing", "c-fidelity-prompts"):
        box = page.locator(f"#{elem_id} input[type=number]")
        box.fill("0")
        box.press("Enter")
    held = [(_Held(), BucketKey(Mode("compile"), Size(8, 8 * (i + 1))))
            for i in range(manager.scheduler.jobs)]
    for engine, bucket in held:
        manager.scheduler.want(engine, bucket, waiting=1)
    try:
        page.click("#compare-btn")
        page.wait_for_function("(document.querySelector('#c-status')?.innerText || '').includes('regional:64x64')",
                               timeout=240_000)
        samples: list[str] = []
        shown: list[str] = []  # the overlay, not a heartbeat's blank (more of those on a loaded box)
        while len(shown) < 9 and len(samples) < 40:  # the compiles stay held until this ends
            samples.append(progress_text(page))
            if "steps |" in samples[-1] or "%" in samples[-1]:
                shown.append(samples[-1])
            page.wait_for_timeout(1000)
    finally:
        for engine, bucket in held:
            manager.scheduler.finished(engine, bucket)
    assert len(shown) >= 9, samples
    assert all(f"compile of regional:{WATCHED}" in s or f"compiling regional:{WATCHED}" in s for s in shown), shown
    runs = max(len(list(group)) for _, group in itertools.groupby(shown))
    assert runs < 5, shown  # the words move at least every 5 s
    page.wait_for_function("document.querySelectorAll('#c-speedup .virtual-body [role=row]').length === 2",
                           timeout=300_000)


def test_compare_draws_every_point_inside_the_plot(page):
    open_compare(page)
    page.click("#compare-btn")
    page.wait_for_function("document.querySelectorAll('#c-speedup .virtual-body [role=row]').length === 2",
                           timeout=300_000)
    page.wait_for_function("document.querySelectorAll('#c-plot g.mark-line path').length >= 2")
    page.wait_for_timeout(300)
    counts, outside = outside_points(page, "c-plot")
    assert len(counts) >= 2 and not outside, (counts, outside)
