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
