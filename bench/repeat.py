"""`python -m bench bench --repeatability`: the same comparison of configurations measured twice, to see
whether its figures repeat.

Each run is what the Compare tab does, in this process on the bench's runners: every configuration warm
first (compile and warm-up reported apart), then timed round-robin with eager fp32 by the shared paired
plan (bench/paired.py) until each speedup's spread is known or the run's time budget ends. The
report gives both runs' speedups with their spread, the ratio between the runs, whether it is within
the tolerance (the target: +-15 %) and whether the ranking held, beside the host's load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench import configs as explicit
from bench.paired import PairedTiming, current_marks, measure_round_robin
from engine.protocol import BucketKey, BucketState, GenerateRequest, Mode, OnCold, Size

DEFAULT_CONFIGS = ("eager/fp32; eager/bf16; compile/fp32; regional/fp32; eager/fp32/first-block:0.2; "
                   "eager/fp32/taylorseer:3:2")
REPEAT_TOLERANCE = 0.15  # the target: every speedup of the second run within 15 % of the first run's
REFERENCE = "eager/fp32"


def ranking(figures: dict[str, dict]) -> list[str]:
    """The configurations other than the reference, fastest first."""
    return [label for label, f in sorted(figures.items(), key=lambda kv: -(kv[1].get("speedup") or 0))
            if label != REFERENCE and f.get("speedup") is not None]


def overlap(a: dict, b: dict) -> bool:
    """Whether two figures' interquartile ranges overlap: their order is not measured apart."""
    (a_low, a_high), (b_low, b_high) = a.get("iqr") or (None, None), b.get("iqr") or (None, None)
    if None in (a_low, a_high, b_low, b_high):
        return False
    return a_low <= b_high and b_low <= a_high


def ranking_held(first: dict[str, dict], second: dict[str, dict]) -> tuple[bool, list[str]]:
    """Whether every pair of configurations kept its order in the second run, except pairs whose ranges
    overlap in either run (a tie there); and the pairs that swapped."""
    order = ranking(first)
    swapped, ties_only = [], True
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if (second.get(a) or {}).get("speedup") is None or (second.get(b) or {}).get("speedup") is None:
                continue
            if second[a]["speedup"] < second[b]["speedup"]:
                tie = overlap(first[a], first[b]) or overlap(second[a], second[b])
                swapped.append(f"{a} / {b}" + (" (a tie: ranges overlap)" if tie else ""))
                ties_only = ties_only and tie
    return ties_only, swapped


def compare_runs(first: dict[str, dict], second: dict[str, dict], tolerance: float = REPEAT_TOLERANCE) -> dict:
    """Per configuration the two speedups, their ratio and whether it is within `tolerance`; whether the
    ranking held. `first`/`second`: label -> Figure.as_dict()."""
    rows = []
    for label in first:
        if label == REFERENCE:
            continue
        a, b = first[label].get("speedup"), (second.get(label) or {}).get("speedup")
        ratio = b / a if a and b else None
        rows.append({"label": label, "first": first[label], "second": second.get(label), "ratio": ratio,
                     "within": ratio is not None and abs(ratio - 1) <= tolerance})
    same = ranking(first) == ranking(second)
    held, swapped = ranking_held(first, second)
    return {"rows": rows, "same_ranking": same, "ranking_held_but_ties": held, "swapped": swapped,
            "ranking_first": ranking(first), "ranking_second": ranking(second),
            "all_within": all(r["within"] for r in rows), "tolerance": tolerance}


def markdown(report: dict) -> str:
    lines = [f"Repeatability: {report['preset']} on {report['device']} at {report['size']}, {report['steps']} steps, "
             f"{report['threads'] or 'default'} threads; host load (1/5/15 min) before {report['load_before']}, "
             f"after {report['load_after']}", "",
             "| configuration | run 1 | run 2 | run 2 ÷ run 1 | within ±"
             f"{report['comparison']['tolerance'] * 100:.0f} % |", "|---|---|---|---|---|"]
    for r in report["comparison"]["rows"]:
        second = (r["second"] or {}).get("text", "—")
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['label']} | {r['first']['text']} | {second} | {ratio} | {'yes' if r['within'] else 'NO'} |")
    c = report["comparison"]
    lines += ["", f"Ranking run 1: {' > '.join(c['ranking_first'])}",
              f"Ranking run 2: {' > '.join(c['ranking_second'])}",
              f"Same ranking: {'yes' if c['same_ranking'] else 'NO'}"
              + ("" if c["same_ranking"] else f" (swapped: {'; '.join(c['swapped'])}; held apart from ties: "
                 f"{'yes' if c['ranking_held_but_ties'] else 'NO'})")
              + f"; every speedup within ±{c['tolerance'] * 100:.0f} %: {'yes' if c['all_within'] else 'NO'}"]
    for i, run in enumerate(report["runs"], 1):
        costs = ", ".join(f"{label} {w.get('compile_s') or 0:.1f} s compile + {w.get('warmup_s') or 0:.2f} s warm-up"
                          if not w.get("error") else f"{label} failed: {w['error']}" for label, w in run["warm"].items())
        lines.append(f"Run {i}: {run['rounds']} rounds ({run['stop_reason']}), {run['elapsed_s']:.0f} s; "
                     f"apart from the figures: {costs}")
    return "\n".join(lines)


def run(plan, runners, configurations: list[explicit.Configuration], budget_s: float, tolerance: float,
        max_rounds: int, seed: int = 0) -> dict:
    """One comparison of `configurations` (eager fp32 added first when missing) on `runners` (advise._Runners:
    weights loaded once per precision): warm, then round-robin."""
    from bench.advise_choice import Candidate
    candidates = {REFERENCE: explicit.Configuration("eager", "fp32"), **{c.text(): c for c in configurations}}

    def runner_of(c: explicit.Configuration):
        return runners.get(Candidate(c.precision, c.mode, c.step_cache))

    def request(c: explicit.Configuration, i: int) -> GenerateRequest:
        cache = {"step_cache": c.step_cache} if c.step_cache != "none" else {}
        return GenerateRequest.checked(prompt=plan.prompt, width=plan.size.width, height=plan.size.height, steps=plan.steps,
                               guidance=plan.preset.guidance, seed=seed + i, mode=Mode(c.mode), on_cold=OnCold.EAGER,
                               lora=c.lora, **cache)

    def warm(label: str) -> dict:
        c = candidates[label]
        runner = runner_of(c)
        runner.check_mode(Mode(c.mode))
        out = {"compile_s": 0.0}
        if c.mode != "eager":
            t0 = time.perf_counter()
            info = runner.warm_bucket(BucketKey(Mode(c.mode), plan.size))
            if info.state != BucketState.WARM:
                raise RuntimeError(info.error or f"bucket is {info.state.value}")
            out["compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        runner.generate(request(c, 99))
        out["warmup_s"] = time.perf_counter() - t0
        return out

    def time_one(label: str, i: int) -> float:
        c = candidates[label]
        return runner_of(c).generate(request(c, 0)).timings.total_ms

    timing = PairedTiming(list(candidates), reference=REFERENCE, tolerance=tolerance, max_rounds=max_rounds,
                          budget_s=budget_s)
    started = time.perf_counter()
    measure_round_robin(timing, time_one, warm=warm, marks=current_marks)
    return {**timing.as_dict(), "elapsed_s": time.perf_counter() - started}


def main(args) -> int:
    from bench.advise import _Runners, serving_threads
    from bench.advise_choice import AdvisePlan
    from bench.bench_options import BenchOptions
    from engine import devices, settings
    from engine.config.flags import SourceFlags, from_args, model_roots_from_args, options_from_args
    from engine.config.presets import get_preset

    opts, source = from_args(BenchOptions, args), from_args(SourceFlags, args)
    preset = get_preset(opts.preset)
    spec = devices.resolve_device(opts.device)
    size = Size.parse(opts.sizes.split(",")[0]) if opts.sizes else preset.buckets[0]
    try:
        configurations = explicit.parse_configurations(opts.configs or DEFAULT_CONFIGS)
    except ValueError as exc:
        print(f"--configs: {exc}", file=sys.stderr)
        return 2
    loras = any(c.lora.name for c in configurations)  # a LoRA entry: the engines get the slot (as --loras would)
    for c in configurations:
        why = explicit.refusal(preset, spec, c, loras=loras or args.loras)
        if why:
            print(f"--configs: {c.text()} cannot run here: {why}", file=sys.stderr)
            return 2
    threads = opts.threads or serving_threads(spec)
    if threads:
        import torch

        torch.set_num_threads(threads)
    cache_dir = Path(source.cache_dir) if source.cache_dir else settings.cache_dir()
    devices.apply_environment(spec, cache_dir)
    import diffusers  # noqa: F401 - after the cache environment (see bench/pipeline.py)

    plan = AdvisePlan(preset=preset, device=spec.name, size=size, steps=opts.steps or preset.steps,
                      cache_dir=cache_dir, options=options_from_args(args, warm_sizes=(), warm_modes=(),
                                                                     loras=loras or args.loras),
                      allowed_roots=tuple(str(r) for r in model_roots_from_args(args)),
                      prompt=opts.prompt or preset.example_prompt)
    runners = _Runners(plan, spec)  # both runs on the same loaded weights, as the app's engines would be
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs = []
    for i in range(2):
        print(f"run {i + 1} of 2 ...", file=sys.stderr, flush=True)
        runs.append(run(plan, runners, configurations, opts.repeat_budget, opts.repeat_spread,
                        opts.repeat_max_rounds))
    load_after = [round(x, 2) for x in os.getloadavg()]
    report = {"preset": preset.name, "device": spec.name, "size": str(size), "steps": plan.steps, "threads": threads,
              "configs": [c.text() for c in configurations], "load_before": load_before, "load_after": load_after,
              "cores": os.cpu_count(), "runs": runs,
              "comparison": compare_runs(runs[0]["figures"], runs[1]["figures"]),
              "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(markdown(report))
    if opts.out:
        path = Path(opts.out) / "repeatability.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {path}", file=sys.stderr)
    ok = report["comparison"]["ranking_held_but_ties"] and report["comparison"]["all_within"]
    return 1 if opts.strict and not ok else 0

