"""How a config dataclass field is a command-line flag: `field(default=..., metadata=flag("help", ...))`.

engine/config/flags.py reads these (`add_fields`, `from_args`, `argv_of`), so a new option is one field: its
name, type and default are the field's, its help and check the metadata's. Plain data: the checks are
ranges (`Whole`, `Decimal`), a list of names (`OneOf`) or a callable that turns text into the value and
raises ValueError with what it takes. Nothing here imports argparse or torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SWITCH = "switch"  # --flag sets True
NEGATED = "negated"  # --no-flag sets the field False (default True)
OPTIONAL_BOOL = "optional-bool"  # --flag / --no-flag; None when neither is given
VALUE = "value"  # --flag VALUE
APPEND = "append"  # --flag VALUE, repeatable
POSITIONAL = "positional"  # VALUE with no flag name before it, named after the field


@dataclass(frozen=True)
class Whole:
    """A whole number in low..high (and 0 meaning `zero`, when given)."""

    low: int
    high: int
    zero: str | None = None


@dataclass(frozen=True)
class Decimal:
    """A finite number in low..high (and 0 meaning `zero`, when given)."""

    low: float
    high: float
    zero: str | None = None


@dataclass(frozen=True)
class OneOf:
    """One of `names()` (read when a value is checked), spelled `what` in the refusal; `names` None: the
    caller gives them (`add_fields(..., names={field: ...})`, a registry above this layer)."""

    names: Callable[[], Iterable[str]] | None
    what: str
    lower: bool = True


@dataclass(frozen=True)
class Flag:
    """A field's flag. `help` (or a callable giving it when the parser is built, for text read from a
    registry) may hold "{default}" (the field's default) and "{per_device[FIELD]}" (a
    DeviceSpec field per device kind). `env`: the key of settings.server_defaults() whose value is the
    default (an environment variable), checked as the flag would be when `as_text`."""

    help: str | Callable[[], str] | None = None
    name: str | None = None  # default: --field-name
    dest: str | None = None  # default: the field's name
    kind: str = VALUE
    check: object = None  # Whole | Decimal | OneOf | a type (int, Path) | callable(text) -> value | None (text)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    env: str | None = None
    as_text: bool = False
    short: str | None = None  # e.g. "-v"
    nargs: str | None = None
    const: object = None

    def flag_name(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def flag(help: str | None = None, **how) -> dict:
    """A field's metadata making it a flag (see Flag)."""
    return {"flag": Flag(help, **how)}


def flag_fields(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of config dataclass `cls` that are flags, in order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
