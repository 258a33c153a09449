"""`python -m bench load`: a real burst against real app processes, batching off and on, in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # starts the app twice


def test_load_runs_a_burst_off_and_on_and_reports_every_figure(cache_dir, tmp_path):
    out = tmp_path / "load"
    cmd = [sys.executable, "-m", "bench", "load", "--visitors", "3", "--rounds", "2", "--mode", "eager",
           "--steps", "2", "--max-batch", "2", "--batch-wait-ms", "200", "--phases", "off,on",
           "--cache-dir", str(cache_dir), "--out", str(out), "--warm-timeout", "300", "--timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    off, on = summary["phases"]
    for phase in (off, on):
        assert phase["images"] == 6 and phase["failed"] == 0 and phase["orphans"] == []
        assert phase["images_per_s"] > 0 and phase["p95_s"] >= phase["p50_s"] > 0
        assert phase["call_p50_ms"] > 0 and phase["web_p50_ms"] is not None
        assert 0 < phase["call_per_image_p50_ms"] <= phase["call_p50_ms"]
    assert off["batch_sizes"] == {"1": 6} and off["calls"] == 6
    # a batch's members are one call (they share its clock), whichever of them came back first
    assert on["calls"] == sum(count // int(size) for size, count in on["batch_sizes"].items())
    # Three visitors at once with a long window and at most 2 per call: a call of 2 in every burst.
    assert on["batch_sizes"].get("2", 0) >= 4, on
    assert set(summary["ratios"]) == {"throughput", "p95", "p50", "engine"}
    assert on["call_per_image_p50_ms"] < on["call_p50_ms"]  # calls of 2: half a call per image
    assert "batching on / off: images/s x" in proc.stdout and "the engine's calls alone" in proc.stdout
