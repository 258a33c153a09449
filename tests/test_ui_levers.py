"""The levers in the UI without a server: plots typed as numbers, the Compare tab's price per
configuration, the step-cache and precision selectors, the advisor's views."""

from __future__ import annotations

import gradio as gr
import pytest

from ui import advisor_views, compare_views, generate_views, views
from ui.compare import CompareHandlers
from ui.generate import GenerateHandlers


def plot_types(frame, **kwargs) -> dict:
    """The axis types Gradio sends to the browser's Vega-Lite spec for this plot value."""
    return gr.LinePlot(x="step", y="step_ms", **kwargs).postprocess(frame).datatypes


@pytest.mark.parametrize("result", [
    None,  # before any run
    {"running": True, "engine": "e", "steps": 8, "timings": {"step_ms": []}},  # the first partial
    {"running": True, "engine": "e", "steps": 8, "timings": {"step_ms": [29.403943, 10.0420119998]}},
    {"engine": "e", "timings": {"step_ms": [10.04, 29.4, 9.1]}, "cached_steps": [2]},
])
def test_the_generate_plot_types_its_axes_from_its_first_value(result):
    # The browser builds the plot's spec from the first value it gets (the empty partial) and only swaps
    # the data afterwards: that first value must already type step as labels (whole-step ticks, in
    # STEP_ORDER) and step_ms as a number.
    plot, _, _ = GenerateHandlers.render_run(None, result)
    types = plot_types(plot["value"], color="steps", sort=generate_views.STEP_ORDER)
    assert types["step"] == "nominal" and types["step_ms"] == "quantitative"
    assert types["steps"] == "nominal"


@pytest.mark.parametrize("result, axis", [
    ({"running": True, "engine": "e", "steps": 8, "timings": {"step_ms": []}}, 8),  # the first partial
    ({"running": True, "engine": "e", "steps": 4, "timings": {"step_ms": [3.0]}}, 4),
    ({"engine": "e", "steps": 1, "timings": {"step_ms": [3.0]}}, 2),
])
def test_the_generate_plot_spans_the_runs_steps_from_its_first_value(result, axis):
    """A first, empty partial drew a one-value axis ticked "1.000000"; a numeric axis of 4 steps was ticked 1.5,
    2.5. No update sets y_lim: the browser kept the empty partial's [0, 1] through a later None and drew the line
    off the chart (tests/test_ui_browser_plot.py)."""
    plot, _, _ = GenerateHandlers.render_run(None, result)
    assert list(dict.fromkeys(plot["value"]["step"])) == [str(step) for step in range(1, axis + 1)]
    assert "y_lim" not in plot and "x_lim" not in plot


@pytest.mark.parametrize("cached, classes", [([], ["no-cached"]), ([2], [])])
def test_the_plot_legend_lists_cached_only_where_a_step_was_cached(cached, classes):
    result = {"engine": "e", "steps": 3, "timings": {"step_ms": [10.0, 2.0, 9.0]}, "cached_steps": cached}
    plot, _, _ = GenerateHandlers.render_run(None, result)
    assert plot["elem_classes"] == classes  # "no-cached" hides the legend's cached entry (ui/blocks.py)


def test_every_series_of_a_full_compare_has_its_own_colour_and_legend_entry():
    """The legend repeated eager fp32's colour from the 7th series on, and its last entries were cut."""
    configs = [f"cpu/{p}/eager/{c}" for p in ("fp32", "bf16", "int8wo") for c in ("first-block:0.2", "magcache:0.06")]
    names = ["cpu/fp32/eager"] + [n for c in configs for n in (c, c + compare_views.CACHED_SUFFIX)]
    colors = compare_views.series_colors(names)
    assert len(set(colors.values())) == len(names) == 13
    assert colors[configs[0] + compare_views.CACHED_SUFFIX] == compare_views.tint(colors[configs[0]])  # its own hue, lighter
    legend = compare_views.legend_html(colors)
    assert legend.count('class="legend-item"') == 13 and "cpu/int8wo/eager/magcache:0.06 · cached" in legend


def test_cached_steps_are_their_own_series():
    result = {"engine": "e", "timings": {"step_ms": [10.0, 2.0, 11.0, 2.5]}, "cached_steps": [2, 4]}
    rows = views.step_rows(result)
    assert [r["steps"] for r in rows] == ["computed", "cached", "computed", "cached"]
    compare = compare_views.compare_step_rows([{**result, "config": "cpu/fp32/eager"}])
    assert [r["config"] for r in compare] == ["cpu/fp32/eager", "cpu/fp32/eager · cached"] * 2


def test_the_compare_plot_is_numeric_even_when_every_configuration_failed():
    payload = {"done": True, "results": [{"config": "a", "error": "x"}, {"config": "b", "error": "y"}]}
    plot, _, _ = CompareHandlers.render_compare(None, payload)[:3]
    types = plot_types(plot["value"], color="config")
    assert types["step"] == "quantitative" and types["step_ms"] == "quantitative"


# -- Compare on the embedded model ------------------------------------------------------------------
class Progress:
    def __call__(self, *args, **kwargs):
        pass


@pytest.fixture(scope="module")
def handlers(manager):
    from ui.handlers import Handlers, UIDefaults

    return Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))


def run_compare(handlers, precisions, modes, caches=None, fidelity_prompts=3,
                prompt="a red circle on a blue background",
                steps=4):
    outputs = list(handlers.compare(prompt=prompt, preset="tiny-shapes", size="64x64", steps=steps,
                                    guidance=1.0, seed=5, devices=["cpu"], precisions=precisions, modes=modes,
                                    wait_for_warm=False, caches=caches, fidelity_prompts=fidelity_prompts,
                                    timing_s=0, request=None, progress=Progress()))
    return outputs[-1]


def test_compare_adds_the_reference_and_prices_every_configuration(handlers):
    _, payload, thumbnails = run_compare(handlers, ["bf16"], ["eager"])
    configs = [r["config"] for r in payload["results"]]
    assert configs == ["cpu/fp32/eager", "cpu/bf16/eager"]  # the reference first, added and said so
    ref, bf16 = payload["results"]
    assert ref["reference"] and "added" in ref["reference_note"] and "drift" not in ref
    assert len(bf16["image_ms"]) == 4  # the prompt and 3 fidelity prompts, each timed
    # bf16 against fp32 at the same prompts and seeds: close, not identical (a reference drawn with
    # another seed or prompt would read ~10 dB)
    assert bf16["drift_samples"] == 4 and bf16["drift_psnr_db"] > 20 and bf16["drift_max_diff"] > 0
    assert 0.0 <= bf16["fidelity"] <= 1.0 and bf16["fidelity_samples"] == 3 and bf16["fidelity_this"] in (True, False)
    rows = {r[0]: r for r in compare_views.price_rows(payload["results"])}
    assert rows["cpu/fp32/eager (reference)"][2] == "1.00×"
    assert rows["cpu/bf16/eager"][2].endswith("×") and "worst of 4" in rows["cpu/bf16/eager"][5]
    assert "prompts)" in rows["cpu/bf16/eager"][6]
    plot, price, costs, cards = handlers.render_compare(payload, thumbnails)[:4]
    # two images, and beside bf16's the heat map of its difference to the reference's
    assert cards.count('class="c-card"') == 2 and cards.count("data:image/png;base64,") == 3
    assert cards.count('class="c-heat"') == 1
    assert "drift: " in cards and "fidelity: " in cards and "vs eager fp32" in cards


def test_compare_with_the_reference_picked_runs_it_once(handlers):
    _, payload, _ = run_compare(handlers, ["fp32"], ["eager", "regional"], fidelity_prompts=0)
    configs = [r["config"] for r in payload["results"]]
    assert configs == ["cpu/fp32/eager", "cpu/fp32/regional"]
    assert "picked" in payload["results"][0]["reference_note"]
    assert "fidelity" not in payload["results"][1] and payload["results"][1]["fidelity_this"] is True


def test_compare_prices_a_step_cache_and_int8_against_the_reference(handlers):
    _, payload, thumbnails = run_compare(handlers, ["fp32", "int8wo"], ["eager"], ["none", "taylorseer:3:2"],
                                         fidelity_prompts=2, steps=8)
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == ["cpu/fp32/eager", "cpu/fp32/eager/taylorseer:3:2", "cpu/int8wo/eager",
                             "cpu/int8wo/eager/taylorseer:3:2"]
    assert not any(r.get("error") for r in results.values()), [r.get("error") for r in results.values()]
    assert len(thumbnails) == 7  # four images, three heat maps (none for the reference)
    cached = results["cpu/fp32/eager/taylorseer:3:2"]
    assert cached["step_cache"] == "taylorseer:3:2" and cached["cached_steps"]
    assert cached["computed_steps"] + len(cached["cached_steps"]) == 8
    assert cached["drift_max_diff"] > 0  # reused steps change the pixels a little
    int8 = results["cpu/int8wo/eager"]
    assert int8["precision"] == "int8wo" and not int8["cached_steps"] and int8["drift_max_diff"] > 0
    assert 0.0 <= int8["fidelity"] <= 1.0 and int8["fidelity_samples"] == 2
    rows = {r[0]: r for r in compare_views.price_rows(payload["results"])}
    n = len(cached["cached_steps"])
    assert rows["cpu/fp32/eager/taylorseer:3:2"][4] == f"{8 - n} / {n}"
    assert rows["cpu/fp32/eager (reference)"][4] == "8 / 0"
    plot, _, _, cards = handlers.render_compare(payload, thumbnails)[:4]
    assert "cpu/fp32/eager/taylorseer:3:2 · cached" in set(plot["value"]["config"])  # cached steps: own series
    assert f"steps computed / cached: {8 - n} / {n}" in cards and cards.count("data:image/png;base64,") == 7


@pytest.mark.parametrize("result", [
    None,
    {"running": True, "engine": "e", "steps": 8, "timings": {"step_ms": []}},  # the first partial: no step yet
    {"running": True, "engine": "e", "steps": 8, "timings": {"step_ms": [12.0, 11.0]}},
])
def test_every_generate_plot_value_names_both_series_first(result):
    # The browser fixes the plot's colours from the series in the value it builds the plot with: a series it
    # does not see then is drawn without a stroke (an empty line), so each value names both, without a point.
    plot, _, _ = GenerateHandlers.render_run(None, result)
    value = gr.LinePlot(x="step", y="step_ms", color="steps").postprocess(plot["value"])
    assert [row[2] for row in value.data[:2]] == [views.COMPUTED, views.CACHED]
    assert [row[1] for row in value.data[:2]] == [None, None]  # not drawn: JSON null
    steps = (result or {}).get("timings", {}).get("step_ms", [])
    assert [row[1] for row in value.data[2:2 + len(steps)]] == steps  # one point per step after them
    assert all(row[1] is None for row in value.data[2 + len(steps):])  # the steps to come: no point yet


def test_the_run_summary_shows_notices_seed_memory_and_how_the_run_ended():
    done = {"engine": "tiny-shapes@cpu/fp32", "mode": "eager", "bucket": "128x128", "seed": 7,
            "peak_memory_bytes": 3 * 2**20, "notices": ["size 100x100 snapped to 128x128", "empty prompt"],
            "timings": {"step_ms": [5.0, 4.0], "total_ms": 20.0, "median_step_ms": 4.5}}
    text = generate_views.run_summary(done)
    assert "20.0 ms" in text and "seed 7" in text and "3.0 MiB" in text
    assert "⚠ size 100x100 snapped to 128x128" in text and "⚠ empty prompt" in text
    cancelled = {**done, "cancelled": True, "message": "cancelled after step 2 of 60"}
    assert generate_views.run_summary(cancelled).startswith("**Cancelled** (cancelled after step 2 of 60)")
    assert generate_views.stats_rows(cancelled)[0] == ["run", "cancelled after step 2 of 60"]
    assert generate_views.run_summary({**done, "error": "out of memory"}) == "**Failed:** out of memory"
    assert "Generate" in generate_views.run_summary(None)


def test_a_step_cache_reason_shared_by_several_caches_is_said_once():
    why = "compile traces the whole denoiser into one graph, which cannot skip its own blocks per step"
    rows = [{"name": "none", "usable": True}, *({"name": n, "default": f"{n}:2", "usable": False, "why_not": why}
                                               for n in ("first-block", "taylorseer", "pyramid")),
            {"name": "magcache", "usable": False, "why_not": "needs a calibration"}]
    labels = [label for label, _ in views.step_cache_choices(rows, short=True)]
    assert labels == ["none", "first-block · unavailable", "taylorseer · unavailable", "pyramid · unavailable",
                      "magcache · unavailable"]
    reasons = generate_views.step_cache_reasons(rows)
    assert reasons.count(why) == 1 and "(first-block, taylorseer, pyramid)" in reasons
    assert "(magcache): needs a calibration" in reasons


def test_the_history_keeps_the_last_runs_newest_first_with_their_figures():
    from PIL import Image

    history = []
    for seed in range(generate_views.HISTORY_RUNS + 2):
        timings = {"engine": "tiny-shapes@cpu/fp32", "mode": "eager", "bucket": "64x64", "seed": seed,
                   "step_cache": "first-block:0.2", "timings": {"step_ms": [1.0] * 4, "total_ms": 12.5}}
        history = GenerateHandlers.remember(history, Image.new("RGB", (512, 256)), timings)
    assert len(history) == generate_views.HISTORY_RUNS
    thumb, caption, number = history[0]
    assert number == generate_views.HISTORY_RUNS + 2 and max(thumb.size) <= 256
    assert caption == (f"#{number} · tiny-shapes@cpu/fp32 · eager:64x64 · first-block:0.2 · 4 steps · "
                       f"seed {number - 1} · 12.5 ms")


def d3_ticks(low: float, high: float, count: int) -> list[float]:
    """The tick values Vega draws (d3-array's ticks: a step of 1, 2 or 5 times a power of ten)."""
    import math

    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step)
    return [i * step for i in range(first, math.floor(high / step) + 1)]


def test_the_frontiers_time_axis_never_repeats_a_tick():
    """One point (a short run) made an axis whose ".3~f" ticks repeated; at 3 significant digits over the
    padded span every tick reads differently (15 ticks: the plot's half-page width)."""
    for seconds in (0.0512, 0.088, 0.105, 0.15, 0.3, 0.999, 1.05, 2.4):
        for values in ([seconds], [seconds, seconds * 1.01]):
            low, high = advisor_views.padded_limits(values, min_share=advisor_views.TIME_AXIS_SHARE)
            labels = [f"{t:.3g}" for t in d3_ticks(low, high, 15)]
            assert len(labels) >= 3 and len(set(labels)) == len(labels), (values, labels)


def test_frontier_axes_are_padded_and_the_frontier_is_named():
    assert advisor_views.padded_limits([93.75, 93.75]) == [89.0625, 98.4375]  # one value: not a zero-width axis
    assert advisor_views.padded_limits([0.1, 0.3]) == [0.08, 0.32]
    assert advisor_views.padded_limits([]) is None
    rows = [{"label": "fp32/eager", "s_per_image": 0.30, "fidelity": 1.0, "eligible": True},
            {"label": "bf16/eager", "s_per_image": 0.20, "fidelity": 0.9, "eligible": True},
            {"label": "bf16/compile", "s_per_image": 0.25, "fidelity": 0.8, "eligible": False}]
    caption = advisor_views.frontier_caption({"rows": rows, "pick": {"label": "bf16/eager"}})
    assert caption == ("3 configurations drawn. Frontier, fastest first: bf16/eager (0.200 s, 90.0 %) → "
                       "fp32/eager (0.300 s, 100.0 %)")
    unscored = {"label": "int8wo/eager", "s_per_image": 0.31, "unscored": True}
    caption = advisor_views.frontier_caption({"rows": [*rows, unscored], "pick": {"label": "bf16/eager"}})
    assert caption.startswith("3 of 4 measured configurations drawn (the others have no quality score).")


def test_an_advisor_run_closed_while_running_shows_cancelled():
    from ui.advisor import AdvisorHandlers, running

    status = running("3/40: bf16/regional: compiling")
    assert AdvisorHandlers.advise_ended(None, status) == (
        "**Cancelled** (at 3/40: bf16/regional: compiling): the advisor process was stopped; no pick.")
    assert AdvisorHandlers.advise_ended(None, "**Done** in 61 s: ...") == gr.skip()  # it ended on its own


def test_the_compare_plot_ticks_whole_steps():
    results = [{"config": c, "timings": {"step_ms": [10.0, 9.0, 8.0, 7.5]}} for c in ("a", "b")]
    plot, _, _ = CompareHandlers.render_compare(None, {"done": True, "results": results})[:3]
    assert plot["sort"] == ["1", "2", "3", "4"]  # one tick a step, in order (not 1.0, 1.5, 2.0, ...)
    assert plot_types(plot["value"], color="config")["step"] == "nominal"
    many = [{"config": "a", "timings": {"step_ms": [1.0] * (compare_views.LABELLED_STEPS + 1)}}]
    plot, _, _ = CompareHandlers.render_compare(None, {"done": True, "results": many})[:3]
    assert plot["sort"] is None and plot_types(plot["value"], color="config")["step"] == "quantitative"


def test_compare_prices_memory_levers_in_seconds_and_gib(handlers):
    outputs = list(handlers.compare(
        prompt="a red circle on a blue background", preset="tiny-shapes", size="64x64", steps=4, guidance=1.0,
        seed=5, devices=["cpu"], precisions=["fp32"], modes=["eager"], wait_for_warm=False, caches=None,
        fidelity_prompts=0, timing_s=0, request=None, progress=Progress(),
        configurations="eager/fp32+mem=layerwise:fp8; eager/fp32+mem=group:block:1:disk; regional/fp32+mem=layerwise:fp8"))
    results = {r["config"]: r for r in outputs[-1][1]["results"]}
    cast, offloaded = results["cpu/fp32/eager+mem=layerwise:fp8"], results["cpu/fp32/eager+mem=group:block:1:disk"]
    assert cast["memory"] == "layerwise:fp8" and cast["engine"].endswith("+layerwise:fp8")
    reference = results["cpu/fp32/eager"]
    assert cast["weights_bytes"]["transformer"] <= 0.5 * reference["weights_bytes"]["transformer"]
    assert offloaded["drift_max_diff"] == 0  # group offload: the reference's pixels
    assert "fullgraph" in results["cpu/fp32/regional+mem=layerwise:fp8"]["error"]  # refused, with the reason
    rows = {r[0]: r for r in compare_views.price_rows(outputs[-1][1]["results"])}
    assert "GiB peak" in rows["cpu/fp32/eager+mem=layerwise:fp8"][1]


def test_compare_crosses_memory_lever_sets_and_refuses_what_cannot_run(handlers):
    configs, reference, _ = handlers._configs(["cpu"], ["fp32"], ["eager"], None, "", None,
                                              ["none", "layerwise:fp8", "model-offload"])
    assert configs == ["cpu/fp32/eager", "cpu/fp32/eager+mem=layerwise:fp8", "cpu/fp32/eager+mem=model-offload"]
    assert handlers.refusal("tiny-shapes", "cpu/fp32/eager+mem=layerwise:fp8") is None
    assert "nowhere to offload" in handlers.refusal("tiny-shapes", "cpu/fp32/eager+mem=model-offload")
    with pytest.raises(gr.Error, match="unknown memory lever"):
        handlers._configs(["cpu"], ["fp32"], ["eager"], None, "", None, ["warp"])


def test_a_precision_whose_engine_is_not_loaded_says_it_loads_one_before_the_click(handlers, monkeypatch):
    import threading

    fp32 = handlers.key_for("tiny-shapes", "cpu", "fp32")
    ready = type("Engine", (), {"ready": threading.Event()})()
    ready.ready.set()
    serving = handlers.serving
    monkeypatch.setattr(serving, "loaded_engine", lambda key: ready if key == fp32 else None)
    monkeypatch.setattr(serving, "status_rows", lambda: [{"load_s": 17.6}, {"load_s": 18.4}, {"load_s": None}])
    labels = dict((value, label) for label, value in handlers.precision_labels("tiny-shapes", "cpu", 1, ""))
    assert labels["fp32"] == "fp32"  # loaded: choosing it starts nothing
    assert labels["bf16"] == "bf16 · loads a new engine: ≈ 18 s"  # the median of this host's loads
    update = handlers.precision_field("tiny-shapes", "cpu", 1, "layerwise:fp8")  # another lever set: another engine
    assert "value" not in update and [value for _, value in update["choices"]] == handlers.precision_choices()
    assert ("fp32 · loads a new engine: ≈ 18 s", "fp32") in update["choices"]
