"""What a run says while it waits for its engine to load or its bucket to compile (ui/waiting.py, the
progress bar of ui/runs.py), from fake scheduler snapshots and boards: no engine, no clock."""

from __future__ import annotations

import threading

from engine.protocol import BucketInfo, BucketKey, BucketState, EngineKey, Mode, Size
from engine.serving.stream import Idle, Started
from ui import waiting
from ui.runs import ProgressBar, RunFeed

KEY = EngineKey("tiny-shapes", "cpu", "fp32")


def _info(mode, size, compile_s):
    return BucketInfo(KEY, BucketKey(Mode(mode), Size.parse(size)), BucketState.WARM, compile_s=compile_s)


def test_a_queued_compile_names_its_bucket_its_place_and_what_runs_ahead():
    snapshot = {"running": [{"engine": str(KEY), "bucket": "compile:256x256", "waiting": 0, "running_s": 61.0}],
                "queued": [{"engine": str(KEY), "bucket": "regional:64x64", "waiting": 1, "hits": 1}]}
    text, share = waiting.compile_wait_text(KEY, snapshot, [], waited_s=12.4)
    assert text == (f"compile of regional:64x64 on {KEY} queued (next in line), behind 1 running compile: "
                    f"compile:256x256 on {KEY} (61 s so far); waited 12 s…")
    assert share is None


def test_a_running_compile_says_its_time_so_far_and_an_estimate_from_this_engines_compiles():
    snapshot = {"running": [{"engine": str(KEY), "bucket": "regional:64x64", "waiting": 1, "running_s": 10.0}],
                "queued": []}
    board = [_info("regional", "128x128", 30.0), _info("regional", "256x256", 20.0), _info("compile", "64x64", 90.0)]
    text, share = waiting.compile_wait_text(KEY, snapshot, board, waited_s=11.0)
    assert text.startswith(f"compiling regional:64x64 on {KEY}: 10 s so far, about 25 s in all")
    assert share == 10.0 / 25.0
    # a request on another engine does not read this engine's compile as its own
    assert waiting.compile_wait_text(EngineKey("tiny-flux", "cpu", "fp32"), snapshot, board, 1.0) is None


class _Engine:
    def __init__(self):
        self.ready = threading.Event()

    def buckets(self):
        return []

    def pending(self):
        return 1


def test_a_loading_engines_bar_moves_with_the_time_waited():
    """A new engine loaded for 22.5 s behind a bar stuck at 0.0 %."""
    seen, engine = [], _Engine()
    feed = RunFeed(ProgressBar(lambda value, desc="", **kw: seen.append((value, desc))), KEY, None,
                   status=lambda: [{"engine": "other", "load_s": 20.0}], compiles=dict,
                   engine_of=lambda key: engine)
    feed.see(Started())
    for waited in (2.0, 8.0, 15.0):
        feed.see(Idle(waited, submitted=False))
    shares = [value for value, _ in seen]
    assert shares == sorted(shares) and shares[0] > 0 and shares[-1] < 1 and len(set(shares)) == 3
    assert seen[-1][1].startswith(f"loading engine {KEY}") and "about 20 s" in seen[-1][1]


def test_a_request_names_the_compile_of_its_bucket_though_it_came_after_the_grant():
    """A Compare waited 79 s for a regional compile reading "queued on …: 0 earlier requests ahead": the compile
    was granted (as a background warm-up) before the request waited, so its entry counted no waiter."""
    snapshot = {"running": [{"engine": str(KEY), "bucket": "regional:64x64", "waiting": 0, "running_s": 14.0}],
                "queued": []}
    bucket = waiting.compile_bucket("regional", "64x64", "wait")
    text, share = waiting.compile_wait_text(KEY, snapshot, [], 9.0, bucket)
    assert text.startswith(f"compiling regional:64x64 on {KEY}: 14 s so far") and share == 14.0 / 30.0
    assert waiting.compile_wait_text(KEY, snapshot, [], 9.0) is None  # without the bucket: nobody waits on it
    # the scheduler has no word (no host scheduler): the engine's board has
    board = [BucketInfo(KEY, BucketKey(Mode("regional"), Size.parse("64x64")), BucketState.COMPILING)]
    text, share = waiting.compile_wait_text(KEY, {}, board, 6.0, bucket)
    assert text.startswith(f"compiling regional:64x64 on {KEY} (compiling): waited 6 s") and share == 6.0 / 30.0
    # a cold bucket served eagerly waits for no compile
    assert waiting.compile_bucket("regional", "64x64", "eager") is None
    assert waiting.compile_bucket("eager", "64x64", "wait") is None


def test_the_feed_passes_its_bucket_to_the_wait_text():
    seen, engine = [], _Engine()
    engine.ready.set()
    snapshot = {"running": [{"engine": str(KEY), "bucket": "regional:64x64", "waiting": 0, "running_s": 3.0}]}
    feed = RunFeed(ProgressBar(lambda value, desc="", **kw: seen.append(desc)), KEY, None, status=list,
                   compiles=lambda: snapshot, engine_of=lambda key: engine, bucket="regional:64x64")
    feed.see(Idle(4.0, submitted=True))
    assert seen and seen[-1].startswith("compiling regional:64x64")
