"""engine/metrics.py: the one median and percentile behind every reported figure."""

from __future__ import annotations

import random
import statistics
import subprocess
import sys

import pytest

from engine.metrics import median, p90, p95, percentile


def test_median_is_statistics_median_and_skips_missing_samples():
    rng = random.Random(0)
    for n in range(1, 40):
        values = [rng.uniform(0, 100) for _ in range(n)]
        assert median(values) == statistics.median(values)
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5
    assert median([]) is None and median([None]) is None
    assert median([None, 5, 1]) == 3.0


def test_percentile_interpolates_between_order_statistics():
    assert percentile(range(1, 11), 0.9) == pytest.approx(9.1)
    assert percentile(range(1, 11), 0.0) == 1 and percentile(range(1, 11), 1.0) == 10
    assert percentile([10, 20], 0.95) == pytest.approx(19.5)  # nearest rank would say 20
    assert percentile([7.0], 0.95) == 7.0
    assert percentile([], 0.5) is None
    rng = random.Random(1)
    for n in range(2, 30):
        values = [rng.uniform(0, 1) for _ in range(n)]
        assert p90(values) == pytest.approx(statistics.quantiles(values, n=10, method="inclusive")[-1])
        assert p95(values) == pytest.approx(statistics.quantiles(values, n=20, method="inclusive")[-1])
        assert percentile(values, 0.5) == pytest.approx(median(values))
    with pytest.raises(ValueError, match="between 0 and 1"):
        percentile([1.0], 95)


def test_every_consumer_shares_the_one_definition():
    from bench import soak, stats
    from engine import protocol
    from ui import views

    assert protocol.median is stats.median is soak.median is views.median is median
    assert stats.p90 is p90 and soak.percentile is percentile
    assert protocol.Timings((4.0, 1.0, 3.0, 2.0), 0, 0, 0, 0).median_step_ms == 2.5


def test_metrics_and_protocol_import_no_torch():
    code = "import sys, engine.metrics, engine.protocol; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
