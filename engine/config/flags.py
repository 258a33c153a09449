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
from pathlib import Path

from engine import settings
from engine.protocol import EngineOptions, MemoryLevers, Size, memory_forms

MAX_BATCH = 64  # each batch size is one more graph per bucket, and the measuring run allocates the largest
MAX_BATCH_WAIT_MS = 10_000.0
MEMORY_POLICIES = ("speed", "auto", "memory")  # engine/serving/fit.py POLICIES  # a request waits at most this long for others to share its call


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


def memory_levers(text) -> str:
    """argparse type: a memory lever set (engine/protocol/memory.py), as its canonical text ("" none)."""
    try:
        levers = MemoryLevers.parse(text)
    except ValueError as exc:  # InvalidRequest is a ValueError
        raise _Refused(str(exc)) from None
    return str(levers) if levers.enabled else ""


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


# (flag, EngineOptions field, help) for the plain on/off recipe flags.
_SWITCHES = (
    ("--fuse-qkv", "fuse_qkv", "fuse the denoiser's QKV projections"),
    ("--channels-last", "channels_last", "channels_last for UNet/VAE convolutions"),
    ("--cpu-offload", "cpu_offload", "model CPU offload (then only regional compile)"),
    ("--max-autotune", "max_autotune", "torch.compile mode=max-autotune (inductor)"),
    ("--dynamic", "dynamic", "dynamic-shape compile where the device allows"),
    ("--cuda-graphs", "cuda_graphs", "CUDA graphs: compile with mode=reduce-overhead, aot with triton.cudagraphs "
                                     "(CUDA only)"),
)


def add_engine_arguments(parser: argparse.ArgumentParser, attention_backends: Iterable[str] | None = None) -> None:
    """The engine flags on `parser`. `attention_backends`: the names --attention-backend may take (the
    registry lives in engine/pipeline/, above this layer; a caller that passes none leaves the name to the
    engine, which refuses an unknown one when it loads)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--cache-dir", type=Path, default=None,
                   help="persistent folder for tiny models and compile caches (default: $SHOWCASE_CACHE_DIR or "
                        "~/.cache/diffusion-showcase)")
    g.add_argument("--model", default=None, help="serve any Hub id or local diffusers folder (buckets from its family)")
    g.add_argument("--model-root", action="append", default=[], type=Path,
                   help="a folder local models may be loaded from (repeatable)")
    g.add_argument("--buckets", type=_sizes, default=None, help="comma-separated WxH buckets for --model")
    for flag, _, help_text in _SWITCHES:
        g.add_argument(flag, action="store_true", help=help_text)
    g.add_argument("--no-compile-vae", action="store_true", help="compile mode leaves vae.decode eager")
    g.add_argument("--loras", action="store_true",
                   help="give the preset's LoRA styles a hot-swap slot in the denoiser (off by default: the slot's "
                        "matmuls run on every step, styled or not)")
    g.add_argument("--inductor-flags", action=argparse.BooleanOptionalAction, default=None,
                   help="flux-fast inductor flags (default: on for CUDA)")
    names = tuple(attention_backends) if attention_backends is not None else None
    g.add_argument("--attention-backend", default="native", metavar="NAME",
                   type=one_of(lambda: names, "attention backend") if names else str,
                   help="diffusers attention backend of the denoiser (native, _native_flash, flex, flash, _flash_3_hub, "
                        "sage, ...); `python -m engine attention` lists which can run here and why not")
    g.add_argument("--memory-lever", dest="memory_lever", type=memory_levers, default="", metavar="LEVERS",
                   help="memory levers of the engines a request names none for, comma-separated: "
                        f"{memory_forms()} (`python -m engine memory-levers` lists which run here)")
    g.add_argument("--memory", dest="memory_policy", type=one_of(lambda: MEMORY_POLICIES, "memory policy"),
                   default="speed", help="the memory levers of an engine no --memory-lever or request names: speed "
                                         "(none), auto (the fastest set whose estimate fits the device's free "
                                         "memory), memory (the smallest); README has the table")
    g.add_argument("--prompt-cache", type=whole(0, 4096, zero="off"), default=EngineOptions.prompt_cache_entries,
                   metavar="N", help="keep the embeddings of the last N prompts per engine, so a repeated prompt "
                                     f"skips the text encoders (default {EngineOptions.prompt_cache_entries}, at "
                                     f"most {EngineOptions.prompt_cache_mib} MiB)")
    g.add_argument("--max-batch", type=whole(1, MAX_BATCH), default=None, metavar="N",
                   help="at most N queued requests that can share a denoiser call (same bucket, steps, guidance, "
                        f"step cache) run as one pipeline call; 1 turns batching off, at most {MAX_BATCH} "
                        f"(default per device: {per_device('max_batch')})")
    g.add_argument("--batch-wait-ms", type=decimal(0, MAX_BATCH_WAIT_MS), default=EngineOptions.batch_wait_ms,
                   metavar="MS",
                   help="how long a request waits after it arrives for others to share its call "
                        f"(default {EngineOptions.batch_wait_ms:g}; requests queued behind a running call join at once)")


def options_from_args(args, **overrides) -> EngineOptions:
    values = {field: getattr(args, field) for _, field, _ in _SWITCHES}
    values.update(compile_vae=not args.no_compile_vae, inductor_flags=args.inductor_flags,
                  attention_backend=getattr(args, "attention_backend", None) or "native",
                  max_batch=getattr(args, "max_batch", None),
                  batch_wait_ms=getattr(args, "batch_wait_ms", EngineOptions.batch_wait_ms),
                  loras=getattr(args, "loras", False) or bool(getattr(args, "lora", None)),  # a style needs the slot
                  memory=getattr(args, "memory_lever", "") or "",
                  memory_policy=getattr(args, "memory_policy", "speed") or "speed",
                  prompt_cache_entries=getattr(args, "prompt_cache", EngineOptions.prompt_cache_entries))
    values.update(overrides)
    return EngineOptions(**values)


def engine_flags_argv(args) -> tuple[str, ...]:
    """The recipe flags of a parsed command line as argv again (for a child process that must match)."""
    flags = [flag for flag, field, _ in _SWITCHES if getattr(args, field, False)]
    if getattr(args, "no_compile_vae", False):
        flags.append("--no-compile-vae")
    if getattr(args, "loras", False):
        flags.append("--loras")
    if args.inductor_flags is not None:
        flags.append("--inductor-flags" if args.inductor_flags else "--no-inductor-flags")
    backend = getattr(args, "attention_backend", None) or "native"
    if backend != "native":
        flags += ["--attention-backend", backend]
    if getattr(args, "max_batch", None) is not None:
        flags += ["--max-batch", str(args.max_batch)]
    if getattr(args, "memory_lever", ""):
        flags += ["--memory-lever", args.memory_lever]
    if getattr(args, "memory_policy", "speed") != "speed":
        flags += ["--memory", args.memory_policy]
    if getattr(args, "prompt_cache", EngineOptions.prompt_cache_entries) != EngineOptions.prompt_cache_entries:
        flags += ["--prompt-cache", str(args.prompt_cache)]
    wait_ms = getattr(args, "batch_wait_ms", EngineOptions.batch_wait_ms)
    if wait_ms != EngineOptions.batch_wait_ms:
        flags += ["--batch-wait-ms", f"{wait_ms:g}"]
    return tuple(flags)


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

