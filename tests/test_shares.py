"""Issue 37, item 7: one address holds at most a share of a device's engines and of the compile queue."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import wait_until

from engine.errors import EngineBusy
from engine.protocol import BucketInfo, BucketKey, BucketState, EngineKey, Mode, Precision, Size

WINDOW = 60.0


def key(precision: str) -> EngineKey:
    return EngineKey("tiny-shapes", "cpu", Precision(precision))


def test_one_address_keeping_engines_recently_used_protects_at_most_half_of_them():
    """The hostile run: three 1-step Generates (bf16, fp16, tf32) every 30 s from one address kept 4 of 4 cpu
    engines "recently used", and another visitor's engine got "No room on this server" for minutes."""
    from engine.serving.shares import VisitorShares

    shares = VisitorShares(WINDOW)
    engines = [key("fp32"), key("bf16"), key("fp16"), key("tf32")]
    shares.used(engines[0], "10.0.0.2", now=100.0)  # the default engine: another visitor's
    for at, engine in zip((110.0, 120.0, 130.0), engines[1:], strict=True):
        shares.used(engine, "10.0.0.1", now=at)
    # Four engines, a share of two each: the attacker's least recently used one no longer protects itself.
    assert shares.overheld(engines, max_engines=4, now=131.0) == {key("bf16")}
    # An engine two clients use is everyone's: protected by either's use.
    shares.used(key("fp16"), "10.0.0.3", now=131.0)
    assert shares.overheld(engines, max_engines=4, now=132.0) == set()
    # Past the window nothing protects, and nothing is remembered of it.
    assert shares.overheld(engines, max_engines=4, now=500.0) == set()


class Resident:
    """What Residency reads of a loaded engine."""

    def __init__(self, precision, last_used):
        self.key, self.last_used, self.evictable, self.footprint, self.closed = key(precision), last_used, True, None, False

    def busy(self):
        return False

    def close(self):
        self.closed = True


def residency_of(engines):
    from engine.serving import budget
    from engine.serving.residency import Residency

    fake = SimpleNamespace(device_budget=lambda device: budget.DeviceBudget(device, None, len(engines)),
                           footprint_of=lambda e: SimpleNamespace(device_bytes=1), app_bytes=lambda device: 0,
                           remember=lambda e: None, drop_engine=lambda e: None, release=lambda e: None)
    residency = Residency(fake, fake, fake, config_for=None, is_default=lambda k: False)
    residency.loaded = {e.key: e for e in engines}
    return residency


def test_residency_evicts_an_overheld_engine_it_would_otherwise_protect():
    import time

    from engine.errors import BudgetExceeded

    now = time.monotonic()
    engines = [Resident("fp32", now - 1), Resident("bf16", now - 2)]
    residency = residency_of(engines)
    with pytest.raises(BudgetExceeded):  # both used within the window: no room for a visitor's engine
        residency.make_room(key("fp16"), 1, protect_used_within_s=WINDOW)
    residency.make_room(key("fp16"), 1, protect_used_within_s=WINDOW, unprotected=frozenset({key("fp32")}))
    assert engines[0].closed and not engines[1].closed


class FakeEngine:
    def __init__(self, precision="fp32"):
        self.key, self.alive, self.states = key(precision), True, {}

    def buckets(self):
        return [BucketInfo(self.key, b, s) for b, s in self.states.items()]


def test_a_visitor_has_one_compile_queued_at_a_time():
    """`/warm` called 8 times by one visitor queued 8 compiles; now the second waits for the first to end."""
    from engine.serving.shares import VisitorShares

    shares, engine = VisitorShares(WINDOW), FakeEngine()
    first, second = BucketKey(Mode.COMPILE, Size(64, 64)), BucketKey(Mode.COMPILE, Size(128, 128))
    shares.check_warm("10.0.0.1", engine, first)
    engine.states[first] = BucketState.QUEUED
    with pytest.raises(EngineBusy, match="still queued or running .at most 1 per visitor"):
        shares.check_warm("10.0.0.1", engine, second)
    shares.check_warm("10.0.0.2", engine, second)  # another visitor has a turn of their own
    engine.states[first] = BucketState.WARM
    shares.check_warm("10.0.0.1", engine, second)  # the first compile ended: the next may queue


def test_visitor_started_engines_unload_when_idle_and_the_default_stays():
    import threading
    import time

    engines = [Resident("fp32", time.monotonic() - 10), Resident("bf16", time.monotonic() - 10)]
    for e in engines:
        e.ready = threading.Event()
        e.ready.set()
    residency = residency_of(engines)
    started_by_visitor = {key("bf16")}
    threading.Thread(target=residency.unload_idle_forever, args=(1.0, started_by_visitor.__contains__, "visitor"),
                     daemon=True).start()
    try:
        wait_until(lambda: engines[1].closed, 30)
        assert not engines[0].closed and list(residency.loaded) == [key("fp32")]
    finally:
        residency.closing = True
