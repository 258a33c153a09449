"""Headless command line: `python -m engine COMMAND` (`--help` lists the commands).

Sub-commands come from one table (`COMMANDS`); each module registers its own parser. Importing this
module (and `--help`, `presets`) never imports torch: sub-commands import what they need when they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine import settings
from engine.config import caches
from engine.config.flags import (
    add_engine_arguments,
    add_fields,
    from_args,
    options_from_args,
    presets_from_args,
)
from engine.config.images import read_image_file
from engine.config.presets import load_presets
from engine.config.request import ImageRequest
from engine.config.resolve import Catalog, resolve_source
from engine.errors import ShowcaseError
from engine.families import registry
from engine.protocol import DEFAULT_PRESET, Mode, Parallel, Size, lora_run_text, params
from engine.protocol.flagfields import SWITCH, flag
from engine.worker.logs import quiet_third_party

# Each sub-command's own flags are the fields of its dataclass below (engine/config/flags.py `add_fields` makes
# a field with `flag(...)` metadata its flag); the command reads them back with `from_args`. The engine flags
# (add_engine_arguments) are the config dataclasses' own.
MODES = ", ".join(Mode.values())


# `generate`: one request (its sampling fields' flags come from their declarations, engine/protocol/params.py),
# and what to do with its image.
GenerateFlags = dataclasses.make_dataclass("GenerateFlags", [*params.cli_fields(), *(
    ("no_snap", bool, field(default=False, metadata=flag("refuse sizes that are not a bucket", kind=SWITCH))),
    ("parallel", str, field(default=Parallel.TENSOR.value, metadata=flag(
        "how --tp ranks split the transformer: tensor (weights sharded), ulysses or ring (context parallel: "
        "tokens split)", choices=Parallel.values()))),
    ("out", str | None, field(default=None, metadata=flag("write the PNG here (a video preset's clip: the MP4)"))),
    ("json", bool, field(default=False, metadata=flag("print one JSON object with the timings", kind=SWITCH))),
)], frozen=True)


def oneshot_runtime(mode: Mode, tp: int, device: str) -> str:
    """Where a one-shot generate runs its engine. Eager: in this process (the `inprocess` runtime), not in
    a worker, a second interpreter importing torch and diffusers again. A worker where isolation matters:
    compiled modes (the compile runs at its own priority and a compiler crash ends the worker, not the
    command), tensor parallel (torchrun's ranks), and a device whose worker is started with mode variables
    (a variable the user exported for another mode would hold in this process)."""
    from engine import devices

    if mode is not Mode.EAGER or tp > 1 or devices.get_device(device).mode_env:
        return "workers"
    return "inprocess"


def cmd_generate(args) -> int:
    from engine.serving import stream
    from engine.serving.manager import make_manager

    o = from_args(GenerateFlags, args)
    # read (bounded) before any engine starts; decoded and checked once, at the gate
    images = tuple(read_image_file(path, f"--image {i + 1}") for i, path in enumerate(o.images))
    mask = read_image_file(o.mask, "--mask") if o.mask else None
    settings.workers_at_own_priority()
    size = Size.parse(o.size) if o.size else None
    # A one-shot run warms only the bucket it needs, and waits for it unless --on-cold eager.
    mode = Mode.parse(o.mode, "mode")
    # A one-shot run that names a style gets the LoRA slot; one that does not pays nothing for it.
    overrides = {"loras": True} if o.lora else {}
    manager = make_manager(args, options_from_args(args, warm_sizes=(), warm_modes=(mode,), **overrides),
                           runtime=oneshot_runtime(mode, o.tp, o.device))
    preset = args.preset  # with --model, make_manager (presets_from_args) named the model's own preset here
    try:
        prompt = o.prompt if o.prompt is not None else manager.catalog.preset(preset).example_prompt
        # the request's event stream, read to its end (Ctrl-C closes it, which cancels the request)
        fields = {name: getattr(o, name) for name, _, _ in params.cli_fields()}
        result = stream.generate(manager, ImageRequest(**{**fields, "preset": preset, "mode": mode, "size": size,
                                                          "prompt": prompt, "images": images, "mask": mask},
                                                       parallel=o.parallel, snap=not o.no_snap))
    finally:
        manager.shutdown()
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_bytes(result.video_mp4 or result.image_png)
    if o.json:
        print(json.dumps(result.as_dict(), indent=None))
    else:
        t = result.timings
        print(f"{result.engine} {result.bucket}: total {t.total_ms:.1f} ms, median step {t.median_step_ms:.2f} ms, "
              f"warm={result.warm} eager_fallback={result.eager_fallback} recompiles={result.recompiles}")
        if result.step_cache.enabled:
            print(f"  step cache {result.step_cache}: {len(result.cached_steps)} of {result.steps} steps cached "
                  f"({', '.join(map(str, result.cached_steps)) or 'none'})")
        if result.num_frames:
            print(f"  clip: {result.num_frames} frames at {result.fps} fps, decode {t.decode_ms:.1f} ms, "
                  f"MP4 {len(result.video_mp4):,} bytes in {result.video_encode_ms:.0f} ms")
        if result.lora_run.choice.name:
            print(f"  LoRA {lora_run_text(result.as_dict())}")
        for notice in result.notices:
            print(f"  note: {notice}")
        if o.out:
            print(f"wrote {o.out}")
    return 0


@dataclass(frozen=True)
class ListFlags:
    """`devices`, `presets`: a table, or JSON."""

    json: bool = field(default=False, metadata=flag(kind=SWITCH))


def cmd_devices(args) -> int:
    from engine.devices import devices_report

    report = devices_report()
    if from_args(ListFlags, args).json:
        print(json.dumps(report, indent=2))
    else:
        for d in report:
            state = "available" if d["available"] else f"unavailable: {d['reason']}"
            print(f"{d['name']:7s} {d['label']:40s} {state}")
    return 0


def cmd_presets(args) -> int:
    presets = load_presets()
    if from_args(ListFlags, args).json:
        print(json.dumps([p.describe() for p in presets.values()], indent=2))
        return 0
    for p in presets.values():
        print(f"{p.name:18s} {p.pipeline:28s} task={registry.find(p.pipeline).task:14s} steps={p.steps:<3d} "
              f"guidance={p.guidance:<4g} buckets={','.join(str(b) for b in p.buckets)}")
        for lora in p.loras:
            print(f"{'':18s}   LoRA {lora.name} (scale {lora.scale:g}){': ' + lora.description if lora.description else ''}")
    return 0


@dataclass(frozen=True)
class AttentionFlags:
    """`attention`: the backends of one device at one precision."""

    device: str = field(default="auto", metadata=flag())
    precision: str = field(default="bf16", metadata=flag("flash, cuDNN, sage and FA3 kernels take bf16/fp16 only"))
    json: bool = field(default=False, metadata=flag(kind=SWITCH))


def cmd_attention(args) -> int:
    from engine import devices
    from engine.pipeline import attention

    o = from_args(AttentionFlags, args)
    spec = devices.resolve_device(o.device) if o.device == devices.AUTO else devices.get_device(o.device)
    available = spec.probe()
    precision = devices.plan_precision(spec, o.precision).precision if available.available else o.precision
    rows = attention.attention_table(spec, precision)
    if o.json:
        print(json.dumps({"device": spec.name, "available": available.available, "reason": available.reason,
                          "precision": str(precision), "backends": rows}, indent=2))
        return 0
    print(f"attention backends on {spec.label} [{spec.name}] in {precision}"
          + ("" if available.available else f" (device not available here: {available.reason})"))
    print(attention.format_table(rows))
    return 0


def cmd_export(args) -> int:
    """Build the aot packages of an engine's buckets ahead of time (a Docker build step, a Space's start-up, CI)."""
    from engine.pipeline import runner

    catalog = Catalog(*presets_from_args(args))
    o = from_args(ExportFlags, args)  # after presets_from_args: --model names its own preset
    key = catalog.make_key(o.preset, o.device, o.precision)
    cache = caches.prepare_cache_dir(args.cache_dir or settings.cache_dir())
    for notice in cache.notices:
        print(f"warning: {notice}", file=sys.stderr)
    options = catalog.options_for(key, options_from_args(args, warm_sizes=(), warm_modes=()))
    config = catalog.config(key, options, cache.path)
    sizes = tuple(Size.parse(s) for s in o.sizes.split(",") if s.strip()) if o.sizes else None
    rows = runner.export_aot_packages(config, sizes, rebuild=o.rebuild, progress=not o.no_progress)
    if o.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            what = r["origin"] if r["state"] == "warm" else f"{r['state']}: {r['error']}"
            print(f"{r['bucket']:16s} {what}  ({r['seconds']:.1f} s)")
        print(f"packages in {settings.aot_dir() or config.cache_path() / 'aot'}")
    ok = all(r["state"] == "warm" for r in rows)
    if ok and o.push_to:
        from engine.pipeline import aot_hub

        url = aot_hub.push_packages(o.push_to, settings.aot_dir() or config.cache_path() / "aot", preset=key.preset)
        print(f"pushed to {o.push_to}: {url}", file=sys.stderr)
    return 0 if ok else 1


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate one image and print its timings")
    add_fields(g, GenerateFlags)
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)


def add_devices_parser(sub) -> None:
    d = sub.add_parser("devices", help="list devices: available, or why not")
    add_fields(d, ListFlags)
    d.set_defaults(func=cmd_devices)


def add_presets_parser(sub) -> None:
    p = sub.add_parser("presets", help="list model presets and their buckets")
    add_fields(p, ListFlags)
    p.set_defaults(func=cmd_presets)


def add_attention_parser(sub) -> None:
    a = sub.add_parser("attention", help="list diffusers attention backends: which can run here, and why not")
    add_fields(a, AttentionFlags)
    a.set_defaults(func=cmd_attention)


@dataclass(frozen=True)
class StepCacheFlags:
    """`step-caches`: which caches run for a preset on a device in a mode."""

    preset: str = field(default=DEFAULT_PRESET, metadata=flag())
    device: str = field(default="auto", metadata=flag())
    mode: str = field(default="eager", metadata=flag(MODES))
    json: bool = field(default=False, metadata=flag(kind=SWITCH))


def cmd_step_caches(args) -> int:
    from engine import devices
    from engine.pipeline import stepcache

    catalog = Catalog(*presets_from_args(args))
    o = from_args(StepCacheFlags, args)  # after presets_from_args: --model names its own preset
    preset = catalog.preset(o.preset)
    spec = devices.resolve_device(o.device) if o.device == devices.AUTO else devices.get_device(o.device)
    rows = stepcache.available_step_caches(preset, spec, o.mode)
    if o.json:
        print(json.dumps({"preset": preset.name, "device": spec.name, "mode": o.mode, "caches": rows}, indent=2))
        return 0
    print(f"step caches for {preset.name} on {spec.label} [{spec.name}], mode {o.mode}")
    print(stepcache.format_table(rows))
    return 0


def add_step_caches_parser(sub) -> None:
    s = sub.add_parser("step-caches", help="list diffusers step caches: which can run for a preset here, and why not")
    add_fields(s, StepCacheFlags)
    add_engine_arguments(s)
    s.set_defaults(func=cmd_step_caches)


@dataclass(frozen=True)
class MemoryLeverFlags:
    """`memory-levers`: the levers of a device (and mode), or a preset's estimate per lever set."""

    device: str = field(default="auto", metadata=flag())
    mode: str | None = field(default=None, metadata=flag("only as combined with this mode: " + MODES))
    preset: str | None = field(default=None, metadata=flag("estimate this preset's memory with each lever set instead"))
    precision: str = field(default="bf16", metadata=flag())
    size: str | None = field(default=None, metadata=flag("WxH (default: the preset's largest bucket)"))
    free: str | None = field(default=None, metadata=flag("the memory --memory auto fits, e.g. 22GiB", metavar="SIZE"))
    json: bool = field(default=False, metadata=flag(kind=SWITCH))


def cmd_memory_levers(args) -> int:
    from engine import devices
    from engine.pipeline import memory

    o = from_args(MemoryLeverFlags, args)
    spec = devices.resolve_device(o.device) if o.device == devices.AUTO else devices.get_device(o.device)
    if o.preset:
        return print_fit(args, spec)
    mode = Mode.parse(o.mode, "mode") if o.mode else None
    rows = memory.lever_table(spec, mode)
    if o.json:
        print(json.dumps({"device": spec.name, "mode": o.mode, "levers": rows}, indent=2))
        return 0
    print(f"memory levers on {spec.label} [{spec.name}]" + (f", mode {mode}" if mode else "")
          + " (engine: part of the engine key; request: set per request)")
    print(memory.format_table(rows))
    return 0


def print_fit(args, spec) -> int:
    """`memory-levers --preset P`: each lever set's estimate for P on `spec`, and what each policy picks."""
    from engine.serving import budget, fit

    catalog = Catalog(*presets_from_args(args))
    o = from_args(MemoryLeverFlags, args)  # after presets_from_args: --model names its own preset
    preset = catalog.preset(o.preset)
    size = Size.parse(o.size) if o.size else max(preset.buckets, key=lambda s: s.pixels)
    key = catalog.make_key(preset.name, spec.name, o.precision) if spec.probe().available else None
    source = None if key is None else Path(resolve_source(catalog.config(key, options_from_args(args),
                                                                         settings.cache_dir())))
    model = fit.model_for(preset, source if source is not None and source.is_dir() else None, o.precision)
    rows = fit.options(model, spec, size.width, size.height, spec.process_overhead_bytes)
    free = budget.parse_size(o.free) if o.free else (
        spec.default_memory_budget()[0] if spec.probe().available else None)
    if o.json:
        print(json.dumps({"preset": preset.name, "device": spec.name, "size": str(size), "estimates": [
            e.as_dict() for e in rows], "picks": {p: fit.choose(rows, free, p)[0].levers for p in fit.POLICIES}}))
        return 0
    print(f"{preset.name} {o.precision} at {size} on {spec.label} [{spec.name}]: estimated peak per lever set")
    for e in rows:
        print(f"  {e.levers or 'none':38s} {e.device_bytes / 2**30:7.2f} GiB  ≈ {e.time_factor:g}× the time")
    print(fit.advice_line(preset.name, o.precision, rows))
    for policy in fit.POLICIES:
        print(f"--memory {policy}: {fit.choose(rows, free, policy)[1]}")
    return 0


def add_memory_levers_parser(sub) -> None:
    m = sub.add_parser("memory-levers", help="list memory levers (offload, layerwise casting, VAE tiling, ...): which "
                                             "can run on a device, with which modes, and why not")
    add_fields(m, MemoryLeverFlags)
    add_engine_arguments(m)
    m.set_defaults(func=cmd_memory_levers)


@dataclass(frozen=True)
class ExportFlags:
    """`export`: which buckets of which engine, and where the packages go."""

    preset: str = field(default=DEFAULT_PRESET, metadata=flag())
    device: str = field(default="auto", metadata=flag())
    precision: str = field(default="fp32", metadata=flag())
    sizes: str | None = field(default=None, metadata=flag(
        "comma-separated WxH buckets (default: every bucket of the preset)"))
    rebuild: bool = field(default=False, metadata=flag("build even where a valid package exists", kind=SWITCH))
    no_progress: bool = field(default=False, metadata=flag(kind=SWITCH))
    json: bool = field(default=False, metadata=flag("print one JSON list, a row per bucket", kind=SWITCH))
    push_to: str | None = field(default=None, metadata=flag(
        "then upload the preset's packages to this Hub model repo (created private; token: $HF_TOKEN); the app "
        "downloads them with --aot-repo", metavar="REPO_ID"))


def add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="build the aot (AOTInductor) packages of an engine's buckets ahead of time")
    add_fields(e, ExportFlags)
    add_engine_arguments(e)  # options that change the graph (--fuse-qkv, --attention-backend, ...) must match the app's
    e.set_defaults(func=cmd_export)


# Every sub-command: its name -> "module:function" that adds its parser. Imported when the parser is built
# (only the named command's when the command line names one); an ImportError there is a bug and is raised,
# never hidden.
COMMANDS = {
    "generate": "engine.cli:add_generate_parser",
    "devices": "engine.cli:add_devices_parser",
    "presets": "engine.cli:add_presets_parser",
    "attention": "engine.cli:add_attention_parser",
    "step-caches": "engine.cli:add_step_caches_parser",
    "memory-levers": "engine.cli:add_memory_levers_parser",
    "export": "engine.cli:add_export_parser",
}
# The measuring commands live in the bench package (`python -m bench COMMAND`), which the engine never
# imports: named here only so that `python -m engine bench` says where the command went.
MEASURING = ("bench", "soak", "load", "fairness", "contention", "cp-bench", "advise", "lora-bench",
             "memory-bench", "oneshot", "fleet-bench", "edit-bench", "video-bench", "vae-bench",
             "inpaint-bench", "step-bench")


@dataclass(frozen=True)
class CommandLine:
    """The flags before the sub-command's name."""

    verbose: bool = field(default=False, metadata=flag(kind=SWITCH, short="-v"))


def build_parser(command: str | None = None, commands: dict[str, str] | None = None,
                 prog: str = "python -m engine", description: str | None = __doc__) -> argparse.ArgumentParser:
    """The parser of every sub-command of `commands` (the engine's by default), or of `command` alone when
    it is one of them."""
    import importlib

    commands = COMMANDS if commands is None else commands
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_fields(parser, CommandLine)
    sub = parser.add_subparsers(dest="command", required=True)
    for entry in [commands[command]] if command in commands else commands.values():
        module, function = entry.split(":")
        getattr(importlib.import_module(module), function)(sub)
    return parser


def main(argv: list[str] | None = None, commands: dict[str, str] | None = None, prog: str = "python -m engine",
         description: str | None = __doc__) -> int:
    """Parse and run one sub-command; the bench's entry (bench/__main__.py) runs its own table through this."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((word for word in argv if not word.startswith("-")), None)
    if commands is None and command in MEASURING:
        print(f"error: `{command}` measures and moved to the bench package: python -m bench {command} ...",
              file=sys.stderr)
        return 2
    args = build_parser(command, commands, prog, description).parse_args(argv)
    logging.basicConfig(level=logging.INFO if from_args(CommandLine, args).verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party()  # the harmless library messages the app drops (engine/worker/logs.py)
    try:
        return args.func(args)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
