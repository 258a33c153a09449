"""The code's shape as checks, so it stays readable as it grows: size limits per function, class and
module; argument counts and branching through ruff's own rules; no dead function (vulture)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "bench", "training", "ui")  # the serving engine, the measuring, the training, the UI
SOURCES = sorted([*(p for top in PACKAGES for p in ROOT.joinpath(top).rglob("*.py")), ROOT / "app.py"])
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 350
MAX_MODULE_LINES = 700


def _nodes(kinds):
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kinds):
                yield path.relative_to(ROOT), node


def _too_long(kinds, limit: int) -> list[str]:
    return [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _nodes(kinds) if node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_longer_than_80_lines():
    assert _too_long((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES) == []


def test_no_class_is_longer_than_350_lines():
    assert _too_long(ast.ClassDef, MAX_CLASS_LINES) == []


def test_no_module_is_longer_than_700_lines():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in SOURCES}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


# engine/'s add_argument calls: the one in engine/config/flags.py `add_fields`; every flag is a field of a config
# dataclass (engine, hosting, app, CLI sub-command, sidecar and client flags alike), so a new option is one field.
MAX_ENGINE_ADD_ARGUMENT = 1


def add_argument_calls(top: str) -> dict[str, int]:
    """`.add_argument(...)` calls per module of package `top` (add_argument_group and the like not counted)."""
    counts: dict[str, int] = {}
    for path in sorted(ROOT.joinpath(top).rglob("*.py")):
        calls = sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument" for node in ast.walk(ast.parse(path.read_text())))
        if calls:
            counts[str(path.relative_to(ROOT))] = calls
    return counts


def test_engine_flags_come_from_config_fields_not_add_argument_calls():
    counts = add_argument_calls("engine")
    print(f"add_argument calls in engine/: {sum(counts.values())} (ceiling {MAX_ENGINE_ADD_ARGUMENT}): {counts}")
    assert sum(counts.values()) <= MAX_ENGINE_ADD_ARGUMENT, (
        f"{counts}: declare a flag as a field with flag(...) metadata (engine/protocol/flagfields.py) and "
        "add it with add_fields (engine/config/flags.py)")



def test_bench_flags_come_from_option_fields_not_add_argument_calls():
    counts = add_argument_calls("bench")
    print(f"add_argument calls in bench/: {sum(counts.values())} (none allowed): {counts}")
    assert not counts, f"{counts}: declare the flag as a field of the command's options dataclass (bench/flags.py)"

def test_ruff_complexity_and_argument_rules_pass():
    """C901 (branching) and PLR0913 (more than 8 parameters) with the thresholds in pyproject.toml."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "C901,PLR0913", "--no-cache",
                           *PACKAGES, "app.py"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_rules_catch_what_they_are_meant_to(tmp_path):
    """The rules above bite: a nine-parameter function fails them."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(a, b, c, d, e, f, g, h, i):\n    return a\n")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "PLR0913", "--no-cache",
                           "--config", str(ROOT / "pyproject.toml"), str(bad)], capture_output=True, text=True)
    assert done.returncode == 1 and "PLR0913" in done.stdout


def test_no_dead_function():
    """vulture finds functions, methods and classes nothing calls; the CLI's subcommands are named as
    "module:function" strings (imported on demand), so those names count as used."""
    vulture = pytest.importorskip("vulture")
    from bench.commands import COMMANDS as MEASURING
    from engine.cli import COMMANDS

    registered = {entry.split(":")[1] for entry in [*COMMANDS.values(), *MEASURING.values()]}
    finder = vulture.Vulture(ignore_decorators=["@on_compile_start"])  # torch calls it
    finder.scavenge([str(ROOT / top) for top in (*PACKAGES, "app.py", "tests")])
    dead = [f"{item.filename}:{item.first_lineno} {item.name}" for item in finder.get_unused_code(min_confidence=60)
            if item.typ in ("function", "method", "class") and item.name not in registered
            and not str(item.filename).startswith(str(ROOT / "tests"))]
    assert dead == []
