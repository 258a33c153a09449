"""The CLIs' command tables (serving: `python -m engine`; measuring: `python -m bench`) and the runtime a
one-shot generate picks (no subprocess, nothing loaded)."""

from __future__ import annotations

import pytest

from bench import commands as measuring
from engine.cli import COMMANDS, MEASURING, build_parser, main, oneshot_runtime
from engine.protocol import Mode


def registered(parser) -> set[str]:
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return set(sub.choices)


def test_every_command_is_registered_under_its_name_in_the_table():
    assert registered(build_parser()) == set(COMMANDS)
    for name in COMMANDS:
        assert registered(build_parser(name)) == {name}  # a named command imports its own module only


def test_every_measuring_command_is_registered_in_the_bench_table_and_none_in_the_engines():
    assert registered(measuring.build_parser()) == set(measuring.COMMANDS)
    for name in measuring.COMMANDS:
        assert registered(measuring.build_parser(name)) == {name}
    assert all(entry.startswith("bench.") for entry in measuring.COMMANDS.values())
    assert not any(entry.startswith("bench") for entry in COMMANDS.values())
    assert set(MEASURING) == set(measuring.COMMANDS) and not set(MEASURING) & set(COMMANDS)


def test_a_measuring_command_given_to_the_engine_says_where_it_went(capsys):
    assert main(["advise", "--preset", "tiny-shapes"]) == 2
    assert "python -m bench advise" in capsys.readouterr().err


def test_an_unknown_command_still_gets_the_full_parser_and_its_error():
    with pytest.raises(SystemExit):
        build_parser("no-such-command").parse_args(["no-such-command"])


@pytest.mark.parametrize(("mode", "tp", "device", "runtime"), [
    (Mode.EAGER, 1, "cpu", "inprocess"),  # no second interpreter importing torch and diffusers again
    (Mode.COMPILE, 1, "cpu", "workers"),  # a compile keeps its own priority and its crashes in a worker
    (Mode.REGIONAL, 1, "cpu", "workers"),
    (Mode.AOT, 1, "cpu", "workers"),
    (Mode.EAGER, 2, "cpu", "workers"),  # torchrun's ranks
    (Mode.EAGER, 1, "tpu", "workers"),  # started with (or without) its mode variables
])
def test_a_one_shot_generate_runs_in_process_only_where_nothing_needs_a_worker(mode, tp, device, runtime):
    assert oneshot_runtime(mode, tp, device) == runtime
