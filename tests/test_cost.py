"""Fair by cost: pricing (engine/serving/cost.py), the public manager's refusals, engines taking turns between
clients (engine/pipeline/batching.py Gatherer), a Compare yielding to Generates, and aot builds kept the host's."""

from __future__ import annotations

import queue
import threading

import pytest
from helpers import FakeClock, engine_manager, make_request, wait_until, waits_in

from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.errors import EngineBusy, NotAllowed
from engine.pipeline.batching import Gatherer
from engine.protocol import BucketState, Mode, Size
from engine.serving import cost
from engine.serving.cost import CostBudget
from engine.serving.manager import Caller, HostPolicy

SHAPES, FLUX, SD3, SDXL = (get_preset(n) for n in ("tiny-shapes", "tiny-flux", "tiny-sd3", "tiny-sdxl"))


# -- pricing (pure) -------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,size,steps,guidance,images,expected", [
    (SHAPES, "64x64", 8, None, 1, 8 * 8 * 8),            # alignment 8: 8x8 tokens of 2x2 latent pixels
    (SHAPES, "128x128", 8, None, 1, 8 * 16 * 16),
    (SHAPES, "64x128", 1, None, 1, 8 * 16),
    (FLUX, "64x64", 4, 3.5, 1, 4 * 4 * 4),                # alignment 16: guidance is embedded, no doubling
    (FLUX, "128x128", 200, None, 1, 200 * 64),
    (SD3, "64x64", 10, 7.0, 1, 10 * 16 * 2),              # cfg with guidance > 1: the batch doubles
    (SD3, "64x64", 10, 1.0, 1, 10 * 16),                  # guidance 1: no unconditional half
    (SDXL, "64x64", 5, 5.0, 1, 5 * (64 // (SDXL.alignment // 2)) ** 2 * 2),  # a UNet: every latent pixel
    (SHAPES, "64x64", 8, None, 6 * 9, 8 * 64 * 54),      # a Compare: configurations x prompts
])
def test_price(preset, size, steps, guidance, images, expected):
    assert cost.price(preset, Size.parse(size), steps, guidance, images) == expected


@pytest.mark.parametrize("text,expected", [
    ("16384", 16384), (" 2_000 ", 2000), ("0", None), ("off", None), (None, None), (500, 500),
])
def test_parse_cost(text, expected):
    assert cost.parse_cost(text, "--max-request-cost") == expected


@pytest.mark.parametrize("text", ["abc", "-5", "1.5"])
def test_parse_cost_refuses_with_the_flag(text):
    with pytest.raises(Exception, match="--max-request-cost .*whole number|--max-request-cost .*positive"):
        cost.parse_cost(text, "--max-request-cost")


@pytest.mark.parametrize("budget,size,steps,words", [
    (16_384, "128x128", 65, "at most 64 steps at 128x128 here, or 65 steps at 128x64"),
    (16_384, "128x128", 200, "at most 64 steps at 128x128 here, or 200 steps at 64x64"),
    (100, "128x128", 1, "128x128 does not fit here at any step count, or 1 step at 64x64"),
])
def test_generate_over_budget_says_what_fits(budget, size, steps, words):
    with pytest.raises(NotAllowed, match="this server allows") as info:
        cost.check_generate(CostBudget(request=budget), SHAPES, Size.parse(size), steps)
    assert words in str(info.value)


def test_generate_within_budget_and_unbounded():
    assert cost.check_generate(CostBudget(request=16_384), SHAPES, Size(128, 128), 64) == 16_384
    assert cost.check_generate(CostBudget(request=None), SHAPES, Size(128, 128), 10_000) == 10_000 * 256


@pytest.mark.parametrize("configs,prompts,steps,words", [
    (6, 9, 8, "at most 6 configurations × 5 images each or 3 configurations × 9 images each at 8 steps, "
              "or at most 4 steps with these choices"),
    # the Compare: one image of 200 steps at 64x64 fits, no split of 6 x 33 does
    (6, 33, 200, "at most 1 configuration × 1 image each at 200 steps, or at most 1 step with these choices"),
])
def test_compare_over_budget_says_what_fits(configs, prompts, steps, words):
    with pytest.raises(NotAllowed, match=f"costs .* \\({configs} configurations × {prompts} images each") as info:
        cost.check_compare(CostBudget(request=16_384), SHAPES, Size(64, 64), steps, configs, prompts)
    assert words in str(info.value)


def test_visitor_budget():
    budget = CostBudget(visitor=1000)
    cost.check_visitor(budget, 400, 600)
    with pytest.raises(EngineBusy, match="you have 401 token-steps .* allows 1,000 per visitor"):
        cost.check_visitor(budget, 401, 600)
    cost.check_visitor(CostBudget(visitor=None), 10**9, 10**9)


# -- the public manager: refused before any engine starts -----------------------------------------
@pytest.fixture(scope="module")
def public(cache_dir):
    policy = HostPolicy(public=True, presets=("tiny-shapes",), cost=CostBudget(request=16_384, visitor=20_000))
    with engine_manager(cache_dir, policy=policy) as m:
        yield m


def test_visitor_refused_over_request_cost_host_is_not(public, monkeypatch):
    with pytest.raises(NotAllowed, match="at most 64 steps at 128x128 here"):
        public.generate(ImageRequest(preset="tiny-shapes", device="cpu", size="128x128", steps=200,
                                     caller=Caller.VISITOR, client="10.0.0.1"))
    assert public.residency.engines() == []  # refused before an engine started
    ran = []
    monkeypatch.setattr(public, "_run", lambda admitted, *a: ran.append(admitted.request))
    public.generate(ImageRequest(preset="tiny-shapes", device="cpu", size="128x128", steps=200,
                                 prompt="a fox", caller=Caller.HOST))
    assert ran and ran[0].steps == 200  # reached the engine


def test_visitor_budget_counts_queued_and_running(public, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(public, "_submit", lambda *a: release.wait(10) and None)  # an engine that answers nothing
    kwargs = dict(preset="tiny-shapes", device="cpu", size="128x128", steps=64, prompt="a fox", caller=Caller.VISITOR)
    first = threading.Thread(target=lambda: public.generate(ImageRequest(client="10.0.0.2", **kwargs)))
    first.start()
    wait_until(lambda: public.flow.held("10.0.0.2") == 16_384, 5)
    with pytest.raises(EngineBusy, match="you have 16,384 token-steps of requests queued or running"):
        public.generate(ImageRequest(client="10.0.0.2", **kwargs))
    with public.admission("10.0.0.3", 16_384, Caller.VISITOR):  # another visitor is not held back
        pass
    release.set()
    first.join(5)
    assert public.flow.held("10.0.0.2") == 0  # released when it ended
    public.generate(ImageRequest(client="10.0.0.2", **kwargs))


def test_compare_priced_as_a_whole(public):
    with pytest.raises(NotAllowed, match="at most 6 configurations × 5 images each"):
        public.price_compare("tiny-shapes", "64x64", 8, 6, 9, caller=Caller.VISITOR)
    assert public.price_compare("tiny-shapes", "64x64", 8, 2, 9, caller=Caller.VISITOR) == 2 * 9 * 512
    assert public.price_compare("tiny-shapes", "128x128", 200, 6, 33, caller=Caller.HOST) == 0


def test_a_compare_of_clips_is_priced_by_its_frames(public):
    one_frame = cost.price(get_preset("tiny-wan"), Size(32, 32), 4)  # a clip's tokens: latent frames x size
    assert public.price_compare("tiny-wan", "32x32", 4, 2, 3, caller=Caller.VISITOR, num_frames=9) == 6 * 3 * one_frame
    assert public.price_compare("tiny-wan", "32x32", 4, 2, 3, caller=Caller.VISITOR, num_frames=10) == 6 * 3 * one_frame
    assert public.price_compare("tiny-wan", "32x32", 4, 2, 3, caller=Caller.VISITOR) == 6 * 5 * one_frame  # 17 frames
    with pytest.raises(NotAllowed, match=r"latent tokens at 32x32 × 9 latent frames \(33 frames\)"):
        public.price_compare("tiny-wan", "32x32", 4, 6, 40, caller=Caller.VISITOR, num_frames=33)


def test_visitor_aot_refused_until_a_package_is_loaded(public):
    for on_cold in ("wait", "eager"):
        with pytest.raises(NotAllowed, match="mode aot at 64x64: no package of this bucket is loaded .* up to "
                                             "the host"):
            public.generate(ImageRequest(preset="tiny-shapes", device="cpu", mode="aot", size="64x64",
                                         on_cold=on_cold, caller=Caller.VISITOR, client="10.0.0.4"))
    assert public.residency.engines() == []


class LoadedEngine:
    """Stands in for a loaded engine whose board has `warm` buckets."""

    def __init__(self, key, warm=()):
        from engine.protocol import BucketInfo

        self.key = key
        self._buckets = [BucketInfo(key, bucket, BucketState.WARM) for bucket in warm]

    def wait_ready(self, timeout=None):
        return True

    def buckets(self):
        return self._buckets


def test_visitor_aot_served_from_a_loaded_package_warm_refused(public, monkeypatch):
    from engine.protocol import BucketKey, EngineKey

    key = EngineKey("tiny-shapes", "cpu", "fp32")
    monkeypatch.setitem(public.residency.loaded, key, LoadedEngine(key))
    with pytest.raises(NotAllowed, match="mode aot at 64x64: no package .* up to the host"):
        public.warm("tiny-shapes", "cpu", "fp32", "aot", "64x64", caller=Caller.VISITOR)
    monkeypatch.setitem(public.residency.loaded, key, LoadedEngine(key, [BucketKey(Mode.AOT, Size(64, 64))]))
    ran = []
    monkeypatch.setattr(public, "_run", lambda admitted, *a: ran.append(admitted.request))
    public.generate(ImageRequest(preset="tiny-shapes", device="cpu", mode="aot", size="64x64", prompt="a fox",
                                 caller=Caller.VISITOR, client="10.0.0.4"))
    assert ran and ran[0].mode is Mode.AOT and ran[0].client == "10.0.0.4"
    with pytest.raises(NotAllowed, match="mode aot at 128x128: no package"):  # only the loaded bucket
        public.generate(ImageRequest(preset="tiny-shapes", device="cpu", mode="aot", size="128x128",
                                     prompt="a fox", caller=Caller.VISITOR, client="10.0.0.4"))


# -- a Compare yields to Generates ---------------------------------------------------------------
def test_compare_image_waits_while_another_clients_generate_runs(public, monkeypatch):
    from engine.serving import admission

    done = threading.Event()
    started = threading.Event()

    def generate_running():
        with public.flow.generate_in_flight("cpu", "10.0.0.5"):
            started.set()
            done.wait(10)

    t = threading.Thread(target=generate_running)
    t.start()
    started.wait(5)
    with monkeypatch.context() as patch:  # on a clock that only a wait could move: its own Generates, no wait
        patch.setattr(admission, "time", FakeClock())
        assert public.flow.yield_to_generates("cpu", "10.0.0.5") == 0.0
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(public.flow.yield_to_generates("cpu", "10.0.0.6")))
    waiter.start()
    wait_until(lambda: waits_in(waiter, threading.Condition.wait), 10, 0.01, "the Compare yielding")
    assert waiter.is_alive() and not waited  # still yielding while the other client's Generate runs
    done.set()
    waiter.join(5)
    t.join(5)
    assert waited and waited[0] > 0  # it went on once the Generate ended


# -- engines take turns between clients (pure: the worker's queue) ---------------------------------
def _gatherer(max_batch: int = 1):
    source: queue.Queue = queue.Queue()
    return source, Gatherer(source, max_batch, 0.0, arrived=lambda r: None, sizes_for=lambda r: (1, 2, 4, 8))


def test_round_robin_between_clients():
    source, gather = _gatherer()
    a = [make_request(steps=s, client="A", prompt=f"a{s}") for s in (20, 21, 22, 23)]
    for r in a:
        source.put(r)
    assert gather.next_batch() == [a[0]]  # running while B arrives
    b = make_request(steps=2, client="B", prompt="b")
    source.put(b)
    order = [gather.next_batch()[0] for _ in range(4)]
    assert order == [b, a[1], a[2], a[3]]  # B waited for the one run under way only


def test_round_robin_three_clients_and_fifo_within_one():
    source, gather = _gatherer()
    reqs = [make_request(client=c, prompt=f"{c}{i}", steps=10 + i) for i, c in enumerate("AAABBC")]
    for r in reqs:
        source.put(r)
    served = [gather.next_batch()[0].prompt for _ in reqs]
    assert served == ["A0", "B3", "C5", "A1", "B4", "A2"]


def test_same_bucket_requests_of_several_clients_still_batch():
    source, gather = _gatherer(max_batch=4)
    reqs = [make_request(client=c, prompt=f"{c}{i}") for i, c in enumerate("ABAB")]
    for r in reqs:
        source.put(r)
    assert gather.next_batch() == reqs  # one call, all four


# -- with a real engine: ordering seen in results (slow: starts a worker) --------------------------
@pytest.mark.slow
def test_engine_serves_another_clients_short_request_after_one_run(cache_dir, tiny_models):
    with engine_manager(cache_dir, {"max_batch": 1}) as m:
        kwargs = dict(preset="tiny-flux", device="cpu", size="64x64", prompt="a fox")
        m.generate(ImageRequest(steps=1, **kwargs))  # loaded and measured once
        finished: list[str] = []
        lock = threading.Lock()
        stepping = threading.Event()

        def run(name: str, client: str, steps: int) -> None:
            m.generate(ImageRequest(steps=steps, client=client, seed=len(finished),
                                    **kwargs), on_progress=lambda p: stepping.set())
            with lock:
                finished.append(name)

        threads = [threading.Thread(target=run, args=(f"A{i}", "10.0.0.1", 30 + i)) for i in range(4)]
        threads[0].start()
        stepping.wait(30)  # A0 runs
        for t in threads[1:]:
            t.start()
        wait_until(lambda: m.residency.engines()[0].pending() >= 4, 10)  # A0 running, A1..A3 sent behind it
        short = threading.Thread(target=run, args=("B", "10.0.0.2", 2))
        short.start()
        for t in [*threads, short]:
            t.join(120)
        assert finished.index("B") <= 1, finished  # after A0 (running when it came), before A1..A3


@pytest.mark.slow
def test_host_builds_aot_visitor_then_served_from_the_package(cache_dir, tiny_models):
    # The session's aot folder: a package tests/test_aot.py built is loaded, else the host builds it here.
    policy = HostPolicy(public=True, presets=("tiny-flux",))
    with engine_manager(cache_dir, policy=policy) as m:
        kwargs = dict(preset="tiny-flux", device="cpu", mode="aot", size="64x64", steps=2, on_cold="wait")
        with pytest.raises(NotAllowed, match="up to the host"):
            m.generate(ImageRequest(caller=Caller.VISITOR, client="10.0.0.9", **kwargs))
        built = m.generate(ImageRequest(caller=Caller.HOST,
                                        **kwargs))  # the host (admin token) may build or load it
        assert built.warm
        board = {(b["mode"], b["size"]): b["state"] for b in m.residency.status_rows()[0]["buckets"] if b["batch"] == 1}
        assert board[("aot", "64x64")] == BucketState.WARM.value
        served = m.generate(ImageRequest(caller=Caller.VISITOR, client="10.0.0.9", **kwargs))
        assert served.warm and served.bucket.mode is Mode.AOT


# -- what a visitor reads on the page or through the API ----------------------------------------------
def test_handlers_refuse_over_budget_with_what_fits(public):
    import gradio as gr

    from ui.handlers import Handlers, UIDefaults

    h = Handlers(public.serving(), UIDefaults(device="cpu", mode="eager", preset="tiny-shapes"))
    with pytest.raises(gr.Error, match="this comparison costs 36,864 token-steps .* at most 6 configurations × 5 "
                                       "images each or 2 configurations × 12 images each at 8 steps"):
        list(h.compare(prompt="a red circle on a blue background", preset="tiny-shapes", size="64x64",
                       steps=8, guidance=1.0, seed=0, devices=["cpu"], precisions=["fp32", "bf16"],
                       modes=["eager", "compile", "regional"], wait_for_warm=False, fidelity_prompts=8))
    with pytest.raises(gr.Error, match="at most 64 steps at 128x128 here"):
        list(h.generate(prompt="a red circle on a blue background", negative_prompt="", preset="tiny-shapes",
                        device="cpu", precision="fp32", mode="eager", size="128x128", steps="200", guidance="1",
                        seed="0", request=None, progress=lambda *a, **k: None))
    assert public.residency.engines() == []
