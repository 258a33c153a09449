"""Shared hosting: budgets and eviction, the host-wide compile scheduler, what visitors may do.

The planning parts are pure and tested directly; one manager test runs real worker processes on the
tiny models to show eviction, refusal and reload end to end.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from helpers import engine_manager, wait_until

from engine.config.request import ImageRequest
from engine.errors import BudgetExceeded, Cancelled, InvalidRequest, NotAllowed
from engine.protocol import BucketKey, EngineKey, Mode, Precision, Size
from engine.serving import budget
from engine.serving.budget import GIB, MIB, DeviceBudget, Resident, plan_room
from engine.serving.manager import Caller, HostPolicy
from engine.serving.scheduler import CompileScheduler


# -- budget planning ----------------------------------------------------------------------------
def _r(name, gib, busy=False, used=0.0, evictable=True):
    return Resident(name, int(gib * GIB), busy, used, evictable)


def test_room_is_made_by_evicting_least_recently_used_idle_engines_first():
    residents = [_r("a", 1, used=30), _r("b", 1, used=10), _r("c", 1, used=20)]
    plan = plan_room(int(1.5 * GIB), DeviceBudget("cpu", 3 * GIB, 8), residents)
    assert plan.fits and plan.evict == ("b", "c")  # b is the oldest, then c; a stays
    assert plan.used_after == int(2.5 * GIB)


def test_a_busy_engine_is_never_evicted_and_the_refusal_says_why():
    residents = [_r("busy-one", 2, busy=True, used=0), _r("idle-one", 0.5, used=5)]
    plan = plan_room(2 * GIB, DeviceBudget("cpu", 3 * GIB, 8), residents)
    assert not plan.fits and plan.evict == ()
    assert "busy-one" in plan.reason and "GiB" in plan.reason


def test_engine_count_limit_evicts_even_when_bytes_fit():
    plan = plan_room(1, DeviceBudget("cpu", 100 * GIB, 2), [_r("a", 0.1, used=2), _r("b", 0.1, used=1)])
    assert plan.fits and plan.evict == ("b",)


def test_a_model_bigger_than_the_whole_budget_is_refused_without_evicting_anything():
    plan = plan_room(5 * GIB, DeviceBudget("cpu", 3 * GIB, 8), [_r("a", 1)])
    assert not plan.fits and plan.evict == () and "more than the whole budget" in plan.reason


def test_no_byte_limit_means_only_the_count_bounds():
    plan = plan_room(10**15, DeviceBudget("tpu", None, 1), [])
    assert plan.fits


@pytest.mark.parametrize("text,expected", [("3GiB", 3 * GIB), ("512MiB", 512 * MIB), ("2.5G", int(2.5 * GIB)),
                                           ("1000000", 1000000), ("", None)])
def test_memory_sizes_parse(text, expected):
    assert budget.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "3 parsecs", "0"])
def test_bad_memory_sizes_say_what_to_write(text):
    with pytest.raises(InvalidRequest, match="e.g. '3GiB'"):
        budget.parse_size(text)


def test_weights_are_counted_from_safetensors_headers(tiny_models):
    params = budget.safetensors_parameters(tiny_models["tiny-flux"])
    assert params > 100_000
    assert budget.weights_bytes(tiny_models["tiny-flux"], "bf16") == 2 * params
    assert budget.weights_bytes(tiny_models["tiny-flux"], "fp32") == 4 * params


# -- compile scheduling --------------------------------------------------------------------------
class FakeEngine:
    def __init__(self, name):
        self.key = name
        self.granted: list[BucketKey] = []

    def grant_compile(self, bucket):
        self.granted.append(bucket)


def _b(mode, size):
    return BucketKey(Mode(mode), Size.parse(size))


def test_scheduler_runs_at_most_jobs_compiles_and_orders_by_demand():
    scheduler = CompileScheduler(jobs=1)
    default, other = FakeEngine("default"), FakeEngine("other")
    scheduler.want(default, _b("compile", "64x64"), startup_rank=0)  # granted at once: the slot is free
    assert default.granted == [_b("compile", "64x64")]
    scheduler.want(default, _b("compile", "128x128"), startup_rank=1)  # start-up list, later
    scheduler.want(other, _b("regional", "64x64"), hits=3)  # requested 3 times
    assert len(scheduler.snapshot()["running"]) == 1
    scheduler.finished(default, _b("compile", "64x64"))
    assert other.granted[-1] == _b("regional", "64x64")  # most requested before the start-up list
    scheduler.finished(other, _b("regional", "64x64"))
    assert default.granted[-1] == _b("compile", "128x128")


def test_a_compile_a_request_waits_for_starts_beside_background_compiles():
    """A cold Compare's bucket was first in line but waited for the one slot a start-up compile held."""
    scheduler = CompileScheduler(jobs=1)
    default, other = FakeEngine("default"), FakeEngine("other")
    scheduler.want(default, _b("compile", "64x64"), startup_rank=0)
    scheduler.want(default, _b("compile", "128x128"), startup_rank=1)
    scheduler.want(other, _b("regional", "128x64"), waiting=1)  # a request waits for it: at once
    assert other.granted == [_b("regional", "128x64")]
    running = scheduler.snapshot()["running"]
    assert [(r["bucket"], r["waiting"]) for r in running] == [("compile:64x64", 0), ("regional:128x64", 1)]
    scheduler.want(other, _b("regional", "256x256"), waiting=1)  # at most `jobs` waited-for compiles at once
    assert len(other.granted) == 1
    scheduler.finished(default, _b("compile", "64x64"))
    assert len(other.granted) == 1 and default.granted == [_b("compile", "64x64")]
    scheduler.finished(other, _b("regional", "128x64"))
    assert other.granted[-1] == _b("regional", "256x256") and len(default.granted) == 1
    scheduler.finished(other, _b("regional", "256x256"))
    assert default.granted[-1] == _b("compile", "128x128")  # background compiles only in free slots


def test_the_console_says_each_compile_that_ends_and_what_the_host_compiles_next(caplog):
    import logging

    from engine.protocol import BucketInfo, BucketState, EngineKey
    from engine.serving.residency import Residency

    key = EngineKey("tiny-shapes", "cpu", "fp32")
    scheduler = CompileScheduler(jobs=1)
    residency = Residency(None, None, scheduler, config_for=None, is_default=lambda k: True)
    engine = FakeEngine(key)
    done, failed, later = _b("compile", "64x64"), _b("compile", "128x128"), _b("compile", "256x256")
    board = {done: BucketInfo(key, done, BucketState.WARM, compile_s=27.46),
             failed: BucketInfo(key, failed, BucketState.FAILED, error="CppCompileError: g++ not found")}
    engine.buckets = lambda: list(board.values())
    for bucket in (done, failed, later):
        scheduler.want(engine, bucket, startup_rank=0)
    with caplog.at_level(logging.INFO, logger="engine.serving.compiles"):
        residency.compile_finished(engine, done)
        residency.compile_finished(engine, failed)
    assert caplog.messages == [
        f"compile:64x64 on {key}: compiled in 27.5 s; host: 1 compiling, 1 queued",
        f"compile:128x128 on {key}: compile failed: CppCompileError: g++ not found; host: 1 compiling, 0 queued"]


def test_an_evicted_engines_queued_compiles_are_dropped_and_its_slot_freed():
    scheduler = CompileScheduler(jobs=1)
    gone, waiting = FakeEngine("gone"), FakeEngine("waiting")
    scheduler.want(gone, _b("compile", "64x64"))
    scheduler.want(gone, _b("compile", "128x128"))
    scheduler.want(waiting, _b("regional", "64x64"))
    assert scheduler.drop_engine(gone) == 1  # the queued one; the running one's slot is freed too
    assert waiting.granted == [_b("regional", "64x64")]
    assert all(q["engine"] != "gone" for q in scheduler.snapshot()["queued"])


def test_two_jobs_run_two_compiles_at_once():
    scheduler = CompileScheduler(jobs=2)
    a, b, c = FakeEngine("a"), FakeEngine("b"), FakeEngine("c")
    for engine in (a, b, c):
        scheduler.want(engine, _b("compile", "64x64"))
    assert [len(e.granted) for e in (a, b, c)] == [1, 1, 0]


# -- what visitors may do ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def public_manager(cache_dir, tiny_models):
    policy = HostPolicy(public=True, presets=("tiny-flux", "tiny-sd3"), precisions=(Precision.FP32, Precision.BF16),
                        modes=(Mode.EAGER, Mode.REGIONAL))
    with engine_manager(cache_dir, policy=policy) as m:
        yield m


@pytest.mark.parametrize("overrides,words", [
    ({"preset": "black-forest-labs/FLUX.1-dev"}, "does not load Hub ids"),
    ({"preset": "/etc"}, "does not load Hub ids or local folders"),
    ({"preset": "./models"}, "does not load Hub ids or local folders"),
    ({"preset": "tiny-sdxl"}, "not offered here; choose one of: tiny-flux, tiny-sd3"),
    ({"precision": "fp16"}, "precision fp16 is not offered"),
    ({"mode": "compile"}, "mode compile is not offered"),
])
def test_public_mode_refuses_what_the_host_does_not_offer(public_manager, overrides, words):
    request = dict(preset="tiny-flux", device="cpu", precision="fp32", mode="eager", size="64x64", steps=1)
    with pytest.raises(NotAllowed, match=words):
        public_manager.generate(ImageRequest(**{**request, **overrides}, caller=Caller.VISITOR))
    assert not public_manager.residency.engines()  # nothing was loaded for a refused request


def test_public_mode_lets_the_host_do_what_visitors_cannot(public_manager):
    with pytest.raises(NotAllowed, match="up to the host"):
        public_manager.warm("tiny-flux", "cpu", "fp32", caller=Caller.VISITOR)  # every bucket
    with pytest.raises(NotAllowed, match="not loaded"):
        public_manager.warm("tiny-flux", "cpu", "fp32", mode="regional", size="64x64", caller=Caller.VISITOR)
    assert public_manager.gate.visitor_presets() == ["tiny-flux", "tiny-sd3"]


def test_without_public_mode_visitors_keep_every_choice(cache_dir, tiny_models):
    with engine_manager(cache_dir) as m:
        m.gate.make_key("tiny-sdxl", "cpu", "fp16", caller=Caller.VISITOR)  # any preset, any precision
        m.gate.check_visitor_choice(mode="compile")


# -- a manager within its budget: real workers ---------------------------------------------------
KEYS = [("tiny-flux", "fp32"), ("tiny-flux", "bf16"), ("tiny-sd3", "fp32")]


@pytest.mark.slow
def test_engines_stay_within_the_engine_count_lru_idle_ones_go_and_come_back(cache_dir, tiny_models):
    with engine_manager(cache_dir, max_engines=2) as m:
        for preset, precision in KEYS[:2]:
            m.generate(ImageRequest(preset=preset, device="cpu", precision=precision, size="64x64", steps=1))
        first = EngineKey("tiny-flux", "cpu", "fp32")
        assert {e.key for e in m.residency.engines()} == {first, EngineKey("tiny-flux", "cpu", "bf16")}
        assert all(m.budgets.footprint_of(e).measured for e in m.residency.engines())  # reported once loaded
        m.generate(ImageRequest(preset="tiny-sd3", device="cpu", precision="fp32", size="64x64", steps=1))
        keys = {e.key for e in m.residency.engines()}
        assert first not in keys and len(keys) == 2  # the least recently used idle engine went
        evicted = [row for row in m.residency.status_rows() if row["state"] == "evicted"]
        assert [row["engine"] for row in evicted] == [str(first)]
        assert "least recently used" in evicted[0]["error"] and "tiny-sd3" in evicted[0]["error"]
        # The next request reloads it (evicting the then least recently used one).
        m.generate(ImageRequest(preset="tiny-flux", device="cpu", precision="fp32", size="64x64", steps=1))
        assert first in {e.key for e in m.residency.engines()} and m.host_status()["evictions"] == 2


@pytest.mark.slow
def test_a_busy_engine_is_kept_and_the_new_one_refused_with_what_to_do(cache_dir, tiny_models):
    with engine_manager(cache_dir, max_engines=1) as m:
        started, submitted, outcome = threading.Event(), [], []

        def long_request():
            try:
                m.generate(ImageRequest(preset="tiny-flux", device="cpu", precision="fp32", size="128x128",
                                        steps=150), on_progress=lambda p: started.set(), on_submit=submitted.append)
            except Cancelled as exc:
                outcome.append(exc)

        worker = threading.Thread(target=long_request)
        worker.start()
        assert started.wait(120)
        with pytest.raises(BudgetExceeded) as refused:
            m.generate(ImageRequest(preset="tiny-sd3", device="cpu", precision="fp32", size="64x64", steps=1))
        assert worker.is_alive() and not outcome  # refused at once: the busy request still runs (cancelled below)
        text = str(refused.value)
        assert "tiny-flux@cpu/fp32" in text and "1-engine limit" in text
        assert "pick one of the loaded engines" in text and "--max-engines" in text
        assert m.cancel(submitted[0])
        worker.join(120)
        assert outcome and "cancelled after step" in str(outcome[0])
        assert [e.key.preset for e in m.residency.engines()] == ["tiny-flux"]  # nothing running was lost


@pytest.mark.slow
def test_idle_engines_unload_after_the_idle_timeout(cache_dir, tiny_models):
    with engine_manager(cache_dir, idle_unload_s=2.0) as m:
        m.generate(ImageRequest(preset="tiny-flux", device="cpu", precision="fp32", size="64x64", steps=1))
        wait_until(lambda: not m.residency.engines(), 30, 0.2, "the idle engine unloading")
        row = next(r for r in m.residency.status_rows() if r["state"] == "evicted")
        assert "idle" in row["error"] and "--idle-unload" in row["error"]


# -- the soak, short ----------------------------------------------------------------------------------
# Before the public app's tests: the bucket a visitor warms there compiles in the background, which
# would run beside the soak's own compiles.
@pytest.mark.slow
def test_soak_two_visitors_nothing_fails_or_hangs_and_nothing_is_left_behind(cache_dir, tiny_models, tmp_path):
    """`python -m bench soak` in its short form: a real app process, 2 random visitors for 30 s (bad
    input and cancels included), a warm-bucket probe; then SIGTERM. Every request is answered (ok or a
    clear error), none fails or hangs, and no process outlives the app.

    The visitors' choices are seeded: with seed 48 and bad input and cancels at 0.3 each, one visitor's first
    request is bad input and the other's a cancel (of a request that starts a second engine), so a short run
    on a busy machine sees both; a compile-mode bucket that is not warm (served eagerly while it compiles)
    comes next. The probe's bucket is tiny-flux's regional 64x64, a graph other tests compile into the
    session's cache too."""
    import json
    import subprocess
    import sys

    out = tmp_path / "soak"
    # inductor's compile workers, as an app has them (the suite turns them off): SIGTERM meets them mid-compile
    with_compile_workers = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--visitors", "2", "--duration", "30", "--memory-budget", "3GiB",
         "--presets", "tiny-flux,tiny-sd3", "--seed", "48", "--bad-rate", "0.3", "--cancel-rate", "0.3",
         "--idle-runs", "5", "--cache-dir", str(cache_dir), "--out", str(out), "--hang-s", "240"],
        capture_output=True, text=True, timeout=900, env=with_compile_workers)
    summary = json.loads((out / "soak.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["failed_or_hung"] == 0 and summary["orphans"] == [], summary
    assert summary["ok"] > 0 and summary["requests"] >= summary["ok"] + summary["clear"]
    assert summary["clear"] > 0 and summary["cancelled"] > 0, summary  # bad input was refused, a cancel answered
    # it ended on SIGTERM by itself (the soak gives it 15 s, then counts what is left as orphans); how long it
    # took is the machine's: 10.8 s at load 13 (the soak prints it)
    assert summary["exited"] is True, summary
    assert 0.2 < summary["peak_rss_gib"] <= summary["rss_target_gib"], summary  # the app alone holds torch


# -- the public app, through its API ---------------------------------------------------------------
ADMIN = "a-long-admin-token-for-tests"
GOOD = dict(prompt="a red fox", negative_prompt="", preset="tiny-flux", device="cpu", precision="fp32",
            mode="eager", size="64x64", steps="2", guidance="", seed="1", on_cold="eager", tp="1")


@pytest.fixture(scope="module")
def public_app(public_manager):
    from gradio_client import Client
    from helpers import launch_demo

    from ui import UIDefaults

    demo, url = launch_demo(public_manager, UIDefaults(device="cpu", mode="eager", admin_token=ADMIN))
    yield public_manager, url, Client(url, verbose=False)
    demo.close()


@pytest.mark.parametrize("overrides,words", [
    ({"preset": "black-forest-labs/FLUX.1-dev"}, "does not load Hub ids"),
    ({"preset": "/etc"}, "Hub ids or local folders"),
    ({"preset": "tiny-sdxl"}, "not offered here"),
    ({"precision": "fp16"}, "not offered here"),
])
@pytest.mark.slow
def test_public_api_refuses_models_and_choices_the_host_does_not_offer(public_app, overrides, words):
    _, _, client = public_app
    with pytest.raises(Exception, match=words):
        client.predict(**{**GOOD, **overrides}, api_name="/generate")


@pytest.mark.slow
def test_restart_is_the_hosts_hidden_operation(public_app):
    manager, _, client = public_app
    assert "/restart" not in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    client.predict(**GOOD, api_name="/generate")  # loads tiny-flux fp32 for this visitor
    pid = manager.residency.engines()[0].pid
    # Undocumented: callable with positional arguments (preset, device, precision, admin_token).
    with pytest.raises(Exception, match="up to the host"):
        client.predict("tiny-flux", "cpu", "fp32", "", api_name="/restart")
    with pytest.raises(Exception, match="up to the host"):
        client.predict("tiny-flux", "cpu", "fp32", "wrong", api_name="/restart")
    assert manager.residency.engines()[0].pid == pid  # nobody else's request was interrupted
    assert client.predict("tiny-flux", "cpu", "fp32", ADMIN, api_name="/restart")["restarted"]


@pytest.mark.slow
def test_a_visitor_warms_one_bucket_of_their_own_engine_only(public_app):
    from gradio_client import Client

    _, url, client = public_app
    client.predict(**GOOD, api_name="/generate")  # this session's engine: tiny-flux@cpu/fp32
    queued = client.predict(preset="tiny-flux", device="cpu", precision="fp32", mode="regional", size="64x64",
                            api_name="/warm")
    assert queued["queued"] == ["64x64"]
    with pytest.raises(Exception, match="up to the host"):
        client.predict(preset="tiny-flux", device="cpu", precision="fp32", mode="regional", size="",
                       api_name="/warm")
    stranger = Client(url, verbose=False)  # another visitor, who has not used this engine
    with pytest.raises(Exception, match="not the engine you are using"):
        stranger.predict(preset="tiny-flux", device="cpu", precision="fp32", mode="regional", size="128x128",
                         api_name="/warm")


@pytest.mark.slow
def test_one_running_request_per_visitor(public_app):
    """A visitor's second request while their first runs is refused at once, saying why; their cancel
    stops only their own request, and then they may ask again."""
    _, _, client = public_app
    long = client.submit(**{**GOOD, "steps": "150", "size": "128x128"}, api_name="/generate")
    wait_until(lambda: any(isinstance(o, dict) and o.get("running") for out in long.outputs() for o in out[1:]),
               60, 0.1, "the long request running")
    with pytest.raises(Exception, match="already have a request running"):
        client.predict(**GOOD, api_name="/generate")
    client.predict(api_name="/cancel")  # this visitor's own running request
    long.result(timeout=120)
    _, timings = client.predict(**GOOD, api_name="/generate")
    assert timings["steps"] == 2


def test_a_sessions_second_run_is_refused_while_one_runs():
    """Where several devices let runs start together, public mode refuses a visitor's second one."""
    from engine.errors import EngineBusy
    from ui.runs import RunRegistry

    runs = RunRegistry(cancel=lambda request_id: False)
    with runs.open("visitor-a", exclusive=True):
        with pytest.raises(EngineBusy, match="already have a request running"):
            with runs.open("visitor-a", exclusive=True):
                pass
        with runs.open("visitor-b", exclusive=True):  # another visitor is not affected
            pass
        with runs.open("visitor-a"):  # without public mode: no limit
            pass
    with runs.open("visitor-a", exclusive=True):  # free again once the first ended
        pass


def test_each_cpu_engine_gets_its_own_short_run_slot_freed_when_it_goes(tmp_path):
    """Engines on the host's cores share one file of "running a short request" bytes (engine/worker/priority.py):
    each gets its own slot, and a slot is cleared and free again once its engine is dropped (evicted,
    crashed, restarted), so a worker killed mid-request never leaves long requests waiting."""
    with engine_manager(tmp_path / "cache") as manager:
        launcher = manager.launcher
        first, second = launcher.take_short_run_slot(), launcher.take_short_run_slot()
        assert (first.slot, second.slot) == (0, 1) and first.path == second.path
        gone = object()
        launcher.hold_slot(gone, first.slot)
        first.set_running(True)  # it died mid-request
        assert second.others_running()
        launcher.release(gone)
        assert not second.others_running()
        assert launcher.take_short_run_slot().slot == 0
    assert not first.path.exists()


def test_the_soak_lists_a_process_tree_and_its_memory_from_proc():
    """The soak's sampler (its own /proc reading, lighter than psutil's walk of all of /proc) finds a
    grandchild and reads resident memory; a process that is gone reads as None / an empty tree."""
    import subprocess
    import sys

    from engine.processes import process_tree, resident_bytes

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.run(['sleep', '30']); sys.exit(0)"])
    try:
        wait_until(lambda: len(process_tree(child.pid)) >= 2, 10, message="the grandchild starting")
        tree = process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        grandchildren = [pid for pid in process_tree(child.pid) if pid != child.pid]
        assert len(grandchildren) == 1 and grandchildren[0] in tree
        assert resident_bytes(os.getpid()) > 10 * 2**20  # this test process holds at least its interpreter
    finally:
        for pid in process_tree(child.pid)[::-1]:
            os.kill(pid, signal.SIGKILL)
        child.wait()
    assert process_tree(child.pid) == [] and resident_bytes(child.pid) is None
