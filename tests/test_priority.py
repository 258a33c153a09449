"""Shorter requests first on shared CPU cores: the cost estimate and the niced serving thread."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import FakeClock, wait_until, waits_in

from engine.pipeline.faults import Faults
from engine.protocol import (
    BucketInfo,
    BucketKey,
    BucketState,
    EngineKey,
    GenerateRequest,
    GenerateResult,
    Mode,
    Result,
    Size,
    StepProgress,
    Timings,
)
from engine.worker import priority
from engine.worker.loop import WorkerLoop
from engine.worker.priority import RunCost, ShortRuns, ShortRunSlots, YieldToRequests
from engine.worker.served import EngineFacts

SMALL, BIG = Size(64, 64), Size(128, 128)


def test_no_runs_yet_means_no_estimate_and_no_penalty():
    cost = RunCost(short_ms=100, max_extra=8)
    assert cost.expected_ms("eager", SMALL, 4) is None
    assert cost.extra_niceness("eager", SMALL, 4) == 0


def test_short_requests_keep_priority_and_longer_ones_run_two_steps_lower_per_doubling():
    cost = RunCost(short_ms=100, max_extra=8)
    cost.record("eager", SMALL, steps=2, total_ms=80)  # 40 ms a step
    assert cost.expected_ms("eager", SMALL, 2) == pytest.approx(80)
    assert cost.extra_niceness("eager", SMALL, 2) == 0  # 80 ms
    assert cost.extra_niceness("eager", SMALL, 4) == 2  # 160 ms: up to one doubling
    assert cost.extra_niceness("eager", SMALL, 5) == 2  # 200 ms
    assert cost.extra_niceness("eager", SMALL, 6) == 4  # 240 ms: up to two
    assert cost.extra_niceness("eager", SMALL, 16) == 6  # 640 ms: up to three
    assert cost.extra_niceness("eager", SMALL, 21) == 8  # 840 ms
    assert cost.extra_niceness("eager", SMALL, 1000) == 8  # never past max_extra


def test_the_least_contended_run_is_the_estimate():
    cost = RunCost(short_ms=100, max_extra=8)
    cost.record("eager", SMALL, steps=2, total_ms=300)  # ran beside others
    cost.record("eager", SMALL, steps=2, total_ms=60)
    cost.record("eager", SMALL, steps=2, total_ms=200)
    assert cost.expected_ms("eager", SMALL, 2) == pytest.approx(60)


def test_an_unseen_size_scales_by_pixels_and_variants_are_apart():
    cost = RunCost(short_ms=100, max_extra=8)
    cost.record("eager", SMALL, steps=1, total_ms=50)
    assert cost.expected_ms("eager", BIG, 1) == pytest.approx(200)  # 4 × the pixels
    assert cost.expected_ms("regional", SMALL, 1) is None  # the compiled graph's cost is its own
    cost.record("regional", SMALL, steps=1, total_ms=20)
    assert cost.expected_ms("regional", SMALL, 3) == pytest.approx(60)


def test_zero_short_ms_turns_the_ordering_off():
    cost = RunCost(short_ms=0, max_extra=8)
    cost.record("eager", SMALL, steps=1, total_ms=10_000)
    assert cost.extra_niceness("eager", SMALL, 1) == 0


# -- the worker's serve loop --------------------------------------------------------------------


class _Board:
    def __init__(self, warm: set[BucketKey]):
        self.warm = warm

    def get(self, bucket):
        state = BucketState.WARM if bucket in self.warm or not bucket.mode.compiled else BucketState.COLD
        return BucketInfo(EngineKey("p", "cpu", "fp32"), bucket, state)


class _Runner:
    """Runs nothing: reports the niceness of the thread it was called on and a fixed cost per step."""

    def __init__(self, ms_per_step: dict[str, float], warm: set[BucketKey]):
        self.spec = SimpleNamespace(host_memory_is_device_memory=True)
        self.config = SimpleNamespace(key=EngineKey("p", "cpu", "fp32"))
        self.board = _Board(warm)
        self.faults = Faults()
        self.ms_per_step = ms_per_step
        self.niceness: list[int] = []
        self.policy: list[int] = []
        self.threads: list[int] = []
        self.step_at: list[list[float]] = []  # per request: when each step ended, on self.clock
        self.clock = time
        self.announced: list[bool] = []  # per request: its own short-run byte set while it ran
        self.short_runs: ShortRuns | None = None
        self.measured_run: tuple[Size, float] | None = None  # the load's measuring run
        self.folders_notice = ""

    def facts(self) -> EngineFacts:
        """What the loop reads of it (EngineFacts.of reads a real runner's options and spec)."""
        return EngineFacts(key=self.config.key, board=self.board, faults=self.faults,
                           shares_host_cores=self.spec.host_memory_is_device_memory)

    def loop(self, conn) -> WorkerLoop:
        """A worker's loop serving it: it is the loop's executor and reports on itself."""
        return WorkerLoop(conn, self.facts(), self, self)

    def footprint(self):
        return None

    def folders(self):
        return None

    def lora_info(self):
        return None

    def buckets_to_warm(self):
        return []

    def generate(self, request, on_step=None, cancel=None):
        self.niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.policy.append(os.sched_getscheduler(0))  # 0: the calling thread
        self.threads.append(threading.get_ident())
        warm = request.bucket in self.board.warm or not request.mode.compiled
        variant = str(request.mode) if request.mode.compiled and warm else "eager"
        total = self.ms_per_step[variant] * request.steps
        if self.short_runs is not None:
            self.announced.append(self.short_runs._map[self.short_runs.slot] == 1)
        self.step_at.append([])
        for step in range(1, request.steps + 1):
            self.step_at[-1].append(self.clock.monotonic())
            if on_step is not None:
                on_step(StepProgress(request.request_id, step, request.steps, 1.0))
        timings = Timings(step_ms=(), encode_ms=0, denoise_ms=total, decode_ms=0, total_ms=total)
        return GenerateResult(
            request.request_id,
            self.config.key,
            request.bucket,
            b"",
            timings,
            warm=warm,
            eager_fallback=not warm,
            recompiles=0,
            peak_memory_bytes=None,
            steps=request.steps,
        )


class _Conn:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def _request(mode: Mode, steps: int) -> GenerateRequest:
    return GenerateRequest.checked("a red circle", 64, 64, steps=steps, guidance=0.0, seed=0, mode=mode)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_long_request_runs_on_a_niced_thread_and_a_short_one_at_the_workers_priority(monkeypatch):
    monkeypatch.setenv("SHOWCASE_SHORT_REQUEST_MS", "100")
    monkeypatch.setenv("SHOWCASE_COMPILE_NICENESS", "10")
    regional = BucketKey(Mode.REGIONAL, SMALL)
    runner = _Runner({"eager": 100.0, "regional": 20.0}, warm={regional})
    conn = _Conn()
    loop = runner.loop(conn)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    loop.serve_whole([_request(Mode.EAGER, 4)])  # nothing known yet: at the worker's priority
    loop.serve_whole([_request(Mode.REGIONAL, 2)])  # first of its variant: likewise
    loop.serve_whole([_request(Mode.EAGER, 4)])  # 400 ms expected: long (two doublings)
    loop.serve_whole([_request(Mode.REGIONAL, 2)])  # 40 ms expected: short
    loop.serve_whole([_request(Mode.COMPILE, 2)])  # compile mode, bucket cold: served eagerly, 200 ms (one doubling)

    here = threading.get_ident()
    assert [n - base for n in runner.niceness] == [0, 0, min(19 - base, 4), 0, min(19 - base, 2)]
    assert [t == here for t in runner.threads] == [True, True, False, True, False]
    other, batch = os.SCHED_OTHER, os.SCHED_BATCH  # long ones do not preempt short ones on waking
    assert runner.policy == [other, other, batch, other, batch]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the serve thread is untouched
    assert sum(isinstance(m, Result) for m in conn.sent) == 5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_loads_measuring_run_is_the_first_estimate_so_a_new_engines_long_requests_are_niced(monkeypatch):
    monkeypatch.setenv("SHOWCASE_SHORT_REQUEST_MS", "100")
    runner = _Runner({"eager": 100.0}, warm=set())
    runner.measured_run = (BIG, 120.0)  # one eager step at 128x128 took 120 ms while loading
    loop = runner.loop(_Conn())
    loop.learn_from_measuring_run(runner.measured_run)
    assert loop.run_cost.expected_ms("eager", SMALL, 10) == pytest.approx(300.0)  # a quarter of the pixels
    loop.serve_whole([_request(Mode.EAGER, 10)])  # its very first request: known to be long
    assert runner.threads[-1] != threading.get_ident()
    loop.serve_whole([_request(Mode.EAGER, 1)])  # 30 ms: short
    assert runner.threads[-1] == threading.get_ident()


def test_accelerator_engines_do_not_order_by_niceness():
    runner = _Runner({"eager": 1000.0}, warm=set())
    runner.spec.host_memory_is_device_memory = False
    loop = runner.loop(_Conn())
    assert loop.run_cost is None
    loop.serve_whole([_request(Mode.EAGER, 4)])
    loop.serve_whole([_request(Mode.EAGER, 4)])
    assert runner.threads == [threading.get_ident()] * 2


# -- long requests step aside while another engine runs a short one -----------------------------
def test_short_run_slots_make_long_requests_wait_for_short_ones_elsewhere_within_a_bound(tmp_path, monkeypatch):
    clock = FakeClock()  # the waits below run on a clock that moves only while step_aside sleeps
    monkeypatch.setattr(priority, "time", clock)
    slots = ShortRunSlots(tmp_path)
    short, long = slots.take(), slots.take()
    assert (short.slot, long.slot) == (0, 1)
    long.max_wait_s = 2.0  # far above what the waits below take, so a wait that ends early ended for its reason
    assert long.step_aside() == 0.0  # nothing short runs
    long.set_running(True)
    assert long.step_aside() == 0.0  # its own byte does not count
    long.set_running(False)

    poll_s = ShortRuns.POLL_S
    short.set_running(True)
    clock.at(0.1, lambda: short.set_running(False))
    waited = long.step_aside()
    assert 0.1 <= waited < 0.1 + poll_s + 1e-9  # until the short one ended, not a poll longer

    short.set_running(True)
    cancel = threading.Event()
    clock.at(0.05, cancel.set)
    assert 0.05 <= long.step_aside(cancel) < 0.05 + poll_s + 1e-9  # a cancel ends the wait
    long.max_wait_s = 0.3
    assert 0.3 <= long.step_aside() < 0.3 + poll_s + 1e-9  # never more than its bound per step
    assert long.others_running()  # the short one still ran: the bound ended that wait

    slots.release(short.slot)  # its engine died with the byte set: cleared
    assert not long.others_running()
    assert slots.take().slot == 0  # and the slot is free again
    again = ShortRuns.from_env(long.env_value())
    assert again.slot == 1 and ShortRuns.from_env("") is None and ShortRuns.from_env("/nonexistent/x:3") is None
    slots.remove()
    assert not slots.path.exists()


def test_a_long_request_waits_between_its_steps_while_another_engine_runs_a_short_one(monkeypatch, tmp_path):
    monkeypatch.setenv("SHOWCASE_SHORT_REQUEST_MS", "100")
    slots = ShortRunSlots(tmp_path)
    elsewhere = slots.take()
    mine = slots.take()
    monkeypatch.setenv("SHOWCASE_SHORT_RUNS", mine.env_value())
    regional = BucketKey(Mode.REGIONAL, SMALL)
    runner = _Runner({"eager": 100.0, "regional": 20.0}, warm={regional})
    loop = runner.loop(_Conn())
    assert loop.short_runs is not None and loop.short_runs.slot == mine.slot
    runner.short_runs = loop.short_runs
    loop.short_runs.max_wait_s = 5.0
    loop.serve_whole([_request(Mode.EAGER, 4)])  # learn the costs (nothing known: served as short)
    loop.serve_whole([_request(Mode.REGIONAL, 2)])
    assert runner.announced == [True, True]  # a short request marks its byte while it runs...
    assert not elsewhere.others_running()  # ...and clears it after

    clock = FakeClock()  # moves only while a request steps aside: each wait below is exact
    monkeypatch.setattr(priority, "time", clock)
    runner.clock = clock
    elsewhere.set_running(True)  # another engine runs a short request for 0.2 s
    clock.at(0.2, lambda: elsewhere.set_running(False))
    loop.serve_whole([_request(Mode.EAGER, 4)])  # 400 ms expected: long
    steps = runner.step_at[-1]
    assert runner.announced[-1] is False  # a long one does not
    assert 0.2 <= steps[0] < 0.2 + ShortRuns.POLL_S + 1e-9  # it waited before its first step, until then
    assert steps[-1] == steps[0]  # then ran its steps without waiting (each would wait up to 5 s)

    elsewhere.set_running(True)
    started = clock.t
    loop.serve_whole([_request(Mode.REGIONAL, 2)])  # short: never waits for other short ones
    assert runner.step_at[-1][0] == started  # a wait would last its 5 s bound
    elsewhere.set_running(False)
    slots.remove()


def test_without_short_run_slots_or_off_requests_are_ordered_by_niceness_alone(monkeypatch, tmp_path):
    slots = ShortRunSlots(tmp_path)
    monkeypatch.setenv("SHOWCASE_SHORT_RUNS", slots.take().env_value())
    monkeypatch.setenv("SHOWCASE_STEP_ASIDE", "0")
    assert _Runner({"eager": 1.0}, warm=set()).loop(_Conn()).short_runs is None
    monkeypatch.delenv("SHOWCASE_STEP_ASIDE")
    accelerator = _Runner({"eager": 1.0}, warm=set())
    accelerator.spec.host_memory_is_device_memory = False
    assert accelerator.loop(_Conn()).short_runs is None  # an accelerator's requests share no cores
    assert _Runner({"eager": 1.0}, warm=set()).loop(_Conn()).short_runs is not None
    slots.remove()


# -- the compile thread steps aside while a request runs ----------------------------------------

def _count_to(n: int) -> int:
    total = 0
    for i in range(n):
        total += abs(i)  # a C call per step: the hook sees it, only Python calls make it wait
        total += _one()
    return total


def _one() -> int:
    return 1


def _compile_like(yielder: YieldToRequests, progress: list, stop: threading.Event) -> None:
    sys.setprofile(yielder.hook)
    try:
        while not stop.is_set():
            _count_to(100)
            progress.append(1)
    finally:
        sys.setprofile(None)


def _waits_in_hook(thread: threading.Thread) -> bool:
    return waits_in(thread, YieldToRequests.hook)


def test_the_compile_thread_waits_while_a_request_runs_and_resumes_after():
    yielder = YieldToRequests(max_wait_s=5.0)
    progress: list = []
    stop = threading.Event()
    compiler = threading.Thread(target=_compile_like, args=(yielder, progress, stop), daemon=True)
    compiler.start()
    try:
        wait_until(lambda: len(progress) >= 5, 30, 0.01, "the compile thread's first passes")
        before = len(progress)
        with yielder.request():
            wait_until(lambda: _waits_in_hook(compiler), 30, 0.01, "the compile thread pausing at its next Python call")
            during = len(progress)
            assert during - before <= 1  # at most the pass that was under way when the request began
            assert _waits_in_hook(compiler) and len(progress) == during  # still paused: no pass went by
        wait_until(lambda: len(progress) > during + 1, 30, 0.01, "the compile thread going on")
    finally:
        stop.set()
        compiler.join(5)


def test_a_compile_thread_never_waits_more_than_its_bound_per_request():
    """A request that needs something the compile thread holds gets it after max_wait_s: no deadlock."""
    yielder = YieldToRequests(max_wait_s=0.2)
    held = threading.Lock()
    progress: list = []
    stop = threading.Event()

    def compile_holding_a_lock():
        with held:
            _compile_like(yielder, progress, stop)

    with yielder.request():
        compiler = threading.Thread(target=compile_holding_a_lock, daemon=True)
        compiler.start()
        # past its bound the compile thread runs beside this request
        wait_until(lambda: len(progress) >= 3, 30, 0.01, "the compile thread going on past its bound")
        stop.set()
        assert held.acquire(timeout=5)  # the request gets the lock once the compile thread lets go of it
        held.release()
    compiler.join(5)


def test_a_request_waits_for_an_fx_trace_under_way_which_is_never_paused():
    """torch.fx's symbolic tracer patches torch.nn.Module.__call__ for every thread while it traces: a
    request run inside that window fails, and pausing the compile thread there would make sure it did."""
    import torch.fx._symbolic_trace as fx

    yielder = YieldToRequests(max_wait_s=5.0)
    inside, release, finished = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def trace_like():
        sys.setprofile(yielder.hook)
        fx._is_fx_tracing_flag = True
        try:
            inside.set()
            release.wait(5)
            _count_to(100)  # Python calls inside the trace while a request waits: none may pause
        finally:
            order.append("trace ended")
            fx._is_fx_tracing_flag = False
            sys.setprofile(None)
        finished.set()

    def request():
        with yielder.request():
            order.append("request started")

    compiler = threading.Thread(target=trace_like, daemon=True)
    compiler.start()
    assert inside.wait(5)
    requester = threading.Thread(target=request, daemon=True)
    requester.start()
    wait_until(lambda: waits_in(requester, YieldToRequests._begin), 30, 0.01, "the request waiting")
    assert order == []  # it waits while the trace is under way
    release.set()
    assert finished.wait(5)  # the trace ran to its end with the request pending: never paused inside
    requester.join(5)
    assert order == ["trace ended", "request started"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_loading_runs_on_a_thread_below_the_serving_one_and_hands_back_its_result_or_error():
    """A worker loads its pipeline (imports, weights, a measuring run) as far below its requests as its
    compiles, so engines loading for new visitors do not slow loaded engines' requests."""
    from engine.worker.priority import run_on_lowered_thread

    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = run_on_lowered_thread(lambda: (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                                          threading.get_ident()), 3, name="load")
    assert seen[0] == min(19, here + 3) and seen[1] != threading.get_ident()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here  # the caller keeps its own

    def broken():
        raise ValueError("no weights")

    with pytest.raises(ValueError, match="no weights"):
        run_on_lowered_thread(broken, 3, name="load")
