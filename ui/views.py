"""Pure data shaping for the UI: engine results and states in, rows and labels out.

Nothing here imports gradio or torch, so every function is tested without a server. The speedup
rows come from the benchmark's own speedup_table, imported on first use.
"""

from __future__ import annotations

import html

import pandas as pd

from engine.metrics import median
from ui.memory_views import gib_text, weights_line

BOARD_COLUMNS = [
    "engine", "device", "precision", "mode", "size", "state", "reason",
    "compile s", "warm-up s", "served",
]
STATS_COLUMNS = ["metric", "value"]
STEP_COLUMNS = ["step", "step_ms", "steps"]
COMPARE_STEP_COLUMNS = ["step", "step_ms", "config"]
# A plot's axis types come from its first value's dtypes and are not rebuilt when later data arrive, so
# every step frame carries these, even empty (an empty frame's object columns would make both axes nominal).
STEP_DTYPES = {"step": "int64", "step_ms": "float64", "steps": "string", "config": "string"}
COMPUTED, CACHED = "computed", "cached"
SPEEDUP_COLUMNS = ["config", "median step", "total", "× step", "× total", "compile s", "warm-up s",
                   "break-even"]
# Distinct hues for up to Compare's 7 configurations (and the rest of a longer list); a configuration's
# cached steps are a light tint of its own colour (series_colors).
SERIES_PALETTE = ("#6366f1", "#f97316", "#10b981", "#ef4444", "#0ea5e9", "#a855f7", "#ca8a04", "#db2777",
                  "#0f766e", "#65a30d", "#475569", "#c026d3")
CACHED_SUFFIX = " · cached"
COST_COLUMNS = ["config", "state", "compile s", "warm-up s", "cache hits", "waited s", "error"]


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


# -- one run ---------------------------------------------------------------------------------------
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


def step_axis(result: dict | None) -> list[float] | None:
    """The per-step plot's x range: step 1 to the run's steps (None: no run)."""
    if not result:
        return None
    steps = result.get("steps") or len((result.get("timings") or {}).get("step_ms") or ())
    return [1, max(2, int(steps or 0))]


LABELLED_STEPS = 60  # up to this many steps a full-width plot labels each step; beyond, numeric ticks


def steps_as_labels(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str] | None]:
    """A step frame for a plot drawn once (Compare's): up to LABELLED_STEPS steps, the steps as labels and
    their order (the plot's `sort`), so the axis ticks each whole step; a numeric axis ticks 1.0, 1.25, 1.5
    when it has more room than steps. More steps: as it is (numeric ticks are then whole steps)."""
    last = int(frame["step"].max()) if len(frame) else 0
    if not 0 < last <= LABELLED_STEPS:
        return frame, None
    return frame.astype({"step": "string"}), [str(i) for i in range(1, last + 1)]


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
            ["engine", f"{result.get('engine', '')} · {result.get('mode', '')} {result.get('bucket', '')}"],
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
        ["engine", f"{result.get('engine', '')} · {result.get('mode', '')} {result.get('bucket', '')}"],
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
        ["LoRA", lora_text(result)],
        ["peak memory", fmt_bytes(result.get("peak_memory_bytes"))],
        ["weights (memory levers: " + (result.get("memory") or "none") + ")", weights_line(result) or "—"],
        ["seed", str(result.get("seed", ""))],
        ["notices", "; ".join(notices) if notices else "—"],
    ]


def lora_choices(preset, slot: bool = True) -> list[tuple[str, str]]:
    """(label, value) of a preset's LoRA adapters, "none" first; without a slot (the host did not start the
    engines with --loras) only "none"."""
    if not slot:
        return [("none", "none")]
    return [("none", "none")] + [(f"{lora.name} · {lora.description}" if lora.description else lora.name, lora.name)
                                 for lora in preset.loras]


def compare_lora_choices(preset, slot: bool) -> list[tuple[str, str]]:
    """Compare's LoRA axis: "none", then each adapter unfused and fused (values in the typed list's
    NAME[:fused] form); without a slot only "none"."""
    return [("none", "none")] + [choice for lora in (preset.loras if slot else ())
                                 for choice in ((lora.name, lora.name), (f"{lora.name} fused", f"{lora.name}:fused"))]


def lora_text(result: dict) -> str:
    """The adapter a run used, its scale and rank, and the hot-swap it waited for."""
    if not result.get("lora"):
        return "none"
    swap, fuse = result.get("lora_swap_ms"), result.get("lora_fuse_ms")
    text = (f"{result['lora']} at scale {result.get('lora_scale', 1):g}, rank {result.get('lora_rank')}; "
            + (f"hot-swapped in {swap:.0f} ms (no recompile)" if swap is not None else "already in place"))
    if result.get("lora_fused"):
        text += (f"; fused into the weights in {fuse:.0f} ms" if fuse is not None
                 else "; fused into the weights (already)")
    return text


def run_summary(result: dict | None) -> str:
    """The lines under the image: how the run ended, its time, seed and peak memory, and every notice
    (a snapped size, an empty prompt), so none of it hides in the timings table."""
    if not result:
        return "Press **Generate**: the image, its progress and its timings appear here."
    t = result.get("timings") or {}
    steps = t.get("step_ms") or []
    where = f"{result.get('engine', '')} · {result.get('mode', '')} {result.get('bucket', '')}".strip(" ·")
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
        head += f" · LoRA {lora_text(result)}"
    notices = result.get("notices") or []
    return head + "".join(f"\n\n⚠ {n}" for n in notices)


HISTORY_RUNS = 12  # images a page keeps in its run history (the oldest go first)


def history_caption(number: int, result: dict) -> str:
    """"#3 · tiny-shapes@cpu/fp32 · eager 64x64 · 8 steps · seed 7 · 41.2 ms": a history entry's
    configuration and figures."""
    t = result.get("timings") or {}
    parts = [f"#{number}", result.get("engine", ""), f"{result.get('mode', '')} {result.get('bucket', '')}".strip(),
             f"{len(t.get('step_ms') or [])} steps", f"seed {result.get('seed', '')}", fmt_ms(t.get("total_ms"))]
    if result.get("step_cache") and result["step_cache"] != NO_CACHE:
        parts.insert(3, result["step_cache"])
    return " · ".join(p for p in parts if p)


# -- bucket board ----------------------------------------------------------------------------------
def board_rows(status: list[dict]) -> list[list]:
    """Every bucket of every engine; an engine without buckets yet (loading / down) gets one row."""
    rows: list[list] = []
    for engine in status:
        name = engine.get("engine", "")
        preset_device = name.split("@", 1)
        device_precision = preset_device[1].split("/", 1) if len(preset_device) > 1 else ["", ""]
        on = f" on {engine['where']}" if engine.get("where") else ""  # under --ray: its node(s) and chips
        device = device_precision[0] + on
        precision = device_precision[1].split(" ", 1)[0] if len(device_precision) > 1 else ""
        if engine.get("state") != "ready" or not engine.get("buckets"):
            state = engine.get("state", "")
            reason = engine.get("error") or ("loading weights" if state == "loading" else "")
            rows.append([name, device, precision, "", "", f"engine {state}", reason or "", "", "", ""])
            if state != "ready":
                continue
        for b in engine.get("buckets", []):
            reason = b.get("error") or ""
            if b.get("state") == "warm" and b.get("cache_hits"):
                reason = reason or f"{b['cache_hits']} compile-cache hits"
            mode = b.get("mode", "")
            if b.get("origin"):  # aot: "loaded from package" / "built now"
                mode = f"{mode} · {b['origin']}"
            size, served = b.get("size", ""), b.get("requests_served", 0)
            if b.get("batch", 1) > 1:  # a batch size's own graph: requests it served, in how many calls
                size = f"{size} · batch {b['batch']}"
                served = f"{served} in {b.get('batches_served', 0)} calls"
            rows.append([
                name, b.get("device", device_precision[0]) + on, b.get("precision", precision), mode,
                size, b.get("state", ""), reason, fmt_s(b.get("compile_s")),
                fmt_s(b.get("warmup_s")), served,
            ])
        if engine.get("lora"):
            rows.append(lora_row(name, device, precision, engine["lora"]))
    return rows


LORA_SLOT = "LoRA slot"  # the board's mode column for an engine's LoRA row (not a mode: never warmed)


def lora_row(name: str, device: str, precision: str, lora: dict) -> list:
    """An engine's LoRA slot as one board row: the adapter serving now, the hot-swaps served and their median,
    and the recompiles on warm graphs (a hot-swap must cause none)."""
    current = lora.get("current")
    state = f"{current} at {lora.get('scale', 0):g}" if current else "no LoRA"
    swaps = lora.get("swaps", 0)
    median_ms = lora.get("median_swap_ms")
    reason = (f"rank {lora.get('target_rank', 0)} · adapters {', '.join(lora.get('adapters', [])) or 'none'} · "
              f"median swap {fmt_ms(median_ms)} · {lora.get('recompiles', 0)} recompiles")
    if lora.get("fuses"):
        reason += f" · {lora['fuses']} fuses (median {fmt_ms(lora.get('median_fuse_ms'))})"
    if lora.get("refused"):
        reason += f" · refused {', '.join(lora['refused'])} (see notices)"
    return [name, device, precision, LORA_SLOT, "", state, reason, "", "", f"{swaps} swaps"]


def attention_markdown(rows: list[dict]) -> str:
    """Every attention backend for the picked engine: can it run here, and why not."""
    lines = ["| backend | runs here | why not / note |", "|---|---|---|"]
    for r in rows:
        why = (r.get("reason") or r.get("note") or r.get("summary") or "").replace("|", "\\|")
        lines.append(f"| `{r['name']}` | {'yes' if r.get('usable') else 'no'} | {why} |")
    return "\n".join(lines)


def find_bucket(status: list[dict], engine: str, mode: str, size: str) -> dict | None:
    for e in status:
        if e.get("engine") != engine:
            continue
        for b in e.get("buckets", []):
            if b.get("mode") == mode and b.get("size") == size and b.get("batch", 1) == 1:
                return b
    return None


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


def engine_line(engine_name: str | None, engine: dict | None, error: str | None = None) -> str:
    """One status line for the engine the Generate settings point at."""
    if error:
        return f"**Unavailable:** {error}"
    if engine is None:
        return f"**Not loaded:** engine {engine_name} starts on first use"
    state = engine.get("state")
    if state == "loading":
        return (f"**Loading** engine {engine_name}: its worker is loading the weights "
                "(the page keeps working)…")
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


def device_notes(report: list[dict]) -> str:
    lines = []
    for d in report:
        if d.get("available"):
            lines.append(f"- **{d['name']}** ({d['label']}): available · "
                         f"compile backend `{d['compile_backend']}` · modes {', '.join(d.get('modes', []))}")
        else:
            lines.append(f"- **{d['name']}** ({d['label']}): unavailable — {d.get('reason')}")
    return "\n".join(lines)


# -- comparison ------------------------------------------------------------------------------------
NO_CACHE = "none"
FIDELITY_SEED = 7  # the bench's prompt-sampling seed: Compare scores the same prompts as its quality samples
REFERENCE_TAG = "reference: eager fp32, no step cache"
PRICE_COLUMNS = ["config", "s / image", "× vs eager fp32", "median step", "steps computed / cached",
                 "drift PSNR / max diff", "fidelity", "compile s", "warm-up s"]
# The speedup (its spread, image count and load marks) gets the room it needs: at 1280x800 six rows fit
# without the table's inner scroller. No header is narrower than its longest word.
PRICE_WIDTHS = ["22%", "6%", "20%", "7%", "9%", "12%", "10%", "7%", "7%"]


def config_label(device: str, precision: str, mode: str, cache: str = NO_CACHE, lora: str = "") -> str:
    """"cpu/fp32/eager", with "/first-block:0.2" appended when a step cache is on and `lora` ("+lora=swap:0.5",
    the typed list's spelling: ui/compare.py writes and reads it) when a LoRA is."""
    base = f"{device}/{precision}/{mode}"
    return (base if not cache or cache == NO_CACHE else f"{base}/{cache}") + lora


def parse_config(label: str) -> tuple[str, str, str, str]:
    """(device, precision, mode, cache) of a config_label, its LoRA part left out."""
    parts = label.split("+", 1)[0].split("/", 3)
    return parts[0], parts[1], parts[2], parts[3] if len(parts) > 3 else NO_CACHE


def reference_label(device: str) -> str:
    return config_label(device, "fp32", "eager")


def _why_not(row: dict) -> str:
    return (row.get("why_not") or "not here").split(";")[0]


def step_cache_choices(rows: list[dict], short: bool = False) -> list[tuple[str, str]]:
    """available_step_caches rows as (label, value) choices: usable ones by name (with their parameters),
    unusable ones marked with why (picking one is refused with that reason); `short`: marked
    "unavailable" only, the reasons said once by step_cache_reasons."""
    choices = []
    for r in rows:
        value = r.get("default") or r["name"]
        if r.get("usable"):
            label = value
        else:
            label = f"{r['name']} · unavailable" + ("" if short else f": {_why_not(r)}")
        choices.append((label, value))
    return choices


def step_cache_reasons(rows: list[dict]) -> str:
    """Why the unusable step caches cannot run, each reason once: "first-block, pyramid: <why>"."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if not r.get("usable"):
            by_reason.setdefault(_why_not(r), []).append(r["name"])
    return " · ".join(f"unavailable ({', '.join(names)}): {why}" for why, names in by_reason.items())


def per_image_s(result: dict) -> float | None:
    """Seconds per image: the median total over the configuration's images (main + fidelity samples)."""
    totals = result.get("image_ms") or [(result.get("timings") or {}).get("total_ms")]
    totals = [t for t in totals if t is not None]
    return median(totals) / 1000 if totals else None


def speedups_vs_reference(results: list[dict]) -> dict[str, float | None]:
    """config -> its speedup over the reference (eager fp32 without a step cache): the paired figure where
    it was timed round-robin with it (speedup_figure), else reference s/image ÷ its s/image."""
    ref = next((r for r in results if r.get("reference") and not r.get("error")), None)
    ref_s = per_image_s(ref) if ref else None
    out = {}
    for r in results:
        figure = r.get("speedup_figure")
        if figure and not r.get("error"):
            out[r.get("config", "")] = figure.get("speedup")
            continue
        mine = None if r.get("error") else per_image_s(r)
        out[r.get("config", "")] = ref_s / mine if ref_s and mine else None
    return out


def speedup_text(result: dict, x: float | None) -> str:
    """The speedup as a table or card shows it: with its spread and images where timed in pairs."""
    figure = result.get("speedup_figure")
    if figure and figure.get("text"):
        return figure["text"]
    return "—" if x is None else f"{x:.2f}×"


def fmt_fidelity(result: dict) -> str:
    share, n = result.get("fidelity"), result.get("fidelity_samples")
    if share is None:
        return "—" if "fidelity" not in result else "no prompt in the model's grammar"
    right = round(share * n) if n else None
    return f"{share * 100:.0f} % ({right}/{n} prompts)" if n else f"{share * 100:.0f} %"


def fmt_steps(result: dict) -> str:
    cached = len(result.get("cached_steps") or [])
    total = len((result.get("timings") or {}).get("step_ms") or [])
    computed = result.get("computed_steps", total - cached)
    return f"{computed} / {cached}"


def price_rows(results: list[dict]) -> list[list]:
    """The Compare tab's table: what each configuration costs and what it buys."""
    speed = speedups_vs_reference(results)
    out = []
    for r in results:
        config = r.get("config", "")
        if r.get("error"):
            out.append([config, r["error"] if r.get("refused") else f"failed: {r['error']}", "", "", "", "", "", "", ""])
            continue
        x = speed.get(config)
        drift = r.get("drift") or "—"
        if r.get("drift_samples"):
            drift = f"{drift} (worst of {r['drift_samples']})"
        out.append([
            config + (" (reference)" if r.get("reference") else ""), fmt_s(per_image_s(r)) + gib_text(r),
            speedup_text(r, x), fmt_ms((r.get("timings") or {}).get("median_step_ms")),
            fmt_steps(r), drift, fmt_fidelity(r), fmt_s(r.get("compile_s")), fmt_s(r.get("warmup_s")),
        ])
    return out


def _esc(text) -> str:
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;"))


def compare_cards_html(results: list[dict], images: list[str | None], heatmaps: list[str | None] | None = None) -> str:
    """One card per configuration: its image (and beside it the heat map of its difference to the reference's)
    and, under them, time, speedup, drift and fidelity. `images[i]` / `heatmaps[i]`: of results[i] as URLs
    (data: URIs), or None (failed, not run yet, the reference)."""
    speed = speedups_vs_reference(results)
    cards = []
    heatmaps = heatmaps or [None] * len(results)
    for r, uri, heat in zip(results, images, heatmaps, strict=True):
        config = r.get("config", "")
        lines = [f'<div class="c-card-title">{_esc(config)}</div>']
        if r.get("reference"):
            lines.append(f'<div class="c-card-tag">{_esc(r.get("reference_note") or REFERENCE_TAG)}</div>')
        if uri and heat:
            lines.append(f'<div class="c-pair"><img src="{uri}" alt="{_esc(config)}">'
                         f'<img class="c-heat" src="{heat}" alt="difference to the reference" '
                         f'title="|this − reference|: black = same pixels, white = the largest difference"></div>')
        elif uri:
            lines.append(f'<img src="{uri}" alt="{_esc(config)}">')
        if r.get("error"):
            error = r["error"] if r.get("refused") else f"failed: {r['error']}"
            lines.append(f'<div class="c-card-error">{_esc(error)}</div>')
        else:
            x = speed.get(config)
            per = per_image_s(r)
            lines.append(f'<div class="c-time">{"—" if per is None else f"{per:.3f} s"} / image{gib_text(r)} · '
                         f'{_esc(speedup_text(r, x))} vs eager fp32</div>')
            drift = r.get("drift") or ("reference" if r.get("reference") else "—")
            lines.append(f'<div class="c-drift">drift: {_esc(drift)}</div>')
            if "fidelity" in r or r.get("fidelity_this") is not None:
                verdict = {True: "✓ draws the prompt", False: "✗ does not draw the prompt"}.get(
                    r.get("fidelity_this"), "prompt outside the grammar")
                lines.append(f'<div class="c-fidelity">fidelity: {_esc(fmt_fidelity(r))} · {verdict}</div>')
            lines.append(f'<div class="c-steps">steps computed / cached: {fmt_steps(r)}</div>')
            if r.get("lora"):
                lines.append(f'<div class="c-lora">LoRA {_esc(lora_text(r))}</div>')
            if r.get("eager_fallback"):
                lines.append('<div class="c-note">eager fallback: the bucket was not warm</div>')
        cards.append('<div class="c-card">' + "".join(lines) + "</div>")
    return '<div class="c-cards">' + "".join(cards) + "</div>"


def series_colors(names: list[str]) -> dict[str, str]:
    """Each series its colour: a configuration the next hue, its cached steps (" · cached") a tint of its own."""
    colors: dict[str, str] = {}
    bases = list(dict.fromkeys(name.removesuffix(CACHED_SUFFIX) for name in names))
    for i, base in enumerate(bases):
        colors[base] = SERIES_PALETTE[i % len(SERIES_PALETTE)]
    for name in names:
        if name.endswith(CACHED_SUFFIX):
            colors[name] = tint(colors[name.removesuffix(CACHED_SUFFIX)])
    return {name: colors[name] for name in names}


def tint(color: str, share: float = 0.55) -> str:
    """`color` (#rrggbb) mixed with white: `share` of white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * share):02x}" for c in rgb)


def legend_html(colors: dict[str, str]) -> str:
    """The plot's legend as HTML that wraps (Vega draws its bottom legend as one row, cut at the plot's edge)."""
    items = "".join(f'<span class="legend-item"><span class="swatch" style="background:{color}"></span>'
                    f'{html.escape(name)}</span>' for name, color in colors.items())
    return f'<div class="legend">{items}</div>' if items else ""


def compare_step_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r.get("error"):
            continue
        for row in step_rows(r):
            config = r.get("config", "")
            rows.append({"step": row["step"], "step_ms": row["step_ms"],
                         "config": f"{config}{CACHED_SUFFIX}" if row["steps"] == CACHED else config})
    return rows


def fidelity_sample_prompts(preset, n: int, fallback: str) -> list[str]:
    """The Compare tab's fidelity prompts: the bench's seeded samples of the model's grammar."""
    from bench.quality import sample_prompts

    return sample_prompts(preset, n, seed=FIDELITY_SEED, fallback=fallback)


def difference_picture(image, reference):
    """|image - reference| as a heat map (PIL), by the bench's quality code."""
    from bench.quality import diff_heatmap

    return diff_heatmap(image, reference)


def has_checker(preset) -> bool:
    from bench.quality import fidelity_checker

    return fidelity_checker(preset) is not None


def price_quality(images: list, prompts: list[str], ref_images: list | None, preset, style: str | None = None) -> dict:
    """Under a Compare image: drift of every image against the reference's image of the same prompt and
    seed (the worst kept), and fidelity over the sample prompts (images[1:]) with the first image's own
    verdict, by the bench's quality.score; with a LoRA `style`, against what the style implies."""
    from bench.quality import fidelity_checker, fmt_drift, score

    out: dict = {}
    if ref_images is not None:
        drift = score(images, prompts, ref_images, preset)
        ssim_text = "" if drift.get("drift_ssim") is None or not drift["drift_max_diff"] else \
            f", SSIM {drift['drift_ssim']:.3f}"
        out.update(drift_psnr_db=drift["drift_psnr_db"], drift_max_diff=drift["drift_max_diff"],
                   drift_ssim=drift.get("drift_ssim"),
                   drift=fmt_drift(drift["drift_psnr_db"], drift["drift_max_diff"]) + ssim_text,
                   drift_samples=len(images))
    checker = fidelity_checker(preset, style)
    if checker is not None:
        out["fidelity_this"] = checker(images[0], prompts[0])
        if len(prompts) > 1:
            fid = score(images[1:], prompts[1:], None, preset, style)
            out.update(fidelity=fid["fidelity"], fidelity_samples=fid["fidelity_samples"])
    return out


def speedup_table(results: list[dict]) -> list[dict]:
    """The Compare tab's speedup rows, computed by the benchmark's own speedup_table (bench),
    so the UI, the CLI bench and docs/benchmarks.md agree.

    `results` are GenerateResult.as_dict() objects, optionally with "config", "compile_s" and
    "warmup_s" added (and "error" for a configuration that failed). The baseline is the eager run of
    the same engine and size; without one the speedup is None.
    """
    from bench import speedup_table as bench_speedup_table

    rows = []
    for r, b in zip(results, bench_speedup_table(results), strict=True):
        rows.append({
            "config": r.get("config")
            or config_label(r.get("device", "?"), r.get("precision", "?"), r.get("mode", "?")),
            "bucket": r.get("bucket"),
            "median_step_ms": b.get("step_ms_median"),
            "total_ms": b.get("image_ms_median"),
            "speedup_step": b.get("speedup_vs_eager"),
            # the paired figure where Compare timed one: the same speedup as the table and the cards
            "speedup_total": r["speedup_figure"]["speedup"] if r.get("speedup_figure")
            else b.get("speedup_image_vs_eager"),
            "compile_s": r.get("compile_s"),
            "warmup_s": r.get("warmup_s"),
            "break_even_images": b.get("break_even_images"),
            "error": r.get("error"),
        })
    return rows


def speedup_display_rows(rows: list[dict]) -> list[list]:
    def x(v):
        return "—" if v is None else f"{v:.2f}×"

    out = []
    for r in rows:
        if r.get("error"):
            out.append([r["config"], f"failed: {r['error']}", "", "", "", "", "", ""])
            continue
        out.append([
            r["config"], fmt_ms(r["median_step_ms"]), fmt_ms(r["total_ms"]),
            x(r["speedup_step"]), x(r["speedup_total"]), fmt_s(r["compile_s"]), fmt_s(r["warmup_s"]),
            "" if r["break_even_images"] is None else str(r["break_even_images"]),
        ])
    return out


def cost_rows(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        out.append([
            r.get("config", ""), r.get("bucket_state") or ("failed" if r.get("error") else ""),
            fmt_s(r.get("compile_s")), fmt_s(r.get("warmup_s")), r.get("cache_hits") or "",
            fmt_s(r.get("waited_s")), r.get("error") or "",
        ])
    return out
