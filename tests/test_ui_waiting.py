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
