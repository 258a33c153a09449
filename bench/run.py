"""Running a benchmark: measure what a plan describes (pipeline or denoiser path), assemble the report,
and the `bench` command's body (bench/cli.py hands over to `main` once the command runs).
"""

from __future__ import annotations

import sys

import torch

from bench.bench_options import BenchOptions
from bench.cache_probe import cmd_compile_probe
from bench.cold_start import cmd_cold_start_child, cmd_runtime_child
from bench.denoiser import run_denoiser_bench
from bench.pipeline import run_pipeline_bench
from bench.plan import BenchPlan, plan_from_args
from bench.report import assemble_report, markdown_report, write_outputs
from engine import devices
from engine.config.flags import from_args


def run_bench(plan: BenchPlan) -> dict:
    """Run the benchmark a plan describes and return the report (also what the UI could call)."""
    measured = run_denoiser_bench(plan) if plan.random_weights else run_pipeline_bench(plan)
    kind = measured.pop("kind")
    results, extras, notes = measured.pop("results"), measured.pop("extras"), measured.pop("notes")
    return assemble_report(plan, devices.get_device(plan.device), kind, results, extras, notes, **measured)


def main(args) -> int:
    opts = from_args(BenchOptions, args)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts._compile_probe:
        return cmd_compile_probe(args)
    if opts._cold_start_child:
        return cmd_cold_start_child(args)
    if opts._runtime_child:
        return cmd_runtime_child(args)
    if opts.repeatability:
        from bench import repeat

        return repeat.main(args)
    plan = plan_from_args(args)
    if plan.caches:
        from bench import levers

        report = levers.run_levers_bench(plan)
        paths = levers.write(report, plan.out) if plan.out else {}
        print(levers.markdown(report))
        for kind, path in paths.items():
            print(f"wrote {kind}: {path}", file=sys.stderr)
        return 1 if opts.strict and report["missed"] else 0
    report = run_bench(plan)
    paths = write_outputs(report, plan.out, chart=not opts.no_chart) if plan.out else {}
    print(markdown_report(report))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    if opts.strict and report["missed"]:
        return 1
    return 0
