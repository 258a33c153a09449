"""Views more than one tab shows: number formats, a run's per-step rows, the engine line and size labels
(Generate and the board's timer), the device, LoRA and step-cache choices (Generate, Compare, Advisor), and a
clip's figures and frame strip (the Video tab, Compare's clip cards).

Each tab's own views live beside it (generate_views, compare_views, buckets_views, advisor_views); nothing
here imports gradio or torch, so every function is tested without a server.
"""

from __future__ import annotations

import pandas as pd

# engine.metrics' median (the one the bench and timings use), for the views that take a median
from engine.metrics import median as median

NO_CACHE = "none"
# A plot's axis types come from its first value's dtypes and are not rebuilt when later data arrive, so
# every step frame carries these, even empty (an empty frame's object columns would make both axes nominal).
STEP_DTYPES = {"step": "int64", "step_ms": "float64", "steps": "string", "config": "string"}
COMPUTED, CACHED = "computed", "cached"
# Distinct hues for up to Compare's 7 configurations (and the rest of a longer list); a configuration's
# cached steps are a light tint of its own colour (series_colors).
SERIES_PALETTE = ("#6366f1", "#f97316", "#10b981", "#ef4444", "#0ea5e9", "#a855f7", "#ca8a04", "#db2777",
                  "#0f766e", "#65a30d", "#475569", "#c026d3")


def fmt_ms(value) -> str:
    return "—" if value is None else f"{value:.1f} ms"


def fmt_s(value) -> str:
    return "" if value is None else f"{value:.2f}"


def fmt_bytes(value) -> str:
    if value is None:
        return "not reported by this device"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


# -- a run's steps -------------------------------------------------------------------------------
def step_rows(result: dict | None) -> list[dict]:
    """One point per denoising step: {"step": 1-based, "step_ms": ms, "steps": "computed" | "cached"}
    (empty before the first step); cached: the step cache served that step's denoiser output."""
    if not result:
        return []
    steps = (result.get("timings") or {}).get("step_ms") or []
    cached = {int(s) for s in result.get("cached_steps") or ()}
    return [{"step": i + 1, "step_ms": float(ms), "steps": CACHED if i + 1 in cached else COMPUTED}
            for i, ms in enumerate(steps)]


def step_frame(rows: list[dict], columns: list[str], series: tuple[str, ...] = ()) -> pd.DataFrame:
    """Step rows as a plot's value: numeric step and step_ms, text series, whatever the rows hold.

    `series`: every series the plot can show, each given a first row without a value (not drawn). The browser
    takes a plot's colours from the series in the value it builds the plot with and only swaps the data
    later, so a series missing then (all of them, in a run's first, empty partial) is drawn without a stroke.
    """
    anchors = [{columns[0]: 1, columns[1]: float("nan"), columns[2]: name} for name in series]
    frame = pd.DataFrame(anchors + rows, columns=columns)
    return frame.astype({c: STEP_DTYPES[c] for c in columns})


def fmt_steps(result: dict) -> str:
    cached = len(result.get("cached_steps") or [])
    total = len((result.get("timings") or {}).get("step_ms") or [])
    computed = result.get("computed_steps", total - cached)
    return f"{computed} / {cached}"


# -- LoRA ------------------------------------------------------------------------------------------
def lora_choices(preset, slot: bool = True) -> list[tuple[str, str]]:
    """(label, value) of a preset's LoRA adapters, "none" first; without a slot (the host did not start the
    engines with --loras) only "none"."""
    if not slot:
        return [("none", "none")]
    return [("none", "none")] + [(f"{lora.name} · {lora.description}" if lora.description else lora.name, lora.name)
                                 for lora in preset.loras]


# -- the engine the settings point at ---------------------------------------------------------------
def engine_state(status: list[dict], engine: str) -> dict | None:
    return next((e for e in status if e.get("engine") == engine), None)


def size_label(size: str, mode: str, engine: dict | None) -> str:
    """"128x128 · warm": what a request at this bucket gets now."""
    if mode == "eager":
        return f"{size} · eager"
    if engine is None:
        return f"{size} · not loaded"
    if engine.get("state") == "loading":
        return f"{size} · loading"
    if engine.get("state") == "down":
        return f"{size} · engine down"
    for b in engine.get("buckets", []):
        if b.get("mode") == mode and b.get("size") == size and b.get("batch", 1) == 1:
            return f"{size} · {b.get('state')}"
    return f"{size} · cold"


def size_choices(sizes: list[str], mode: str, engine: dict | None) -> list[tuple[str, str]]:
    return [(size_label(s, mode, engine), s) for s in sizes]


def engine_line(engine_name: str | None, engine: dict | None, error: str | None = None,
                load_s: float | None = None) -> str:
    """One status line for the engine the Generate settings point at (`load_s`: about how long a load takes
    here, said while a new engine loads: a request now waits for it)."""
    if error:
        return f"**Unavailable:** {error}"
    if engine is None:
        return f"**Not loaded:** engine {engine_name} starts on first use"
    state = engine.get("state")
    if state == "loading":
        took = f": ≈ {load_s:.0f} s here" if load_s else ""
        return (f"**Loading** engine {engine_name} (a new engine loads{took}): its worker is loading the weights; "
                "a Generate now waits for it (the page keeps working)…")
    if state == "down":
        return f"**Down:** engine {engine_name}: {engine.get('error')}"
    buckets = engine.get("buckets", [])
    counts: dict[str, int] = {}
    for b in buckets:
        if b.get("mode") != "eager":
            counts[b["state"]] = counts.get(b["state"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    load = engine.get("load_s")
    loaded = f" · loaded in {load:.1f} s" if load else ""
    return f"**Ready:** engine {engine_name}{loaded} · compiled buckets: {summary or 'none'}"


# -- devices ---------------------------------------------------------------------------------------
def device_choices(report: list[dict], short: bool = False) -> list[tuple[str, str]]:
    """"auto (→ cpu)", then every registry device; unavailable ones marked with the reason
    (`short`: just "unavailable"; the System tab and the Generate tab's notes say why)."""
    auto = next((d["name"] for d in report if d.get("auto")), None)
    choices = [(f"auto (→ {auto})" if auto else "auto", "auto")]
    for d in report:
        if d.get("available"):
            label = f"{d['name']} · {d['label']}"
        else:
            reason = (d.get("reason") or "unavailable").split(":")[0]
            label = f"{d['name']} · unavailable" if short else f"{d['name']} · unavailable: {reason}"
        choices.append((label, d["name"]))
    return choices


# -- step caches -----------------------------------------------------------------------------------
def why_not(row: dict) -> str:
    """An unusable step cache's first reason."""
    return (row.get("why_not") or "not here").split(";")[0]


def step_cache_choices(rows: list[dict], short: bool = False) -> list[tuple[str, str]]:
    """available_step_caches rows as (label, value) choices: usable ones by name (with their parameters),
    unusable ones marked with why (picking one is refused with that reason); `short`: marked
    "unavailable" only, the reasons said once (generate_views.step_cache_reasons)."""
    choices = []
    for r in rows:
        value = r.get("default") or r["name"]
        if r.get("usable"):
            label = value
        else:
            label = f"{r['name']} · unavailable" + ("" if short else f": {why_not(r)}")
        choices.append((label, value))
    return choices


STRIP_FRAMES = 33  # frames a strip shows at most (evenly picked from a longer clip)


def clip_figures(result: dict) -> dict:
    """A clip run's own figures from its result JSON: frames, rate, seconds per clip, milliseconds per frame, the
    VAE decode's milliseconds and share of the run (Compare's clip cards show them too)."""
    t = result["timings"]
    total, frames = t["total_ms"], result["frames"]
    return {"frames": frames, "fps": result["fps"], "clip_s": total / 1000, "frame_ms": total / frames,
            "decode_ms": t["decode_ms"], "decode_share": 100 * t["decode_ms"] / total if total else 0.0}


def strip_of(frames: list, most: int = STRIP_FRAMES) -> list[tuple]:
    """(frame, caption) of at most `most` of a clip's frames, evenly spread from the first."""
    step = max(1, -(-len(frames) // most))
    return [(frame, f"frame {i + 1}") for i, frame in enumerate(frames) if i % step == 0]
