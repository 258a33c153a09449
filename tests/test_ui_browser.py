"""The app in a real headless Chromium (Debian's, driven by PyPI playwright; never `playwright install`).

One app, one engine manager and one page per module; the tests run in file order like one user's session:
load the page, warm a bucket on the board, compare (also in a 1280x800 window), then generate, switch
bucket, cancel. The Generates run in the page's default compile mode at cold buckets: served eagerly, they
queue full compiles in the background that no test here waits for. Coming after the board and the compare,
those compiles neither run ahead of the bucket the board warms nor beside the compare's timing rounds, and
they end with the module's manager. Screenshots land in artifacts/.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from helpers import browser_page, launch_demo, require_chromium, wait_until

from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.errors import Cancelled
from engine.settings import DEFAULT_PRESET
from ui.handlers import UIDefaults

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
# The regional bucket this module warms from the board, then compares at: the default preset's first
# bucket, whose regional graph other tests (batching, step caches) compile into the session's cache too, so
# one of them compiles it and the rest load it.
WATCHED = "64x64"

require_chromium()


@pytest.fixture(scope="module")
def manager(cache_dir, tiny_models):
    """The page's own engine manager (the session's is not used here): shut down with the module, workers,
    background compiles and all."""
    from helpers import engine_manager

    with engine_manager(cache_dir) as m:
        yield m


@pytest.fixture(scope="module")
def app_url(manager):
    demo, url = launch_demo(manager, UIDefaults())  # the real defaults: auto device, compile mode
    yield url
    demo.close()


@pytest.fixture(scope="module")
def page(app_url):
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_page(None) as pg:  # each test loads the app itself
        pg.app_url = app_url
        pg.console_errors = []
        pg.on("console", lambda m: m.type == "error" and pg.console_errors.append(m.text))
        yield pg


def choose(page, elem_id: str, label_prefix: str) -> None:
    """Pick a Gradio dropdown option by the start of its label."""
    page.click(f"#{elem_id} input")
    page.locator(f'#{elem_id} [role=option][aria-label^="{label_prefix}"]').first.click()


def close_toasts(page) -> None:
    """Dismiss notifications so screenshots show the page."""
    for button in page.locator("[data-testid='toast-body'] button, .toast-close").all():
        try:
            button.click(timeout=1000)
        except Exception:
            pass


def plot_points(page, elem_id: str) -> list[int]:
    """Vertices of each drawn line of a LinePlot (Vega renders SVG: one path per series)."""
    paths = page.eval_on_selector_all(f"#{elem_id} g.mark-line path", "ps => ps.map(p => p.getAttribute('d') || '')")
    return [len(re.findall(r"[ML]", d)) for d in paths if d and d != "M0,0"]


def table_rows(page, elem_id: str) -> list[list[str]]:
    """Body rows of a gr.Dataframe (Gradio 6 draws a virtual grid: role=row / role=gridcell)."""
    return page.eval_on_selector_all(
        f"#{elem_id} .virtual-body [role=row]",
        "rows => rows.map(r => Array.from(r.querySelectorAll('[role=gridcell]')).map(c => c.innerText.trim()))")


def scroll_table(page, elem_id: str, page_index: int) -> bool:
    """Scroll a gr.Dataframe's grid to its `page_index`-th half-screen; False past its end."""
    moved = page.eval_on_selector(f"#{elem_id} .virtual-body", """(body, i) => {
        let el = body;
        while (el && !(el.scrollHeight > el.clientHeight + 2)) el = el.parentElement;
        if (!el) return false;
        const top = (i + 1) * Math.max(20, el.clientHeight / 2);
        if (top >= el.scrollHeight) { el.scrollTop = 0; return false; }
        el.scrollTop = top;
        return true;
    }""", page_index)
    if moved:
        page.wait_for_timeout(150)  # the grid draws the rows now in view
    return moved


def image_width(page, elem_id: str) -> int:
    return page.eval_on_selector(f"#{elem_id} img", "img => img.naturalWidth")


def drawn_lines(page, elem_id: str) -> list[tuple[int, str, float]]:
    """(vertices, stroke colour, stroke width) of each drawn line of a LinePlot."""
    return [tuple(line) for line in page.eval_on_selector_all(f"#{elem_id} g.mark-line path", """ps => ps
        .filter(p => (p.getAttribute('d') || '') && p.getAttribute('d') !== 'M0,0')
        .map(p => [(p.getAttribute('d').match(/[ML]/g) || []).length, getComputedStyle(p).stroke,
                   parseFloat(getComputedStyle(p).strokeWidth) * parseFloat(getComputedStyle(p).strokeOpacity)])""")]


def squeezed_headers(page, elem_id: str) -> list[tuple[str, float, float]]:
    """Header cells of a gr.Dataframe whose longest word is wider than the room its text has, i.e. that
    break inside a word ("cache hits" one letter a line): (header, word width px, room px)."""
    return [tuple(h) for h in page.eval_on_selector_all(f"#{elem_id} [role=columnheader]", """ths => ths.map(th => {
        const text = th.innerText.trim();
        let holder = th;  // the innermost element that holds the whole text
        for (const el of th.querySelectorAll('*')) if (el.innerText && el.innerText.trim() === text) holder = el;
        const style = getComputedStyle(holder);
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
        const word = text.split(/\\s+/).reduce((a, b) => ctx.measureText(b).width > ctx.measureText(a).width ? b : a, '');
        const room = holder.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        return [text, ctx.measureText(word).width, room];
    }).filter(([text, word, room]) => text && word > room + 1)""")]


def in_view(page, locator) -> bool:
    """The element is drawn inside the viewport and no ancestor that clips (overflow) cuts it."""
    return locator.is_visible() and locator.evaluate("""el => {
        const r = el.getBoundingClientRect();
        if (r.width === 0 || r.top < 0 || r.bottom > innerHeight || r.left < 0 || r.right > innerWidth) return false;
        for (let a = el.parentElement; a; a = a.parentElement) {
            const s = getComputedStyle(a);
            if (s.overflowX === 'visible' && s.overflowY === 'visible') continue;
            const b = a.getBoundingClientRect();
            if (r.left < b.left - 1 || r.right > b.right + 1 || r.top < b.top - 1 || r.bottom > b.bottom + 1) return false;
        }
        return true;
    }""")


def test_page_renders_and_the_default_engine_gets_ready(page):
    start = time.perf_counter()
    page.goto(page.app_url)
    page.wait_for_selector("#generate-btn")
    rendered = time.perf_counter() - start
    print(f"page rendered in {rendered:.2f} s")
    page.wait_for_function("document.querySelector('#engine-line').innerText.includes('Ready')", timeout=180_000)
    for tab in ("Generate", "Buckets", "Compare", "System"):
        assert page.get_by_role("tab", name=tab).is_visible()


def spy_on_generate(manager, monkeypatch) -> tuple[list, threading.Event]:
    """How each engine request the UI makes ends (result or exception), and an event set once the first
    one is submitted to its engine."""
    outcomes, submitted, real = [], threading.Event(), manager.generate

    def spy(spec, on_submit=None, **hooks):
        def submit(request_id):
            on_submit(request_id)
            submitted.set()

        try:
            outcomes.append(real(spec, on_submit=submit, **hooks))
        except Exception as exc:
            outcomes.append(exc)
            raise
        return outcomes[-1]

    monkeypatch.setattr(manager, "generate", spy)
    return outcomes, submitted


def stopped_early(outcomes: list, steps: int, timeout: float = 60) -> str:
    """The first engine request's end: Cancelled before its last step (its message is returned)."""
    deadline = time.monotonic() + timeout
    while not outcomes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcomes and isinstance(outcomes[0], Cancelled), outcomes
    message = str(outcomes[0])
    ran = re.search(rf"after step (\d+) of {steps}", message)
    assert "before it started" in message or (ran and int(ran.group(1)) < steps), message
    return message


def test_the_board_shows_a_bucket_becoming_warm(page):
    page.get_by_role("tab", name="Buckets").click()
    page.wait_for_function("document.querySelectorAll('#board .virtual-body [role=row]').length >= 12")
    engine = f"{DEFAULT_PRESET}@cpu/fp32"  # the page's own engine: the compare below runs on it
    choose(page, "board-engine", engine)
    choose(page, "board-mode", "regional")
    choose(page, "board-size", WATCHED)

    def watched_state():
        # The board lists every bucket of every loaded engine in a virtual grid that draws only the rows in
        # view: scroll through it until the row shows.
        for top in range(0, 40):
            for row in table_rows(page, "board"):
                if row[0] == engine and row[3] == "regional" and row[4] == WATCHED:
                    return row[5]
            if not scroll_table(page, "board", top):
                return None
        return None

    # The bucket is cold before the click (read before it: the board's next tick after the click can
    # already show it queued)
    deadline = time.monotonic() + 30
    while watched_state() is None and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    seen, first_change = [watched_state()], None
    assert seen == ["cold"], seen
    clicked = time.perf_counter()
    page.click("#warm-btn")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        state = watched_state()
        if state and (not seen or seen[-1] != state):
            seen.append(state)
            if state != "cold" and first_change is None:
                first_change = time.perf_counter() - clicked
        if state in ("warm", "failed"):
            break
        page.wait_for_timeout(250)
    print(f"board: {WATCHED} regional went {' -> '.join(seen)}; first change on the board after {first_change:.2f} s, "
          f"warm after {time.perf_counter() - clicked:.1f} s")
    # cold -> (queued / compiling, when a poll lands on them: with a hot compile cache and the same worker
    # having compiled other sizes already, the compile can take under a second) -> warm
    assert seen[0] == "cold" and seen[-1] == "warm", seen
    assert set(seen) <= {"cold", "queued", "compiling", "warm"}
    close_toasts(page)
    page.screenshot(path=str(ARTIFACTS / "ui_board.png"), full_page=True)


def open_compare(page) -> None:
    """The Compare tab at the WATCHED size, the page loaded first where no earlier test has (a test run alone)."""
    if not page.url.startswith(page.app_url):
        page.goto(page.app_url)
        page.wait_for_selector("#generate-btn")
        page.wait_for_function("document.querySelector('#engine-line').innerText.includes('Ready')",
                               timeout=180_000)
    page.get_by_role("tab", name="Compare").click()
    choose(page, "c-size", WATCHED)
    page.keyboard.press("Escape")


def test_compare_shows_latencies_speedups_and_images_side_by_side(page):
    open_compare(page)
    page.click("#compare-btn")
    page.wait_for_function("document.querySelectorAll('#c-speedup .virtual-body [role=row]').length === 2", timeout=240_000)
    # The images are on the cards (the gallery sits in a closed accordion), one per configuration.
    page.wait_for_function("Array.from(document.querySelectorAll('#c-cards .c-card img:not(.c-heat)'))"
                           ".filter(i => i.complete && i.naturalWidth === 64).length === 2")
    page.wait_for_function("document.querySelectorAll('#c-plot g.mark-line path').length >= 2")
    speedups = {r[0]: r for r in table_rows(page, "c-speedup")}
    assert set(speedups) == {"cpu/fp32/eager (reference)", "cpu/fp32/regional"}
    assert speedups["cpu/fp32/eager (reference)"][2].startswith("1.00× (reference, ")
    # A figure with its spread; a busy CI box adds "· marked: host load ..." after it.
    assert re.search(r"[\d.]+×.*, \d+ images\)( · marked: .+)?$", speedups["cpu/fp32/regional"][2])
    # The A/B slider: the reference's image and the (only) other configuration's, both loaded.
    page.wait_for_function("Array.from(document.querySelectorAll('#c-ab img'))"
                           ".filter(i => i.complete && i.naturalWidth === 64).length === 2")
    cards = page.locator("#c-cards .c-card")
    assert cards.nth(0).locator(".c-card-title").inner_text() == "cpu/fp32/eager"
    assert cards.nth(0).locator(".c-drift").inner_text() == "drift: reference"
    assert cards.nth(1).locator(".c-card-title").inner_text() == "cpu/fp32/regional"
    assert re.fullmatch(r"drift: (identical|[\d.]+ dB / \d+(, SSIM [\d.]+)?)", cards.nth(1).locator(".c-drift").inner_text())
    steps = get_preset(DEFAULT_PRESET).steps  # the form starts with the default preset's steps
    assert sorted(plot_points(page, "c-plot")) == [steps, steps]  # both series drawn, one point per step
    legend = page.eval_on_selector_all("#c-plot g.role-legend-label text", "ts => ts.map(t => t.textContent)")
    assert sorted(legend) == ["cpu/fp32/eager", "cpu/fp32/regional"]  # the legend grew with the second series
    costs = {r[0]: r for r in table_rows(page, "c-costs")}
    assert costs["cpu/fp32/regional"][1] == "warm" and float(costs["cpu/fp32/regional"][2]) > 0
    close_toasts(page)
    page.screenshot(path=str(ARTIFACTS / "ui_compare.png"), full_page=True)


def test_compare_cancel_stops_the_comparison(page, manager, monkeypatch):
    """Cancel while the first configuration's request waits in its engine's queue: it never runs, nor
    does the second configuration, and the page shows both cancelled.

    Requests that are not the page's keep the engine busy until the page's request is cancelled, so the
    test does not depend on how fast a headless browser on a busy machine takes the click.
    """
    open_compare(page)
    blockers: list[str] = []
    real_cancel = manager.cancel

    def occupy_the_engine():
        try:
            # The page's own address: an engine serves its clients in turn, so another client's requests
            # would let the page's run after the first of them.
            manager.generate(ImageRequest(preset=DEFAULT_PRESET, device="cpu", precision="fp32",
                                          size="128x128", steps=200, prompt="a busy engine",
                                          client="127.0.0.1"), on_submit=blockers.append)
        except Cancelled:
            pass

    busy = [threading.Thread(target=occupy_the_engine, daemon=True) for _ in range(3)]
    for thread in busy:
        thread.start()
    deadline = time.monotonic() + 60
    while len(blockers) < len(busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert len(blockers) == len(busy), "the engine never took the blocking requests"
        outcomes, submitted = spy_on_generate(manager, monkeypatch)
        steps = page.locator("#c-steps input[type=number]")
        steps.fill("200")
        steps.press("Enter")
        page.click("#compare-btn")
        assert submitted.wait(60)  # the first configuration's request is queued behind the blockers
        page.click("#c-cancel-btn")
        # Gradio closed the handler, which cancelled its request: it ends while the blockers still run (the
        # engine answers a cancelled request that waits at once, not when its turn comes: the page's 4 s
        # toast was long gone by then)
        wait_until(lambda: outcomes, 120, message="the Cancel button did not stop the comparison")
        assert all(thread.is_alive() for thread in busy), "the page's request was answered only at its turn"
    finally:
        for request_id in blockers:
            real_cancel(request_id)
        for thread in busy:
            thread.join(60)
    assert "before it started" in stopped_early(outcomes, 200)
    page.locator("[data-testid='toast-body']", has_text="Cancelled").first.wait_for()
    page.wait_for_function(
        "document.querySelector('#c-costs').innerText.includes('cancelled before it started')")
    costs = {r[0]: r[-1] for r in table_rows(page, "c-costs")}
    assert costs == {"cpu/fp32/eager": "cancelled", "cpu/fp32/regional": "cancelled before it started"}
    assert len(outcomes) == 1  # the second configuration never reached the engine
    close_toasts(page)
    steps.fill("4")
    steps.press("Enter")


def test_compare_price_reads_at_1280x800(page):
    """On a laptop-sized window, the drift and fidelity under each image are in view once scrolled to, and
    the price table fits its column (its text wraps) instead of scrolling sideways."""
    page.set_viewport_size({"width": 1280, "height": 800})
    try:
        page.get_by_role("tab", name="Compare").click()
        page.locator("#c-modes label", has_text="regional").click()  # eager only
        page.locator("#c-precisions label", has_text="bf16").click()  # fp32 (the reference) and bf16
        samples = page.locator("#c-fidelity-prompts input[type=number]")
        samples.fill("4")
        samples.press("Enter")
        page.click("#compare-btn")
        # its progress under the buttons, in view (the cards start below the fold)
        page.wait_for_function("/step \\d+\\/\\d+|queued|loading|waiting/.test(document.querySelector('#c-status').innerText)",
                               timeout=120_000)
        assert in_view(page, page.locator("#c-status"))
        page.wait_for_function("document.querySelectorAll('#c-cards .c-card .c-fidelity').length === 2"
                               " && document.querySelectorAll('#c-costs .virtual-body [role=row]').length === 2",
                               timeout=300_000)
        close_toasts(page)
        cards = page.locator("#c-cards .c-card")
        assert [cards.nth(i).locator(".c-card-title").inner_text() for i in range(cards.count())] == [
            "cpu/fp32/eager", "cpu/bf16/eager"]
        for i in range(2):
            card = cards.nth(i)
            card.scroll_into_view_if_needed()
            drift, fidelity = card.locator(".c-drift"), card.locator(".c-fidelity")
            assert re.fullmatch(r"drift: (reference|identical|[\d.]+ dB / \d+(, SSIM [\d.]+)?)", drift.inner_text())
            assert re.match(r"fidelity: \d+ % \(\d/4 prompts\) · ", fidelity.inner_text())
            for part in (card.locator(".c-time"), drift, fidelity, card.locator("img").first):
                assert in_view(page, part), f"card {i}: {part} is not in view"
        # the cards come after the quality images; the paired speedups after the timing rounds that follow
        page.wait_for_function("document.querySelector('#c-speedup').innerText.includes('(reference, ')",
                               timeout=300_000)
        page.screenshot(path=str(ARTIFACTS / "ui_compare_1280.png"))
        table = page.locator("#c-speedup")
        table.scroll_into_view_if_needed()
        box = table.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 1280, box
        sideways = table.evaluate("""el => Array.from(el.querySelectorAll('*'))
            .filter(e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX))
            .map(e => e.scrollWidth - e.clientWidth)""")
        assert max(sideways, default=0) <= 2, f"the price table scrolls sideways: {sideways}"
        rows = {r[0]: r for r in table_rows(page, "c-speedup")}
        assert rows["cpu/fp32/eager (reference)"][2].startswith("1.00× (reference, ") and "prompts)" in rows["cpu/bf16/eager"][6]
        for cell in table.locator("[role=gridcell]").all():  # every cell's text wraps inside its column
            assert cell.evaluate("c => c.scrollWidth <= c.clientWidth + 2"), cell.inner_text()
        page.locator("#c-costs").scroll_into_view_if_needed()
        for elem_id in ("c-speedup", "c-costs"):  # no header breaks inside a word
            assert not squeezed_headers(page, elem_id), (elem_id, squeezed_headers(page, elem_id))
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})


def test_advisor_progress_is_in_view_while_it_runs_and_a_cancel_says_so(page):
    page.set_viewport_size({"width": 1280, "height": 800})
    try:
        page.get_by_role("tab", name="Advisor").click()
        assert not squeezed_headers(page, "a-table"), squeezed_headers(page, "a-table")
        minutes = page.locator("#a-minutes input[type=number]")
        minutes.fill("1")
        minutes.press("Enter")
        page.click("#advise-btn")
        status = page.locator("#a-status")
        # The child process reports its progress: the status line under the buttons (with the bar) says how far
        # seconds of its budget used (it moves with every configuration), what it measures, how many so far
        page.wait_for_function("/Running · \\d+ s of \\d+ s: .+ · \\d+ timed/.test(document.querySelector('#a-status').innerText)",
                               timeout=120_000)
        assert in_view(page, status) and status.bounding_box()["height"] >= 30
        page.screenshot(path=str(ARTIFACTS / "ui_advisor_running_1280.png"))
        page.click("#a-cancel-btn")
        page.wait_for_function("document.querySelector('#a-status').innerText.startsWith('Cancelled')", timeout=30_000)
        assert in_view(page, status) and "no pick" in status.inner_text()
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})


def test_generate_shows_the_image_and_one_plot_point_per_step(page):
    """At 1280x800, scrolled down to the steps slider (the controls are taller than the window), the image
    and the run's progress stay in view after pressing Generate; the per-step line is drawn, one point a step."""
    page.set_viewport_size({"width": 1280, "height": 800})
    try:
        page.get_by_role("tab", name="Generate").click()
        page.evaluate("window.scrollTo(0, 0)")  # from the top, as a page just loaded (earlier tests scrolled)
        steps = page.locator("#steps input[type=number]")
        steps.fill("5")
        steps.press("Enter")
        assert page.evaluate("scrollY") > 0  # the slider sits below the fold: the page scrolled to it
        page.click("#generate-btn")
        # the progress (queued / loading / step n/5) is drawn over the image while it runs
        page.wait_for_function("/queued|loading|waiting|step \\d/.test(document.querySelector('#output-image').innerText)"
                               " || document.querySelector('#output-image img')", timeout=60_000)
        assert in_view(page, page.locator("#output-image")), "the image and its progress are off-screen"
        page.wait_for_function("document.querySelector('#output-image img')?.naturalWidth === 64", timeout=120_000)
        page.wait_for_function("document.querySelector('#stats')?.innerText.includes('(5 steps)')")
        page.wait_for_function(
            "Array.from(document.querySelectorAll('#step-plot g.mark-line path')).some(p => (p.getAttribute('d') || '')"
            ".split(/[ML]/).length - 1 === 5)")
        assert in_view(page, page.locator("#output-image img")) and in_view(page, page.locator("#step-plot"))
        lines = drawn_lines(page, "step-plot")
        assert [points for points, _, _ in lines] == [5], lines
        (_, stroke, width), = lines
        assert stroke not in ("none", "", "rgba(0, 0, 0, 0)") and width > 0, lines  # a visible line
        legend = page.eval_on_selector_all("#step-plot g.role-legend-label text",
                                           "ts => ts.filter(t => t.getBoundingClientRect().width > 0).map(t => t.textContent)")
        assert legend == ["computed"]  # no empty "cached" entry: no step was cached
        ticks = page.eval_on_selector_all("#step-plot g.role-axis-label text", "ts => ts.map(t => t.textContent)")
        assert {"1", "2", "3", "4", "5"} <= set(ticks) and not [t for t in ticks if "." in t], ticks  # whole steps
        stats = dict(r[:2] for r in table_rows(page, "stats") if len(r) >= 2)
        assert "eager fallback" in stats["bucket"]  # compile mode at a bucket that is not warm yet: served now
        assert stats["total"].endswith("ms")
        # Outside any scroller: the notice, the seed, the peak memory; the history holds the image.
        summary = page.locator("#run-summary")
        assert in_view(page, summary) and "served eagerly" in summary.inner_text()
        assert "seed 0" in summary.inner_text() and "peak memory" in summary.inner_text()
        assert page.locator("#history img").count() == 1
        assert "5 steps" in page.inner_text("#history")
        assert not squeezed_headers(page, "stats")
        close_toasts(page)
        page.screenshot(path=str(ARTIFACTS / "ui_generate_1280.png"))
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})


def test_switching_bucket_generates_at_that_size(page):
    choose(page, "size", "128x128")
    page.click("#generate-btn")
    page.wait_for_function("document.querySelector('#output-image img')?.naturalWidth === 128", timeout=120_000)
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('128x128')")
    assert image_width(page, "output-image") == 128
    close_toasts(page)
    page.screenshot(path=str(ARTIFACTS / "ui_generate.png"), full_page=True)
    # Every bucket label carries its state, e.g. "128x128 · cold".
    page.click("#size input")
    labels = page.eval_on_selector_all("#size [role=option]", "os => os.map(o => o.getAttribute('aria-label'))")
    page.keyboard.press("Escape")
    assert len(labels) == 4 and all(re.match(r"^\d+x\d+ · (cold|queued|compiling|warm|failed)$", s) for s in labels)


def test_cancel_stops_the_run_between_steps(page, manager, monkeypatch):
    """The Cancel button (Gradio's cancels=) closes the handler, which cancels the engine request.

    Clicked as soon as the request reaches its engine, at 128x128 (the bucket picked above): a tiny
    model steps so fast that, later in a run, the page's progress updates can keep a headless browser
    on a busy machine from taking the click before the run is over.
    """
    outcomes, submitted = spy_on_generate(manager, monkeypatch)
    steps = page.locator("#steps input[type=number]")
    steps.fill("200")
    steps.press("Enter")
    page.click("#generate-btn")
    assert submitted.wait(120)
    clicked = time.monotonic()
    page.click("#cancel-btn")
    message = stopped_early(outcomes, 200)
    print(f"Cancel: the engine request ended {time.monotonic() - clicked:.2f} s after the click: {message}")
    # The page shows the run cancelled: a toast, no image, the stats of what ran without a progress row.
    page.locator("[data-testid='toast-body']", has_text="Cancelled").first.wait_for()
    page.wait_for_function("document.querySelector('#stats').innerText.includes('denoise')")
    assert "progress" not in page.inner_text("#stats")
    assert page.locator("#output-image img").count() == 0
    page.wait_for_function("document.querySelector('#run-summary').innerText.startsWith('Cancelled')")
    assert "cancelled after step" in page.inner_text("#stats")
    close_toasts(page)
    steps.fill("5")
    steps.press("Enter")


def test_an_unavailable_device_is_refused_with_its_reason(page):
    choose(page, "device", "tpu")
    page.wait_for_function("document.querySelector('#engine-line').innerText.includes('not available')")
    page.click("#generate-btn")
    toast = page.locator("[data-testid='toast-body']", has_text="torch_tpu").first
    toast.wait_for()
    choose(page, "device", "auto")
    page.wait_for_function("document.querySelector('#engine-line').innerText.includes('Ready')")


def test_system_tab_shows_devices_and_no_secrets(page):
    page.get_by_role("tab", name="System").click()
    page.wait_for_function("document.querySelector('#system')?.innerText.includes('Cache folders')")
    text = page.inner_text("#system")
    assert "torch_tpu is not installed" in text and "diffusers" in text
    close_toasts(page)
    page.screenshot(path=str(ARTIFACTS / "ui_system.png"), full_page=True)
    assert not [e for e in page.console_errors if "Failed to load resource" not in e]
