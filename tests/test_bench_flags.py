"""The measuring commands' flags come from their options dataclasses (bench/flags.py): no hand-written
add_argument in bench/, every flag a command takes is a field of its options (or an engine flag), the
parsed values come back as that dataclass, and a bad value is refused as argparse parses it, in one line
naming the flag. Parsers only: nothing loads."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from pathlib import Path

import pytest

from bench.commands import COMMANDS, build_parser
from engine.config.flags import add_engine_arguments, argv_of, from_args
from engine.protocol.flagfields import flag_fields

# Every flag of a measuring command is a field of its options dataclass: a new option is one field.

OPTIONS = {  # command -> its options dataclass; `True`: the engine flags follow its own
    "bench": ("bench.bench_options:BenchOptions", True),
    "soak": ("bench.soak:SoakOptions", False),
    "load": ("bench.load:LoadOptions", False),
    "fairness": ("bench.fairness:FairnessOptions", False),
    "contention": ("bench.contention:ContentionOptions", False),
    "cp-bench": ("bench.context_parallel:CpBenchOptions", False),
    "advise": ("bench.advise:AdviseOptions", True),
    "lora-bench": ("bench.lora:LoraBenchOptions", False),
    "memory-bench": ("bench.memory:MemoryBenchOptions", False),
    "oneshot": ("bench.oneshot:OneshotOptions", True),
    "fleet-bench": ("bench.fleet:FleetBenchOptions", False),
    "video-bench": ("bench.video:VideoBenchOptions", False),
    "edit-bench": ("bench.edit:EditBenchOptions", False),
    "vae-bench": ("bench.vae_decode:VaeBenchOptions", False),
    "step-bench": ("bench.stepping:StepBenchOptions", False),
    "inpaint-bench": ("bench.inpaint:InpaintBenchOptions", False),
}


def _options(command: str):
    module, name = OPTIONS[command][0].split(":")
    return getattr(importlib.import_module(module), name)


def _subparser(command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser(command)._actions if a.dest == "command"]
    return sub.choices[command]


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions} - {"help"}


def _engine_dests() -> set[str]:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return _dests(parser)


def test_every_command_has_its_options_table_entry():
    assert set(OPTIONS) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_flags_are_its_option_fields_and_nothing_else(command):
    cls, engine = _options(command), OPTIONS[command][1]
    own = {how.dest or f.name for f, how in flag_fields(cls)}
    assert len(own) == len(dataclasses.fields(cls))  # every field is a flag
    taken = _dests(_subparser(command))
    engine_flags = _engine_dests() if engine else set()
    assert taken - engine_flags == own
    assert engine_flags <= taken


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_defaults_come_back_as_the_options_dataclass(command):
    cls = _options(command)
    args = build_parser(command).parse_args([command])
    assert from_args(cls, args) == cls()
    assert argv_of(cls, args) == []  # nothing differs from the field defaults


def test_a_flags_value_comes_back_typed_and_round_trips_as_argv():
    cls = _options("cp-bench")
    args = build_parser("cp-bench").parse_args(["cp-bench", "--tp", "4", "--threads", "2", "--text-len", "8",
                                                "--parallel", "ring", "--timeout", "60", "--out", "x",
                                                "--precision", "BF16"])
    opts = from_args(cls, args)
    assert (opts.tp, opts.threads, opts.text_len, opts.parallel, opts.timeout, opts.out, opts.precision) == (
        4, 2, 8, "ring", 60.0, Path("x"), "bf16")
    # what the launcher hands its ranks: the same options again
    assert from_args(cls, build_parser("cp-bench").parse_args(["cp-bench", *argv_of(cls, opts)])) == opts


def test_repeatable_switch_and_hidden_flags_parse_into_their_fields():
    soak = from_args(_options("soak"), build_parser("soak").parse_args(
        ["soak", "--app-arg=--verbose", "--app-arg", "x", "--no-public", "--seed", "3"]))
    assert (soak.app_arg, soak.public, soak.seed) == (["--verbose", "x"], False, 3)
    bench = from_args(_options("bench"), build_parser("bench").parse_args(
        ["bench", "--_runtime-child", "inprocess:eager", "--_cold-start-child", "--no-chart", "--steps", "0"]))
    assert (bench._runtime_child, bench._cold_start_child, bench.no_chart, bench.steps) == (
        "inprocess:eager", True, True, 0)


@pytest.mark.parametrize(("argv", "refusal"), [
    (["bench", "--runs", "x"], "argument --runs: 'x' is not a whole number; allowed: 1..100000"),
    (["bench", "--runs", "0"], "argument --runs: 0 is out of range"),
    (["bench", "--repeat-budget", "nan"], "argument --repeat-budget: nan is out of range"),
    (["advise", "--steps", "900"], "argument --steps: 900 is out of range; allowed: 1..200, or 0 (the preset's)"),
    (["advise", "--min-ssim", "1.5"], "argument --min-ssim: 1.5 is out of range; allowed: 0..1"),
    (["soak", "--cancel-rate", "2"], "argument --cancel-rate: 2 is out of range; allowed: 0..1"),
    (["load", "--max-batch", "65"], "argument --max-batch: 65 is out of range; allowed: 1..64"),
    (["fleet-bench", "--mode", "turbo"], "argument --mode: unknown mode 'turbo'; choose one of: eager"),
    (["contention", "--precision", "fp99"], "argument --precision: unknown precision 'fp99'"),
    (["cp-bench", "--parallel", "tensor"], "argument --parallel: invalid choice: 'tensor'"),
    (["oneshot", "--runs", "-1"], "argument --runs: -1 is out of range"),
    (["memory-bench", "--denoiser-gib", "0"], "argument --denoiser-gib: 0 is out of range"),
])
def test_a_bad_value_is_refused_as_it_is_parsed_naming_the_flag(argv, refusal, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv[0]).parse_args(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert refusal in last and last.startswith(f"python -m bench {argv[0]}: error: ")
