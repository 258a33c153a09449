"""`python -m bench step-bench`: a short request that arrives during a long run at the same engine, with and
without step-level scheduling (engine/worker/stepped.py), in one run.

Two worker engines of one preset (eager), one after the other: `--step-scheduling` on, then off. Each serves
the long request (`--long-steps` at the largest bucket) alone and the short one (`--short-steps` at the same
bucket) alone, then the long one again with the short one sent `--arrive-after` seconds after it: the short
one's latency (sent to answered, as its client waits) and the long one's. Both mixed pictures are compared
with their pictures alone (max difference in 1/255). The stepped engine's between-step overhead (its
denoising time that is no step's, per step) is reported against its median step. Medians over `--rounds`
with their spreads (min..max), ratios side by side, and the targets each is held to.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine.config.flags import from_args


@dataclass(frozen=True)
class StepBenchOptions:
    """`step-bench`'s flags."""

    preset: str = flags.preset("tiny-shapes")
    device: str = flags.device("cpu")
    precision: str = flags.precision("fp32")
    size: str | None = flags.size(None, "WxH of both requests (default: the preset's largest bucket)")
    long_steps: int = flags.count(200, "steps of the long run")
    short_steps: int = flags.count(4, "steps of the short request")
    arrive_after: float = flags.seconds(0.3, "seconds after the long run is sent that the short one is")
    rounds: int = flags.count(3, "rounds of each measurement per engine")
    cache_dir: str | None = flags.cache_dir()
    out: str | None = flags.out(None, "folder for step.json and step.md")
    json: bool = flags.as_json("print the result as JSON")


def add_step_bench_parser(sub) -> None:
    flags.add_command(sub, "step-bench", StepBenchOptions, cmd_step_bench,
                      help="a short request during a long run: latency and pictures with and without step scheduling")


def _engine(opts: StepBenchOptions, stepped: bool):
    from engine import settings
    from engine.config.presets import get_preset
    from engine.protocol import EngineConfig, EngineKey, EngineOptions
    from engine.worker.client import ProcessClient

    key = EngineKey(opts.preset, opts.device, opts.precision)
    config = EngineConfig(key, get_preset(opts.preset), EngineOptions(warm_sizes=(), step_scheduling=stepped),
                          str(opts.cache_dir or settings.cache_dir()))
    engine = ProcessClient(config)
    engine.start()
    if not engine.wait_ready(timeout=600):
        raise RuntimeError(f"engine {key} did not start: {engine.describe_exit()}")
    return engine


def _requests(opts: StepBenchOptions, size, tag: str, seed: int):
    from engine.config.presets import get_preset
    from engine.protocol import GenerateRequest

    preset = get_preset(opts.preset)
    common = dict(width=size.width, height=size.height, guidance=preset.guidance, mode="eager")
    long = GenerateRequest.checked(prompt=preset.examples[0], steps=opts.long_steps, seed=seed, client="10.0.0.1",
                                   request_id=f"long-{tag}", **common)
    short = GenerateRequest.checked(prompt=preset.examples[1], steps=opts.short_steps, seed=seed + 1,
                                    client="10.0.0.2", request_id=f"short-{tag}", **common)
    return long, short


def _max_diff(a, b) -> int:
    import numpy as np

    pa, pb = (np.asarray(r.image().convert("RGB"), dtype=np.int16) for r in (a, b))
    return int(np.abs(pa - pb).max())


def _round(engine, opts: StepBenchOptions, size, k: int) -> dict:
    long, short = _requests(opts, size, f"alone-{k}", seed=k)
    started = time.perf_counter()
    long_alone = engine.generate(long, timeout=3600)
    long_alone_s = time.perf_counter() - started
    started = time.perf_counter()
    short_alone = engine.generate(short, timeout=600)
    short_alone_s = time.perf_counter() - started
    long_m, short_m = (r.replace(request_id=r.request_id.replace("alone", "mixed")) for r in (long, short))
    started = time.perf_counter()
    long_future = engine.submit(long_m)
    time.sleep(opts.arrive_after)
    sent = time.perf_counter()
    short_result = engine.submit(short_m).result(3600)
    short_mixed_s = time.perf_counter() - sent
    long_result = long_future.result(3600)
    long_mixed_s = time.perf_counter() - started
    steps_ms = sorted(long_alone.timings.step_ms)
    median_step = steps_ms[len(steps_ms) // 2] if steps_ms else 0.0
    between = (long_alone.timings.denoise_ms - sum(long_alone.timings.step_ms)) / max(1, len(steps_ms))
    return {
        "long_alone_s": long_alone_s, "short_alone_s": short_alone_s, "short_mixed_s": short_mixed_s,
        "long_mixed_s": long_mixed_s, "short_diff": _max_diff(short_result, short_alone),
        "long_diff": _max_diff(long_result, long_alone), "short_batches": list(short_result.step_batches),
        "long_pauses": len(long_result.pauses), "stepped": short_result.stepped,
        "median_step_ms": median_step, "between_steps_ms": between,
    }


def _summary(rounds: list[dict], field: str) -> dict:
    from engine.metrics import median

    values = [r[field] for r in rounds]
    return {"median": median(values), "min": min(values), "max": max(values)}


def run_step_bench(opts: StepBenchOptions) -> dict:
    from engine.config.presets import get_preset
    from engine.protocol import Size

    preset = get_preset(opts.preset)
    size = Size.parse(opts.size) if opts.size else max(preset.buckets, key=lambda s: s.pixels)
    report = {"preset": opts.preset, "device": opts.device, "precision": opts.precision, "size": str(size),
              "long_steps": opts.long_steps, "short_steps": opts.short_steps, "arrive_after_s": opts.arrive_after,
              "rounds": opts.rounds, "engines": {}}
    for stepped in (True, False):
        engine = _engine(opts, stepped)
        try:
            warm_long, warm_short = _requests(opts, size, "warm", seed=100)
            engine.generate(warm_short.replace(steps=2), timeout=600)  # first-call costs out of the figures
            rounds = [_round(engine, opts, size, k) for k in range(opts.rounds)]
        finally:
            engine.close()
        fields = ("long_alone_s", "short_alone_s", "short_mixed_s", "long_mixed_s", "median_step_ms",
                  "between_steps_ms", "short_diff", "long_diff")
        report["engines"]["stepped" if stepped else "whole"] = {
            "rounds": rounds, **{f: _summary(rounds, f) for f in fields}}
    on, off = report["engines"]["stepped"], report["engines"]["whole"]
    bound = max(4 * on["short_alone_s"]["median"], 0.2 * on["long_alone_s"]["median"])
    overhead = on["between_steps_ms"]["median"] / on["median_step_ms"]["median"] if on["median_step_ms"]["median"] else None
    report["ratios"] = {
        "short_mixed_whole_over_stepped": off["short_mixed_s"]["median"] / on["short_mixed_s"]["median"],
        "short_mixed_over_alone_stepped": on["short_mixed_s"]["median"] / on["short_alone_s"]["median"],
        "long_mixed_stepped_over_whole": on["long_mixed_s"]["median"] / off["long_mixed_s"]["median"],
        "long_alone_stepped_over_whole": on["long_alone_s"]["median"] / off["long_alone_s"]["median"],
        "between_steps_over_step": overhead,
    }
    report["targets"] = [
        {"target": f"short request during the long run <= max(4 x alone, 0.2 x long alone) = {bound:.2f} s",
         "value": on["short_mixed_s"]["median"], "met": on["short_mixed_s"]["median"] <= bound},
        {"target": "pictures equal alone (<= 1/255)", "value": max(on["short_diff"]["max"], on["long_diff"]["max"]),
         "met": max(on["short_diff"]["max"], on["long_diff"]["max"]) <= 1},
        {"target": "between-step overhead <= 5 % of a step", "value": overhead,
         "met": overhead is not None and overhead <= 0.05},
    ]
    return report


def markdown(report: dict) -> str:
    lines = [f"## Step-level scheduling: a {report['short_steps']}-step request {report['arrive_after_s']:g} s into a "
             f"{report['long_steps']}-step run ({report['preset']}, {report['size']}, eager, {report['precision']} on "
             f"{report['device']}; medians of {report['rounds']} rounds, min..max)", "",
             "| engine | long alone s | short alone s | short mixed s | long mixed s | step ms | between steps ms "
             "| diff short/long |", "|---|---|---|---|---|---|---|---|"]

    def cell(s: dict, digits: int = 2) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"

    for name, e in report["engines"].items():
        lines.append(f"| {name} | {cell(e['long_alone_s'])} | {cell(e['short_alone_s'])} | {cell(e['short_mixed_s'])} "
                     f"| {cell(e['long_mixed_s'])} | {cell(e['median_step_ms'], 1)} | {cell(e['between_steps_ms'], 2)} "
                     f"| {e['short_diff']['max']}/{e['long_diff']['max']} |")
    lines += ["", *[f"- {k}: {v:.3f}" if v is not None else f"- {k}: n/a" for k, v in report["ratios"].items()], ""]
    lines += [f"- {'met' if t['met'] else 'MISSED'}: {t['target']} ({t['value']:.3f})" if t["value"] is not None
              else f"- MISSED: {t['target']} (n/a)" for t in report["targets"]]
    return "\n".join(lines)


def cmd_step_bench(args) -> int:
    opts = from_args(StepBenchOptions, args)
    report = run_step_bench(opts)
    text = markdown(report)
    if opts.out:
        folder = Path(opts.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "step.json").write_text(json.dumps(report, indent=2))
        (folder / "step.md").write_text(text + "\n")
    print(json.dumps(report, indent=2) if opts.json else text)
    return 0 if all(t["met"] for t in report["targets"]) else 1

