"""The engine flags, defined once: the CLI sub-commands, app.py and the bench all take them.

Every numeric and named flag is checked as argparse parses it (`whole`, `decimal`, `one_of`, `comma_list`:
argparse `type=` callables), so a bad value stops the program before anything loads, with one line naming
the flag and what it takes (`OneLineParser`). Nothing here imports torch, so `--help` stays instant: the
per-device defaults it shows are read from engine/devices/'s source (`device_defaults`), not imported.
"""

from __future__ import annotations

import argparse
import ast
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine import settings
from engine.protocol import BatchingOptions, EngineOptions, RecipeOptions, Size
from engine.protocol.flagfields import (
    APPEND,
    NEGATED,
    OPTIONAL_BOOL,
    POSITIONAL,
    SWITCH,
    Decimal,
    Flag,
    OneOf,
    Whole,
    field_default,
    flag,
    flag_fields,
)
from engine.protocol.options import memory_text

_Refused = argparse.ArgumentTypeError  # argparse prints its text after "argument --flag: "


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose error is one line (the flag, the value, what it takes), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def _shown(value) -> str:
    text = repr(str(value))
    return text if len(text) <= 40 else text[:37] + "..."


def as_text(value):
    """A default as text: argparse checks a text default with the flag's type, so an environment variable
    gets the same check as the flag."""
    return None if value is None else str(value)


def whole(low: int, high: int, *, zero: str | None = None) -> Callable[[str], int]:
    """argparse type: a whole number in low..high (and 0 meaning `zero`, when given)."""
    allowed = f"{low}..{high}" + (f", or 0 ({zero})" if zero else "")

    def parse(text) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise _Refused(f"{_shown(text)} is not a whole number; allowed: {allowed}") from None
        if not (low <= value <= high or (zero and value == 0)):
            raise _Refused(f"{value} is out of range; allowed: {allowed}")
        return value

    return parse


def decimal(low: float, high: float, *, zero: str | None = None) -> Callable[[str], float]:
    """argparse type: a finite number in low..high (and 0 meaning `zero`, when given)."""
    allowed = f"{low:g}..{high:g}" + (f", or 0 ({zero})" if zero else "")

    def parse(text) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise _Refused(f"{_shown(text)} is not a number; allowed: {allowed}") from None
        if not (math.isfinite(value) and (low <= value <= high or (zero and value == 0))):
            raise _Refused(f"{value:g} is out of range; allowed: {allowed}")
        return value

    return parse


def one_of(names: Callable[[], Iterable[str]], what: str, *, lower: bool = True) -> Callable[[str], str]:
    """argparse type: one of `names()` (read when a value is checked: a preset file, a registry)."""

    def parse(text) -> str:
        value = str(text).strip()
        value = value.lower() if lower else value
        allowed = list(names())
        if value not in allowed:
            raise _Refused(f"unknown {what} {_shown(text)}; choose one of: {', '.join(allowed)}")
        return value

    return parse


def comma_list(item: Callable[[str], str]) -> Callable[[str], str]:
    """argparse type: comma-separated values, each checked by `item`; the checked list, comma-joined."""

    def parse(text) -> str:
        values = [item(t) for t in str(text).split(",") if t.strip()]
        if not values:
            raise _Refused(f"{_shown(text)} names nothing; give a comma-separated list")
        return ",".join(values)

    return parse


def _sizes(text) -> str:
    try:
        return ",".join(str(Size.parse(t)) for t in str(text).split(",") if t.strip())
    except ValueError as exc:  # InvalidRequest is a ValueError
        raise _Refused(str(exc)) from None


def checked(parse: Callable) -> Callable[[str], object]:
    """argparse type from a parser that raises ValueError (InvalidRequest is one) saying what it takes."""

    def check(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise _Refused(str(exc)) from None

    check.__name__ = getattr(parse, "__name__", "value")
    return check


memory_levers = checked(memory_text)  # argparse type: a memory lever set as its canonical text ("" none)


_DEVICES = Path(__file__).resolve().parent.parent / "devices"
_ARITHMETIC = {ast.Mult: lambda a, b: a * b, ast.Pow: lambda a, b: a**b, ast.Add: lambda a, b: a + b,
               ast.Sub: lambda a, b: a - b}


def _constant(node: ast.expr):
    """A literal, or arithmetic on literals (`700 * 2**20`); ValueError for anything else."""
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_constant(node.left), _constant(node.right))
    return ast.literal_eval(node)


@functools.cache
def device_defaults(field: str) -> dict[str, object] | None:
    """`DeviceSpec.<field>` of every device kind, read from engine/devices/'s source instead of imported (it
    imports torch, and `--help` must not): the literal each device module's `spec()` passes, else the
    class default. None when the source says it in any other way (tests/test_flags.py compares the result
    with the registry)."""
    try:
        def tree(module: str) -> ast.Module:
            return ast.parse((_DEVICES / f"{module}.py").read_text())

        spec_class = next(n for n in tree("spec").body if isinstance(n, ast.ClassDef) and n.name == "DeviceSpec")
        default = next(_constant(n.value) for n in spec_class.body
                       if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == field)
        modules = next(n.value for n in tree("registry").body if isinstance(n, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == "DEVICE_MODULES" for t in n.targets))
        values = {}
        for module in (m.id for m in modules.elts):
            body = tree(module)
            constants = {t.id: n.value.value for n in body.body if isinstance(n, ast.Assign)
                         and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
            call = next(n for n in ast.walk(body) if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Name) and n.func.id == "DeviceSpec")
            keywords = {k.arg: k.value for k in call.keywords}
            name = keywords["name"]
            name = constants[name.id] if isinstance(name, ast.Name) else ast.literal_eval(name)
            values[name] = _constant(keywords[field]) if field in keywords else default
        return values
    except (OSError, SyntaxError, StopIteration, KeyError, ValueError, AttributeError, TypeError):
        return None


def per_device(field: str) -> str:
    """'cpu 8, cuda and xpu 4, mps 2, neuron and tpu 1': a DeviceSpec field per device (README says it so)."""
    values = device_defaults(field)
    if not values:
        return "the device's; `python -m engine devices` lists them"
    groups: dict[object, list[str]] = {}
    for name, value in values.items():
        groups.setdefault(value, []).append(name)
    return ", ".join(f"{' and '.join(sorted(names))} {value}"
                     for value, names in sorted(groups.items(), key=lambda kv: kv[0], reverse=True))


# ------------------------------------------------------------------------------------------------
# Flags from config dataclasses: a field with `flag(...)` metadata (engine/protocol/flagfields.py) is a flag
# ------------------------------------------------------------------------------------------------


class _PerDevice:
    """"{per_device[max_batch]}" in a help text: that DeviceSpec field per device kind."""

    def __getitem__(self, field: str) -> str:
        return per_device(field)


def _argparse_type(check, names=None):
    if isinstance(check, Whole):
        return whole(check.low, check.high, zero=check.zero)
    if isinstance(check, Decimal):
        return decimal(check.low, check.high, zero=check.zero)
    if isinstance(check, OneOf):
        listed = names if names is not None else check.names
        return one_of(listed, check.what, lower=check.lower) if listed is not None else str
    if isinstance(check, type):
        return check  # int, float, Path: argparse's own refusal ("invalid int value: 'x'")
    return checked(check) if check is not None else None


def _argument(f, how: Flag, defaults: dict | None, names: dict) -> tuple[tuple, dict]:
    """add_argument's (names, keywords) for field `f`."""
    default = field_default(f)
    if how.env is not None and defaults is not None and defaults[how.env] is not None:
        default = defaults[how.env]  # unset: the field's default
    flags = (how.short, how.flag_name(f.name)) if how.short else (how.flag_name(f.name),)
    text = how.help() if callable(how.help) else how.help  # a callable: text read from a registry now
    text = text.format(default=default, per_device=_PerDevice()) if text else text
    kw: dict = {"dest": how.dest or f.name, "help": text}
    if how.kind == POSITIONAL:  # argparse names a positional's dest after it, and refuses a second one
        flags, kw = (f.name,), {"help": text}
    if how.kind in (SWITCH, NEGATED):
        return flags, {**kw, "action": "store_true"}
    if how.kind == OPTIONAL_BOOL:
        return flags, {**kw, "action": argparse.BooleanOptionalAction, "default": default}
    kind = _argparse_type(how.check, names.get(f.name))
    kw.update(default=as_text(default) if how.as_text else default,
              **{k: v for k, v in (("type", kind), ("metavar", how.metavar), ("choices", how.choices),
                                   ("nargs", how.nargs), ("const", how.const)) if v is not None})
    if how.kind == APPEND:
        kw.update(action="append", default=list(default or ()))
    return flags, kw


def add_fields(group, cls, defaults: dict | None = None, names: dict | None = None) -> None:
    """One argparse argument per flag field of config dataclass `cls`, in field order. `defaults`: the
    environment's defaults by Flag.env key (settings.server_defaults()); `names`: field -> the names a
    OneOf(None, ...) field may take."""
    for f, how in flag_fields(cls):
        flags, kw = _argument(f, how, defaults, names or {})
        group.add_argument(*flags, **kw)


def field_values(cls, args) -> dict:
    """The parsed values of `cls`'s flag fields, by field name (a flag a parser lacks: the field's default)."""
    values = {}
    for f, how in flag_fields(cls):
        value = getattr(args, how.dest or f.name, None if how.kind != SWITCH else False)
        values[f.name] = (not value) if how.kind == NEGATED else value
        if how.kind not in (SWITCH, NEGATED, OPTIONAL_BOOL) and value is None:
            values[f.name] = field_default(f)
    return values


def from_args(cls, args, **overrides):
    """Config dataclass `cls` from a parsed command line (its flag fields; `overrides` replace any)."""
    return cls(**{**field_values(cls, args), **overrides})


def argv_of(cls, args) -> list[str]:
    """`cls`'s flag fields of a parsed command line as argv again, those that differ from the default."""
    argv: list[str] = []
    for f, how in flag_fields(cls):
        value, default, name = field_values(cls, args)[f.name], field_default(f), how.flag_name(f.name)
        if value == default or (how.kind == APPEND and not value):
            continue
        if how.kind in (SWITCH, NEGATED):
            argv.append(name)
        elif how.kind == OPTIONAL_BOOL:
            argv.append(name if value else "--no-" + name.removeprefix("--"))
        elif how.kind == POSITIONAL:
            argv.append(str(value))
        else:
            argv += [name, f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


@dataclass(frozen=True)
class SourceFlags:
    """Where an engine's weights and caches come from (read by `presets_from_args` and the manager)."""

    cache_dir: Path | None = field(default=None, metadata=flag(
        "persistent folder for tiny models and compile caches (default: $SHOWCASE_CACHE_DIR or "
        "~/.cache/diffusion-showcase)", check=Path))
    model: str | None = field(default=None, metadata=flag(
        "serve any Hub id or local diffusers folder (buckets from its family)"))
    model_root: tuple[Path, ...] = field(default=(), metadata=flag(
        "a folder local models may be loaded from (repeatable)", kind=APPEND, check=Path))
    buckets: str | None = field(default=None, metadata=flag("comma-separated WxH buckets for --model",
                                                            check=lambda text: _sizes(text)))


ENGINE_FLAG_CONFIGS = (RecipeOptions, BatchingOptions)  # the EngineOptions parts whose fields are engine flags


def add_engine_arguments(parser: argparse.ArgumentParser, attention_backends: Iterable[str] | None = None) -> None:
    """The engine flags on `parser`. `attention_backends`: the names --attention-backend may take (the
    registry lives in engine/pipeline/, above this layer; a caller that passes none leaves the name to the
    engine, which refuses an unknown one when it loads)."""
    g = parser.add_argument_group("engine")
    add_fields(g, SourceFlags)
    names = tuple(attention_backends) if attention_backends is not None else None
    for cls in ENGINE_FLAG_CONFIGS:
        add_fields(g, cls, names={"attention_backend": (lambda: names) if names else None})


def options_from_args(args, **overrides) -> EngineOptions:
    values = {name: value for cls in ENGINE_FLAG_CONFIGS for name, value in field_values(cls, args).items()}
    values["attention_backend"] = values["attention_backend"] or "native"
    values["loras"] = values["loras"] or bool(getattr(args, "lora", None))  # a style needs the slot
    values.update(overrides)
    return EngineOptions(**values)


def engine_flags_argv(args) -> tuple[str, ...]:
    """The engine flags of a parsed command line as argv again (for a child process that must match)."""
    return tuple(flag for cls in ENGINE_FLAG_CONFIGS for flag in argv_of(cls, args))


def model_roots_from_args(args) -> list[Path]:
    """SHOWCASE_MODEL_ROOTS + --model-root, plus the parent of a --model path typed on the command line."""
    roots = [*settings.model_roots(), *[Path(r).resolve() for r in args.model_root]]
    if args.model:
        model_path = Path(args.model).expanduser()
        if model_path.exists() or args.model.startswith((".", "/", "~")):
            roots.append(model_path.resolve().parent)
    return roots


def presets_from_args(args) -> tuple[list[Path], dict]:
    """(allowed model roots, extra presets) of a command line: --model becomes a preset of its own (and
    args.preset names it)."""
    from engine.config.presets import preset_for_model

    roots = model_roots_from_args(args)
    extra = {}
    if args.model:
        preset = preset_for_model(args.model, roots, buckets=args.buckets)
        extra[preset.name] = preset
        args.preset = preset.name
    return roots, extra

