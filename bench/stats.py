"""Statistics, the speedup table, ratios and targets: the pure part of the benchmark.

Everything here works on plain result dicts (the `results` of `bench.json`, or
`GenerateResult.as_dict()` objects), so the UI's Compare tab turns stored results into the same
table the CLI prints. It imports no torch and nothing heavy: a test checks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.modes import BASELINE_MODE, COMPILED_MODES
from engine.metrics import median, p90
from engine.protocol import Mode

# Fields every configuration's result carries (tests check them; the UI may rely on them).
RESULT_FIELDS = (
    "kind", "preset", "device", "precision", "mode", "size", "steps", "runs", "attention_backend", "origin",
    "load_s", "compile_s", "warmup_s", "first_request_ms",
    "step_ms_median", "step_ms_p90", "image_ms_median", "image_ms_p90", "images_per_s",
    "speedup_vs_eager", "speedup_image_vs_eager", "warm_hit_ratio",
    "recompiles", "peak_memory_bytes", "error",
)
# bench/quality.py: what each configuration draws against eager fp32 (absent when not measured)
QUALITY_FIELDS = ("drift_psnr_db", "drift_max_diff", "fidelity", "fidelity_held_out", "quality_samples")
RESULT_FIELDS += QUALITY_FIELDS


def empty_result(kind: str, plan, precision: str, mode: str, size) -> dict:
    """A configuration's result before it is measured: every RESULT_FIELD, None where not known yet."""
    r = {f: None for f in RESULT_FIELDS}
    r.update(kind=kind, preset=plan.preset.name, device=plan.device, precision=precision, mode=mode,
             size=str(size), steps=plan.steps, runs=plan.runs, recompiles=0, notices=[], samples={},
             attention_backend=plan.options.attention_backend)
    return r


def finish_result(r: dict, step_ms: list[float], image_ms: list[float]) -> dict:
    """Fill a result's statistics from its samples (kept, rounded, for later analysis)."""
    r["samples"] = {"step_ms": [round(x, 4) for x in step_ms], "image_ms": [round(x, 4) for x in image_ms]}
    r["step_ms_median"] = median(step_ms)
    r["step_ms_p90"] = p90(step_ms)
    r["image_ms_median"] = median(image_ms)
    r["image_ms_p90"] = p90(image_ms)
    r["images_per_s"] = ratio(1000.0, r["image_ms_median"])
    r["warm_hit_ratio"] = ratio(r.get("first_request_ms"), r["image_ms_median"])
    return r


def apply_speedups(results: list[dict]) -> None:
    """Copy the speedup columns of the table into the results themselves (bench.json has both)."""
    for r, row in zip(results, speedup_table(results), strict=True):
        for key in ("speedup_vs_eager", "speedup_image_vs_eager", "speedup_vs_fp32_eager"):
            r[key] = row[key]


def ratio(a, b) -> float | None:
    """a / b, None when either side is missing (or b is 0)."""
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
            "attention_backend": r.get("attention_backend") or "native",
            "origin": r.get("origin"),
            "steps": r.get("steps"),
            "load_s": r.get("load_s"),
            "compile_s": r.get("compile_s"),
            "warmup_s": r.get("warmup_s"),
            "first_request_ms": r.get("first_request_ms"),
            "step_ms_median": step,
            "step_ms_p90": r.get("step_ms_p90"),
            "image_ms_median": image,
            "images_per_s": r.get("images_per_s") if r.get("images_per_s") is not None else ratio(1000.0, image),
            "speedup_vs_eager": ratio(b.get("step_ms_median"), step) if b else None,
            "speedup_image_vs_eager": ratio(b.get("image_ms_median"), image) if b else None,
            "speedup_vs_fp32_eager": ratio(f.get("step_ms_median"), step) if f else None,
            "warm_hit_ratio": r.get("warm_hit_ratio")
            if r.get("warm_hit_ratio") is not None
            else ratio(r.get("first_request_ms"), image),
            "recompiles": r.get("recompiles"),
            "peak_memory_bytes": r.get("peak_memory_bytes"),
            "break_even_images": _break_even(r, b),
            "error": r.get("error"),
            **{k: r.get(k) for k in QUALITY_FIELDS if k in r},
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
    Target("drift_compile", "drift of fp32 compile vs fp32 eager, worst sample: PSNR dB", ">=", 40.0, ("pipeline",)),
    Target("fidelity_first_bucket", "fidelity, eager fp32, the preset's first bucket", ">=", 0.95, ("pipeline",)),
    Target("fidelity_other_buckets", "fidelity, eager fp32, every other bucket (worst)", ">=", 0.85, ("pipeline",)),
    Target("fidelity_held_out", "fidelity on held-out combinations, eager fp32 (worst bucket)", ">=", 0.80,
           ("pipeline",)),
    Target("fidelity_gap", "fidelity lost vs eager fp32 by any other configuration (points, worst)", "<=", 0.02,
           ("pipeline",)),
    Target("image_ms_reference", "one image, eager fp32, the first bucket: median ms (model with a checker)", "<=",
           100.0, ("pipeline",)),
    Target("aot_step", "aot / full compile: steady step time", "<=", 1.1, ("pipeline", "denoiser")),
    Target("aot_cold_start_empty", "cold start, process start -> every bucket warm: aot with packages / compile "
           "with an empty inductor cache", "<=", 0.1, ("pipeline",)),
    Target("aot_cold_start_filled", "cold start, process start -> every bucket warm: aot with packages / compile "
           "with a filled inductor cache", "<=", 0.5, ("pipeline",)),
    Target("aot_warmup_filled", "warm-up only, engine loaded -> every bucket warm: aot with packages / compile "
           "with a filled inductor cache", "<=", 0.5, ("pipeline",)),
    Target("aot_first_request", "aot: first request at a bucket loaded from a package / its steady per-image "
           "median (median over buckets, fresh process)", "<=", 1.25, ("pipeline",)),
    Target("aot_memory", "aot: process memory with every bucket's package loaded / with one (weights shared)",
           "<=", 1.1, ("pipeline",)),
    Target("aot_recompiles", "aot: graphs compiled in the fresh process (loading, warm-up, timed runs; must be 0)",
           "<=", 0, ("pipeline",)),
    Target("inprocess_first_image", "in-process runtime / worker runtime: process start -> first image (eager)",
           "<=", 1.0, ("pipeline",)),
    Target("inprocess_steady", "in-process runtime / worker runtime: steady per-image median (eager)", "<=", 1.05,
           ("pipeline",)),
    Target("inprocess_aot_cold_start", "in-process runtime with aot packages: process start -> every bucket warm / "
           "compile with an empty inductor cache", "<=", 0.1, ("pipeline",)),
)


# Ratios the cold-start probe (bench/cold_start.py) measures in fresh processes.
COLD_START_KEYS = ("aot_cold_start_empty", "aot_cold_start_filled", "aot_warmup_filled", "aot_first_request",
                   "aot_memory", "aot_recompiles", "inprocess_first_image", "inprocess_steady",
                   "inprocess_aot_cold_start")


def _pair_ratios(results: list[dict], num_modes, den_mode: str, field: str, invert: bool = False) -> list[dict]:
    by = {(r.get("precision"), str(r.get("size")), r.get("mode")): r for r in results if not r.get("error")}
    out = []
    for (precision, size, mode), r in by.items():
        if mode not in num_modes or (precision, size, den_mode) not in by:
            continue
        num, den = r.get(field), by[(precision, size, den_mode)].get(field)
        value = ratio(den, num) if invert else ratio(num, den)
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


def _value(values: list[dict], pick=min, note: str = "") -> dict:
    """A target computed as the worst (pick) of per-configuration values."""
    if not values:
        return {"value": None, "n": 0, "values": [], "note": note}
    worst = pick(values, key=lambda v: v["value"])
    return {"value": worst["value"], "n": len(values), "values": values,
            "note": note or f"worst: {worst['precision']} {worst['mode']} {worst['size']}"}


def _quality_ratios(ok: list[dict]) -> dict[str, dict]:
    """Drift and fidelity targets from the quality columns (bench/quality.py)."""
    def entry(r, value):
        return {"precision": r["precision"], "size": str(r["size"]), "mode": r["mode"], "value": value}

    # Identical images (no PSNR) count as the best possible value.
    drift = [entry(r, r["drift_psnr_db"] if r["drift_psnr_db"] is not None else float("inf")) for r in ok
             if r.get("drift_max_diff") is not None and r["mode"] == Mode.COMPILE and r["precision"] == "fp32"]
    out = {"drift_compile": _value(drift)}
    refs = [r for r in ok if r["precision"] == "fp32" and r["mode"] == Mode.EAGER and r.get("fidelity") is not None]
    if not refs:  # no pixel checker for this model: the fidelity targets are n/a
        note = "the model has no pixel checker (a preset with fidelity = \"shapes\" has one)"
        out.update({k: _value([], note=note) for k in ("fidelity_first_bucket", "fidelity_other_buckets",
                                                         "fidelity_held_out", "fidelity_gap", "image_ms_reference")})
        return out
    first = refs[0]
    out["fidelity_first_bucket"] = _value([entry(first, first["fidelity"])])
    out["fidelity_other_buckets"] = _value([entry(r, r["fidelity"]) for r in refs[1:]])
    out["fidelity_held_out"] = _value([entry(r, r["fidelity_held_out"]) for r in refs
                                       if r.get("fidelity_held_out") is not None])
    by_size = {str(r["size"]): r["fidelity"] for r in refs}
    gaps = [entry(r, by_size[str(r["size"])] - r["fidelity"]) for r in ok
            if r.get("fidelity") is not None and str(r["size"]) in by_size and r not in refs]
    out["fidelity_gap"] = _value(gaps, pick=max)
    if first.get("image_ms_median") is not None:
        out["image_ms_reference"] = _value([entry(first, first["image_ms_median"])])
    return out


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
             "value": ratio(r.get("first_request_ms"), r.get("image_ms_median"))}
            for r in compiled
            if ratio(r.get("first_request_ms"), r.get("image_ms_median")) is not None
        ],
        "over compiled configurations" if compiled is not ok else "over all configurations",
    )
    regional, full, eager = (Mode.REGIONAL,), Mode.COMPILE, Mode.EAGER
    ratios["regional_compile_time"] = _summary(_pair_ratios(ok, regional, full, "compile_s"))
    ratios["regional_step"] = _summary(_pair_ratios(ok, regional, full, "step_ms_median"))
    ratios["compiled_vs_eager_step"] = _summary(_pair_ratios(ok, (full,), eager, "step_ms_median"))
    ratios["compile_speedup"] = _summary(_pair_ratios(ok, (full,), eager, "step_ms_median", invert=True))
    ratios["aot_step"] = _summary(_pair_ratios(ok, (Mode.AOT,), full, "step_ms_median"))
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

    ratios.update(_quality_ratios(ok))
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
    cold = extras.get("cold_start") or {}
    for key in COLD_START_KEYS:
        value = (cold.get("ratios") or {}).get(key)
        ratios[key] = {"value": value, "n": 1 if value is not None else 0, "values": [],
                       "note": (cold.get("notes") or {}).get(key, cold.get("error") or cold.get("skipped", ""))}
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
