"""The levers bench: step caches x precisions (quantized ones included) x modes, side by side in one run.

`python -m bench bench --caches none,first-block:0.2,taylorseer:3:2 --precisions fp32,int8wo,int8dq
--modes eager,regional` measures one row per (precision, mode, cache): seconds per image (median of
round-robin requests, the starting configuration rotating each round), the steps served from the cache,
speedups (medians of the paired ratios of each round, bench/paired.py, with their spread) against
eager fp32 without a cache, against the same precision and mode without a cache, and
(compiled modes) against eager with the same precision and cache; drift (PSNR, largest pixel difference)
against eager fp32 without a cache for the same prompt and seed; fidelity over several prompts for a
model with a checker. A combination the engine refuses is a row with the reason, never left out.

One engine per precision (weights load once each); every cache is a variant of its modes on those
weights, exactly as the app serves it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from bench import quality
from bench.measure import build_runner, error_text, progress
from bench.modes import MODE_TABLE
from bench.paired import PairedTiming
from bench.report import fmt, machine_info
from bench.stats import median, ratio
from engine.errors import ShowcaseError
from engine.pipeline import stepcache
from engine.protocol import BucketKey, BucketState, GenerateRequest, OnCold, StepCache

log = logging.getLogger(__name__)

REFERENCE = ("fp32", "eager", "none")  # (precision, mode, cache): speed and drift baseline
CACHE_SPEEDUP_TARGET = 1.4  # at least one cache, eager fp32, per image against no cache ...
FIDELITY_POINTS = 0.03  # ... with fidelity within 3 points of no cache
TARGET_MIN_STEPS = 20  # the cache target applies to schedules this long (short ones are reported as is)


def _configs(plan) -> list[tuple[str, str, str]]:
    return [(p, m, c) for p in plan.precisions for m in plan.modes for c in plan.caches]


def run_levers_bench(plan) -> dict:
    from bench.pipeline import _prepare_process

    return _LeversRun(plan, _prepare_process(plan)).run()


class _LeversRun:
    """One levers bench: load one runner per precision, warm every configuration (a refusal is a row with
    its reason), time them round-robin, measure their quality, report."""

    def __init__(self, plan, spec):
        self.plan, self.spec, self.size = plan, spec, plan.sizes[0]
        self.configs = _configs(plan)
        total = len(plan.precisions) + len(self.configs) * (2 + plan.runs + plan.quality_samples)
        self.bar = progress(total, plan.progress, f"levers {plan.preset.name}@{spec.name}")
        self.runners: dict[tuple, tuple] = {}  # (precision, options key) -> (runner or its load error, load s)
        self.rows: dict[tuple, dict] = {}

    def run(self) -> dict:
        self.load()
        live = self.warm()
        self.time_rounds(live)
        self.measure_quality(live)
        self.bar.set_postfix_str("done")
        self.bar.close()
        return self.report()

    def load(self) -> None:
        plan = self.plan
        for precision in plan.precisions:
            for mode in dict.fromkeys(m for m in plan.modes):
                key = (precision, MODE_TABLE[mode].options_key)
                if key in self.runners:
                    continue
                self.bar.set_postfix_str(f"load {precision}")
                runner = build_runner(plan, self.spec, precision, MODE_TABLE[mode])
                start = time.perf_counter()
                try:
                    runner.load()
                except ShowcaseError as exc:
                    runner = exc
                self.runners[key] = (runner, time.perf_counter() - start)
            self.bar.update()

    def engine(self, config):
        precision, mode, _ = config
        return self.runners[(precision, MODE_TABLE[mode].options_key)][0], MODE_TABLE[mode].engine

    def request(self, config, seed, prompt=None, steps=None):
        _, mode, cache = config
        plan, size = self.plan, self.size
        return GenerateRequest.checked(prompt=prompt or plan.prompt, width=size.width, height=size.height,
                               steps=steps or plan.steps, guidance=plan.preset.guidance, seed=seed,
                               mode=MODE_TABLE[mode].engine, on_cold=OnCold.EAGER, step_cache=cache)

    def warm(self) -> list[tuple]:
        """Refusals, then warm-up: compiled buckets compile, every cache variant is built (magcache
        calibrates). Returns the configurations that run."""
        for config in self.configs:
            precision, mode, cache = config
            row = self.rows[config] = {"precision": precision, "mode": mode, "cache": cache, "size": str(self.size),
                                       "error": None, "image_ms": [], "cached_steps": None, "recompiles": 0}
            runner, engine_mode = self.engine(config)
            self.bar.set_postfix_str(f"warm {precision} {mode} {cache}")
            try:
                if isinstance(runner, Exception):
                    raise runner
                runner.check_mode(engine_mode)
                stepcache.check_step_cache(cache, self.plan.preset, self.spec, engine_mode)
                if engine_mode.compiled:
                    info = runner.warm_bucket(BucketKey(engine_mode, self.size))
                    if info.state is not BucketState.WARM:
                        raise RuntimeError(info.error or f"bucket is {info.state.value}")
                    row["compile_s"] = info.compile_s
                runner.generate(self.request(config, seed=0))
            except Exception as exc:  # a refused or failing configuration is a row with its reason
                row["error"] = error_text(exc)
            self.bar.update(2)
        return [c for c in self.configs if not self.rows[c]["error"]]

    def time_rounds(self, live: list[tuple]) -> None:
        """plan.runs rounds over the live configurations, the starting one rotating each round."""
        for i in range(self.plan.runs):
            order = live[i % len(live):] + live[: i % len(live)] if live else []
            for config in order:
                runner, _ = self.engine(config)
                self.bar.set_postfix_str(f"run {i + 1}/{self.plan.runs} {' '.join(config)}")
                result = runner.generate(self.request(config, seed=100 + i))
                row = self.rows[config]
                row["image_ms"].append(result.timings.total_ms)
                row["recompiles"] += result.recompiles
                row["cached_steps"] = len(result.cached_steps)
                row["eager_fallback"] = row.get("eager_fallback", False) or result.eager_fallback
                self.bar.update()

    def measure_quality(self, live: list[tuple]) -> None:
        """Drift against the reference and fidelity (a model with a checker), over the quality samples."""
        plan = self.plan
        if plan.quality_samples <= 0 or not live:
            return
        prompts = quality.sample_prompts(plan.preset, plan.quality_samples, seed=quality.PROMPT_SEED,
                                         fallback=plan.prompt)
        images = {}
        for config in live:
            runner, _ = self.engine(config)
            self.bar.set_postfix_str(f"quality {' '.join(config)}")
            images[config] = []
            for seed, prompt in zip(quality.image_seeds(len(prompts)), prompts, strict=True):
                images[config].append(runner.generate(self.request(config, seed=seed, prompt=prompt)).image_png)
                self.bar.update()
        _score(plan, [self.rows[c] for c in live], [images[c] for c in live], images.get(REFERENCE), prompts)

    def report(self) -> dict:
        plan = self.plan
        results = [_finish(self.rows[c], self.rows, plan) for c in self.configs]
        targets = _targets(plan, results)
        return {
            "kind": "levers",
            "preset": plan.preset.name,
            "device": self.spec.name,
            "machine": machine_info(self.spec),
            "steps": plan.steps,
            "size": str(self.size),
            "runs": plan.runs,
            "quality_samples": plan.quality_samples,
            "command": plan.command,
            "results": results,
            "targets": targets,
            "missed": [t["key"] for t in targets if t["status"] == "MISSED"],
        }


def _score(plan, rows: list[dict], images: list[list], reference: list | None, prompts: list[str]) -> None:
    """Each row's drift against the reference's images and its fidelity (a model with a checker)."""
    checker = quality.fidelity_checker(plan.preset)
    for row, mine in zip(rows, images, strict=True):
        if reference is not None:
            drift = quality.worst_drift([quality.image_drift(a, b) for a, b in zip(mine, reference, strict=True)])
            row["drift_psnr_db"], row["drift_max_diff"] = drift["psnr_db"], drift["max_diff"]
        if checker is not None:
            scored = [checker(img, p) for img, p in zip(mine, prompts, strict=True)]
            scored = [s for s in scored if s is not None]
            row["fidelity"] = sum(scored) / len(scored) if scored else None


def _finish(row: dict, rows: dict, plan) -> dict:
    out = {k: v for k, v in row.items() if k != "image_ms"}
    out["image_ms_median"] = median(row["image_ms"]) if row["image_ms"] else None
    out["image_ms"] = [round(x, 2) for x in row["image_ms"]]
    if out["cached_steps"] is not None:
        out["computed_steps"] = plan.steps - out["cached_steps"]

    def ms(precision, mode, cache):
        other = rows.get((precision, mode, cache))
        return median(other["image_ms"]) if other and other["image_ms"] else None

    p, m, c = row["precision"], row["mode"], row["cache"]
    none = str(StepCache())
    mine = out["image_ms_median"]
    figure = paired_figure(row, rows.get(REFERENCE))
    out["speedup_figure"] = figure
    # One speedup per row: the paired figure where both were timed in the same rounds, else the medians' ratio.
    out["speedup_vs_reference"] = figure["speedup"] if figure else ratio(ms(*REFERENCE), mine)
    base = paired_figure(row, rows.get((p, m, none))) if c != none else None
    out["cache_speedup"] = (base["speedup"] if base else ratio(ms(p, m, none), mine)) if c != none else None
    out["speedup_vs_eager_same_cache"] = ratio(ms(p, "eager", c), mine) if m != "eager" else None
    return out


def paired_figure(row: dict, base: dict | None) -> dict | None:
    """`row`'s speedup over `base` as the shared paired plan reads it: image i of each was timed in round i
    (round-robin, the start rotating), so each round gives one ratio. None without pairs."""
    if not base or base is row or base.get("error") or row.get("error") or len(row["image_ms"]) != len(base["image_ms"]):
        return None
    timing = PairedTiming(["base", "row"], reference="base")
    for i, (mine, theirs) in enumerate(zip(row["image_ms"], base["image_ms"], strict=True)):
        timing.record(i, "row", mine)
        timing.record(i, "base", theirs)
    figure = timing.figure("row")
    return figure.as_dict() if figure.speedup is not None else None


def _targets(plan, results: list[dict]) -> list[dict]:
    targets = []
    by = {(r["precision"], r["mode"], r["cache"]): r for r in results}
    base = by.get(REFERENCE)
    cached = [r for r in results if r["precision"] == "fp32" and r["mode"] == "eager" and r["cache"] != "none"
              and not r["error"]]
    applies = plan.steps >= TARGET_MIN_STEPS and base is not None and not base["error"] and cached
    best, status = None, "n/a"
    if applies:
        def within(r):
            if base.get("fidelity") is None or r.get("fidelity") is None:
                return True  # no checker: speed only
            return r["fidelity"] >= base["fidelity"] - FIDELITY_POINTS - 1e-9

        eligible = [r for r in cached if within(r) and r["cache_speedup"] is not None]
        best = max(eligible, key=lambda r: r["cache_speedup"], default=None)
        status = "met" if best and best["cache_speedup"] >= CACHE_SPEEDUP_TARGET else "MISSED"
    targets.append({
        "key": "step_cache_speedup",
        "what": f"best step cache, eager fp32, {TARGET_MIN_STEPS}+ steps: per-image speedup vs no cache with "
                f"fidelity within {FIDELITY_POINTS * 100:.0f} points",
        "value": best["cache_speedup"] if best else None, "by": best["cache"] if best else None,
        "target": f">= {CACHE_SPEEDUP_TARGET}", "status": status,
        "note": "" if applies else f"applies at {TARGET_MIN_STEPS}+ steps with eager fp32 none and a cache in the run",
    })
    offered = [r for r in results if not (r["error"] or "").startswith("UnsupportedCombination")]
    failed = [f"{r['precision']} {r['mode']} {r['cache']}: {r['error']}" for r in offered if r["error"]]
    targets.append({"key": "offered_combinations_run", "what": "every combination the engine offers produces images",
                    "value": f"{len(offered) - len(failed)}/{len(offered)}", "target": "all",
                    "status": "MISSED" if failed else "met", "note": "; ".join(failed)})
    quantized = [r for r in offered if r["precision"] in ("int8wo", "int8dq")]
    if quantized:
        bad = [r for r in quantized if r["error"] or ("fidelity" not in r and plan.preset.fidelity)]
        targets.append({"key": "quantized_run", "what": "int8wo / int8dq run, fidelity reported",
                        "value": f"{len(quantized) - len(bad)}/{len(quantized)}", "target": "all",
                        "status": "MISSED" if bad else "met", "note": ""})
    return targets


def markdown(report: dict) -> str:
    lines = [f"## Levers: {report['preset']} on {report['device']}, {report['size']}, {report['steps']} steps, "
             f"{report['runs']} runs per row, {report['quality_samples']} quality samples", "",
             "| precision | mode | cache | s/image | cached/computed | × eager fp32 | × no cache | × eager same cache "
             "| drift PSNR / max | fidelity | recompiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if r["error"]:
            refused = r["error"].startswith("UnsupportedCombination")
            why = r["error"].split(": ", 1)[-1]
            why = why.split(f"mode {r['mode']}: ", 1)[-1].split(". `python -m engine", 1)[0]
            lines.append(f"| {r['precision']} | {r['mode']} | {r['cache']} | {'refused' if refused else 'FAILED'}: "
                         f"{why[:140]} | | | | | | | |")
            continue
        sec = r["image_ms_median"] / 1000 if r["image_ms_median"] is not None else None
        steps = f"{r['cached_steps']}/{r.get('computed_steps')}" if r["cached_steps"] is not None else "–"
        drift = quality.fmt_drift(r.get("drift_psnr_db"), r.get("drift_max_diff")) \
            if r.get("drift_max_diff") is not None else "–"
        fid = f"{r['fidelity'] * 100:.0f}%" if r.get("fidelity") is not None else "–"
        lines.append(f"| {r['precision']} | {r['mode']} | {r['cache']} | {fmt(sec, 3)} | {steps} "
                     f"| {(r.get('speedup_figure') or {}).get('text') or fmt(r['speedup_vs_reference'])} "
                     f"| {fmt(r['cache_speedup'])} "
                     f"| {fmt(r['speedup_vs_eager_same_cache'])} | {drift} | {fid} | {r['recompiles']} |")
    lines += ["", "| target | value | target | status | note |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        value = fmt(t["value"]) if isinstance(t["value"], float) else (t["value"] or "–")
        by = f" ({t['by']})" if t.get("by") else ""
        lines.append(f"| {t['what']} | {value}{by} | {t['target']} | {t['status']} | {t['note']} |")
    return "\n".join(lines)


def write(report: dict, out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "levers.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "levers.md").write_text(markdown(report) + "\n")
    return {"json": str(out / "levers.json"), "markdown": str(out / "levers.md")}
