"""Batching: concurrent requests that can share a denoiser call run as one pipeline call.

The admission logic (engine/pipeline/batching.py) is tested without torch; the rest against real worker processes of
the embedded tiny-shapes model: one engine with batch sizes 1, 2, 4 whose compiles the test grants itself
(regional 64x64 at 1 and 2 only, so batch 4 stays cold), and one with batching off.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import numpy as np
import pytest
from helpers import wait_until

from engine.config.flags import add_engine_arguments, engine_flags_argv, options_from_args
from engine.config.presets import get_preset
from engine.errors import Cancelled
from engine.pipeline import batching
from engine.protocol import (
    BucketKey,
    BucketState,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateRequest,
    Mode,
    Size,
)
from engine.worker.client import EngineEvents, ProcessClient
from training.shapes.fidelity import check

KEY = EngineKey("tiny-shapes", "cpu", "fp32")
PROMPTS = ("a red circle on a blue background", "a green square on a yellow background",
           "a blue triangle on a red background", "a yellow circle on a green background")
B64 = Size(64, 64)


def request(i: int = 0, **fields) -> GenerateRequest:
    base = dict(prompt=PROMPTS[i % len(PROMPTS)], width=64, height=64, steps=6, guidance=1.0, seed=100 + i,
                mode="regional")
    return GenerateRequest.checked(**{**base, **fields})


# -- admission (no torch) --------------------------------------------------------------------------
def gatherer(items, max_batch=4, wait_ms=0.0, sizes=(1, 2, 4), splits=None):
    source: queue.Queue = queue.Queue()
    for item in items:
        source.put(item)
    return source, batching.Gatherer(source, max_batch, wait_ms, arrived=lambda r: None,
                                     sizes_for=lambda r: sizes,
                                     on_split=(lambda r, b: splits.append(b)) if splits is not None else None)


def test_batch_sizes_and_device_defaults():
    assert batching.batch_sizes(1) == (1,)
    assert batching.batch_sizes(4) == (1, 2, 4)
    assert batching.batch_sizes(6) == (1, 2, 4, 6)
    from engine import devices

    cpu = devices.get_device("cpu")
    assert batching.max_batch_for(None, cpu) == cpu.max_batch == 8
    assert batching.max_batch_for(1, cpu) == 1
    assert batching.max_batch_for(8, cpu, tp=2) == 1  # tensor-parallel ranks run every request in step


def test_gatherer_groups_same_key_keeps_the_others_in_order():
    a, b, c, d = request(0), request(1, steps=7), request(2), request(3, guidance=2.0)
    _, g = gatherer([a, b, c, d])
    assert g.next_batch() == [a, c]
    assert g.next_batch() == [b]
    assert g.next_batch() == [d]
    assert g.pending() == 0


def test_gatherer_splits_to_warm_sizes_and_asks_for_the_cold_one():
    items = [request(i) for i in range(4)]
    splits: list[int] = []
    _, g = gatherer(items, sizes=(1, 2), splits=splits)  # batch size 4 is not warm
    assert g.next_batch() == items[:2]
    assert splits == [4]
    assert g.next_batch() == items[2:]  # the rest ran next, in order
    _, g = gatherer(items[:3], sizes=(1, 2, 4), splits=splits)
    assert g.next_batch() == items[:2]  # 3 is no static size: split, not padded
    assert g.next_batch() == items[2:3]


class ScriptedQueue(queue.Queue):
    """A request queue on a clock of its own: items arrive at scripted times, and a `get` that waits moves
    the clock to the next arrival (or to the end of its timeout), so batching windows are tested exactly,
    whatever the machine is doing."""

    def __init__(self, script=()):
        super().__init__()
        self.now = 0.0
        self.script = sorted(script, key=lambda at_item: at_item[0])
        self.waited: list[float] = []  # every timeout the gatherer waited with

    def clock(self) -> float:
        return self.now

    def get(self, block=True, timeout=None):
        if not self.empty() or not block:
            return super().get(block=False)
        self.waited.append(timeout)
        if self.script and (timeout is None or self.script[0][0] <= self.now + timeout):
            at, item = self.script.pop(0)
            self.now = max(self.now, at)
            return item
        if timeout is None:
            raise AssertionError("the gatherer waited without a timeout on a queue nothing more arrives on")
        self.now += timeout
        raise queue.Empty


def scripted_gatherer(script, first, max_batch=8, wait_ms=100.0, arrivals=None):
    source = ScriptedQueue(script)
    source.put(first)
    g = batching.Gatherer(source, max_batch, wait_ms, arrived=lambda r: (arrivals or {}).get(r.seed),
                          sizes_for=lambda r: (1, 2, 4, 8), clock=source.clock)
    return source, g


def test_gatherer_waits_for_stragglers_within_the_window():
    source, g = scripted_gatherer([(0.05, request(1))], request(0), max_batch=2, wait_ms=2000)
    assert len(g.next_batch()) == 2
    assert source.now == pytest.approx(0.05)  # a full group goes at once, before the window ends
    source, g = scripted_gatherer([], request(0), wait_ms=100)
    assert len(g.next_batch()) == 1
    assert source.now == pytest.approx(0.1)  # waited the whole window for a straggler, then went alone


def test_the_window_slides_with_each_joiner_and_closes_after_a_gap():
    """Requests 60 ms apart with a 100 ms window all join (each keeps it open for the next); a gap longer
    than the window closes the group, and the request after the gap starts the next one."""
    script = [(at, request(i)) for i, at in ((1, 0.06), (2, 0.12), (3, 0.18), (4, 0.45))]  # 4: 270 ms after 3
    arrivals = {100 + i: at for i, at in ((0, 0.0), (1, 0.06), (2, 0.12), (3, 0.18), (4, 0.45))}
    source, g = scripted_gatherer(script, request(0), arrivals=arrivals)
    group = g.next_batch()
    assert [r.seed for r in group] == [100, 101, 102, 103]  # past one window after the first, all joined
    assert source.now == pytest.approx(0.28)  # closed 100 ms after the last joiner, not waiting for 4
    assert [r.seed for r in g.next_batch()] == [104]


def test_max_batch_1_never_waits_and_never_groups():
    items = [request(i) for i in range(3)]
    source = ScriptedQueue()
    for item in items:
        source.put(item)
    g = batching.Gatherer(source, 1, 5000, arrived=lambda r: None, sizes_for=lambda r: (1,), clock=source.clock)
    assert [g.next_batch() for _ in range(3)] == [[x] for x in items]
    assert source.waited == [] and source.now == 0.0


def test_keys_keep_apart_what_changes_the_graph_or_the_schedule():
    key = batching.batch_key
    assert key(request(0)) == key(request(1, seed=5))  # prompt and seed are each member's own
    for change in (dict(steps=7), dict(guidance=2.0), dict(mode="compile"), dict(width=128),
                   dict(negative_prompt="blurry"), dict(step_cache="taylorseer"), dict(on_cold="wait")):
        assert key(request(0)) != key(request(0, **change)), change
    assert key(request(0, step_cache="first-block")) is None  # decides per step from the whole batch


def test_flags_reach_the_options_and_child_command_lines():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--max-batch", "1", "--batch-wait-ms", "2"])
    options = options_from_args(args)
    assert (options.max_batch, options.batch_wait_ms) == (1, 2.0)
    assert engine_flags_argv(args)[-4:] == ("--max-batch", "1", "--batch-wait-ms", "2")
    assert options_from_args(parser.parse_args([])).max_batch is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-batch", "0"])


# -- real workers ----------------------------------------------------------------------------------
class GrantedCompiles(EngineEvents):
    """The host's scheduler stand-in: grants only the buckets the test names; remembers every wish."""

    def __init__(self):
        self.allowed: set[BucketKey] = set()
        self.wished: list[BucketKey] = []

    def compile_wanted(self, engine, wish) -> None:
        self.wished.append(wish.bucket)
        if wish.bucket in self.allowed:
            engine.grant_compile(wish.bucket)


def start(cache_dir, **options) -> ProcessClient:
    """A worker batching requests per pipeline call (step-level serving, which batches per step, is off:
    tests/test_stepped_worker.py has it)."""
    options.setdefault("warm_sizes", ())
    options.setdefault("step_scheduling", False)
    config = EngineConfig(KEY, get_preset(KEY.preset), EngineOptions(**options), str(cache_dir))
    gate = GrantedCompiles()
    engine = ProcessClient(config, env={"TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}, events=gate)
    engine.start()
    engine.gate = gate
    assert engine.wait_ready(timeout=300)
    return engine


def warm(engine, bucket: BucketKey) -> None:
    engine.gate.allowed.add(bucket)
    engine.warm(bucket)
    deadline = time.time() + 600
    while time.time() < deadline:
        info = next((b for b in engine.buckets() if b.bucket == bucket), None)
        if info is not None and info.state in (BucketState.WARM, BucketState.FAILED):
            assert info.state == BucketState.WARM, info.error
            return
        time.sleep(0.05)
    raise AssertionError(f"{bucket} never warmed")


def together(engine, requests, on_progress=None):
    """Submit at once (the worker's window gathers them); the futures in order."""
    return [engine.submit(r, on_progress) for r in requests]


@pytest.fixture(scope="module")
def batched(cache_dir, tiny_models):
    # A wide window: requests submitted together by the test always meet in it.
    engine = start(cache_dir, max_batch=4, batch_wait_ms=300, warm_modes=(Mode.REGIONAL,))
    warm(engine, BucketKey(Mode.REGIONAL, B64))
    warm(engine, BucketKey(Mode.REGIONAL, B64, 2))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def solo_images(batched):
    """Each request alone (its own call), the reference for the batched ones."""
    return [batched.generate(request(i), timeout=300) for i in range(4)]


def pixels(result) -> np.ndarray:
    return np.asarray(result.image().convert("RGB")).astype(int)


@pytest.mark.slow  # starts a worker, compiles
def test_batched_images_equal_solo_ones_at_a_warm_batch_size(batched, solo_images):
    assert all(r.batch_size == 1 for r in solo_images)
    results = [f.result(300) for f in together(batched, [request(i) for i in range(2)])]
    for solo, result in zip(solo_images, results, strict=False):
        assert result.batch_size == 2 and result.warm and not result.eager_fallback
        assert result.recompiles == 0  # a warm batch size compiles nothing
        assert np.abs(pixels(result) - pixels(solo)).max() <= 2
        assert check(result.image(), result_prompt(result)).correct == check(solo.image(), result_prompt(solo)).correct
        assert result.seed == solo.seed and result.timings.queued_ms >= 0


def result_prompt(result) -> str:
    return PROMPTS[(result.seed - 100) % len(PROMPTS)]


@pytest.mark.slow  # starts a worker, compiles
def test_a_cold_batch_size_runs_as_smaller_warm_ones_and_is_asked_for(batched, solo_images):
    results = [f.result(300) for f in together(batched, [request(i) for i in range(4)])]
    assert [r.batch_size for r in results] == [2, 2, 2, 2]
    assert all(r.recompiles == 0 and r.warm for r in results)
    for solo, result in zip(solo_images, results, strict=True):
        assert np.abs(pixels(result) - pixels(solo)).max() <= 2
    assert BucketKey(Mode.REGIONAL, B64, 4) in batched.gate.wished  # compiled later, in the background
    cold = next(b for b in batched.buckets() if b.bucket == BucketKey(Mode.REGIONAL, B64, 4))
    assert cold.state == BucketState.QUEUED and cold.requests_served == 0


@pytest.mark.slow  # starts a worker, compiles
def test_eager_requests_batch_at_any_size(batched):
    results = [f.result(300) for f in together(batched, [request(i, mode="eager") for i in range(3)])]
    assert [r.batch_size for r in results] == [3, 3, 3]
    alone = batched.generate(request(2, mode="eager", request_id="alone"), timeout=300)
    assert np.abs(pixels(results[2]) - pixels(alone)).max() <= 2


@pytest.mark.slow  # starts a worker, compiles
def test_cancel_one_member_the_other_finishes_and_matches_solo(batched, solo_images):
    steps = 40
    a, b = request(0, steps=steps), request(1, steps=steps)
    seen: dict[str, list] = {a.request_id: [], b.request_id: []}
    cancelled_after = []

    def on_progress(p):
        seen[p.request_id].append(p)
        if p.request_id == b.request_id and p.step == 3 and not cancelled_after:
            cancelled_after.append(p.step)
            batched.cancel(b.request_id)

    fa, fb = together(batched, [a, b], on_progress)
    with pytest.raises(Cancelled) as info:
        fb.result(300)
    result = fa.result(300)
    assert result.batch_size == 2 and result.steps == steps and len(result.timings.step_ms) == steps
    left_at = int(str(info.value).split("after step ")[1].split()[0])
    assert left_at <= cancelled_after[0] + 2, str(info.value)  # within a step of the cancel arriving
    assert len(seen[b.request_id]) <= left_at  # no progress after it left
    assert len(seen[a.request_id]) == steps and all(p.batch_size == 2 for p in seen[a.request_id])
    alone = batched.generate(request(0, steps=steps, request_id="alone-40"), timeout=300)
    assert np.abs(pixels(result) - pixels(alone)).max() <= 2


@pytest.mark.slow  # starts a worker, compiles
def test_board_and_status_show_batch_sizes(batched):
    from ui.buckets_views import board_rows
    from ui.views import size_label

    before = batched.status()["batching"]["served"].get("2", {"calls": 0, "requests": 0})
    [f.result(300) for f in together(batched, [request(i, seed=7 + i) for i in range(2)])]

    def counted():  # a member's result can come before its call ends (decoded apart): counted at the end
        status = batched.status()
        return status if status["batching"]["served"].get("2", before) != before else None

    status = wait_until(counted, 10)
    served = status["batching"]["served"]
    assert status["batching"]["batch_sizes"] == [1, 2, 4]
    assert served["2"]["calls"] == before["calls"] + 1 and served["2"]["requests"] == before["requests"] + 2
    rows = board_rows([status])
    batch_rows = [r for r in rows if "batch 2" in str(r[4]) and r[3] == "regional"]
    assert batch_rows and batch_rows[0][5] == "warm" and " in " in str(batch_rows[0][9])
    assert size_label("64x64", "regional", status) == "64x64 · warm"  # the solo bucket's state, not a batch row's


@pytest.fixture(scope="module")
def unbatched(cache_dir, tiny_models):
    engine = start(cache_dir, max_batch=1, batch_wait_ms=300)
    yield engine
    engine.close()


@pytest.mark.slow  # starts a worker, compiles
def test_max_batch_1_serves_one_request_per_call(unbatched):
    assert unbatched.status()["batching"]["batch_sizes"] == [1]
    futures = together(unbatched, [request(i, mode="eager") for i in range(3)])
    results = [f.result(300) for f in futures]
    assert [r.batch_size for r in results] == [1, 1, 1]
    assert all(b.bucket.batch == 1 for b in unbatched.buckets())
    # each waited for the ones before it, not for a window
    assert sorted(r.timings.queued_ms for r in results)[0] < 250


@pytest.mark.slow  # starts a worker, compiles
def test_step_cache_requests_batch_with_the_same_cache_and_match_solo(batched):
    cache = "taylorseer"
    results = [f.result(300) for f in together(batched, [request(i, mode="eager", step_cache=cache, steps=8)
                                                         for i in range(2)])]
    assert [r.batch_size for r in results] == [2, 2]
    assert all(str(r.step_cache).startswith(cache) and r.cached_steps for r in results)
    alone = batched.generate(request(1, mode="eager", step_cache=cache, steps=8, request_id="alone-cache"), timeout=300)
    assert alone.batch_size == 1 and alone.cached_steps == results[1].cached_steps
    assert np.abs(pixels(results[1]) - pixels(alone)).max() <= 2
    # first-block decides from the whole batch: its requests run alone
    fb = [f.result(300) for f in together(batched, [request(i, mode="eager", step_cache="first-block")
                                                    for i in range(2)])]
    assert [r.batch_size for r in fb] == [1, 1]


# -- a batch decoded image by image (in this process, eager: no compile) ----------------------------------
@pytest.fixture(scope="module")
def runner(cache_dir, tiny_models):
    from helpers import make_runner

    return make_runner(cache_dir, preset=KEY.preset, max_batch=4)


def test_a_batch_on_a_cpu_answers_each_member_as_its_image_is_decoded(runner):
    import dataclasses

    assert runner.spec.decode_batch_apart  # a CPU decodes 8 images in 8 times the time of one
    members = [request(i, mode="eager", request_id=f"apart-{i}") for i in range(3)]
    answered, steps = [], []
    outcomes = runner.generate_batch(members, on_step=lambda p: steps.append(p.step),
                                     on_result=lambda i, result: answered.append((i, result, len(steps))))
    assert outcomes == [None, None, None]  # each was answered through on_result
    assert [i for i, _, _ in answered] == [0, 1, 2]
    assert [r.request_id for _, r, _ in answered] == [m.request_id for m in members]
    assert all(r.batch_size == 3 and r.steps == 6 and len(r.timings.step_ms) == 6 for _, r, _ in answered)
    decode_ms = [r.timings.decode_ms for _, r, _ in answered]
    assert decode_ms == sorted(decode_ms) and decode_ms[0] < decode_ms[2]  # each answered at its own decode
    # The same images as one decode of the whole batch (what a GPU does) and as each request alone
    whole_spec = dataclasses.replace(runner.spec, decode_batch_apart=False)
    runner.spec, spec = whole_spec, runner.spec
    try:
        whole = runner.generate_batch(members)
    finally:
        runner.spec = spec
    assert all(r.batch_size == 3 for r in whole)
    alone = runner.generate(members[2])
    for (_, result, _), one_decode in zip(answered, whole, strict=True):
        assert np.abs(pixels(result) - pixels(one_decode)).max() <= 2
    assert np.abs(pixels(answered[2][1]) - pixels(alone)).max() <= 2
    assert check(answered[2][1].image(), PROMPTS[2]).correct == check(alone.image(), PROMPTS[2]).correct


def test_a_member_cancelled_after_the_last_step_leaves_before_its_image(runner):
    members = [request(i, mode="eager", request_id=f"late-{i}") for i in range(2)]
    cancels = [threading.Event(), threading.Event()]
    answered, left = [], []

    def on_step(progress):
        if progress.step == progress.total:
            cancels[1].set()  # after every step ran: the decode is next

    outcomes = runner.generate_batch(members, on_step=on_step, cancels=cancels,
                                     on_leave=lambda i, exc: left.append((i, exc)),
                                     on_result=lambda i, result: answered.append(i))
    assert outcomes == [None, None] and answered == [0]
    assert [i for i, _ in left] == [1] and isinstance(left[0][1], Cancelled)


def test_only_pipelines_with_nothing_after_their_decode_decode_apart():
    from engine.pipeline.variants import can_decode_apart

    class FluxPipeline:  # the name is what is checked: diffusers' FluxPipeline decodes, then postprocesses
        def __init__(self, **parts):
            self.vae, self.image_processor = object(), type("Processor", (), {"postprocess": None})()
            self.__dict__.update(parts)

    class SanaPipeline(FluxPipeline):  # resizes back from its binned resolution after the decode
        pass

    assert can_decode_apart(FluxPipeline())
    assert not can_decode_apart(FluxPipeline(safety_checker=object()))
    assert not can_decode_apart(FluxPipeline(watermark=object()))
    assert not can_decode_apart(FluxPipeline(image_processor=None))
    assert not can_decode_apart(SanaPipeline())


@pytest.mark.parametrize("preset", ["tiny-flux2-klein", "tiny-sd3", "tiny-sdxl"])
def test_every_pipeline_that_decodes_apart_gives_the_images_of_one_decode(cache_dir, tiny_models, preset):
    import dataclasses

    from helpers import make_runner

    runner = make_runner(cache_dir, preset=preset, max_batch=2)
    assert runner.spec.decode_batch_apart and runner.preset.pipeline in {"Flux2KleinPipeline",
                                                                       "StableDiffusion3Pipeline",
                                                                       "StableDiffusionXLPipeline"}
    size = runner.preset.buckets[0]
    members = [GenerateRequest.checked(prompt=PROMPTS[i], width=size.width, height=size.height, steps=2, seed=i,
                               guidance=runner.preset.guidance, mode="eager", request_id=f"{preset}-{i}")
               for i in range(2)]
    answered = []
    assert runner.generate_batch(members, on_result=lambda i, result: answered.append(result)) == [None, None]
    runner.spec = dataclasses.replace(runner.spec, decode_batch_apart=False)
    whole = runner.generate_batch(members)
    assert [r.batch_size for r in answered + whole] == [2, 2, 2, 2]
    for apart, one_decode in zip(answered, whole, strict=True):
        assert np.abs(pixels(apart) - pixels(one_decode)).max() <= 2
