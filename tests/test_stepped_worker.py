"""A worker serving requests a step at a time (engine/worker/stepped.py) on threads of this process, with the
tiny-shapes engine: a short request that arrives during a long one joins it or pauses it at a step boundary,
finishes first, and both pictures are the ones they make alone."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from engine.protocol import Cancel, Generate, GenerateRequest, Progress, RequestFailed, Result, Shutdown
from engine.serving.inprocess import LocalConnection
from engine.worker.loop import WorkerLoop
from engine.worker.served import EngineFacts

PROMPTS = ["a red circle on a blue background", "a yellow triangle on a purple background"]


def request(i: int, steps: int, size=(64, 64), **fields) -> GenerateRequest:
    values = dict(prompt=PROMPTS[i % 2], width=size[0], height=size[1], steps=steps, guidance=1.0, seed=i,
                  mode="eager", request_id=f"r{i}", client=f"client-{i}")
    return GenerateRequest.checked(**{**values, **fields})


def pixels(result) -> np.ndarray:
    return np.asarray(result.image().convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def runner(cache_dir, tiny_models):
    from helpers import make_runner

    return make_runner(cache_dir, preset="tiny-shapes", max_batch=4, step_scheduling=True)


@pytest.fixture(scope="module")
def whole_runner(cache_dir, tiny_models):
    from helpers import make_runner

    return make_runner(cache_dir, preset="tiny-shapes", max_batch=4, step_scheduling=False)


class Served:
    """A WorkerLoop over `runner` on threads: what it sends, in order, and a way to send it messages."""

    def __init__(self, runner):
        self.ours, theirs = LocalConnection.pair()
        self.loop = WorkerLoop(theirs, EngineFacts.of(runner), runner, runner, switch_interval=False)
        self.received: queue.Queue = queue.Queue()
        self.order: list = []
        threading.Thread(target=self._read, daemon=True).start()
        self.serving = threading.Thread(target=self.loop.run, daemon=True)
        self.serving.start()

    def _read(self):
        while True:
            try:
                message = self.ours.recv()
            except EOFError:
                return
            self.received.put(message)

    def send(self, request: GenerateRequest) -> None:
        self.ours.send(Generate(request))

    def wait_for_step(self, request_id: str, step: int) -> None:
        while True:
            message = self.received.get(timeout=60)
            self.order.append(message)
            if isinstance(message, Progress) and message.progress.request_id == request_id \
                    and message.progress.step >= step:
                return

    def answers(self, n: int) -> list:
        """The next n answers (Result or RequestFailed), in the order they came."""
        answers = []
        while len(answers) < n:
            message = self.received.get(timeout=120)
            self.order.append(message)
            if isinstance(message, (Result, RequestFailed)):
                answers.append(message)
        return answers

    def close(self):
        self.ours.send(Shutdown())
        self.ours.close()
        self.serving.join(30)


@pytest.fixture
def served(runner):
    served = Served(runner)
    yield served
    served.close()


def test_a_short_request_joins_a_long_run_and_finishes_first(runner, served):
    long, short = request(0, 40), request(1, 4)
    alone = {r.request_id: runner.generate(r) for r in (long, short)}
    served.send(long)
    served.wait_for_step("r0", 3)
    served.send(short)
    first, second = served.answers(2)
    assert [a.result.request_id for a in (first, second)] == ["r1", "r0"]
    short_result, long_result = first.result, second.result
    assert short_result.stepped and short_result.step_batches == (2, 2, 2, 2)  # joined the running batch
    assert long_result.step_batches[:3] == (1, 1, 1) and long_result.step_batches.count(2) == 4
    assert long_result.step_batches[-1] == 1  # it went on alone once the short one left
    for result in (short_result, long_result):
        assert np.abs(pixels(result) - pixels(alone[result.request_id])).max() <= 1


def test_a_request_at_another_bucket_pauses_the_long_one_which_keeps_its_pixels(runner, served):
    long, short = request(0, 40), request(1, 4, size=(128, 64))
    alone = runner.generate(long)
    served.send(long)
    served.wait_for_step("r0", 3)
    served.send(short)
    first, second = served.answers(2)
    assert [a.result.request_id for a in (first, second)] == ["r1", "r0"]
    long_result = second.result
    assert set(long_result.step_batches) == {1} and long_result.pauses  # never batched, paused in turn
    assert all(p.for_requests == 1 for p in long_result.pauses)
    assert any("paused" in n and "for 1 request" in n for n in long_result.notices)
    assert np.abs(pixels(long_result) - pixels(alone)).max() == 0  # fp32, never batched: bit for bit
    # the steps the short one took came between the long one's
    steps = [(m.progress.request_id, m.progress.step) for m in served.order if isinstance(m, Progress)]
    short_at = [k for k, (rid, _) in enumerate(steps) if rid == "r1"]
    assert any(steps[k + 1][0] == "r0" for k in short_at[:-1])


def test_a_cancel_takes_effect_at_the_next_step_boundary(served):
    served.send(request(0, 200))
    served.wait_for_step("r0", 2)
    served.ours.send(Cancel("r0"))
    [answer] = served.answers(1)
    assert isinstance(answer, RequestFailed) and "cancelled after step" in str(answer.error)
    step = int(str(answer.error).split("after step ")[1].split()[0])
    assert 2 <= step < 200


def test_without_step_scheduling_the_short_request_waits_for_the_long_run(whole_runner):
    assert whole_runner.stepper is None
    assert any("step-level scheduling is off" in n for n in whole_runner.notices)  # said on the board
    served = Served(whole_runner)
    try:
        served.send(request(0, 40))
        served.wait_for_step("r0", 3)
        served.send(request(1, 4))
        first, second = served.answers(2)
        assert [a.result.request_id for a in (first, second)] == ["r0", "r1"]
        assert not first.result.stepped and not second.result.stepped
    finally:
        served.close()
