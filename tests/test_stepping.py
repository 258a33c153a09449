"""Step-level serving (engine/pipeline/stepping.py): a request stepped by the engine makes the pipeline's own
picture, alone and in a batch with requests at other steps; a paused request resumes where it was."""

from __future__ import annotations

import numpy as np
import pytest

from engine.protocol import GenerateRequest

PROMPTS = ["a red circle on a blue background", "a yellow triangle on a purple background",
           "a white square on a black background"]


def request(i: int = 0, **fields) -> GenerateRequest:
    values = dict(prompt=PROMPTS[i % len(PROMPTS)], width=64, height=64, steps=4, guidance=1.0, seed=i,
                  mode="eager", request_id=f"r{i}")
    values.update(fields)
    return GenerateRequest.checked(**values)


def pixels(result) -> np.ndarray:
    return np.asarray(result.image().convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def runner(cache_dir, tiny_models):
    from helpers import make_runner

    return make_runner(cache_dir, preset="tiny-shapes", max_batch=4, step_scheduling=True)


def stepped(runner, requests, schedule):
    """Run `requests` on the runner's stepper: `schedule` lists, per step, the indexes that step together."""
    states = [runner.stepper.start(r) for r in requests]
    for indexes in schedule:
        runner.stepper.step([states[i] for i in indexes])
    assert all(s.done for s in states)
    return [runner.stepper.finish(s) for s in states]


def test_a_stepped_request_is_the_pipelines_own_picture(runner):
    assert runner.stepper is not None  # FluxPipeline has a step function
    alone = runner.generate(request(0))
    [result] = stepped(runner, [request(0)], [[0]] * 4)
    assert np.abs(pixels(result) - pixels(alone)).max() == 0
    assert result.stepped and result.step_batches == (1, 1, 1, 1) and len(result.timings.step_ms) == 4


def test_requests_at_different_steps_share_steps_and_keep_their_pictures(runner):
    long, short = request(1, steps=6), request(2, steps=3, seed=7)
    alone = [runner.generate(long), runner.generate(short)]
    # the long one runs two steps alone, the short one joins for three, the long one finishes alone
    results = stepped(runner, [long, short], [[0], [0], [0, 1], [0, 1], [0, 1], [0]])
    assert [r.step_batches for r in results] == [(1, 1, 2, 2, 2, 1), (2, 2, 2)]
    for result, own in zip(results, alone, strict=True):
        assert np.abs(pixels(result) - pixels(own)).max() <= 1


def test_a_paused_request_resumes_with_the_same_pixels(runner):
    import time

    first, second = request(0, steps=5), request(1, steps=2)
    alone = runner.generate(first)
    states = [runner.stepper.start(first), runner.stepper.start(second)]
    runner.stepper.step([states[0]])
    states[0].pause(time.perf_counter())
    for _ in range(2):
        runner.stepper.step([states[1]])
        states[0].waited_for([second.request_id])
    states[0].resume(time.perf_counter())
    while not states[0].done:
        runner.stepper.step([states[0]])
    result = runner.stepper.finish(states[0])
    assert np.abs(pixels(result) - pixels(alone)).max() == 0  # fp32, never batched: bit for bit
    assert [(p.after_step, p.for_requests) for p in result.pauses] == [(1, 1)]
    assert any("paused" in n and "for 1 request" in n for n in result.notices)
    # the pause is kept out of the step times, and in the total
    assert sum(result.timings.step_ms) + result.pauses[0].ms <= result.timings.denoise_ms + 1


def test_what_runs_whole_says_why(runner):
    stepper = runner.stepper
    assert stepper.why_whole(request(0)) == ""
    assert "step cache" in stepper.why_whole(request(0, step_cache="first-block"))
    assert "partial images" in stepper.why_whole(request(0, previews=1))


@pytest.mark.slow  # compiles the bucket's graphs at batch sizes 1 and 2
@pytest.mark.parametrize("mode", ["compile", "regional"])
def test_stepped_on_a_compiled_bucket_is_the_pipelines_picture_and_compiles_nothing(runner, mode):
    from engine.protocol import BucketKey, Mode, Size

    bucket = BucketKey(Mode.parse(mode, "mode"), Size(64, 64))
    for batch in (1, 2):
        assert runner.warm_bucket(bucket.batched(batch)).state.value == "warm"
    alone = runner.generate(request(0, mode=mode))
    assert alone.warm and alone.recompiles == 0
    [result] = stepped(runner, [request(0, mode=mode)], [[0]] * 4)
    assert result.warm and not result.eager_fallback and result.recompiles == 0
    assert np.abs(pixels(result) - pixels(alone)).max() == 0
    other = runner.generate(request(1, mode=mode, steps=2))
    pair = stepped(runner, [request(0, mode=mode), request(1, mode=mode, steps=2)], [[0], [0, 1], [0, 1], [0]])
    assert [r.recompiles for r in pair] == [0, 0]  # batch sizes 1 and 2 are warm: nothing compiles
    for result, own in zip(pair, [alone, other], strict=True):
        assert np.abs(pixels(result) - pixels(own)).max() <= 1
