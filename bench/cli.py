"""The `bench` sub-command: its parser, registered by bench/commands.py's COMMANDS table.

bench/commands.py imports this whenever it builds the parser of every command (`python -m bench --help`), so
this module imports no torch: `cmd_bench` hands over to bench/run.py, which does, only when
`bench` actually runs.
"""

from __future__ import annotations

import argparse

from bench import flags
from bench.bench_options import BenchOptions

DESCRIPTION = "Benchmark: what each mode and precision buys, measured side by side in one run."


def cmd_bench(args) -> int:
    # Imported here, not at the top: it imports torch, which building the parser must not.
    from bench import run

    return run.main(args)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the CLI's subparsers (bench/commands.py calls this)."""
    return flags.add_command(subparsers, "bench", BenchOptions, cmd_bench, engine=True, description=DESCRIPTION,
                             help="measure every mode x precision x size side by side; print ratios against targets")
