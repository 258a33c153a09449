"""The advisor's report read out: the one renderer of its table and summary, for the CLI
(`python -m bench advise` prints `markdown`) and the UI's Advisor tab (`summary` above `table_rows`).
Torch-free, gradio-free.
"""

from __future__ import annotations

from bench.paired import row_speedup_text
from bench.quality import fmt_drift

# Eager fp32 without a step cache (with the run's LoRA, if any, unfused): every speedup and drift of the
# advisor is measured against it.
REFERENCE = {"precision": "fp32", "mode": "eager", "step_cache": "none", "attention": "native", "lora_fused": False}
ABSENT = {"attention": "native", "lora_fused": False}  # what a row written before the key existed means
COLUMNS = ["configuration", "s / image · peak", "× eager fp32", "drift PSNR / max diff", "fidelity",
           "steps cached (mean)", "compile s", "within bound"]


def pct(value) -> str:
    """A share (0-1) as a whole percent; "—" where not measured."""
    return "—" if value is None else f"{value * 100:.0f} %"


def seconds_text(value) -> str:
    return "" if value is None else f"{value:.2f}"


def is_reference(row: dict) -> bool:
    """Whether a row (or a pick) is eager fp32 without a step cache (attention native where not named)."""
    return {k: row.get(k, ABSENT.get(k)) for k in REFERENCE} == REFERENCE and not row.get("memory")


def table_rows(report: dict | None) -> list[list]:
    """Every measured configuration (COLUMNS), the largest speedup over eager fp32 first (timed in
    alternation with it), with why it is (not) eligible; then what was skipped and why."""
    if not report:
        return []
    pick = (report.get("pick") or {}).get("label")
    out = []
    for r in sorted(report.get("rows", []), key=lambda r: -(r.get("speedup") or 0)):
        if r.get("error"):
            out.append([r["label"], "failed", "", "", "", "", "", r["error"]])
            continue
        verdict = "★ pick" if r["label"] == pick else ("yes" if r.get("eligible") else f"no: {r.get('why_not', '')}")
        out.append([r["label"], f"{r['s_per_image']:.3f}" + peak_text(r), row_speedup_text(r),
                    fmt_drift(r.get("drift_psnr_db"), r.get("drift_max_diff"))
                    + ("" if r.get("drift_ssim") is None else f", SSIM {r['drift_ssim']:.3f}"), pct(r.get("fidelity")),
                    "—" if r.get("cached_steps") is None else f"{r['cached_steps']:.1f}",
                    seconds_text(r.get("compile_s")), verdict])
    for s in report.get("skipped", []):
        out.append([s["what"], "skipped", "", "", "", "", "", s["why"]])
    return out


def peak_text(row: dict) -> str:
    """" · 0.41 GiB" after a row's seconds: its measured peak ("" where not measured)."""
    return "" if row.get("peak_bytes") is None else f" · {row['peak_bytes'] / 2**30:.2f} GiB"


def frontier(items: list[dict], y: str, higher: bool = True) -> list[dict]:
    """The items no other beats on both seconds per image and `y` (quality: higher is better; a peak: lower),
    fastest first: the Advisor's speed-quality and speed-memory frontiers, for the CLI and the UI alike."""
    sign = 1 if higher else -1
    best, out = float("-inf"), []
    for item in sorted(items, key=lambda i: (i["s_per_image"], -sign * i[y])):
        if sign * item[y] > best:
            out.append(item)
            best = sign * item[y]
    return out


def peak_rows(report: dict | None) -> list[dict]:
    """The measured configurations whose seconds per image and peak memory were both measured."""
    return [r for r in (report or {}).get("rows", [])
            if not r.get("error") and r.get("s_per_image") is not None and r.get("peak_bytes") is not None]


def memory_frontier(report: dict | None) -> list[dict]:
    """The measured configurations no other beats on both seconds per image and measured peak memory, fastest
    first (the speed-memory frontier, beside the speed-quality one)."""
    return frontier(peak_rows(report), "peak_bytes", higher=False)


def memory_frontier_text(report: dict | None) -> str:
    """"Speed–memory frontier, fastest first: a (0.120 s, 0.41 GiB) → b (0.300 s, 0.20 GiB)" ("" unmeasured)."""
    steps = [f"{r['label']} ({r['s_per_image']:.3f} s, {r['peak_bytes'] / 2**30:.2f} GiB)"
             for r in memory_frontier(report)]
    return "Speed–memory frontier, fastest first: " + " → ".join(steps) if steps else ""


def summary(report: dict) -> str:
    """What was measured, the pick with its final-round speedup, the bound and where the file went."""
    pick = report.get("pick")
    parts = [f"**{report['preset']} on {report['device']}**, {report['size']}, {report['steps']} steps: "
             f"{len(report.get('rows', []))} configurations measured in {report['elapsed_s']:.0f} s, "
             f"{len(report.get('skipped', []))} skipped (listed in the table)."]
    short = report.get("short_budget")
    if pick is None and short:
        parts.append(short_budget_text(report, short))
    elif pick is None:
        parts.append("No configuration within the bound: eager fp32 stays.")
    elif is_reference(pick):
        parts.append("**Pick: `fp32/eager`** — no configuration within the bound measured faster than eager fp32.")
    else:
        confirm = report.get("confirm") or {}
        parts.append(f"**Pick: `{pick['label']}`** — {pick['s_per_image']:.3f} s per image, "
                     f"**{row_speedup_text(pick)}** eager fp32 (final round: "
                     f"{(confirm.get('pick_ms_median') or 0):.1f} vs {(confirm.get('reference_ms_median') or 0):.1f} "
                     f"ms, medians of {confirm.get('rounds')} rounds), fidelity {pct(pick.get('fidelity'))}"
                     f"{margin_text(pick, report.get('bound') or {})}.")
    limits = bound_text(report.get("bound") or {})
    if limits:
        parts.append("Bound: " + ", ".join(limits) + ".")
    if report.get("saved"):
        parts.append(f"Saved to `{report['saved']}` (start the app with `--config-from` that file).")
    return "\n\n".join(parts)


def short_budget_text(report: dict, short: dict) -> str:
    """No pick because the budget ran out before any configuration faster than eager fp32 had its quality
    checked: that, and the budget that would reach the first one cut."""
    cut = short.get("cut") or [short["first"]]
    return (f"**No pick: the budget ({report.get('max_minutes', 0):g} min) was too short** to check the quality "
            f"of any configuration faster than eager fp32 ({len(cut)} cut for time, first `{short['first']}`). "
            f"About **{short['needed_minutes']:g} min** would reach `{short['first']}`'s check. Nothing to "
            "apply: Generate keeps its configuration.")


def margin_text(pick: dict, bound: dict) -> str:
    """", PSNR 25.0008 dB: 0.0008 dB over its 25 dB floor": how close the pick came to the quality bound."""
    floor, psnr = bound.get("min_psnr_db"), pick.get("drift_psnr_db")
    if floor is None or psnr is None or psnr == float("inf"):
        return ""
    margin = psnr - floor
    figure = f"{margin:.4f}" if abs(margin) < 0.1 else f"{margin:.1f}"
    thin = " (a thin margin: another run may not pick it)" if abs(margin) < 0.1 else ""
    return f", PSNR {psnr:.4f} dB: {figure} dB over its {floor:g} dB floor{thin}"


def bound_text(bound: dict) -> list[str]:
    limits = []
    if bound.get("fidelity_points") is not None:
        limits.append(f"fidelity within {bound['fidelity_points']:g} points of eager fp32")
    if bound.get("min_psnr_db") is not None:
        limits.append(f"PSNR ≥ {bound['min_psnr_db']:g} dB against eager fp32")
    if bound.get("min_ssim") is not None:
        limits.append(f"SSIM ≥ {bound['min_ssim']:g} against eager fp32")
    if bound.get("max_memory_bytes"):
        limits.append(f"measured peak ≤ {bound['max_memory_bytes'] / 2**30:.2f} GiB")
    return limits


def markdown(report: dict) -> str:
    """The whole report as Markdown (the CLI's output): the summary, when and how it was measured, the table."""
    threads = report.get("threads")
    measured = (f"Measured {report.get('measured_at', '?')}, {report.get('quality_samples', '?')} quality samples"
                + (f", {threads} CPU thread{'s' if threads > 1 else ''}" if threads else "") + ".")
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table_rows(report)]
    return "\n\n".join(filter(None, [summary(report), measured, memory_frontier_text(report), "\n".join(table)]))
