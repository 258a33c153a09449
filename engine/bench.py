"""Benchmark: what each mode and precision buys, measured side by side in one run.

`python -m engine bench` measures every (precision, mode, size) configuration of one model in one
process, so the ratios compare numbers taken on the same machine in the same minutes. It prints a
Markdown table and a list of ratios against their targets (a target the code does not reach is
printed as MISSED, never hidden), and writes `bench.json`, `bench.md` and `bench.png` to `--out`.

Two kinds of run:

* pipeline (default): the real engine path. One `PipelineRunner` per precision (weights load once),
  every bucket warmed first, then the timed requests go round-robin over all configurations (the
  starting configuration rotates each round), so drift in a shared machine's load hits every
  configuration alike. Extra measurements: engine overhead (engine request vs a bare diffusers call
  on the same compiled pipeline, interleaved) and the persistent compile cache (compile time in a
  fresh process with a filled `TORCHINDUCTOR_CACHE_DIR` vs an empty one, in child processes).
* denoiser (`--random-weights`): the preset's real architecture (`denoiser_config` in
  presets/models.toml) built with random weights on the device, fed random inputs of the bucket's
  shapes; each step is one synchronised denoiser forward. No download, real shapes: the GPU run.

The pure part (speedup_table, compute_ratios, evaluate_targets, markdown_report) imports neither
torch nor anything heavy, so the UI's Compare tab can turn stored results into the same table.
Everything that measures imports torch lazily.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BASELINE_MODE = "eager"
# "max-autotune" is a bench-only label: a full compile with torch.compile(mode="max-autotune").
BENCH_MODES = ("eager", "compile", "regional", "max-autotune", "defer-and-fuse")
COMPILED_MODES = ("compile", "regional", "max-autotune", "defer-and-fuse")
FULL_COMPILE_MODES = ("compile", "max-autotune")
PROBE_MARK = "BENCH_PROBE "
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"

# Fields every configuration's result carries (tests check them; the UI may rely on them).
RESULT_FIELDS = (
    "kind", "preset", "device", "precision", "mode", "size", "steps", "runs",
    "load_s", "compile_s", "warmup_s", "first_request_ms",
    "step_ms_median", "step_ms_p90", "image_ms_median", "image_ms_p90", "images_per_s",
    "speedup_vs_eager", "speedup_image_vs_eager", "warm_hit_ratio",
    "recompiles", "peak_memory_bytes", "error",
)

# Published reference points (per image, FLUX.1-dev 1024x1024, 28 steps, bf16).
REFERENCE_POINTS = (
    "torch.compile took FLUX.1-dev on an H100 from 6.7 s to 4.5 s per image (1.49x)",
    "an H200 ran FLUX.1-dev compiled in 4.3 s per image",
)


# ================================================================================================
# Pure part: statistics, the speedup table, ratios, targets, Markdown. No torch.
# ================================================================================================


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def p90(values) -> float | None:
    """90th percentile (linear interpolation between order statistics)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=10, method="inclusive")[-1])


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def _group(row: dict) -> tuple:
    return (row.get("preset"), row.get("device"), row.get("precision"), str(row.get("size")))


def _normalize(r: dict) -> dict:
    """Accept GenerateResult.as_dict() too (timings nested, size under "bucket")."""
    if "step_ms_median" in r or "timings" not in r:
        return r
    t = r.get("timings") or {}
    return {
        **r,
        "size": r.get("size") or r.get("bucket"),
        "step_ms_median": t.get("median_step_ms"),
        "image_ms_median": t.get("total_ms"),
    }


def speedup_table(results: list[dict], baseline_mode: str = BASELINE_MODE) -> list[dict]:
    """Rows of the speedup table, one per configuration, in the order given.

    Each input needs `precision`, `mode`, `size` and `step_ms_median` (`image_ms_median` and the
    other RESULT_FIELDS are used when present); GenerateResult.as_dict() objects work as well.
    Speedups compare against `baseline_mode` at the same (preset, device, precision, size):
    `speedup_vs_eager` is eager step time / this step time (> 1 means faster).
    `speedup_vs_fp32_eager` compares against fp32 eager at the same size, so a precision's gain
    shows too. `break_even_images`: requests after which compile + warm-up time is paid back by the
    faster image (None when it never is). Pure: safe to call from the UI on stored JSON.
    """
    results = [_normalize(r) for r in results]
    base = {_group(r): r for r in results if r.get("mode") == baseline_mode and not r.get("error")}
    fp32 = {
        (r.get("preset"), r.get("device"), str(r.get("size"))): r
        for r in results
        if r.get("mode") == baseline_mode and r.get("precision") == "fp32" and not r.get("error")
    }
    rows = []
    for r in results:
        b = base.get(_group(r))
        f = fp32.get((r.get("preset"), r.get("device"), str(r.get("size"))))
        step, image = r.get("step_ms_median"), r.get("image_ms_median")
        row = {
            "preset": r.get("preset"),
            "device": r.get("device"),
            "precision": r.get("precision"),
            "mode": r.get("mode"),
            "size": str(r.get("size")),
            "steps": r.get("steps"),
            "load_s": r.get("load_s"),
            "compile_s": r.get("compile_s"),
            "warmup_s": r.get("warmup_s"),
            "first_request_ms": r.get("first_request_ms"),
            "step_ms_median": step,
            "step_ms_p90": r.get("step_ms_p90"),
            "image_ms_median": image,
            "images_per_s": r.get("images_per_s") if r.get("images_per_s") is not None else _ratio(1000.0, image),
            "speedup_vs_eager": _ratio(b.get("step_ms_median"), step) if b else None,
            "speedup_image_vs_eager": _ratio(b.get("image_ms_median"), image) if b else None,
            "speedup_vs_fp32_eager": _ratio(f.get("step_ms_median"), step) if f else None,
            "warm_hit_ratio": r.get("warm_hit_ratio")
            if r.get("warm_hit_ratio") is not None
            else _ratio(r.get("first_request_ms"), image),
            "recompiles": r.get("recompiles"),
            "peak_memory_bytes": r.get("peak_memory_bytes"),
            "break_even_images": _break_even(r, b),
            "error": r.get("error"),
        }
        for extra in ("tflops", "matmul_fraction", "flops_per_step", "compile_cache_hits", "compile_cache_misses"):
            if r.get(extra) is not None:
                row[extra] = r[extra]
        rows.append(row)
    return rows


def _break_even(r: dict, base: dict | None) -> int | None:
    if not base or r.get("mode") == BASELINE_MODE or r.get("error"):
        return None
    saved_ms = (base.get("image_ms_median") or 0) - (r.get("image_ms_median") or 0)
    cost_s = (r.get("compile_s") or 0) + (r.get("warmup_s") or 0)
    if saved_ms <= 0 or cost_s <= 0 or r.get("image_ms_median") is None:
        return None
    return math.ceil(cost_s * 1000 / saved_ms)


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    op: str  # "<=" or ">="
    limit: float
    kinds: tuple[str, ...]  # which kind of run reports it: "pipeline", "denoiser"


TARGETS: tuple[Target, ...] = (
    Target("engine_overhead", "engine overhead: engine request / bare diffusers call, same compiled pipeline",
           "<=", 1.05, ("pipeline",)),
    Target("warm_hit", "warm hit: first request at a pre-warmed bucket / steady per-image median",
           "<=", 1.25, ("pipeline", "denoiser")),
    Target("regional_compile_time", "regional / full compile: compile time", "<=", 0.6, ("pipeline", "denoiser")),
    Target("regional_step", "regional / full compile: steady step time", "<=", 1.15, ("pipeline", "denoiser")),
    Target("persistent_cache", "persistent cache: compile time in a fresh process, filled cache / empty cache",
           "<=", 0.35, ("pipeline",)),
    Target("compiled_vs_eager_step", "compile / eager: steady step time", "<=", 0.6, ("pipeline",)),
    Target("compile_speedup", "compile speedup over eager: eager step / compiled step", ">=", 1.4, ("denoiser",)),
    Target("matmul_fraction", "best compiled step's TFLOP/s / measured matmul TFLOP/s", ">=", 0.8, ("denoiser",)),
    Target("recompiles", "graphs compiled during the timed runs (must be 0)", "<=", 0, ("pipeline", "denoiser")),
)


def _pair_ratios(results: list[dict], num_modes, den_mode: str, field: str, invert: bool = False) -> list[dict]:
    by = {(r.get("precision"), str(r.get("size")), r.get("mode")): r for r in results if not r.get("error")}
    out = []
    for (precision, size, mode), r in by.items():
        if mode not in num_modes or (precision, size, den_mode) not in by:
            continue
        num, den = r.get(field), by[(precision, size, den_mode)].get(field)
        value = _ratio(den, num) if invert else _ratio(num, den)
        if value is not None:
            out.append({"precision": precision, "size": size, "mode": mode, "value": value})
    return out


def _summary(values: list[dict], note: str = "") -> dict:
    nums = [v["value"] for v in values]
    return {
        "value": median(nums),
        "min": min(nums) if nums else None,
        "max": max(nums) if nums else None,
        "n": len(nums),
        "values": values,
        "note": note,
    }


def compute_ratios(results: list[dict], extras: dict | None = None) -> dict[str, dict]:
    """Every ratio the targets speak of, from per-configuration results (+ extra measurements).

    Each ratio is the median over the (precision, size) pairs that have both sides, with the
    per-pair values kept. Pure.
    """
    extras = extras or {}
    ok = [r for r in results if not r.get("error")]
    ratios: dict[str, dict] = {}

    compiled = [r for r in ok if r.get("mode") in COMPILED_MODES] or ok
    ratios["warm_hit"] = _summary(
        [
            {"precision": r["precision"], "size": str(r["size"]), "mode": r["mode"],
             "value": _ratio(r.get("first_request_ms"), r.get("image_ms_median"))}
            for r in compiled
            if _ratio(r.get("first_request_ms"), r.get("image_ms_median")) is not None
        ],
        "over compiled configurations" if compiled is not ok else "over all configurations",
    )
    ratios["regional_compile_time"] = _summary(_pair_ratios(ok, ("regional",), "compile", "compile_s"))
    ratios["regional_step"] = _summary(_pair_ratios(ok, ("regional",), "compile", "step_ms_median"))
    ratios["compiled_vs_eager_step"] = _summary(_pair_ratios(ok, ("compile",), "eager", "step_ms_median"))
    ratios["compile_speedup"] = _summary(_pair_ratios(ok, ("compile",), "eager", "step_ms_median", invert=True))
    fractions = [
        {"precision": r["precision"], "size": str(r["size"]), "mode": r["mode"], "value": r["matmul_fraction"]}
        for r in ok
        if r.get("mode") in COMPILED_MODES and r.get("matmul_fraction") is not None
    ]
    best = max(fractions, key=lambda v: v["value"]) if fractions else None
    ratios["matmul_fraction"] = {
        **_summary([best] if best else []),
        "note": f"best compiled mode: {best['mode']}" if best else "",
        "all": fractions,
    }
    total = sum(int(r.get("recompiles") or 0) for r in ok)
    ratios["recompiles"] = {"value": float(total) if ok else None, "n": len(ok), "values": [], "note": "sum"}

    overhead = extras.get("engine_overhead") or {}
    ratios["engine_overhead"] = {
        "value": overhead.get("ratio"), "n": overhead.get("pairs", 0), "values": [],
        "note": overhead.get("note", overhead.get("skipped", "")),
    }
    probe = extras.get("cache_probe") or {}
    ratios["persistent_cache"] = {
        "value": probe.get("ratio"), "n": 1 if probe.get("ratio") is not None else 0, "values": [],
        "note": probe.get("note", probe.get("skipped", "")),
    }
    return ratios


def evaluate_targets(ratios: dict[str, dict], kind: str = "pipeline") -> list[dict]:
    """One row per target of this kind of run: value, target, status "met", "MISSED" or "n/a". Pure."""
    rows = []
    for t in TARGETS:
        if kind not in t.kinds:
            continue
        entry = ratios.get(t.key) or {}
        value = entry.get("value")
        if value is None:
            status = "n/a"
        elif (value <= t.limit) if t.op == "<=" else (value >= t.limit):
            status = "met"
        else:
            status = "MISSED"
        sign = "≤" if t.op == "<=" else "≥"
        rows.append({
            "key": t.key,
            "label": t.label,
            "value": value,
            "min": entry.get("min"),
            "max": entry.get("max"),
            "n": entry.get("n", 0),
            "target": f"{sign} {t.limit:g}",
            "status": status,
            "note": entry.get("note", ""),
        })
    return rows


def _fmt(value, digits: int = 2, unit: str = "") -> str:
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
    header = [
        "precision", "mode", "size", "load s", "compile s", *(["FX cache hit/miss"] if has_cache else []),
        "warm-up s", "first req ms",
        "step ms median", "step ms p90", "image ms", "img/s", "speedup vs eager", "vs fp32 eager",
        "recompiles", "peak MiB",
    ]
    if has_flops:
        header += ["TFLOP/s", "of matmul"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if r.get("error"):
            cells = [r["precision"], r["mode"], r["size"], "error: " + str(r["error"])[:80]] + [""] * (len(header) - 4)
        else:
            peak = r.get("peak_memory_bytes")
            cells = [
                r["precision"], r["mode"], r["size"],
                _fmt(r.get("load_s")), _fmt(r.get("compile_s"), 1),
                *([f"{r['compile_cache_hits']}/{r['compile_cache_misses']}"
                   if r.get("compile_cache_hits") is not None else "—"] if has_cache else []),
                _fmt(r.get("warmup_s"), 2),
                _fmt(r.get("first_request_ms"), 1), _fmt(r.get("step_ms_median"), 2),
                _fmt(r.get("step_ms_p90"), 2), _fmt(r.get("image_ms_median"), 1),
                _fmt(r.get("images_per_s"), 1), _fmt(r.get("speedup_vs_eager"), 2, "×"),
                _fmt(r.get("speedup_vs_fp32_eager"), 2, "×"), _fmt(r.get("recompiles")),
                _fmt(peak / 2**20 if peak else None, 0),
            ]
            if has_flops:
                frac = r.get("matmul_fraction")
                tf = r.get("tflops")
                cells += [f"{tf:.3g}" if tf is not None else "—", _fmt(frac * 100 if frac is not None else None, 1, "%")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def markdown_targets(target_rows: list[dict]) -> str:
    lines = ["| ratio (median) | value | range | n | target | status |", "|---|---|---|---|---|---|"]
    for t in target_rows:
        rng = f"{_fmt(t['min'])}–{_fmt(t['max'])}" if t.get("min") is not None and t.get("n", 0) > 1 else ""
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(
            f"| {t['label']}{note} | {_fmt(t['value'], 3)} | {rng} | {t['n']} | {t['target']} | **{t['status']}** |"
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


# ================================================================================================
# Machine description (no torch import needed)
# ================================================================================================


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(device: str | None = None) -> dict:
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
    if "torch" in sys.modules:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    if device and device.startswith("cuda") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        try:
            info["gpu"] = torch.cuda.get_device_name()
            info["cuda"] = torch.version.cuda
        except Exception:
            pass
    return info


# ================================================================================================
# Measuring (torch imported lazily)
# ================================================================================================


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=sys.stderr)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return _NullBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NullBar()
    return tqdm(total=total, file=sys.stderr, desc=desc, unit="step", dynamic_ncols=True, leave=True)


@dataclass
class BenchPlan:
    preset: object  # ModelPreset
    device: str  # registry name after resolving "auto"
    modes: tuple[str, ...]
    precisions: tuple[str, ...]
    sizes: tuple  # Size
    steps: int
    runs: int
    options: object  # EngineOptions
    cache_dir: Path
    allowed_roots: tuple[str, ...] = ()
    prompt: str = "a red fox in the snow"
    overhead_pairs: int = 20
    cache_probe: str = "compile"  # mode the persistent-cache probe compiles, or "off"
    probe_timeout_s: float = 900.0
    progress: bool = True
    model_args: tuple[str, ...] = ()  # --model/--buckets/--model-root passed on to probe children
    # denoiser (random weights)
    random_weights: bool = False
    config_override: dict | None = None
    text_len: int | None = None
    matmul_roofline: bool = False
    warmup_calls: int = 1
    time_budget_s: float | None = None
    out: Path | None = None
    force: bool = False
    threads: int | None = None
    engine_args: tuple[str, ...] = ()  # engine flags passed on to probe children
    command: str = ""


def _sizes_label(sizes) -> str:
    return ",".join(str(s) for s in sizes)


def _inductor_cache_state(spec, cache_dir: Path) -> tuple[str | None, int]:
    if spec.compile_backend != "inductor":
        return None, 0
    folder = os.environ.get(INDUCTOR_CACHE_VAR) or spec.environment(cache_dir).get(INDUCTOR_CACHE_VAR)
    if not folder or not Path(folder).is_dir():
        return folder, 0
    return folder, sum(len(files) for _, _, files in os.walk(folder))


def _quiet_loading() -> None:
    """No per-component loading bars from diffusers/transformers: the bench has its own bar."""
    try:
        import diffusers.utils.logging as dlog

        dlog.disable_progress_bar()
        import transformers.utils.logging as tlog

        tlog.disable_progress_bar()
    except Exception:
        pass


def _prime_compiler(spec) -> float:
    """A throwaway compile, so the first measured bucket does not pay inductor's one-time start-up
    (imports, toolchain checks, compile worker pool) that every later bucket skips."""
    import torch

    start = time.perf_counter()
    fn = torch.compile(lambda x: torch.nn.functional.gelu(x * 2.0 + 1.0), backend=spec.compile_backend)
    with torch.no_grad():
        fn(torch.ones(8, device=spec.torch_device))
    spec.synchronize()
    return time.perf_counter() - start


def _engine_for(mode: str) -> tuple[str, dict]:
    """Runner mode and option overrides for a bench mode."""
    if mode == "max-autotune":
        return "compile", {"max_autotune": True}
    return mode, {}


def _empty_result(kind: str, plan: BenchPlan, precision: str, mode: str, size) -> dict:
    r = {f: None for f in RESULT_FIELDS}
    r.update(kind=kind, preset=plan.preset.name, device=plan.device, precision=precision, mode=mode,
             size=str(size), steps=plan.steps, runs=plan.runs, recompiles=0, notices=[], samples={})
    return r


def _finish(r: dict, step_ms: list[float], image_ms: list[float]) -> dict:
    r["samples"] = {"step_ms": [round(x, 4) for x in step_ms], "image_ms": [round(x, 4) for x in image_ms]}
    r["step_ms_median"] = median(step_ms)
    r["step_ms_p90"] = p90(step_ms)
    r["image_ms_median"] = median(image_ms)
    r["image_ms_p90"] = p90(image_ms)
    r["images_per_s"] = _ratio(1000.0, r["image_ms_median"])
    r["warm_hit_ratio"] = _ratio(r.get("first_request_ms"), r["image_ms_median"])
    return r


def _apply_speedups(results: list[dict]) -> None:
    for r, row in zip(results, speedup_table(results), strict=True):
        for key in ("speedup_vs_eager", "speedup_image_vs_eager", "speedup_vs_fp32_eager"):
            r[key] = row[key]


# ---- pipeline bench ----------------------------------------------------------------------------


def run_pipeline_bench(plan: BenchPlan) -> dict:
    from engine import devices

    spec = devices.resolve_device(plan.device)
    # The cache folder first: importing torch._dynamo (diffusers does, at import) pins inductor's
    # default folder (/tmp/torchinductor_<user>) in os.environ, after which apply_environment's
    # setdefault no longer takes effect.
    devices.apply_environment(spec, plan.cache_dir)
    import diffusers

    from engine.protocol import BucketKey, BucketState, EngineConfig, EngineKey, GenerateRequest
    from engine.runner import PipelineRunner

    getattr(diffusers, plan.preset.pipeline)  # import the pipeline module now, not inside the timed load
    _quiet_loading()
    notes: list[str] = []

    configs = [(p, m, s) for p in plan.precisions for s in plan.sizes for m in plan.modes]
    engine_ids = sorted({(p, _engine_for(m)[1].get("max_autotune", False)) for p, m, _ in configs},
                        key=lambda e: (plan.precisions.index(e[0]), e[1]))
    total = (len(engine_ids) + len(configs) * (2 + plan.runs) + 2 * plan.overhead_pairs
             + (2 if plan.cache_probe != "off" else 0))
    bar = _progress(total, plan.progress, f"bench {plan.preset.name}@{spec.name}")

    # 1. Load: one runner per precision (and per max-autotune option), weights once each.
    runners: dict[tuple[str, bool], PipelineRunner] = {}
    load_s: dict[tuple[str, bool], float] = {}
    for precision, autotune in engine_ids:
        bar.set_postfix_str(f"load {precision}{' max-autotune' if autotune else ''}")
        options = dataclasses.replace(plan.options, **plan.preset.options.get(spec.name, {}))
        if autotune:
            options = dataclasses.replace(options, max_autotune=True)
        config = EngineConfig(
            key=EngineKey(plan.preset.name, spec.name, precision),
            preset=plan.preset,
            options=options,
            cache_dir=str(plan.cache_dir),
            allowed_roots=plan.allowed_roots,
        )
        runner = PipelineRunner(config)
        runner.resolve_source()  # build a tiny model now if missing: not part of the load time
        load_s[(precision, autotune)] = runner.load()
        runners[(precision, autotune)] = runner
        bar.update()

    def runner_for(precision: str, mode: str) -> tuple[PipelineRunner, str]:
        engine_mode, extra = _engine_for(mode)
        return runners[(precision, extra.get("max_autotune", False))], engine_mode

    def activate(runner: PipelineRunner) -> None:
        devices.apply_precision(runner.precision)  # process-wide (TF32); engines may differ

    cache_folder, cache_files = _inductor_cache_state(spec, plan.cache_dir)
    startup_s = None
    if any(m in COMPILED_MODES for m in plan.modes) and spec.compile_backend == "inductor":
        bar.set_postfix_str("compiler start-up")
        startup_s = _prime_compiler(spec)

    results: dict[tuple, dict] = {}
    for precision, mode, size in configs:
        r = _empty_result("pipeline", plan, precision, mode, size)
        runner, _ = runner_for(precision, mode)
        r["load_s"] = load_s[(precision, mode == "max-autotune")]
        r["notices"] = list(dict.fromkeys(runner.notices))
        results[(precision, mode, size)] = r

    def request(mode: str, size, seed: int, steps: int | None = None, rid: str | None = None):
        kwargs = {"request_id": rid} if rid else {}
        return GenerateRequest(
            prompt=plan.prompt, width=size.width, height=size.height, steps=steps or plan.steps,
            guidance=plan.preset.guidance, seed=seed, mode=mode, on_cold="eager", **kwargs,
        )

    # 2. Warm every bucket (compiled modes compile here), before any timed request.
    for precision, mode, size in configs:
        r = results[(precision, mode, size)]
        runner, engine_mode = runner_for(precision, mode)
        bar.set_postfix_str(f"warm {precision} {mode} {size}")
        activate(runner)
        try:
            runner.check_mode(engine_mode)
            if engine_mode in ("compile", "regional", "defer-and-fuse"):
                info = runner.warm_bucket(BucketKey(engine_mode, size))
                if info.state != BucketState.WARM:
                    r["error"] = info.error or f"bucket is {info.state.value}"
                r["compile_s"], r["warmup_s"] = info.compile_s, info.warmup_s
                # FX-graph cache hits/misses while compiling: says whether compile_s was cold or cached.
                r["compile_cache_hits"] = getattr(info, "cache_hits", None)
                r["compile_cache_misses"] = getattr(info, "cache_misses", None)
            else:
                start = time.perf_counter()
                runner.generate(request(engine_mode, size, seed=0, steps=runner.options.warm_steps, rid="warm"))
                r["warmup_s"] = time.perf_counter() - start
        except Exception as exc:  # one configuration failing must not end the benchmark
            log.warning("%s %s %s failed: %s", precision, mode, size, exc)
            r["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        bar.update()

    live = [c for c in configs if not results[c]["error"]]

    # 3. The first request at each pre-warmed bucket.
    for precision, mode, size in live:
        r = results[(precision, mode, size)]
        runner, engine_mode = runner_for(precision, mode)
        bar.set_postfix_str(f"first request {precision} {mode} {size}")
        activate(runner)
        res = runner.generate(request(engine_mode, size, seed=1))
        r["first_request_ms"] = res.timings.total_ms
        r["recompiles_first_request"] = res.recompiles
        if res.eager_fallback:
            r["notices"].append("first request fell back to eager: the bucket was not warm")
        bar.update()

    # 4. Timed runs, round-robin over configurations; the starting configuration rotates.
    steps_by: dict[tuple, list[float]] = {c: [] for c in live}
    images_by: dict[tuple, list[float]] = {c: [] for c in live}
    for i in range(plan.runs):
        order = live[i % len(live):] + live[: i % len(live)] if live else []
        for c in order:
            precision, mode, size = c
            r = results[c]
            runner, engine_mode = runner_for(precision, mode)
            bar.set_postfix_str(f"run {i + 1}/{plan.runs} {precision} {mode} {size}")
            activate(runner)
            res = runner.generate(request(engine_mode, size, seed=100 + i))
            steps_by[c].extend(res.timings.step_ms)
            images_by[c].append(res.timings.total_ms)
            r["recompiles"] += res.recompiles
            if res.eager_fallback:
                r["eager_fallbacks"] = r.get("eager_fallbacks", 0) + 1
            peak = res.peak_memory_bytes
            if peak is not None:
                r["peak_memory_bytes"] = max(peak, r["peak_memory_bytes"] or 0)
            bar.update()
    for c in live:
        _finish(results[c], steps_by[c], images_by[c])
    bar.update(len(configs) - len(live))
    bar.update((plan.runs) * (len(configs) - len(live)))

    ordered = [results[c] for c in configs]
    _apply_speedups(ordered)

    # 5. Engine overhead, on one compiled configuration (full compile preferred).
    extras: dict = {}
    target = _overhead_config(live)
    if target and plan.overhead_pairs > 0:
        precision, mode, size = target
        runner, engine_mode = runner_for(precision, mode)
        activate(runner)
        extras["engine_overhead"] = measure_engine_overhead(
            runner, engine_mode, size, plan.steps, plan.overhead_pairs, plan.prompt, plan.preset.guidance, bar
        )
        extras["engine_overhead"].update(precision=precision, mode=mode, size=str(size))
    else:
        extras["engine_overhead"] = {"skipped": "no configuration ran" if not target else "--overhead-runs 0"}

    # 6. Persistent cache: cold vs filled inductor cache in fresh child processes.
    if plan.cache_probe != "off":
        if spec.compile_backend != "inductor":
            extras["cache_probe"] = {"skipped": f"{spec.name} compiles with {spec.compile_backend}, not inductor"}
            bar.update(2)
        else:
            extras["cache_probe"] = run_cache_probe(plan, spec.name, plan.cache_probe, bar)
    else:
        extras["cache_probe"] = {"skipped": "--cache-probe off"}

    bar.set_postfix_str("done")
    bar.close()

    compiled_label = (
        "compile s = first call at the bucket in this process (compiles the graph, includes one "
        f"{plan.options.warm_steps}-step run), after a throwaway compile paid inductor's one-time start-up "
        f"({_fmt(startup_s)} s), with the persistent inductor cache at {cache_folder} ({cache_files} files at "
        "start): cache hits make it shorter than a cold compile; the persistent-cache probe gives the cold number"
    )
    if spec.compile_backend != "inductor":
        compiled_label = "compile s = first call at the bucket in this process (compiles the graph)"
    notes += [
        compiled_label,
        "load s = from_pretrained + .to(device) for the precision's engine (shared by its modes; diffusers "
        "imported beforehand)",
        "warm-up s = the run after compiling (eager: the first run), "
        f"{plan.options.warm_steps} steps; first req ms = the first full request at the warmed bucket; "
        "image ms = the engine's per-request total (encode + denoise + decode)",
        f"steady numbers: {plan.runs} requests per configuration, round-robin over all configurations; "
        "per-step median/p90 over every step of those requests",
        f"peak memory: {spec.describe_memory() or 'device peak'}",
        "speedups compare against eager at the same precision and size, measured in the same run",
    ]
    if "compile" in plan.modes and plan.options.compile_vae:
        notes.append("mode compile also compiles vae.decode (engine default); regional compiles the denoiser's "
                     "repeated blocks only")
    return {
        "kind": "pipeline",
        "results": ordered,
        "extras": extras,
        "notes": notes,
        "compile_startup_s": startup_s,
        "inductor_cache": {"dir": cache_folder, "files_at_start": cache_files},
    }


def _overhead_config(live: list[tuple]) -> tuple | None:
    for wanted in ("compile", "regional", "max-autotune", "eager"):
        for c in live:
            if c[1] == wanted:
                return c
    return live[0] if live else None


def measure_engine_overhead(runner, mode: str, size, steps: int, pairs: int, prompt: str, guidance: float,
                            bar=None) -> dict:
    """runner.generate(request) vs calling the same (compiled) pipeline object directly with the same
    arguments, interleaved (the order alternates each pair), wall time around each call; medians."""

    from engine.protocol import GenerateRequest
    from engine.runner import compiles_in_this_thread, pipeline_call_kwargs

    pipe = runner.variant(mode)
    spec = runner.spec
    engine_ms: list[float] = []
    bare_ms: list[float] = []
    bare_recompiles = 0

    def engine_call(seed: int) -> None:
        req = GenerateRequest(prompt=prompt, width=size.width, height=size.height, steps=steps,
                              guidance=guidance, seed=seed, mode=mode, on_cold="eager")
        start = time.perf_counter()
        runner.generate(req)
        spec.synchronize()
        engine_ms.append((time.perf_counter() - start) * 1000)

    def bare_call(seed: int) -> None:
        nonlocal bare_recompiles
        before = compiles_in_this_thread()
        start = time.perf_counter()
        # Exactly what a user writes (the pipeline's own no_grad, as in the engine): any different grad
        # mode (e.g. inference_mode) would fail the graphs' guards and recompile.
        request = GenerateRequest(prompt=prompt, width=size.width, height=size.height, steps=steps,
                                  guidance=guidance, seed=seed, mode=mode)
        pipe(**pipeline_call_kwargs(runner.preset, pipe, request))
        spec.synchronize()
        bare_ms.append((time.perf_counter() - start) * 1000)
        bare_recompiles += compiles_in_this_thread() - before

    bare_call(0)  # the bare path's own first call (e.g. lazy state on the shared scheduler), untimed
    bare_ms.clear()
    first_call_recompiles, bare_recompiles = bare_recompiles, 0
    for i in range(pairs):
        if bar:
            bar.set_postfix_str(f"engine overhead {i + 1}/{pairs}")
        first, second = (engine_call, bare_call) if i % 2 == 0 else (bare_call, engine_call)
        first(500 + i)
        second(500 + i)
        if bar:
            bar.update(2)
    e, b = median(engine_ms), median(bare_ms)
    return {
        "pairs": pairs,
        "engine_ms_median": e,
        "bare_ms_median": b,
        "ratio": _ratio(e, b),
        "bare_recompiles": bare_recompiles,
        "bare_first_call_recompiles": first_call_recompiles,
        "engine_ms": [round(x, 4) for x in engine_ms],
        "bare_ms": [round(x, 4) for x in bare_ms],
        "note": f"{mode} {size}, {pairs} interleaved pairs; engine adds a pipeline copy, its own scheduler, "
                "per-step callbacks and PNG encoding",
    }


def run_cache_probe(plan: BenchPlan, device: str, mode: str, bar=None) -> dict:
    """Compile one bucket in a fresh child process with an empty inductor cache (cold), then in
    another fresh child with the same, now filled, cache (warm). The cache folder is set in the
    child's environment, so it is in force before the child imports torch."""
    precision, size = plan.precisions[0], plan.sizes[0]
    folder = Path(tempfile.mkdtemp(prefix="showcase-bench-inductor-"))
    cmd = [
        sys.executable, "-m", "engine", "bench", "--_compile-probe", "--preset", plan.preset.name,
        "--device", device, "--precisions", precision, "--modes", mode, "--sizes", str(size),
        "--cache-dir", str(plan.cache_dir), *plan.model_args,
        *(["--threads", str(plan.threads)] if plan.threads else []), *plan.engine_args,
    ]
    env = {**os.environ, INDUCTOR_CACHE_VAR: str(folder)}
    out: dict = {"mode": mode, "precision": precision, "size": str(size), "cache_dir": str(folder)}
    try:
        for label in ("cold", "warm"):
            if bar:
                bar.set_postfix_str(f"persistent cache: {label} compile in a fresh process")
            start = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=plan.probe_timeout_s,
                                  cwd=str(Path(__file__).resolve().parent.parent))
            wall = time.perf_counter() - start
            if bar:
                bar.update()
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith(PROBE_MARK)]
            if proc.returncode != 0 or not found:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                out["error"] = f"{label} probe exited {proc.returncode}: {' | '.join(tail)}"
                return out
            child = json.loads(found[-1][len(PROBE_MARK):])
            out[f"{label}_compile_s"] = child.get("compile_s")
            out[f"{label}_process_s"] = wall
            out[f"{label}_child"] = child
            if child.get("error"):
                out["error"] = f"{label} probe: {child['error']}"
                return out
        out["ratio"] = _ratio(out.get("warm_compile_s"), out.get("cold_compile_s"))
        out["note"] = (f"{mode} {precision} {size}: cold {_fmt(out.get('cold_compile_s'), 1)} s, "
                       f"with the cache {_fmt(out.get('warm_compile_s'), 1)} s (first bucket call in a fresh process)")
    except subprocess.TimeoutExpired:
        out["error"] = f"probe took longer than {plan.probe_timeout_s:.0f}s"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def cmd_compile_probe(args) -> int:
    """Child side of the persistent-cache probe: load, compile one bucket, print one JSON line."""
    plan = plan_from_args(args)
    from engine import devices
    from engine.protocol import BucketKey, EngineConfig, EngineKey
    from engine.runner import PipelineRunner

    spec = devices.resolve_device(plan.device)
    mode, extra = _engine_for(plan.modes[0])
    options = dataclasses.replace(plan.options, **plan.preset.options.get(spec.name, {}), **extra)
    runner = PipelineRunner(EngineConfig(EngineKey(plan.preset.name, spec.name, plan.precisions[0]), plan.preset,
                                         options, cache_dir=str(plan.cache_dir), allowed_roots=plan.allowed_roots))
    runner.resolve_source()
    runner.load()
    info = runner.warm_bucket(BucketKey(mode, plan.sizes[0]))
    seen = None
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        seen = inductor_cache_dir()
    except Exception:
        pass
    print(PROBE_MARK + json.dumps({
        "compile_s": info.compile_s,
        "cache_hits": getattr(info, "cache_hits", None),
        "cache_misses": getattr(info, "cache_misses", None),
        "warmup_s": info.warmup_s,
        "state": info.state.value,
        "error": info.error,
        "env_cache_dir": os.environ.get(INDUCTOR_CACHE_VAR),
        "inductor_cache_dir": seen,
        "pid": os.getpid(),
    }), flush=True)
    return 0


# ---- denoiser bench (random weights) -----------------------------------------------------------

DENOISER_CLASSES = {
    "FluxPipeline": "FluxTransformer2DModel",
    "StableDiffusion3Pipeline": "SD3Transformer2DModel",
    "StableDiffusionXLPipeline": "UNet2DConditionModel",
    "StableDiffusionPipeline": "UNet2DConditionModel",
}
DEFAULT_TEXT_LEN = {"FluxPipeline": 512, "StableDiffusion3Pipeline": 333, "StableDiffusionXLPipeline": 77,
                    "StableDiffusionPipeline": 77}
VAE_SCALE = 8


def denoiser_class(pipeline: str):
    import diffusers

    name = DENOISER_CLASSES.get(pipeline)
    if name is None:
        from engine.errors import UnsupportedCombination

        raise UnsupportedCombination(
            f"--random-weights knows the denoiser inputs of {', '.join(DENOISER_CLASSES)}; {pipeline} is not one"
        )
    return getattr(diffusers, name)


def flux_step_flops(cfg: dict, width: int, height: int, text_len: int = 512, batch: int = 1) -> int:
    """FLOPs of one FluxTransformer2DModel forward, counted analytically (multiply-add = 2 FLOPs).

    With D = heads·head_dim, N_img = (H/16)·(W/16) image tokens, N_txt text tokens, N = N_img + N_txt:
      linear layer:  2 · tokens · in · out;   attention (QKᵀ and AV): 4 · N² · D per layer
      double block:  qkv img+txt 6·N·D², out projections 2·N·D², MLP 4D 16·N·D²  -> 24·N·D² + 4·N²·D
                     + AdaLN modulation of the 1-token embedding for img and txt: 2 · 2·D·6D
      single block:  qkv 6·N·D², proj_mlp 8·N·D², proj_out (5D -> D) 10·N·D²   -> 24·N·D² + 4·N²·D
                     + AdaLN modulation 2·D·3D
      embedders:     x 2·N_img·C_in·D, context 2·N_txt·J·D, proj_out 2·N_img·D·C_out, norm_out 2·D·2D,
                     timestep (and guidance) 2·256·D + 2·D², pooled 2·P·D + 2·D²
    FLUX.1-dev at 1024² with 512 text tokens: ≈ 74.4 TFLOP per step. Everything times the batch.
    Checked against torch.utils.flop_counter.FlopCounterMode (tests/test_bench.py).
    """
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    d = heads * head_dim
    patch = cfg.get("patch_size", 1)
    c_in = cfg.get("in_channels", 64)
    c_out = (cfg.get("out_channels") or c_in) * patch * patch
    n_img = (height // (VAE_SCALE * 2)) * (width // (VAE_SCALE * 2)) // (patch * patch)
    n = n_img + text_len
    per_layer = 24 * n * d * d + 4 * n * n * d
    double = cfg.get("num_layers", 19) * (per_layer + 2 * 2 * d * 6 * d)
    single = cfg.get("num_single_layers", 38) * (per_layer + 2 * d * 3 * d)
    time_embeds = (2 * 256 * d + 2 * d * d) * (2 if cfg.get("guidance_embeds", False) else 1)
    pooled = 2 * cfg.get("pooled_projection_dim", 768) * d + 2 * d * d
    embed = (2 * n_img * c_in * d + 2 * text_len * cfg.get("joint_attention_dim", 4096) * d
             + 2 * n_img * d * c_out + 2 * d * 2 * d + time_embeds + pooled)
    return batch * (double + single + embed)


def denoiser_inputs(pipeline: str, cfg: dict, size, text_len: int, batch: int, device: str, dtype,
                    guidance: float = 3.5, seed: int = 0) -> dict:
    """Random inputs of the shapes the pipeline gives its denoiser at one step for this bucket."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    h, w = size.height // VAE_SCALE, size.width // VAE_SCALE
    if pipeline == "FluxPipeline":
        # Packed latents: 2x2 patches of the 16-channel latent -> (H/16)·(W/16) tokens of 64 channels.
        hp, wp = h // 2, w // 2
        img_ids = torch.zeros(hp, wp, 3)
        img_ids[..., 1] = torch.arange(hp)[:, None]
        img_ids[..., 2] = torch.arange(wp)[None, :]
        inputs = {
            "hidden_states": rnd(batch, hp * wp, cfg.get("in_channels", 64)),
            "encoder_hidden_states": rnd(batch, text_len, cfg.get("joint_attention_dim", 4096)),
            "pooled_projections": rnd(batch, cfg.get("pooled_projection_dim", 768)),
            "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),  # sigma; the model scales by 1000
            "img_ids": img_ids.reshape(hp * wp, 3).to(device=device, dtype=dtype),
            "txt_ids": torch.zeros(text_len, 3, device=device, dtype=dtype),
            "return_dict": False,
        }
        if cfg.get("guidance_embeds", False):
            inputs["guidance"] = torch.full((batch,), guidance, device=device, dtype=torch.float32)
        return inputs
    if pipeline == "StableDiffusion3Pipeline":
        return {
            "hidden_states": rnd(batch, cfg.get("in_channels", 16), h, w),
            "encoder_hidden_states": rnd(batch, text_len, cfg.get("joint_attention_dim", 4096)),
            "pooled_projections": rnd(batch, cfg.get("pooled_projection_dim", 2048)),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
            "return_dict": False,
        }
    # UNet2DConditionModel (SDXL: text_time micro-conditioning)
    inputs = {
        "sample": rnd(batch, cfg.get("in_channels", 4), h, w),
        "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": rnd(batch, text_len, cfg.get("cross_attention_dim", 2048)),
        "return_dict": False,
    }
    if cfg.get("addition_embed_type") == "text_time":
        time_dim = cfg.get("addition_time_embed_dim", 256)
        text_dim = cfg.get("projection_class_embeddings_input_dim", 2816) - 6 * time_dim
        inputs["added_cond_kwargs"] = {"text_embeds": rnd(batch, text_dim), "time_ids": rnd(batch, 6)}
    return inputs


def count_flops_meta(cls, cfg: dict, pipeline: str, size, text_len: int, batch: int, guidance: float) -> int | None:
    """FLOPs of one forward counted by FlopCounterMode on the meta device (no memory, no compute).
    On meta, SDPA takes the math path, so attention's matmuls are counted too."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.device("meta"):
            model = cls.from_config(cfg)
        inputs = denoiser_inputs(pipeline, cfg, size, text_len, batch, "meta", torch.float32, guidance)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(**inputs)
        return int(counter.get_total_flops())
    except Exception as exc:  # counting is informative; never fail the benchmark over it
        log.warning("FLOP count on meta failed: %s", exc)
        return None


def _available_memory(spec) -> int | None:
    import torch

    if spec.name == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    if spec.name == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def measure_matmul_rate(spec, dtype, sizes=None, iters: int = 20) -> dict:
    """Best achieved dense matmul rate (TFLOP/s) in `dtype` on this device: the roofline the
    denoiser's step is compared with. Square matmuls, 2·n³ FLOPs each, synchronised wall time."""
    import torch

    if sizes is None:
        sizes = (4096, 8192, 16384) if spec.name == "cuda" else (256, 512, 1024)
    best, rows = 0.0, []
    for n in sizes:
        a = torch.randn(n, n, device=spec.torch_device, dtype=dtype)
        b = torch.randn(n, n, device=spec.torch_device, dtype=dtype)
        for _ in range(3):
            a @ b
        spec.synchronize()
        k = iters if spec.name != "cpu" else max(2, iters // 4)
        start = time.perf_counter()
        for _ in range(k):
            a @ b
        spec.synchronize()
        seconds = (time.perf_counter() - start) / k
        tflops = 2 * n**3 / seconds / 1e12
        rows.append({"n": n, "ms": seconds * 1000, "tflops": tflops})
        best = max(best, tflops)
        del a, b
    return {"dtype": str(dtype).replace("torch.", ""), "tflops": best, "sizes": rows}


def run_denoiser_bench(plan: BenchPlan) -> dict:
    import torch

    from engine import devices, recipes
    from engine.errors import InvalidRequest, UnsupportedCombination
    from engine.runner import _install_compile_counter, clone_module_tree, compiles_in_this_thread

    started = time.perf_counter()
    preset = plan.preset
    if not preset.denoiser_config:
        raise InvalidRequest(
            f"preset {preset.name} has no denoiser_config in presets/models.toml; --random-weights needs the "
            "architecture (presets with one: "
            + ", ".join(p for p, v in _presets_with_config().items() if v) + ")"
        )
    spec = devices.resolve_device(plan.device)
    env = devices.apply_environment(spec, plan.cache_dir)  # before diffusers' model modules load (see above)
    cfg = {**preset.denoiser_config, **(plan.config_override or {})}
    cls = denoiser_class(preset.pipeline)
    text_len = plan.text_len or DEFAULT_TEXT_LEN.get(preset.pipeline, 77)
    batch = 2 if preset.cfg and preset.guidance > 1.0 else 1  # classifier-free guidance doubles the batch
    notes: list[str] = []
    cache_folder, cache_files = _inductor_cache_state(spec, plan.cache_dir)
    _install_compile_counter()
    recipes.raise_recompile_limit(len(plan.modes) * len(plan.sizes) * len(plan.precisions) * 2)
    notes += recipes.apply_inductor_flags(plan.options, spec)

    configs = [(p, m, s) for p in plan.precisions for s in plan.sizes for m in plan.modes]
    total = len(plan.precisions) + len(configs) * (1 + plan.runs * plan.steps) + (1 if plan.matmul_roofline else 0)
    bar = _progress(total, plan.progress, f"bench {preset.name} denoiser@{spec.name}")
    results: list[dict] = []
    extras: dict = {"environment": env, "batch": batch, "text_len": text_len, "config": cfg}

    def checkpoint() -> None:
        if plan.out:  # partial results survive a timeout (the GPU run has a hard limit)
            _apply_speedups(results)
            write_outputs(_assemble(plan, "denoiser", results, extras, notes, partial=True), plan.out, chart=False)

    # FLOPs per step, per size: analytic (Flux) and FlopCounterMode on meta (any denoiser).
    flops: dict[str, dict] = {}
    for size in plan.sizes:
        counted = count_flops_meta(cls, cfg, preset.pipeline, size, text_len, batch, preset.guidance)
        analytic = (flux_step_flops(cfg, size.width, size.height, text_len, batch)
                    if preset.pipeline == "FluxPipeline" else None)
        flops[str(size)] = {"analytic": analytic, "counted": counted, "used": analytic or counted}
    extras["flops_per_step"] = flops

    # The roofline first (seconds), so a run cut short by a time limit still has it. Each precision is
    # compared with the matmul rate in its own dtype on this machine.
    if plan.matmul_roofline:
        extras["matmul"] = {}
        for precision in plan.precisions:
            bar.set_postfix_str(f"matmul roofline {precision}")
            extras["matmul"][precision] = measure_matmul_rate(spec, devices.plan_precision(spec, precision).dtype)
        bar.update()

    budget_hit = False
    for precision in plan.precisions:
        plan_p = devices.plan_precision(spec, precision)
        devices.apply_precision(plan_p)
        dtype = plan_p.dtype
        bar.set_postfix_str(f"build {cls.__name__} {precision}")
        with torch.device("meta"):
            n_params = sum(p.numel() for p in cls.from_config(cfg).parameters())
        need = n_params * torch.empty((), dtype=dtype).element_size()
        avail = _available_memory(spec)
        if avail is not None and need * 1.3 > avail and not plan.force:
            raise UnsupportedCombination(
                f"{cls.__name__} with this config has {n_params / 1e9:.2f}B parameters ({need / 2**30:.1f} GiB in "
                f"{precision}); {spec.name} has {avail / 2**30:.1f} GiB available. Use a smaller "
                "--denoiser-config-override, another device, or --force"
            )
        start = time.perf_counter()
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built directly in the benchmark dtype on the device: no fp32 copy
        try:
            with torch.device(spec.torch_device):
                model = cls.from_config(cfg)
        finally:
            torch.set_default_dtype(old_dtype)
        model.eval().requires_grad_(False)
        if preset.repeated_blocks:
            model._repeated_blocks = list(preset.repeated_blocks)
        if plan.options.fuse_qkv:
            notes.append(recipes.step_fuse_qkv(types.SimpleNamespace(denoiser=model), "denoiser"))
        spec.synchronize()
        build_s = time.perf_counter() - start
        extras.setdefault("parameters", n_params)
        bar.update()

        for size in plan.sizes:
            inputs = denoiser_inputs(preset.pipeline, cfg, size, text_len, batch, spec.torch_device, dtype,
                                     preset.guidance)
            for mode in plan.modes:
                r = _empty_result("denoiser", plan, precision, mode, size)
                r.update(load_s=build_s, batch=batch, text_len=text_len, parameters=n_params,
                         flops_per_step=flops[str(size)]["used"])
                results.append(r)
                if plan.time_budget_s and time.perf_counter() - started > plan.time_budget_s:
                    r["error"] = f"skipped: time budget of {plan.time_budget_s:.0f}s spent"
                    budget_hit = True
                    bar.update(1 + plan.runs * plan.steps)
                    checkpoint()
                    continue
                bar.set_postfix_str(f"{precision} {mode} {size}: compile + warm-up")
                try:
                    fn = _denoiser_variant(model, mode, plan.options, spec, clone_module_tree)
                    _measure_denoiser(fn, inputs, mode, plan, spec, r, bar, compiles_in_this_thread)
                    rate = (extras.get("matmul") or {}).get(precision, {}).get("tflops")
                    if r.get("tflops") is not None and rate:
                        r["matmul_fraction"] = r["tflops"] / rate
                except Exception as exc:
                    log.warning("%s %s %s failed: %s", precision, mode, size, exc)
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    r["error"] = f"{type(exc).__name__}: {first}"[:500]
                checkpoint()
        del model
        if spec.name == "cuda":
            torch.cuda.empty_cache()

    bar.close()
    _apply_speedups(results)
    notes += [
        f"denoiser only: {cls.__name__} from the preset's denoiser_config with random weights, batch {batch}, "
        f"{text_len} text tokens; one step = one synchronised forward; image ms = {plan.steps} steps",
        f"compile s = first forward in this process (compiles); inductor cache at {cache_folder} "
        f"({cache_files} files at start); warm-up s = the next {plan.warmup_calls} forward(s)",
        "modes are measured one after another (each complete before the next), so a time-limited run keeps "
        "finished modes",
        "TFLOP/s = FLOPs per step / median step time; FLOPs: "
        + ("analytic (flux_step_flops), cross-checked with FlopCounterMode on meta"
           if preset.pipeline == "FluxPipeline" else "FlopCounterMode on the meta device"),
        *[f"reference: {p}" for p in REFERENCE_POINTS],
    ]
    if budget_hit:
        notes.append(f"time budget {plan.time_budget_s:.0f}s was spent: later configurations were skipped")
    return {"kind": "denoiser", "results": results, "extras": extras, "notes": notes}


def _presets_with_config() -> dict[str, bool]:
    from engine.presets import load_presets

    return {name: bool(p.denoiser_config) for name, p in load_presets().items()}


def _denoiser_variant(model, mode: str, options, spec, clone_module_tree):
    import torch

    from engine import recipes

    kwargs, _ = recipes.compile_kwargs(options, spec)
    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model, **kwargs)
    if mode == "max-autotune":
        return torch.compile(model, **{**kwargs, "mode": "max-autotune"})
    if mode == "regional":
        clone = clone_module_tree(model)
        clone.compile_repeated_blocks(**kwargs)
        return clone
    from engine.errors import UnsupportedCombination

    raise UnsupportedCombination(f"mode {mode!r} has no denoiser-only variant")


def _measure_denoiser(fn, inputs: dict, mode: str, plan: BenchPlan, spec, r: dict, bar, compiles) -> None:
    import torch

    cudagraphs = mode == "max-autotune" and spec.name == "cuda"

    def step() -> float:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        start = time.perf_counter()
        fn(**inputs)
        spec.synchronize()
        return (time.perf_counter() - start) * 1000

    with torch.no_grad():  # as the pipelines run their denoiser
        spec.reset_peak_memory()
        r["compile_s"] = step() / 1000 if mode != "eager" else None
        warm = [step() for _ in range(plan.warmup_calls + (1 if mode == "eager" else 0))]
        r["warmup_s"] = sum(warm) / 1000
        bar.update()
        step_ms: list[float] = []
        image_ms: list[float] = []
        for i in range(plan.runs):
            before = compiles()
            spec.reset_peak_memory()
            times = []
            for _ in range(plan.steps):
                times.append(step())
                bar.update()
            r["recompiles"] += compiles() - before
            peak = spec.peak_memory_bytes()
            if peak is not None:
                r["peak_memory_bytes"] = max(peak, r["peak_memory_bytes"] or 0)
            if i == 0:
                r["first_request_ms"] = sum(times)
            step_ms += times
            image_ms.append(sum(times))
    _finish(r, step_ms, image_ms)
    if r.get("flops_per_step") and r["step_ms_median"]:
        r["tflops"] = r["flops_per_step"] / (r["step_ms_median"] / 1000) / 1e12


# ================================================================================================
# Report assembly, outputs, chart
# ================================================================================================


def _assemble(plan: BenchPlan, kind: str, results: list[dict], extras: dict, notes: list[str],
              partial: bool = False, **more) -> dict:
    ratios = compute_ratios(results, extras)
    targets = evaluate_targets(ratios, kind)
    missed = [t for t in targets if t["status"] == "MISSED"]
    report = {
        "kind": kind,
        "partial": partial,
        "command": plan.command,
        "machine": machine_info(plan.device),
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


# ================================================================================================
# Command line
# ================================================================================================


def _split(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def _load_override(text: str | None) -> dict | None:
    if not text:
        return None
    from engine.errors import InvalidRequest

    raw = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"--denoiser-config-override is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("--denoiser-config-override must be a JSON object")
    return value


def plan_from_args(args) -> BenchPlan:
    from engine import devices, settings
    from engine.errors import InvalidRequest
    from engine.flags import engine_flags_argv, options_from_args
    from engine.presets import get_preset, preset_for_model, route_size
    from engine.protocol import Size

    cache_dir = Path(args.cache_dir) if args.cache_dir else settings.cache_dir()
    roots = [*settings.model_roots(), *[Path(r).resolve() for r in args.model_root]]
    model_args: list[str] = []
    if args.model:
        model_path = Path(args.model).expanduser()
        if model_path.exists():
            roots.append(model_path.resolve().parent)
        preset = preset_for_model(args.model, roots, buckets=args.buckets)
        model_args = ["--model", args.model] + (["--buckets", args.buckets] if args.buckets else [])
        for root in args.model_root:
            model_args += ["--model-root", str(root)]
    else:
        preset = get_preset(args.preset)
    modes = _split(args.modes)
    for m in modes:
        if m not in BENCH_MODES:
            raise InvalidRequest(f"unknown mode {m!r}: choose from {', '.join(BENCH_MODES)}")
    precisions = _split(args.precisions)
    if not modes or not precisions:
        raise InvalidRequest("--modes and --precisions need at least one value each")
    spec = devices.resolve_device(args.device)
    for p in precisions:
        devices.plan_precision(spec, p)  # refuses what the device cannot run, with the reason
    sizes = tuple(Size.parse(s) for s in _split(args.sizes)) if args.sizes else preset.buckets[:1]
    for size in sizes:
        if args.random_weights:
            if size.width % preset.alignment or size.height % preset.alignment:
                raise InvalidRequest(f"size {size} is not divisible by {preset.alignment} ({preset.name})")
        else:
            route_size(preset, size.width, size.height, snap=False)  # must be one of the buckets
    steps = args.steps or preset.steps
    if steps < 1 or args.runs < 1:
        raise InvalidRequest("--steps and --runs must be at least 1")
    overhead = args.overhead_runs if args.overhead_runs is not None else 2 * args.runs
    return BenchPlan(
        preset=preset, device=spec.name, modes=modes, precisions=precisions, sizes=sizes, steps=steps,
        runs=args.runs, options=options_from_args(args, warm_sizes=(), warm_modes=()), cache_dir=cache_dir,
        allowed_roots=tuple(str(r) for r in roots), prompt=args.prompt, overhead_pairs=overhead,
        cache_probe=args.cache_probe, probe_timeout_s=args.probe_timeout, progress=not args.no_progress,
        model_args=tuple(model_args), random_weights=bool(args.random_weights), config_override=_load_override(args.denoiser_config_override),
        text_len=args.text_len, matmul_roofline=args.matmul_roofline, warmup_calls=args.warmup_calls,
        time_budget_s=args.time_budget, out=Path(args.out) if args.out else None, force=args.force,
        threads=args.threads, engine_args=engine_flags_argv(args),
        command="python -m engine " + " ".join(a for a in sys.argv[1:] if a) if sys.argv else "",
    )


def run_bench(plan: BenchPlan) -> dict:
    """Run the benchmark a plan describes and return the report (also what the UI could call)."""
    measured = run_denoiser_bench(plan) if plan.random_weights else run_pipeline_bench(plan)
    kind = measured.pop("kind")
    results, extras, notes = measured.pop("results"), measured.pop("extras"), measured.pop("notes")
    return _assemble(plan, kind, results, extras, notes, **measured)


def cmd_bench(args) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args._compile_probe:
        return cmd_compile_probe(args)
    plan = plan_from_args(args)
    report = run_bench(plan)
    paths = write_outputs(report, plan.out, chart=not args.no_chart) if plan.out else {}
    print(markdown_report(report))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    if args.strict and report["missed"]:
        return 1
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the CLI's subparsers (engine/cli.py calls this)."""
    from engine.flags import add_engine_arguments

    b = subparsers.add_parser(
        "bench",
        help="measure every mode x precision x size side by side; print ratios against targets",
        description=__doc__.split("\n\n")[0],
    )
    b.add_argument("--preset", default="tiny-flux")
    b.add_argument("--device", default="auto")
    b.add_argument("--modes", default="eager,compile,regional",
                   help=f"comma-separated, from {', '.join(BENCH_MODES)} (max-autotune = full compile "
                        "with mode='max-autotune')")
    b.add_argument("--precisions", default="fp32", help="comma-separated: fp32,tf32,bf16,fp16")
    b.add_argument("--sizes", default=None, help="comma-separated WxH buckets (default: the preset's first)")
    b.add_argument("--steps", type=int, default=None, help="denoising steps per image (default: the preset's)")
    b.add_argument("--runs", type=int, default=10, help="timed requests (images) per configuration")
    b.add_argument("--out", default="artifacts/bench", help="folder for bench.json, bench.md, bench.png")
    b.add_argument("--prompt", default="a red fox in the snow")
    b.add_argument("--overhead-runs", type=int, default=None,
                   help="interleaved engine/bare pairs for the engine-overhead ratio (default: 2 x --runs; 0 = skip)")
    b.add_argument("--cache-probe", default="compile", choices=("compile", "regional", "off"),
                   help="mode whose cold vs cached compile is measured in fresh processes (off = skip; the "
                        "cold compile of a full tiny-flux bucket takes about a minute on 2 CPU cores)")
    b.add_argument("--probe-timeout", type=float, default=900.0, help="seconds per probe process")
    b.add_argument("--random-weights", action="store_true",
                   help="benchmark the denoiser alone, built from the preset's denoiser_config with random "
                        "weights (no download; real shapes)")
    b.add_argument("--denoiser-config-override", default=None,
                   help="JSON object (or @file) merged into denoiser_config, e.g. a tiny config for tests")
    b.add_argument("--text-len", type=int, default=None, help="text tokens fed to the denoiser (random weights)")
    b.add_argument("--matmul-roofline", action="store_true",
                   help="measure the dense matmul rate in the first precision and report each step's share")
    b.add_argument("--warmup-calls", type=int, default=2,
                   help="denoiser forwards after the compiling one, before timing (random weights)")
    b.add_argument("--time-budget", type=float, default=None,
                   help="seconds: skip configurations not started by then (random weights)")
    b.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core); on a shared machine 1 avoids "
                        "OpenMP spin-wait stalls that inflate latency many times")
    b.add_argument("--force", action="store_true", help="build the denoiser even if it looks too big for memory")
    b.add_argument("--no-chart", action="store_true")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--strict", action="store_true", help="exit 1 when a target is MISSED")
    b.add_argument("--_compile-probe", action="store_true", help=argparse.SUPPRESS)
    add_engine_arguments(b)
    b.set_defaults(func=cmd_bench)
    return b
