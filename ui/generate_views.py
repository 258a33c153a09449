"""The Generate tab's views: a run's stats table, its summary under the image, its history captions, the
per-step plot's axis and the device notes. Pure: no gradio, tested without a server."""

from __future__ import annotations

from engine.protocol import MAX_STEPS, lora_run_text
from ui.memory_views import WHY_NOT_TITLE, weights_line
from ui.views import CACHED, COMPUTED, NO_CACHE, fmt_bytes, fmt_ms, fmt_steps, median, why_not

STATS_COLUMNS = ["metric", "value"]
STEP_COLUMNS = ["step", "step_ms", "steps"]


def _bucket_of(result: dict) -> str:
    """"regional:64x64": the one spelling of a bucket the page uses (the verdicts and the compile waits too)."""
    mode, bucket = result.get("mode") or "", result.get("bucket") or ""
    return f"{mode}:{bucket}" if mode and bucket else mode or bucket


def step_axis(result: dict | None) -> list[float] | None:
    """The per-step plot's x range: step 1 to the run's steps (None: no run)."""
    if not result:
        return None
    steps = result.get("steps") or len((result.get("timings") or {}).get("step_ms") or ())
    return [1, max(2, int(steps or 0))]


# The per-step plots' x axis is the steps as labels, in this order: a numeric axis of 4 steps was ticked 1.5, 2.5.
STEP_ORDER = [str(step) for step in range(1, MAX_STEPS + 1)]


def steps_to_come(result: dict | None, rows: list[dict]) -> list[dict]:
    """A row without a value for each step of the run not done yet, so the axis spans the run from its start."""
    axis = step_axis(result)
    return [{"step": step, "step_ms": float("nan"), "steps": COMPUTED}
            for step in range(len(rows) + 1, axis[1] + 1)] if axis else []


def plot_classes(rows: list[dict]) -> list[str]:
    """The plot's classes: "no-cached" hides the legend's cached entry (ui/blocks.py CSS) where no step was
    cached. A class, not colors_in_legend: changing that prop rebuilds the chart, and racing rebuilds draw stale
    lines."""
    return [] if any(r["steps"] == CACHED for r in rows) else ["no-cached"]


def bucket_verdict(result: dict) -> str:
    if result.get("mode") == "eager":
        return "eager (no compiled graph asked for)"
    if result.get("warm"):
        return f"warm: the {result.get('mode')} graph of bucket {result.get('bucket')} served it"
    if result.get("eager_fallback"):
        return f"eager fallback: bucket {result.get('mode')}:{result.get('bucket')} was not warm yet"
    return "—"


def stats_rows(result: dict | None) -> list[list[str]]:
    """The stats table of one run (also of a run still in progress: {"running": True, ...})."""
    if not result:
        return []
    t = result.get("timings") or {}
    steps = t.get("step_ms") or []
    if result.get("running"):
        rows = [
            ["engine", f"{result.get('engine', '')} · {_bucket_of(result)}"],
            ["progress", f"step {len(steps)} of {result.get('steps', '?')}"
             + (f" ({len(result['cached_steps'])} from the step cache)" if result.get("cached_steps") else "")],
        ]
        if steps:
            rows.append(["first step / median step",
                         f"{fmt_ms(steps[0])} / {fmt_ms(median(steps))}"])
        return rows
    notices = result.get("notices") or []
    its = t.get("steps_per_s")
    ended = []
    if result.get("cancelled"):
        ended = [["run", result.get("message") or "cancelled"]]
    elif result.get("error"):
        ended = [["run", f"failed: {result['error']}"]]
    return ended + [
        ["engine", f"{result.get('engine', '')} · {_bucket_of(result)}"
                   + (f" on node {result['node']}" if result.get("node") else "")],
        ["encode", fmt_ms(t.get("encode_ms"))],
        ["denoise", f"{fmt_ms(t.get('denoise_ms'))} ({len(steps)} steps)"],
        ["decode", fmt_ms(t.get("decode_ms"))],
        ["total", fmt_ms(t.get("total_ms"))],
        ["first step / median step", f"{fmt_ms(t.get('first_step_ms'))} / {fmt_ms(t.get('median_step_ms'))}"],
        ["it/s", "—" if its is None else f"{its:.2f}"],
        ["step cache", result.get("step_cache") or NO_CACHE],
        ["steps computed / cached", fmt_steps(result)],
        ["bucket", bucket_verdict(result)],
        ["batch", (f"one pipeline call for {result['batch_size']} requests (steps shared)"
                   if result.get("batch_size", 1) > 1 else "alone")],
        ["recompiles", str(result.get("recompiles", 0))],
        ["LoRA", lora_run_text(result)],
        ["peak memory", fmt_bytes(result.get("peak_memory_bytes"))],
        ["weights (memory levers: " + (result.get("memory") or "none") + ")", weights_line(result) or "—"],
        ["seed", str(result.get("seed", ""))],
        ["notices", "; ".join(notices) if notices else "—"],
    ]


def run_summary(result: dict | None) -> str:
    """The lines under the image: how the run ended, its time, seed and peak memory, and every notice
    (a snapped size, an empty prompt), so none of it hides in the timings table."""
    if not result:
        return "Press **Generate**: the image, its progress and its timings appear here."
    t = result.get("timings") or {}
    steps = t.get("step_ms") or []
    where = f"{result.get('engine', '')} · {_bucket_of(result)}".strip(" ·")
    if result.get("node"):  # under --ray: the node that served it
        where += f" on node {result['node']}"
    if result.get("running"):
        return f"**Running** on {where}: step {len(steps)} of {result.get('steps') or '?'}"
    if result.get("cancelled"):
        return f"**Cancelled** ({result.get('message') or 'cancelled'}): no image. {where}"
    if result.get("error"):
        return f"**Failed:** {result['error']}"
    head = (f"**{fmt_ms(t.get('total_ms'))}** total · {len(steps)} steps, median {fmt_ms(t.get('median_step_ms'))}"
            f" · seed {result.get('seed', '')} · peak memory {fmt_bytes(result.get('peak_memory_bytes'))}"
            f" · {where}")
    if result.get("step_cache") and result["step_cache"] != NO_CACHE:
        head += f" · {result['step_cache']}: {fmt_steps(result)} steps computed / cached"
    if result.get("lora"):  # the style, its rank and what switching to it cost (the plot's steps include it)
        head += f" · LoRA {lora_run_text(result)}"
    notices = result.get("notices") or []
    return head + "".join(f"\n\n⚠ {n}" for n in notices)


HISTORY_RUNS = 12  # images a page keeps in its run history (the oldest go first)


def history_caption(number: int, result: dict) -> str:
    """"#3 · tiny-shapes@cpu/fp32 · eager:64x64 · 8 steps · seed 7 · 41.2 ms": a history entry's
    configuration and figures."""
    t = result.get("timings") or {}
    parts = [f"#{number}", result.get("engine", ""), f"{_bucket_of(result)}".strip(),
             f"{len(t.get('step_ms') or [])} steps", f"seed {result.get('seed', '')}", fmt_ms(t.get("total_ms"))]
    if result.get("step_cache") and result["step_cache"] != NO_CACHE:
        parts.insert(3, result["step_cache"])
    return " · ".join(p for p in parts if p)


def device_notes(report: list[dict]) -> str:
    lines = []
    for d in report:
        if d.get("available"):
            lines.append(f"- **{d['name']}** ({d['label']}): available · "
                         f"compile backend `{d['compile_backend']}` · modes {', '.join(d.get('modes', []))}")
        else:
            lines.append(f"- **{d['name']}** ({d['label']}): unavailable — {d.get('reason')}")
    return "\n".join(lines)


def step_cache_note(rows: list[dict]) -> str | None:
    """The step cache field's info: how many cannot run here, the reasons in the accordion under it."""
    unavailable = sum(1 for r in rows if not r.get("usable"))
    return f"{unavailable} unavailable here: why under \"{WHY_NOT_TITLE}\"" if unavailable else None


def step_cache_reasons(rows: list[dict], sep: str = " · ") -> str:
    """Why the unusable step caches cannot run, each reason once: "first-block, pyramid: <why>"."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if not r.get("usable"):
            by_reason.setdefault(why_not(r), []).append(r["name"])
    return sep.join(f"unavailable ({', '.join(names)}): {why}" for why, names in by_reason.items())
