"""Issue 50, item 4: the host's engines are pinned. A visitor's tiny-flux load evicted the default engine, then
three addresses trickling requests kept it out (17 of 17 tries "no room" over 110 s). Now a visitor's engine
never evicts the default one (or a preset the host pins), and a visitor asking for the default engine makes
room among the visitors' engines, recently used or not."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import engine_manager

from engine.serving.manager import Caller, HostPolicy

pytestmark = pytest.mark.slow


def loaded(manager) -> set[str]:
    return {str(e.key) for e in manager.residency.engines()}


def visitor_load(manager, preset: str, precision: str = "fp32"):
    key = manager.gate.make_key(preset, "cpu", precision, caller=Caller.VISITOR)
    engine = manager.engine(key, caller=Caller.VISITOR)
    assert engine.wait_ready(timeout=300)
    return key


def test_visitors_engines_never_evict_the_default_one_and_it_comes_back_first(cache_dir, tiny_models):
    policy = HostPolicy(public=True, presets=("tiny-shapes", "tiny-flux"), evict_idle_after_s=0.0)
    with engine_manager(cache_dir, policy=policy, max_engines=2) as manager:
        default = manager.gate.make_key("tiny-shapes", "cpu", "fp32")
        manager.default_key = default
        assert manager.engine(default).wait_ready(timeout=300)
        flux = visitor_load(manager, "tiny-flux")
        assert loaded(manager) == {str(default), str(flux)}
        # The device holds 2 engines: the default is the least recently used, and before it was the one evicted.
        shapes_bf16 = visitor_load(manager, "tiny-shapes", "bf16")
        assert loaded(manager) == {str(default), str(shapes_bf16)}, "a visitor's engine evicted the default one"
        evicted = manager.residency.evicted
        assert flux in evicted and default not in evicted

        # The default gone anyway (the host unloaded it); visitors' engines fill the device and were used just
        # now (they protect each other for 60 s), yet a visitor asking for the default engine gets it.
        manager.residency.unload(default)
        visitor_load(manager, "tiny-flux")
        manager.policy = dataclasses.replace(policy, evict_idle_after_s=60.0)
        for key in (flux, shapes_bf16):
            manager.shares.used(key, f"10.0.0.{key.precision}")
        again = manager.engine(manager.gate.make_key("tiny-shapes", "cpu", "fp32", caller=Caller.VISITOR),
                               caller=Caller.VISITOR)
        assert again.key == default and str(default) in loaded(manager) and len(loaded(manager)) == 2


def test_a_preset_the_host_pins_is_kept_too(cache_dir, tiny_models):
    policy = HostPolicy(public=True, presets=("tiny-shapes", "tiny-flux"), evict_idle_after_s=0.0,
                        pinned=("tiny-flux",))
    with engine_manager(cache_dir, policy=policy, max_engines=2) as manager:
        manager.default_key = manager.gate.make_key("tiny-shapes", "cpu", "fp32")
        assert manager.engine(manager.default_key).wait_ready(timeout=300)
        flux = visitor_load(manager, "tiny-flux")
        with pytest.raises(Exception, match="no room") as refused:
            visitor_load(manager, "tiny-shapes", "bf16")
        assert type(refused.value).__name__ == "BudgetExceeded"
        assert loaded(manager) == {str(manager.default_key), str(flux)}
