"""The levers in the UI without a server: plots typed as numbers, the Compare tab's price per
configuration, the step-cache and precision selectors, the advisor's views."""

from __future__ import annotations

import gradio as gr
import pytest

from ui import views
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
def test_the_generate_plot_is_numeric_from_its_first_value(result):
    # The browser builds the plot's spec from the first value it gets (the empty partial) and only swaps
    # the data afterwards: that first value must already type step and step_ms as numbers.
    plot, _ = GenerateHandlers.render_run(None, result)
    types = plot_types(plot, color="steps")
    assert types["step"] == "quantitative" and types["step_ms"] == "quantitative"
    assert types["steps"] == "nominal"


def test_cached_steps_are_their_own_series():
    result = {"engine": "e", "timings": {"step_ms": [10.0, 2.0, 11.0, 2.5]}, "cached_steps": [2, 4]}
    rows = views.step_rows(result)
    assert [r["steps"] for r in rows] == ["computed", "cached", "computed", "cached"]
    compare = views.compare_step_rows([{**result, "config": "cpu/fp32/eager"}])
    assert [r["config"] for r in compare] == ["cpu/fp32/eager", "cpu/fp32/eager · cached"] * 2


def test_the_compare_plot_is_numeric_even_when_every_configuration_failed():
    payload = {"done": True, "results": [{"config": "a", "error": "x"}, {"config": "b", "error": "y"}]}
    plot, _, _ = CompareHandlers.render_compare(None, payload)[:3]
    types = plot_types(plot["value"], color="config")
    assert types["step"] == "quantitative" and types["step_ms"] == "quantitative"
