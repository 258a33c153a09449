"""One gate: a Generate is checked once (engine/serving/gate.py). Counting spies on the functions that resolve
the key, start or find the engine, validate the request and price it show each runs exactly once per
Generate, for a host and for a priced visitor, whether it comes through the manager or the page's handler."""

from __future__ import annotations

import collections
import functools
import sys
from types import SimpleNamespace

import gradio as gr
import pytest
from helpers import engine_manager

from engine.config import validation
from engine.config.request import ImageRequest
from engine.config.resolve import Catalog
from engine.errors import InvalidRequest, NotAllowed
from engine.serving import cost
from engine.serving.cost import CostBudget
from engine.serving.manager import Caller, EngineManager, HostPolicy
from engine.serving.residency import Residency

pytestmark = pytest.mark.slow  # starts a worker process


def _spy(counts: collections.Counter, name: str, real):
    @functools.wraps(real)
    def counted(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)

    return counted


def _replace_everywhere(mp: pytest.MonkeyPatch, real, spy) -> None:
    """Put `spy` wherever a loaded module holds `real` (its own module and every `from ... import` of it)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith(("engine", "ui")):
            for attr, value in list(vars(module).items()):
                if value is real:
                    mp.setattr(module, attr, spy)


@pytest.fixture(scope="module")
def counted(cache_dir, tiny_models):
    """A public-mode manager built after the spies are in place (so no part holds an uncounted function),
    and the counter the spies add to."""
    import engine.serving.manager  # noqa: F401 - every module that imports the spied functions is loaded
    import ui.generate  # noqa: F401

    counts: collections.Counter = collections.Counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Catalog, "make_key", _spy(counts, "make_key", Catalog.make_key))
        mp.setattr(EngineManager, "engine", _spy(counts, "engine", EngineManager.engine))
        mp.setattr(Residency, "load", _spy(counts, "residency.load", Residency.load))
        _replace_everywhere(mp, validation.build, _spy(counts, "build_request", validation.build))  # the gate builds
        _replace_everywhere(mp, cost.check_generate, _spy(counts, "check_generate", cost.check_generate))
        policy = HostPolicy(public=True, presets=("tiny-shapes",), cost=CostBudget(request=16_384, visitor=40_000))
        with engine_manager(cache_dir, policy=policy) as manager:
            yield manager, counts


def _spec(caller: Caller, **fields) -> ImageRequest:
    return ImageRequest(**{**dict(preset="tiny-shapes", device="cpu", precision="fp32", size="64x64", steps=2,
                                  mode="eager", prompt="a red circle", caller=caller, client="10.0.0.9"), **fields})


@pytest.mark.parametrize("caller", [Caller.HOST, Caller.VISITOR])
def test_a_generate_through_the_manager_is_checked_once(counted, caller):
    manager, counts = counted
    counts.clear()
    result = manager.generate(_spec(caller))
    assert result.image_png
    priced = 1 if caller is Caller.VISITOR else 0
    assert dict(counts) == {"make_key": 1, "engine": 1, "residency.load": 1, "build_request": 1,
                            **({"check_generate": 1} if priced else {})}


@pytest.mark.parametrize("caller", [Caller.HOST, Caller.VISITOR])
def test_a_generate_from_the_page_is_checked_once(counted, caller):
    """The page's handler: the key, the price and the engine come from the one gate, not from checks of its own
    before the manager checks again."""
    from ui.handlers import Handlers, UIDefaults

    manager, counts = counted
    handlers = Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))
    form = dict(prompt="a red circle", negative_prompt="", preset="tiny-shapes", device="cpu", precision="fp32",
                mode="eager", size="64x64", steps=2, guidance=3.5, seed=0, on_cold="eager")
    request = SimpleNamespace(username="host") if caller is Caller.HOST else None  # a Gradio login is the host
    counts.clear()
    outputs = list(handlers.generate(**form, request=request, progress=lambda *a, **k: None))
    assert outputs[-1][0] is not None and "error" not in outputs[-1][1]
    priced = caller is Caller.VISITOR
    assert dict(counts) == {"make_key": 1, "engine": 1, "residency.load": 1, "build_request": 1,
                            **({"check_generate": 1} if priced else {})}


@pytest.mark.parametrize("fields,message", [
    (dict(steps="many"), "steps must be a whole number, got 'many'"),
    (dict(size="huge"), "size"),
    (dict(mode="turbo"), "mode"),
    (dict(steps=500), "steps must be between 1 and"),
])
def test_bad_input_is_refused_once_with_what_to_change(counted, fields, message):
    manager, counts = counted
    counts.clear()
    with pytest.raises(InvalidRequest, match=message) as refused:
        manager.generate(_spec(Caller.VISITOR, **fields))
    assert counts["build_request"] == 1 and counts["engine"] == 0  # refused before any engine is asked for
    assert str(refused.value).count(message) == 1


def test_over_budget_is_refused_once_before_an_engine_starts(counted):
    manager, counts = counted
    counts.clear()
    with pytest.raises(NotAllowed, match="at most 64 steps at 128x128 here") as refused:
        manager.generate(_spec(Caller.VISITOR, size="128x128", steps=200))
    assert counts["check_generate"] == 1 and counts["engine"] == 0
    assert "token-steps" in str(refused.value)


def test_the_page_shows_the_gates_refusal(counted):
    from ui.handlers import Handlers, UIDefaults

    manager, counts = counted
    handlers = Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))
    counts.clear()
    with pytest.raises(gr.Error, match="steps must be between 1 and"):
        list(handlers.generate(prompt="x", negative_prompt="", preset="tiny-shapes", device="cpu", precision="fp32",
                               mode="eager", size="64x64", steps=500, guidance=3.5, seed=0, on_cold="eager",
                               request=None, progress=lambda *a, **k: None))
    assert counts["build_request"] == 1 and counts["engine"] == 0
