"""The worker loop on threads of this process, over an in-memory connection, with a runner that computes
nothing: where a request waits for its compile, and which engines take test faults."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
from helpers import make_request, make_runner, wait_until

from engine.errors import InvalidRequest
from engine.pipeline.faults import Faults
from engine.pipeline.runner import BucketBoard
from engine.protocol import (
    BucketKey,
    BucketState,
    Cancel,
    CompileGranted,
    CompileWanted,
    EngineKey,
    EngineOptions,
    Fault,
    Generate,
    GenerateResult,
    InjectFault,
    Mode,
    RequestFailed,
    Result,
    Shutdown,
    Size,
    TestingOptions,
    Timings,
    Warm,
)
from engine.serving.inprocess import LocalConnection
from engine.worker.loop import WorkerLoop
from engine.worker.served import EngineFacts

KEY = EngineKey("tiny-flux", "cpu", "fp32")
REGIONAL = BucketKey(Mode.REGIONAL, Size(64, 64))


class _Runner:
    """A runner whose compile of a bucket lasts until the test releases it, and whose generate notes the
    state of the request's bucket when it ran."""

    def __init__(self):
        self.spec = SimpleNamespace(host_memory_is_device_memory=False)
        self.config = SimpleNamespace(key=KEY)
        self.board = BucketBoard(KEY)
        self.faults = Faults()
        self.max_batch, self.batch_sizes, self.measured_run = 1, (1,), None
        self.folders_notice = ""
        self.compiling, self.release = threading.Event(), threading.Event()
        self.ran_at: list[BucketState] = []
        self.generating = threading.Event()

    def warm_bucket(self, bucket):
        self.board.update(bucket, state=BucketState.COMPILING)
        self.compiling.set()
        assert self.release.wait(30)
        return self.board.update(bucket, state=BucketState.WARM)

    def footprint(self):
        return None

    def buckets_to_warm(self):
        return []

    def folders(self):
        return None

    def lora_info(self):
        return None

    def generate(self, request, on_step=None, cancel=None):
        self.generating.set()
        info = self.board.get(request.bucket)
        self.ran_at.append(info.state)
        warm = info.state is BucketState.WARM
        timings = Timings(step_ms=(1.0,), encode_ms=0, denoise_ms=1, decode_ms=0, total_ms=1)
        return GenerateResult(request.request_id, KEY, request.bucket, b"", timings, warm=warm,
                              eager_fallback=not warm, recompiles=0, peak_memory_bytes=None, steps=request.steps)


def facts_of(runner) -> EngineFacts:
    """What the loop reads of a fake runner (EngineFacts.of reads a real one's options and spec)."""
    return EngineFacts(key=KEY, board=runner.board, faults=runner.faults, max_batch=runner.max_batch,
                       batch_sizes=runner.batch_sizes)


def start_loop(runner, on_message=None, board_changes: bool = False):
    """A WorkerLoop serving `runner` on threads: (client end of the connection, messages the loop sent, the
    serving thread). The client side grants every compile; `on_message` sees each message first;
    `board_changes`: the runner's bucket states are sent too, as a worker process sends them."""
    ours, theirs = LocalConnection.pair()
    if board_changes:
        from engine.protocol import BucketChanged

        runner.board.listener = lambda info: theirs.send(BucketChanged(info))
    loop = WorkerLoop(theirs, facts_of(runner), runner, runner)
    received: queue.Queue = queue.Queue()

    def read():
        while True:
            try:
                message = ours.recv()
            except EOFError:
                return
            if isinstance(message, CompileWanted):
                ours.send(CompileGranted(message.bucket))
            if on_message is not None:
                on_message(message)
            received.put(message)

    threading.Thread(target=read, daemon=True).start()
    serving = threading.Thread(target=loop.run, daemon=True)
    serving.start()
    return ours, received, serving


@pytest.fixture
def loop_and_client():
    """(runner, client end of the connection, messages the loop sent); the loop grants every compile."""
    runner = _Runner()
    ours, received, serving = start_loop(runner)
    yield runner, ours, received
    runner.release.set()
    ours.send(Shutdown())
    ours.close()
    serving.join(10)


def _next(received: queue.Queue, kind: type, timeout: float = 30):
    while True:
        message = received.get(timeout=timeout)
        if isinstance(message, kind):
            return message


def _next_result(received: queue.Queue) -> GenerateResult:
    return _next(received, Result).result


def test_a_request_at_a_compiling_bucket_that_waits_runs_once_it_is_compiled(loop_and_client):
    runner, client, received = loop_and_client
    client.send(Warm(REGIONAL))
    assert runner.compiling.wait(30)
    client.send(Generate(make_request(mode="regional", on_cold="wait")))
    assert not runner.generating.wait(0.5)  # it waits while the bucket compiles
    runner.release.set()
    result = _next_result(received)
    assert runner.ran_at == [BucketState.WARM] and result.warm and not result.eager_fallback


def test_a_request_at_a_compiling_bucket_that_does_not_wait_runs_eagerly_meanwhile(loop_and_client):
    runner, client, received = loop_and_client
    client.send(Warm(REGIONAL))
    assert runner.compiling.wait(30)
    client.send(Generate(make_request(mode="regional")))
    result = _next_result(received)
    assert runner.ran_at == [BucketState.COMPILING] and result.eager_fallback


def test_the_runner_alone_never_waits_nor_compiles_for_a_request(cache_dir, tiny_models):
    """Waiting is the worker loop's: a runner called directly serves a cold bucket eagerly, with the reason."""
    runner = make_runner(cache_dir)
    result = runner.generate(make_request(mode="regional", on_cold="wait"))
    assert result.eager_fallback and any("is cold; served eagerly" in n for n in result.notices)
    assert runner.board.get(REGIONAL).state is BucketState.COLD


def test_an_engine_not_started_for_tests_refuses_every_fault(loop_and_client):
    runner, client, received = loop_and_client
    for fault in Fault:
        client.send(InjectFault(fault))
        failed = _next(received, RequestFailed)
        assert failed.request_id is None and "fault injection is off" in str(failed.error)
    assert not any(runner.faults.take(fault) for fault in Fault)


def test_the_app_and_the_cli_start_engines_with_the_test_hooks_off():
    import app
    from engine.config.flags import options_from_args

    every_flag = ["--fuse-qkv", "--channels-last", "--cpu-offload", "--max-autotune", "--dynamic", "--cuda-graphs",
                  "--no-compile-vae", "--inductor-flags", "--max-batch", "2", "--attention-backend", "flex"]
    assert options_from_args(app.build_parser().parse_args(every_flag)).testing == TestingOptions()
    assert Faults(EngineOptions().testing).should_fail_compile() is False
    with pytest.raises(InvalidRequest, match="fault injection is off"):
        Faults(EngineOptions().testing).arm(Fault.OOM)


class _HeldRunner(_Runner):
    """Its generate runs until the test lets it finish (`finish`)."""

    def __init__(self):
        super().__init__()
        self.finish = threading.Event()

    def generate(self, request, on_step=None, cancel=None):
        self.generating.set()
        assert self.finish.wait(30)
        self.ran_at.append(BucketState.COLD)  # eager: its bucket is not on the board
        timings = Timings(step_ms=(1.0,), encode_ms=0, denoise_ms=1, decode_ms=0, total_ms=1)
        return GenerateResult(request.request_id, KEY, request.bucket, b"", timings, warm=False,
                              eager_fallback=False, recompiles=0, peak_memory_bytes=None, steps=request.steps)


def test_a_waiting_request_cancelled_is_answered_at_once_not_at_its_turn():
    """A Compare cancelled while its request waited behind others: its answer came only when the requests
    ahead had run (~20 s), so its caller waited that long. The receiver answers it at once (before it handles
    the next message: no timing involved), and the serving loop never runs it."""
    runner = _HeldRunner()
    ours, received, serving = start_loop(runner)
    ahead, waiting, after = make_request(), make_request(), make_request()
    try:
        ours.send(Generate(ahead))
        assert runner.generating.wait(30)  # the serving thread is busy with `ahead`
        ours.send(Generate(waiting))
        ours.send(Cancel(waiting.request_id))
        ours.send(InjectFault(Fault.OOM))  # answered by the receiver right after the cancel: a marker
        first = _next(received, RequestFailed)
        assert first.request_id == waiting.request_id and "cancelled before it started" in str(first.error), first
        assert "fault injection is off" in str(_next(received, RequestFailed).error)
        ours.send(Generate(after))
        runner.finish.set()
        assert [_next_result(received).request_id for _ in range(2)] == [ahead.request_id, after.request_id]
        assert len(runner.ran_at) == 2  # the cancelled one never ran
    finally:
        runner.finish.set()
        ours.send(Shutdown())
        ours.close()
        serving.join(10)


class _SlowBackgroundRunner(_Runner):
    """Its compile of BACKGROUND runs until the test releases it (calling Python functions meanwhile, as a
    compile does); every other bucket compiles at once."""

    def __init__(self):
        super().__init__()
        self.compiles: list[tuple[BucketKey, str]] = []

    def step(self):  # a unit of work where a compile may be set aside (as dynamo's bytecode steps)
        return self.release.wait(0.01)

    def warm_bucket(self, bucket):
        self.board.update(bucket, state=BucketState.COMPILING)
        if bucket == BACKGROUND:
            self.compiling.set()
            try:
                while not self.step():
                    pass
            except BaseException:
                self.compiles.append((bucket, "set aside"))
                raise
        self.compiles.append((bucket, "compiled"))
        return self.board.update(bucket, state=BucketState.WARM)


BACKGROUND = BucketKey(Mode.REGIONAL, Size(128, 128))


def test_a_request_waiting_for_a_compile_does_not_wait_behind_a_background_one():
    """A cold Compare waited ~105 s: its bucket was first in the host's queue, but its engine compiles one
    bucket at a time and was busy with the start-up warm list. The background compile is set aside (back in
    the queue), the waited-for bucket compiles, the request runs warm, then the background compile resumes."""
    runner = _SlowBackgroundRunner()
    ours, received, serving = start_loop(runner)
    try:
        ours.send(Warm(BACKGROUND))
        assert runner.compiling.wait(30)
        ours.send(Generate(make_request(mode="regional", on_cold="wait")))
        result = _next_result(received)  # without the set-aside: no result until the test releases the compile
        assert result.warm and runner.ran_at == [BucketState.WARM]
        assert runner.compiles[:2] == [(BACKGROUND, "set aside"), (REGIONAL, "compiled")]
        assert runner.board.get(BACKGROUND).state in (BucketState.QUEUED, BucketState.COMPILING)
        runner.release.set()
        wait_until(lambda: runner.compiles[-1] == (BACKGROUND, "compiled"), timeout=30,
                   message="the background compile set aside never ran again")
    finally:
        runner.release.set()
        ours.send(Shutdown())
        ours.close()
        serving.join(10)


@pytest.mark.slow  # compiles the tiny pipeline (regional) twice
def test_a_real_compile_set_aside_unwinds_and_compiles_again(cache_dir, tiny_models):
    """The set-aside raises inside torch.compile (dynamo, inductor): the waited-for bucket compiles and
    serves warm, the bucket set aside compiles again later and serves warm too."""
    import torch._dynamo

    from engine.protocol import BucketChanged

    torch._dynamo.reset()  # other tests' graphs of the same classes in this process count against its limit
    runner = make_runner(cache_dir)
    states: list[tuple[BucketKey, BucketState]] = []

    def note_state(message):
        if isinstance(message, BucketChanged):
            states.append((message.info.bucket, message.info.state))

    ours, received, serving = start_loop(runner, note_state, board_changes=True)
    try:
        ours.send(Warm(BACKGROUND))
        wait_until(lambda: (BACKGROUND, BucketState.COMPILING) in states, timeout=60, message="no background compile")
        ours.send(Generate(make_request(mode="regional", on_cold="wait")))
        result = _next(received, Result, timeout=600).result  # its compile: 20-120 s on a busy 2-core box
        assert result.warm and not result.eager_fallback
        after = states[states.index((BACKGROUND, BucketState.COMPILING)):]
        assert (BACKGROUND, BucketState.QUEUED) in after, states  # set aside mid-compile
        wait_until(lambda: runner.board.get(BACKGROUND).state in (BucketState.WARM, BucketState.FAILED),
                   timeout=600, message="the background bucket never compiled again")
        assert runner.board.get(BACKGROUND).state is BucketState.WARM, runner.board.get(BACKGROUND).error
        ours.send(Generate(make_request(mode="regional", on_cold="wait", width=128, height=128, request_id="big")))
        assert _next(received, Result, timeout=600).result.warm
    finally:
        ours.send(Shutdown())
        ours.close()
        serving.join(10)


@pytest.mark.parametrize("asks_to_stop", [True, False], ids=["shutdown", "hang-up"])
def test_the_sidecar_loop_tells_a_shutdown_from_a_hang_up(asks_to_stop):
    """A sidecar started by hand exits when its client asks it to, and waits for the next client when the
    client only hangs up: its loop notes which it was (engine/tp/sidecar.py RankProcess.serve)."""
    from engine.tp.runner import GroupHealth
    from engine.tp.sidecar import GroupStop

    runner = _Runner()
    ours, theirs = LocalConnection.pair()
    loop = WorkerLoop(theirs, facts_of(runner), runner, runner, GroupStop(GroupHealth(runner.config.key)))
    serving = threading.Thread(target=loop.run, daemon=True)
    serving.start()
    if asks_to_stop:
        ours.send(Shutdown())
    ours.close()
    serving.join(10)
    assert not serving.is_alive() and loop.shutdown_asked is asks_to_stop
