"""Measuring command line: `python -m bench COMMAND` (`--help` lists the commands).

The same machinery as the engine's serving commands (engine/cli.py), over this package's own table: each
module registers its own parser, imported only when the parser is built (only the named command's when
the command line names one). Importing this module (and `--help`) never imports torch.
"""

from __future__ import annotations

import sys

PROG = "python -m bench"
COMMANDS = {
    "bench": "bench.cli:add_bench_parser",
    "soak": "bench.soak:add_soak_parser",
    "load": "bench.load:add_load_parser",
    "fairness": "bench.fairness:add_fairness_parser",
    "contention": "bench.contention:add_contention_parser",
    "cp-bench": "bench.context_parallel:add_cp_bench_parser",
    "advise": "bench.advise:add_advise_parser",
    "lora-bench": "bench.lora:add_lora_bench_parser",
    "memory-bench": "bench.memory:add_memory_bench_parser",
    "oneshot": "bench.oneshot:add_oneshot_parser",
    "fleet-bench": "bench.fleet:add_fleet_bench_parser",
    "video-bench": "bench.video:add_video_bench_parser",
    "edit-bench": "bench.edit:add_edit_bench_parser",
    "vae-bench": "bench.vae_decode:add_vae_bench_parser",
    "inpaint-bench": "bench.inpaint:add_inpaint_bench_parser",
    "step-bench": "bench.stepping:add_step_bench_parser",
}


def main(argv: list[str] | None = None) -> int:
    from engine.cli import main as run_command

    return run_command(sys.argv[1:] if argv is None else argv, COMMANDS, PROG, __doc__)


def build_parser(command: str | None = None):
    """The parser of every measuring command, or of `command` alone (engine/cli.py's build_parser)."""
    from engine.cli import build_parser as build

    return build(command, COMMANDS, PROG, __doc__)
