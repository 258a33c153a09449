"""The measuring commands' flags, defined once: each command's options are one frozen dataclass whose fields
carry flag metadata (engine/protocol/flagfields.py); `add_command` generates the command's parser from it and
the command reads its values back as that dataclass (`from_args`), so a new option is one field.

Flags several commands take (preset, device, precision, mode, size, steps, the cache folder, --json, ...) are
one function each below: a command's field names its default (and its own help where it says more), the
flag's name, type and check are shared. Nothing here imports torch (`--help` builds every parser).
"""

from __future__ import annotations

import argparse
from dataclasses import field
from pathlib import Path

from engine.config.flags import add_engine_arguments, add_fields
from engine.protocol import MAX_STEPS, Mode, Precision
from engine.protocol.flagfields import APPEND, OPTIONAL_BOOL, SWITCH, Decimal, OneOf, Whole, flag

MAX_COUNT = 100_000  # runs, rounds, samples, visitors: past this a count is a typo
MAX_SECONDS = 7 * 86400.0  # durations and timeouts: a week
MAX_THREADS = 1024


def add_command(sub, name: str, options, run, *, engine: bool = False, **parser) -> argparse.ArgumentParser:
    """Register command `name` on the CLI's subparsers: a flag per field of dataclass `options` in field
    order (then the engine flags, when the command builds engines), `run(args)` its body."""
    p = sub.add_parser(name, **parser)
    add_fields(p, options)
    if engine:
        add_engine_arguments(p)
    p.set_defaults(func=run)
    return p


def hidden(name: str, default=None, **how):
    """A flag a parent process passes to its child (not in --help), spelled `name` (e.g. "--_child")."""
    return field(default=default, metadata=flag(argparse.SUPPRESS, name=name, **how))


def text(default: str | None = None, help: str | None = None, **how):
    """A flag taking any text (checked where it is read)."""
    return field(default=default, metadata=flag(help, **how))


def switch(help: str | None = None, **how):
    """--flag sets True."""
    return field(default=False, metadata=flag(help, kind=SWITCH, **how))


def either(default: bool, help: str | None = None):
    """--flag / --no-flag."""
    return field(default=default, metadata=flag(help, kind=OPTIONAL_BOOL))


def count(default: int | None, help: str | None = None, *, low: int = 1, high: int = MAX_COUNT,
          zero: str | None = None, **how):
    """A whole number of runs, rounds, samples, ... in low..high (0 meaning `zero`, when given)."""
    return field(default=default, metadata=flag(help, check=Whole(low, high, zero=zero), **how))


def seconds(default: float | None, help: str | None = None, *, low: float = 0.0, high: float = MAX_SECONDS):
    """A duration, a timeout or a pause in seconds."""
    return field(default=default, metadata=flag(help, check=Decimal(low, high)))


def number(default: float | None, low: float, high: float, help: str | None = None):
    """A rate, a share, a bound: a finite number in low..high."""
    return field(default=default, metadata=flag(help, check=Decimal(low, high)))


def app_args():
    """--app-arg, repeatable: extra app.py arguments of a command that starts the app."""
    return field(default_factory=list, metadata=flag("extra app.py argument (repeatable)", kind=APPEND))


# ---- flags several commands share ---------------------------------------------------------------------


def preset(default: str, help: str | None = None):
    return text(default, help)


def device(default: str, help: str | None = None):
    return text(default, help)


def precision(default: str = "fp32", help: str | None = None):
    return field(default=default, metadata=flag(help, check=OneOf(Precision.values, "precision")))


def mode(default: str, help: str | None = None):
    return field(default=default, metadata=flag(help, check=OneOf(Mode.values, "mode")))


def size(default: str | None, help: str | None = None):
    """One WxH bucket (checked against the preset's where it is read)."""
    return text(default, help)


def sizes(default: str | None, help: str | None = None):
    """Comma-separated WxH buckets."""
    return text(default, help)


def steps(default: int | None, help: str | None = None):
    """Denoising steps; a command whose default is the preset's takes 0 for it too."""
    return count(default, help, high=MAX_STEPS, zero="the preset's" if default is None else None)


def threads(help: str):
    """Torch CPU threads (default: the command's own choice)."""
    return count(None, help, high=MAX_THREADS, zero="the default")


def cache_dir(check=None):
    """The persistent folder of models and compile caches (default: $SHOWCASE_CACHE_DIR or ~/.cache/...)."""
    return field(default=None, metadata=flag(None, check=check))


def out(default: str | Path | None, help: str | None = None, check=None):
    """Where the command writes its results."""
    return field(default=default, metadata=flag(help, check=check))


def as_json(help: str | None = None):
    """--json: print the result as JSON."""
    return switch(help)
