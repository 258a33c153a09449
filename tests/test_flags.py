"""Every flag of app.py checked before anything loads: a bad value exits 2 with one line naming the flag and
what it takes, and no traceback; `--help` shows the per-device defaults the device registry holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
# Runs app.py's main as `python app.py ARGV` does, then says how it ended and whether torch was imported.
PROBE = ("import json, runpy, sys\nsys.argv = ['app.py', *json.loads(sys.argv[1])]\ncode = 0\ntry:\n"
         "    runpy.run_path('app.py', run_name='__main__')\nexcept SystemExit as exc:\n    code = exc.code\n"
         "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))")
GOOD_ADVICE = {"preset": "tiny-shapes", "device": "cpu", "size": "64x64", "steps": 8,
               "pick": {"precision": "fp32", "mode": "eager", "step_cache": "none", "attention": "native"}}


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _advice(tmp_path: Path, **pick) -> str:
    return _write(tmp_path, "advice.json", json.dumps({**GOOD_ADVICE, "pick": {**GOOD_ADVICE["pick"], **pick}}))


# (argv, the flag the line names, what it says is allowed). Item 7 of issue 30, each case as it was found.
BAD_FLAGS = [
    (lambda t: ["--port", "99999"], "--port", "allowed: 1..65535"),
    (lambda t: ["--config-from", _write(t, "deep.json", "[" * 50_000 + "]" * 50_000)], "--config-from",
     "at most 32 are read"),
    (lambda t: ["--config-from", _write(t, "list.json", json.dumps([GOOD_ADVICE]))], "--config-from",
     "holds a JSON list, not the advisor's object"),
    (lambda t: ["--presets", "nonexistent"], "--presets", "choose one of: tiny-shapes, tiny-flux"),
    (lambda t: ["--queue-size", "-1"], "--queue-size", "allowed: 1..100000"),
    (lambda t: ["--memory-budget", "1KiB"], "--memory-budget", "allowed: at least 512MiB"),
    (lambda t: ["--attention-backend", "bogus"], "--attention-backend", "choose one of: native, _native_math"),
    (lambda t: ["--config-from", _advice(t, attention="bogus")], "--config-from",
     "unknown attention backend 'bogus'; choose one of: native, _native_math"),
    (lambda t: ["--client-events", "-3"], "--client-events", "allowed: 1..100000, or 0 (unbounded)"),
    (lambda t: ["--max-batch", "100000"], "--max-batch", "allowed: 1..64"),
    # and the neighbours of those: wrong types in the advisor file, other named and numeric flags
    (lambda t: ["--config-from", _write(t, "types.json", json.dumps({**GOOD_ADVICE, "steps": [8]}))],
     "--config-from", "steps must be a whole number"),
    (lambda t: ["--config-from", _advice(t, step_cache="taylorseer:3:0")], "--config-from", "allowed 1..200"),
    (lambda t: ["--preset", "nope"], "--preset", "choose one of: tiny-shapes"),
    (lambda t: ["--precision", "fp7"], "--precision", "choose one of: fp32, tf32, bf16"),
    (lambda t: ["--modes", "eager,fast"], "--modes", "choose one of: eager, compile, regional"),
    (lambda t: ["--warm", "64by64"], "--warm", "allowed: all, none or sizes"),
    (lambda t: ["--tp", "0"], "--tp", "allowed: 1..256"),
    (lambda t: ["--idle-unload", "-5"], "--idle-unload", "or 0 (off)"),
    (lambda t: ["--batch-wait-ms", "nan"], "--batch-wait-ms", "allowed: 0..10000"),
    (lambda t: ["--max-engines", "0"], "--max-engines", "allowed: 1..64"),
    (lambda t: ["--max-request-cost", "lots"], "--max-request-cost", "whole number (e.g. 16384), or 0 for no bound"),
    (lambda t: ["--max-visitor-cost", "-5"], "--max-visitor-cost", "positive number of token-steps, or 0"),
    (lambda t: ["--header-timeout", "0"], "--header-timeout", "allowed: 1..600"),
    (lambda t: ["--max-header-bytes", "lots"], "--max-header-bytes", "not a size from 1KiB to 1MiB"),
    (lambda t: ["--lora", "nope"], "--lora", "unknown LoRA 'nope' for tiny-shapes: choose one of swap, small, corner"),
    (lambda t: ["--config-from", _write(t, "lora.json", json.dumps({**GOOD_ADVICE, "lora": "nope"}))], "--config-from",
     "unknown LoRA 'nope' for tiny-shapes"),
    (lambda t: ["--config-from", _write(t, "lora5.json", json.dumps({**GOOD_ADVICE, "lora": 5}))], "--config-from",
     "lora must be text"),
    (lambda t: ["--lora", "swap:5"], "--lora", "LoRA scale 5 is outside [0, 2]"),
    # issue 37: a MemoryError traceback, a hang, an OverflowError traceback
    (lambda t: ["--config-from", "/dev/zero"], "--config-from", "/dev/zero is not a regular file"),
    (lambda t: ["--config-from", _fifo(t)], "--config-from", "is not a regular file"),
    (lambda t: ["--memory-budget", "1e400"], "--memory-budget", "larger than any machine's memory"),
    (lambda t: ["--memory-budget", "nan"], "--memory-budget", "not a number with a unit"),
    (lambda t: ["--max-streams-per-client", "-2"], "--max-streams-per-client", "allowed: 1..1000000, or 0"),
    # the /v1 API's keys (ui/openai_api.py): a file to read, with a key in it; admin-token with a token to be it
    (lambda t: ["--api-keys", str(t / "absent.txt")], "--api-keys", "cannot read the key file"),
    (lambda t: ["--api-keys", _write(t, "keys.txt", "# none yet\n\n")], "--api-keys", "holds no key"),
    (lambda t: ["--api-keys", "admin-token"], "--api-keys", "admin-token needs --admin-token"),
    # issue 50: a 2-character key was accepted without a word
    (lambda t: ["--api-keys", _write(t, "keys.txt", "ab\n")], "--api-keys", "shorter than 16 characters"),
    (lambda t: ["--admin-token", "s3cret"], "--admin-token", "a token of 6 characters can be guessed"),
]


def _fifo(tmp_path: Path) -> str:
    import os

    path = tmp_path / "advice.fifo"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("make_argv, flag, allowed", BAD_FLAGS, ids=[case[1] + f"-{i}" for i, case in enumerate(BAD_FLAGS)])
def test_a_bad_flag_stops_the_app_at_once_with_one_line(tmp_path, make_argv, flag, allowed):
    argv = make_argv(tmp_path)
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    ended = json.loads(out.stdout.strip().splitlines()[-1])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert ended["code"] == 2, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"app.py: error: argument {flag}: ") and allowed in lines[0], lines[0]
    assert not ended["torch"], f"{flag} was checked only after torch was imported"


def test_env_defaults_get_the_flags_checks(monkeypatch):
    import app

    monkeypatch.setenv("SHOWCASE_QUEUE_SIZE", "0")
    with pytest.raises(SystemExit) as stopped:
        app.build_parser().parse_args([])
    assert stopped.value.code == 2
    for name, text in (("SHOWCASE_QUEUE_SIZE", "many"), ("SHOWCASE_PORT", "http")):  # not numbers: no traceback
        monkeypatch.setenv(name, text)
        with pytest.raises(SystemExit) as stopped:
            app.build_parser().parse_args([])
        assert stopped.value.code == 2
        monkeypatch.delenv(name)
    monkeypatch.setenv("SHOWCASE_QUEUE_SIZE", "12")
    monkeypatch.setenv("SHOWCASE_PRESETS", " tiny-flux , tiny-sd3 ")
    args = app.build_parser().parse_args([])
    assert args.queue_size == 12 and args.presets == "tiny-flux,tiny-sd3"


def test_good_values_pass_as_before():
    import app

    args = app.build_parser().parse_args(
        ["--port", "8080", "--client-events", "0", "--memory-budget", "3GiB", "--attention-backend", "FLEX",
         "--max-batch", "64", "--presets", "tiny-flux,tiny-sd3", "--preset", "org/some-model", "--modes", "eager",
         "--precision", "BF16", "--warm", "none", "--idle-unload", "0", "--buckets", "64x64,128x96"])
    assert (args.port, args.client_events, args.memory_budget, args.max_batch) == (8080, 0, "3GiB", 64)
    assert (args.attention_backend, args.precision, args.preset) == ("flex", "bf16", "org/some-model")
    assert args.buckets == "64x64,128x96" and args.idle_unload == 0
    args = app.build_parser().parse_args(["--lora", "Small:1.5:Fused"])
    engine = app.check_flags(app.build_parser(), args)
    assert engine.lora == "small:1.5:fused"  # Generate's LoRA selectors start there
    from engine.config.flags import options_from_args

    assert options_from_args(args).recipe.loras  # a style needs the slot: --lora turns on --loras


def test_a_budget_that_holds_no_engine_on_its_device_is_refused():
    import app
    from engine import devices

    overhead = devices.get_device("cpu").process_overhead_bytes
    budget = [overhead]
    serving = SimpleNamespace(memory_budget=lambda: budget[0], app_bytes=lambda device: 300 * 2**20)
    problem = app.check_engine_room(SimpleNamespace(memory_budget="700MiB"), serving, "cpu")
    assert problem.startswith("argument --memory-budget: 700MiB leaves no room for an engine on cpu")
    assert "allowed: at least" in problem
    budget[0] = overhead + 300 * 2**20
    assert app.check_engine_room(SimpleNamespace(memory_budget="1GiB"), serving, "cpu") is None


def test_help_shows_the_registrys_per_device_defaults_as_the_readme_does():
    from engine.config.flags import device_defaults, per_device
    from engine.devices import registry

    specs = registry()
    for field in ("max_batch", "max_engines", "process_overhead_bytes"):
        assert device_defaults(field) == {name: getattr(spec, field) for name, spec in specs.items()}, field
    shown = per_device("max_batch")
    assert shown.startswith(f"cpu {specs['cpu'].max_batch},")
    out = subprocess.run([sys.executable, "app.py", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    help_text = re.sub(r"\s+", " ", out)
    assert f"(default per device: {shown})" in help_text
    assert f"(default per device kind: {per_device('max_engines')};" in help_text
    readme = re.sub(r"\s+", " ", (REPO / "README.md").read_text())
    assert f"(default per device: {shown};" in readme
    assert f"(default {per_device('max_engines')}:" in readme


def test_cli_sidecar_and_client_flags_are_fields_that_refuse_as_argparse_did(capsys):
    """The sub-command, sidecar and client flags are dataclass fields: a typed field keeps argparse's own refusal
    ("invalid int value"), a choice its "invalid choice", a positional field stays required, and the parsed
    command line reads back as the dataclass the command uses."""
    import argparse

    from engine.cli import GenerateFlags, build_parser
    from engine.config.flags import add_fields, argv_of, from_args
    from engine.tp.client import ClientFlags
    from engine.tp.flags import SidecarFlags
    from engine.tp.sidecar import build_parser as sidecar_parser

    def refusal(parser, argv) -> str:
        with pytest.raises(SystemExit) as ended:
            parser.parse_args(argv)
        assert ended.value.code == 2
        return capsys.readouterr().err.splitlines()[-1]

    assert refusal(build_parser("generate"), ["generate", "--steps", "x"]).endswith(
        "error: argument --steps: invalid int value: 'x'")
    assert refusal(build_parser("generate"), ["generate", "--on-cold", "later"]).endswith(
        "error: argument --on-cold: invalid choice: 'later' (choose from 'eager', 'wait')")
    assert refusal(sidecar_parser(), ["--join-timeout", "soon"]).endswith(
        "error: argument --join-timeout: invalid float value: 'soon'")
    client = argparse.ArgumentParser(prog="client")
    add_fields(client, ClientFlags)
    assert refusal(client, []).endswith("error: the following arguments are required: address_file")

    o = from_args(GenerateFlags, build_parser("generate").parse_args(["generate", "--seed", "7", "--no-snap"]))
    assert (o.seed, o.no_snap, o.steps, o.on_cold) == (7, True, None, "wait")
    sidecar = from_args(SidecarFlags, sidecar_parser().parse_args(["--warm", "eager", "--warm", "compile", "-v"]))
    assert (sidecar.warm, sidecar.verbose, sidecar.tp, sidecar.join_timeout) == (["eager", "compile"], True, 2, 600)
    argv = ["a.json", "--steps", "3", "--shutdown"]
    assert argv_of(ClientFlags, client.parse_args(argv)) == argv


@pytest.mark.parametrize(("argv", "words"), [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--public", "--ray", "8.8.8.8:6379"], "a public app joins only a cluster on loopback or a private network"),
])
def test_a_refused_combination_of_flags_exits_with_status_2_in_one_line(argv, words):
    """Issue 50: a combination refused after parsing exited with status 1, where README says 2."""
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    ended = json.loads(out.stdout.strip().splitlines()[-1])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert ended["code"] == 2, out.stderr
    errors = [line for line in lines if "error" in line.lower()]  # after the start-up's info lines
    assert errors == [lines[-1]] and lines[-1].startswith("app.py: error: ") and words in lines[-1], out.stderr
    assert "Traceback" not in out.stderr
