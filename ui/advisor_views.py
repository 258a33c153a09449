"""The Advisor tab's views: its speed-quality and speed-memory frontiers (points, padded axes, the captions that
name each frontier) and its table's column widths. Pure functions of the advisor's report (bench/advise.py);
which points make a frontier is bench/advise_report.py's `frontier`, the CLI's report's too."""

from __future__ import annotations

from bench.advise_report import frontier, peak_rows

ADVISOR_POINT_COLUMNS = ["configuration", "s_per_image", "quality", "verdict"]
ADVISOR_MEMORY_COLUMNS = ["configuration", "s_per_image", "peak_gib", "verdict"]
GIB = 2**30
# No header narrower than its longest word; the reasons (last column) get the rest and wrap.
ADVISOR_WIDTHS = ["19%", "8%", "9%", "12%", "8%", "9%", "8%", "27%"]
IDENTICAL_PSNR_DB = 100.0  # where an image identical to eager fp32 is drawn on the PSNR axis


def advisor_points(result: dict | None) -> list[dict]:
    """The frontier's points: seconds per image against fidelity (%) on a model with a checker, else PSNR."""
    if not result:
        return []
    pick = (result.get("pick") or {}).get("label")
    points = []
    for r in result.get("rows", []):
        if r.get("error") or r.get("s_per_image") is None or r.get("unscored"):  # no quality measured: no point
            continue
        if r.get("fidelity") is not None:
            q = r["fidelity"] * 100
        else:
            q = IDENTICAL_PSNR_DB if not r.get("drift_max_diff") else r.get("drift_psnr_db")
        points.append({"configuration": r["label"], "s_per_image": r["s_per_image"], "quality": q,
                       "verdict": _verdict(r, pick)})
    return points


def _verdict(row: dict, pick: str | None) -> str:
    return "pick" if row["label"] == pick else ("within bound" if row.get("eligible") else "outside bound")


def memory_points(result: dict | None) -> list[dict]:
    """The speed-memory frontier's points: seconds per image against the measured peak (GiB: the engine's
    weights and what an image adds), every configuration whose peak was measured (its quality need not be)."""
    pick = ((result or {}).get("pick") or {}).get("label")
    return [{"configuration": r["label"], "s_per_image": r["s_per_image"], "peak_gib": r["peak_bytes"] / GIB,
             "verdict": _verdict(r, pick)} for r in peak_rows(result)]


TIME_AXIS_SHARE = 0.1  # the Advisor's seconds axis: at least this share of the time on each side


def padded_limits(values, min_share: float = 0.05) -> list[float] | None:
    """An axis's [low, high] around its values with a tenth of their span (at least `min_share` of their
    size) on each side, so no point sits on the frame and a single value does not make a zero-width axis
    whose ticks read "93.750000" (or, at 10 %, repeat the same 3 significant digits)."""
    values = [float(v) for v in values if v == v]  # NaN != NaN
    if not values:
        return None
    low, high = min(values), max(values)
    pad = max((high - low) * 0.1, abs(high) * min_share, 1e-3)
    return [round(low - pad, 4), round(high + pad, 4)]


def frontier_caption(result: dict | None) -> str:
    """The frontier's configurations named under the plot (the plot marks them only by colour)."""
    points = advisor_points(result)
    if not points:
        return ""
    unit = "%" if any(r.get("fidelity") is not None for r in (result or {}).get("rows", [])) else "dB"
    steps = [f"{p['configuration']} ({p['s_per_image']:.3f} s, {p['quality']:.1f} {unit})"
             for p in frontier(points, "quality")]
    measured = len([r for r in (result or {}).get("rows", []) if not r.get("error")])
    drawn = (f"{len(points)} configurations drawn" if measured == len(points) else
             f"{len(points)} of {measured} measured configurations drawn (the others have no quality score)")
    return f"{drawn}. Frontier, fastest first: " + " → ".join(steps)


def memory_frontier_caption(result: dict | None) -> str:
    """The speed-memory frontier named under its plot ("" where no peak was measured)."""
    points = memory_points(result)
    if not points:
        return ""
    steps = [f"{p['configuration']} ({p['s_per_image']:.3f} s, {p['peak_gib']:.2f} GiB)"
             for p in frontier(points, "peak_gib", higher=False)]
    return f"Speed–memory frontier ({len(points)} measured peaks), fastest first: " + " → ".join(steps)
