"""Pure data shaping for the UI: engine results and states in, rows and labels out.

Nothing here imports gradio or torch, so every function is tested without a server. The speedup
rows come from the benchmark's own speedup_table, imported on first use.
"""

from __future__ import annotations

from engine.metrics import median

BOARD_COLUMNS = [
    "engine", "device", "precision", "mode", "size", "state", "reason",
    "compile s", "warm-up s", "served",
]
STATS_COLUMNS = ["metric", "value"]
STEP_COLUMNS = ["step", "step_ms"]
COMPARE_STEP_COLUMNS = ["step", "step_ms", "config"]
SPEEDUP_COLUMNS = ["config", "median step", "total", "× step", "× total", "compile s", "warm-up s",
                   "break-even"]
SERIES_PALETTE = ("#6366f1", "#f97316", "#10b981", "#ef4444", "#0ea5e9", "#a855f7")
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
    """One point per denoising step: {"step": 1-based, "step_ms": ms} (empty before the first step)."""
    if not result:
        return []
    steps = (result.get("timings") or {}).get("step_ms") or []
    return [{"step": i + 1, "step_ms": float(ms)} for i, ms in enumerate(steps)]


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
            ["progress", f"step {len(steps)} of {result.get('steps', '?')}"],
        ]
        if steps:
            rows.append(["first step / median step",
                         f"{fmt_ms(steps[0])} / {fmt_ms(median(steps))}"])
        return rows
    notices = result.get("notices") or []
    its = t.get("steps_per_s")
    return [
        ["engine", f"{result.get('engine', '')} · {result.get('mode', '')} {result.get('bucket', '')}"],
        ["encode", fmt_ms(t.get("encode_ms"))],
        ["denoise", f"{fmt_ms(t.get('denoise_ms'))} ({len(steps)} steps)"],
        ["decode", fmt_ms(t.get("decode_ms"))],
        ["total", fmt_ms(t.get("total_ms"))],
        ["first step / median step", f"{fmt_ms(t.get('first_step_ms'))} / {fmt_ms(t.get('median_step_ms'))}"],
        ["it/s", "—" if its is None else f"{its:.2f}"],
        ["bucket", bucket_verdict(result)],
        ["batch", (f"one pipeline call for {result['batch_size']} requests (steps shared)"
                   if result.get("batch_size", 1) > 1 else "alone")],
        ["recompiles", str(result.get("recompiles", 0))],
        ["peak memory", fmt_bytes(result.get("peak_memory_bytes"))],
        ["seed", str(result.get("seed", ""))],
        ["notices", "; ".join(notices) if notices else "—"],
    ]


# -- bucket board ----------------------------------------------------------------------------------
def board_rows(status: list[dict]) -> list[list]:
    """Every bucket of every engine; an engine without buckets yet (loading / down) gets one row."""
    rows: list[list] = []
    for engine in status:
        name = engine.get("engine", "")
        preset_device = name.split("@", 1)
        device_precision = preset_device[1].split("/", 1) if len(preset_device) > 1 else ["", ""]
        device = device_precision[0]
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
                name, b.get("device", device), b.get("precision", precision), mode,
                size, b.get("state", ""), reason, fmt_s(b.get("compile_s")),
                fmt_s(b.get("warmup_s")), served,
            ])
    return rows


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
def config_label(device: str, precision: str, mode: str) -> str:
    return f"{device}/{precision}/{mode}"


def series_colors(names: list[str]) -> dict[str, str]:
    return {name: SERIES_PALETTE[i % len(SERIES_PALETTE)] for i, name in enumerate(names)}


def compare_step_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r.get("error"):
            continue
        for row in step_rows(r):
            rows.append({**row, "config": r.get("config", "")})
    return rows


def image_quality(image, first_image, preset, prompt: str) -> dict:
    """What the Compare tab shows under an image: drift against the first configuration's image (PSNR,
    largest pixel difference) and, for a model with a pixel checker (the embedded shapes model), whether
    it drew the prompt. Computed by the bench's own functions, so the UI and the bench agree."""
    from engine.bench.quality import fidelity_checker, fmt_drift, image_drift

    out: dict = {}
    if first_image is not None:
        drift = image_drift(image, first_image)
        out.update(drift_psnr_db=drift["psnr_db"], drift_max_diff=drift["max_diff"],
                   drift=fmt_drift(drift["psnr_db"], drift["max_diff"]))
    checker = fidelity_checker(preset)
    if checker is not None:
        out["fidelity"] = checker(image, prompt)  # None: the prompt is outside the model's grammar
    return out


def quality_caption(quality: dict) -> str:
    parts = []
    if "drift" in quality:
        parts.append(f"drift vs first: {quality['drift']}")
    if quality.get("fidelity") is not None:
        parts.append("draws the prompt ✓" if quality["fidelity"] else "does not draw the prompt ✗")
    elif "fidelity" in quality:
        parts.append("fidelity: the prompt is outside the model's grammar (see its examples)")
    return " · ".join(parts)


def speedup_table(results: list[dict]) -> list[dict]:
    """The Compare tab's speedup rows, computed by the benchmark's own speedup_table (engine.bench),
    so the UI, the CLI bench and docs/benchmarks.md agree.

    `results` are GenerateResult.as_dict() objects, optionally with "config", "compile_s" and
    "warmup_s" added (and "error" for a configuration that failed). The baseline is the eager run of
    the same engine and size; without one the speedup is None.
    """
    from engine.bench import speedup_table as bench_speedup_table

    rows = []
    for r, b in zip(results, bench_speedup_table(results), strict=True):
        rows.append({
            "config": r.get("config")
            or config_label(r.get("device", "?"), r.get("precision", "?"), r.get("mode", "?")),
            "bucket": r.get("bucket"),
            "median_step_ms": b.get("step_ms_median"),
            "total_ms": b.get("image_ms_median"),
            "speedup_step": b.get("speedup_vs_eager"),
            "speedup_total": b.get("speedup_image_vs_eager"),
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
