"""What a benchmark run leaves behind: the Markdown table and report, bench.json, bench.md, bench.png.

Pure formatting over the report dict (the UI and docs render stored results with the same code), plus
the machine description that makes numbers from different runs comparable. No torch: a device is only
asked through its spec's hooks, and matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from bench.quality import fmt_drift
from bench.stats import compute_ratios, evaluate_targets, speedup_table


def fmt(value, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return "—"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value}{unit}"
    return f"{value:.{digits}f}{unit}"


def markdown_table(rows: list[dict]) -> str:
    """The speedup table as Markdown (columns for TFLOP/s appear when the rows have them)."""
    has_flops = any(r.get("tflops") is not None for r in rows)
    has_cache = any(r.get("compile_cache_hits") is not None for r in rows)
    has_origin = any(r.get("origin") for r in rows)
    header = [
        "precision", "mode", "size", "attention", "load s", "compile s",
        *(["FX cache hit/miss"] if has_cache else []), *(["origin"] if has_origin else []),
        "warm-up s", "first req ms",
        "step ms median", "step ms p90", "image ms", "img/s", "speedup vs eager", "vs fp32 eager",
        "recompiles", "peak MiB",
    ]
    if has_flops:
        header += ["TFLOP/s", "of matmul"]
    has_drift = any(r.get("drift_max_diff") is not None for r in rows)
    has_fidelity = any(r.get("fidelity") is not None for r in rows)
    if has_drift:
        header += ["drift vs fp32 eager (PSNR / max px)"]
    if has_fidelity:
        header += ["fidelity", "held-out"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        attention = r.get("attention_backend") or "native"
        if r.get("error"):
            cells = ([r["precision"], r["mode"], r["size"], attention, "error: " + str(r["error"])[:80]]
                     + [""] * (len(header) - 5))
        else:
            peak = r.get("peak_memory_bytes")
            cells = [
                r["precision"], r["mode"], r["size"], attention,
                fmt(r.get("load_s")), fmt(r.get("compile_s"), 1),
                *([f"{r['compile_cache_hits']}/{r['compile_cache_misses']}"
                   if r.get("compile_cache_hits") is not None else "—"] if has_cache else []),
                *([r.get("origin") or "—"] if has_origin else []),
                fmt(r.get("warmup_s"), 2),
                fmt(r.get("first_request_ms"), 1), fmt(r.get("step_ms_median"), 2),
                fmt(r.get("step_ms_p90"), 2), fmt(r.get("image_ms_median"), 1),
                fmt(r.get("images_per_s"), 1), fmt(r.get("speedup_vs_eager"), 2, "×"),
                fmt(r.get("speedup_vs_fp32_eager"), 2, "×"), fmt(r.get("recompiles")),
                fmt(peak / 2**20 if peak else None, 0),
            ]
            if has_flops:
                frac = r.get("matmul_fraction")
                tf = r.get("tflops")
                cells += [f"{tf:.3g}" if tf is not None else "—", fmt(frac * 100 if frac is not None else None, 1, "%")]
            if has_drift:
                cells.append(fmt_drift(r.get("drift_psnr_db"), r.get("drift_max_diff")))
            if has_fidelity:
                fid, held = r.get("fidelity"), r.get("fidelity_held_out")
                cells += [fmt(fid * 100 if fid is not None else None, 0, "%"),
                          fmt(held * 100 if held is not None else None, 0, "%")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def markdown_targets(target_rows: list[dict]) -> str:
    lines = ["| ratio (median) | value | range | n | target | status |", "|---|---|---|---|---|---|"]
    for t in target_rows:
        rng = f"{fmt(t['min'])}–{fmt(t['max'])}" if t.get("min") is not None and t.get("n", 0) > 1 else ""
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(
            f"| {t['label']}{note} | {fmt(t['value'], 3)} | {rng} | {t['n']} | {t['target']} | **{t['status']}** |"
        )
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    """The whole report (machine, table, targets, notes) as Markdown. Pure."""
    m = report.get("machine", {})
    cfg = report.get("config", {})
    title = f"## Benchmark: {cfg.get('preset')} on {cfg.get('device')} ({report.get('kind')})"
    machine = (
        f"{m.get('cpu_model')} ({m.get('cpu_count')} cores, {m.get('cpus_usable')} usable, "
        f"{m.get('torch_threads')} torch threads"
        f"{', load ' + m['loadavg'] if m.get('loadavg') else ''})"
        f"{'; GPU ' + m['gpu'] if m.get('gpu') else ''}; torch {m.get('torch')}, diffusers {m.get('diffusers')}, "
        f"Python {m.get('python')}; {m.get('date')}"
    )
    parts = [
        title,
        "",
        f"Machine: {machine}",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        markdown_table(report.get("table", [])),
        "",
        markdown_targets(report.get("targets", [])),
    ]
    notes = report.get("notes") or []
    if notes:
        parts += ["", *[f"- {n}" for n in notes]]
    return "\n".join(parts) + "\n"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(spec=None) -> dict:
    """The machine a run measured on. `spec` (a DeviceSpec) names the accelerator through its
    `device_name()` hook; torch is read only if the run already imported it."""
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = None
    info = {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "loadavg": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": None,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
    # The cpu device names the host CPU, already listed above: only an accelerator's own name is a "gpu".
    name = spec.device_name() if spec is not None and torch is not None else None
    if name and name != cpu_model:
        info["gpu"] = name
        info["cuda"] = torch.version.cuda
    return info


def assemble_report(plan, spec, kind: str, results: list[dict], extras: dict, notes: list[str],
                    partial: bool = False, **more) -> dict:
    """The report (bench.json): plan, machine, per-configuration results, table, ratios, targets, notes."""
    ratios = compute_ratios(results, extras)
    targets = evaluate_targets(ratios, kind)
    missed = [t for t in targets if t["status"] == "MISSED"]
    report = {
        "kind": kind,
        "partial": partial,
        "command": plan.command,
        "machine": machine_info(spec),
        "config": {
            "preset": plan.preset.name, "device": plan.device, "modes": list(plan.modes),
            "precisions": list(plan.precisions), "sizes": [str(s) for s in plan.sizes], "steps": plan.steps,
            "runs": plan.runs, "options": dataclasses.asdict(plan.options),
        },
        "results": results,
        "table": speedup_table(results),
        "ratios": ratios,
        "targets": targets,
        "missed": [t["key"] for t in missed],
        "extras": extras,
        "notes": list(dict.fromkeys(notes)),
        **more,
    }
    return report


def write_outputs(report: dict, out: Path, chart: bool = True) -> dict[str, str]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "bench.json"), "markdown": str(out / "bench.md")}
    Path(paths["json"]).write_text(json.dumps(report, indent=1, default=str))
    Path(paths["markdown"]).write_text(markdown_report(report))
    if chart:
        try:
            write_chart(report.get("table", []), out / "bench.png", title=_chart_title(report))
            paths["chart"] = str(out / "bench.png")
        except ImportError:
            report.setdefault("notes", []).append("chart skipped: matplotlib is not installed")
    return paths


def _chart_title(report: dict) -> str:
    cfg, m = report.get("config", {}), report.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpu_model')}, {m.get('cpus_usable')} cores"
    return f"{cfg.get('preset')} on {cfg.get('device')} ({where}), {cfg.get('steps')} steps"


def write_chart(rows: list[dict], path: Path, title: str = "") -> None:
    """Two panels: per-step latency (median bar, p90 whisker) and speedup vs eager, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("error") and r.get("step_ms_median") is not None]
    groups = list(dict.fromkeys(f"{r['precision']}\n{r['size']}" for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / max(1, len(modes))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(groups) + 4), 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, mode in enumerate(modes):
        xs, med, err, speed = [], [], [], []
        for i, g in enumerate(groups):
            match = [r for r in rows if r["mode"] == mode and f"{r['precision']}\n{r['size']}" == g]
            if not match:
                continue
            r = match[0]
            xs.append(i + (j - (len(modes) - 1) / 2) * width)
            med.append(r["step_ms_median"])
            err.append(max(0.0, (r.get("step_ms_p90") or r["step_ms_median"]) - r["step_ms_median"]))
            speed.append(r.get("speedup_vs_eager") or 0.0)
        color = colors[j % len(colors)]
        ax1.bar(xs, med, width, yerr=[[0] * len(err), err], capsize=3, label=mode, color=color)
        ax2.bar(xs, speed, width, label=mode, color=color)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups)
    ax1.set_ylabel("ms per step (median, whisker = p90)")
    ax1.set_title("per-step latency")
    ax2.set_ylabel("× vs eager (same precision and size)")
    ax2.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax2.set_title("speedup vs eager")
    ax1.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
