"""One median and one percentile for every figure the project reports.

Timings (engine/protocol/requests.py), the benchmark tables (bench/), the soak's latencies
(bench/soak.py) and the UI's tables all summarise samples here, so "p95" or "median" means the same
thing everywhere.
Pure Python: engine/protocol/ imports it and must stay free of torch and numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def _sorted_numbers(values: Iterable) -> list[float]:
    """The samples, sorted; None entries (a measurement that did not happen) are left out."""
    return sorted(float(v) for v in values if v is not None)


def percentile(values: Iterable, q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of the samples, None when there are none.

    Linear interpolation between order statistics at position q * (n - 1) of the sorted samples
    (numpy's default, `statistics.quantiles(method="inclusive")`): the result lies within the samples,
    one sample is its own every percentile, and percentile(v, 0.5) is the median (up to rounding).
    """
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"q must be between 0 and 1, not {q}")
    s = _sorted_numbers(values)
    if not s:
        return None
    position = q * (len(s) - 1)
    low = math.floor(position)
    high = min(low + 1, len(s) - 1)
    return s[low] + (s[high] - s[low]) * (position - low)


def median(values: Iterable) -> float | None:
    """The middle sample (the mean of the two middle ones for an even count), None when there are none;
    the same value as `statistics.median`."""
    s = _sorted_numbers(values)
    if not s:
        return None
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def p90(values: Iterable) -> float | None:
    return percentile(values, 0.9)


def p95(values: Iterable) -> float | None:
    return percentile(values, 0.95)
