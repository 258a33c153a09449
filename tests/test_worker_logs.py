"""A worker's log lines, end to end: with --log-format json (SHOWCASE_LOG_FORMAT=json) a line the worker
process logs while it serves a request carries that request's id (engine/worker/logs.py)."""

from __future__ import annotations

import json

import pytest
from helpers import engine_manager

from engine.config.request import ImageRequest

pytestmark = pytest.mark.slow  # starts a worker process that loads a pipeline

REQUEST = ImageRequest(preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64", steps=2,
               prompt="a red circle on a blue background")


def json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # a library's own handler writes text (not ours to format)
    return [line for line in lines if isinstance(line, dict)]


def test_a_workers_log_line_during_a_generate_carries_the_request_id(cache_dir, monkeypatch, capfd):
    monkeypatch.setenv("SHOWCASE_LOG_FORMAT", "json")  # a worker starts with the app's environment
    monkeypatch.setenv("SHOWCASE_LOG_LEVEL", "DEBUG")
    with engine_manager(cache_dir, runtime="workers") as manager:
        result = manager.generate(REQUEST)
        other = manager.generate(REQUEST)
    worker = [line for line in json_lines(capfd.readouterr().err) if line.get("process", "").startswith("worker ")]
    assert worker, "the worker logged no JSON line"
    serving = [line for line in worker if line["logger"] == "engine.worker.serving" and "serving" in line["message"]]
    assert [line["request_id"] for line in serving] == [result.request_id, other.request_id]
    assert {line["request_id"] for line in worker} <= {None, result.request_id, other.request_id}


LEAK_PROBE = """
import multiprocessing as mp, os, sys

def child():
    from engine.worker import logs
    logs.thread_locks_for_progress_bars()  # what a worker does at start
    import tqdm
    for _ in tqdm.tqdm(range(2), file=open(os.devnull, "w")):
        pass
    os._exit(0)  # how a worker leaves (engine/worker/loop.py worker_main)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child)
    p.start()
    p.join()
"""


def test_a_worker_leaves_no_semaphore_for_the_app_to_warn_about(tmp_path):
    """tqdm's default lock is a multiprocessing semaphore: a worker ending with os._exit left it, and the app
    printed "resource_tracker: There appear to be 1 leaked semaphore objects" at every shutdown."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "probe.py"
    script.write_text(LEAK_PROBE)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr
