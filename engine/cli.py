"""Headless command line: `python -m engine COMMAND` (`--help` lists the commands).

Sub-commands come from one table (`COMMANDS`); each module registers its own parser. Importing this
module (and `--help`, `presets`) never imports torch: sub-commands import what they need when they run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from engine import settings
from engine.config import caches
from engine.config.flags import add_engine_arguments, options_from_args, presets_from_args
from engine.config.presets import load_presets
from engine.config.request import ImageRequest
from engine.config.resolve import Catalog, resolve_source
from engine.errors import ShowcaseError
from engine.protocol import DEFAULT_PRESET, Mode, OnCold, Parallel, Size, step_cache_forms
from engine.worker.logs import quiet_third_party


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

    settings.workers_at_own_priority()
    size = Size.parse(args.size) if args.size else None
    # A one-shot run warms only the bucket it needs, and waits for it unless --on-cold eager.
    mode = Mode.parse(args.mode, "mode")
    # A one-shot run that names a style gets the LoRA slot; one that does not pays nothing for it.
    overrides = {"loras": True} if args.lora else {}
    manager = make_manager(args, options_from_args(args, warm_sizes=(), warm_modes=(mode,), **overrides),
                           runtime=oneshot_runtime(mode, args.tp, args.device))
    try:
        prompt = args.prompt if args.prompt is not None else manager.catalog.preset(args.preset).example_prompt
        # the request's event stream, read to its end (Ctrl-C closes it, which cancels the request)
        result = stream.generate(manager, ImageRequest(preset=args.preset, device=args.device,
                                                       precision=args.precision, mode=mode, size=size, prompt=prompt,
                                                       negative_prompt=args.negative_prompt, steps=args.steps,
                                                       guidance=args.guidance, seed=args.seed, tp=args.tp,
                                                       parallel=args.parallel, snap=not args.no_snap,
                                                       on_cold=args.on_cold, step_cache=args.cache, lora=args.lora))
    finally:
        manager.shutdown()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_bytes(result.image_png)
    if args.json:
        print(json.dumps(result.as_dict(), indent=None))
    else:
        t = result.timings
        print(f"{result.engine} {result.bucket}: total {t.total_ms:.1f} ms, median step {t.median_step_ms:.2f} ms, "
              f"warm={result.warm} eager_fallback={result.eager_fallback} recompiles={result.recompiles}")
        if result.step_cache.enabled:
            print(f"  step cache {result.step_cache}: {len(result.cached_steps)} of {result.steps} steps cached "
                  f"({', '.join(map(str, result.cached_steps)) or 'none'})")
        if result.lora:
            swap = f", swapped in {result.lora_swap_ms:.0f} ms" if result.lora_swap_ms is not None else ""
            print(f"  LoRA {result.lora} at scale {result.lora_scale:g} (rank {result.lora_rank}{swap})")
        for notice in result.notices:
            print(f"  note: {notice}")
        if args.out:
            print(f"wrote {args.out}")
    return 0


def cmd_devices(args) -> int:
    from engine.devices import devices_report

    report = devices_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for d in report:
            state = "available" if d["available"] else f"unavailable: {d['reason']}"
            print(f"{d['name']:7s} {d['label']:40s} {state}")
    return 0


def cmd_presets(args) -> int:
    presets = load_presets()
    if args.json:
        print(json.dumps([p.describe() for p in presets.values()], indent=2))
        return 0
    for p in presets.values():
        print(f"{p.name:18s} {p.pipeline:28s} steps={p.steps:<3d} guidance={p.guidance:<4g} "
              f"buckets={','.join(str(b) for b in p.buckets)}")
        for lora in p.loras:
            print(f"{'':18s}   LoRA {lora.name} (scale {lora.scale:g}){': ' + lora.description if lora.description else ''}")
    return 0


def cmd_attention(args) -> int:
    from engine import devices
    from engine.pipeline import attention

    spec = devices.resolve_device(args.device) if args.device == devices.AUTO else devices.get_device(args.device)
    available = spec.probe()
    precision = devices.plan_precision(spec, args.precision).precision if available.available else args.precision
    rows = attention.attention_table(spec, precision)
    if args.json:
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
    key = catalog.make_key(args.preset, args.device, args.precision)
    cache = caches.prepare_cache_dir(args.cache_dir or settings.cache_dir())
    for notice in cache.notices:
        print(f"warning: {notice}", file=sys.stderr)
    options = catalog.options_for(key, options_from_args(args, warm_sizes=(), warm_modes=()))
    config = catalog.config(key, options, cache.path)
    sizes = tuple(Size.parse(s) for s in args.sizes.split(",") if s.strip()) if args.sizes else None
    rows = runner.export_aot_packages(config, sizes, rebuild=args.rebuild, progress=not args.no_progress)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            what = r["origin"] if r["state"] == "warm" else f"{r['state']}: {r['error']}"
            print(f"{r['bucket']:16s} {what}  ({r['seconds']:.1f} s)")
        print(f"packages in {settings.aot_dir() or config.cache_path() / 'aot'}")
    ok = all(r["state"] == "warm" for r in rows)
    if ok and args.push_to:
        from engine.pipeline import aot_hub

        url = aot_hub.push_packages(args.push_to, settings.aot_dir() or config.cache_path() / "aot", preset=key.preset)
        print(f"pushed to {args.push_to}: {url}", file=sys.stderr)
    return 0 if ok else 1


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate one image and print its timings")
    g.add_argument("--preset", default=DEFAULT_PRESET)
    g.add_argument("--device", default="auto")
    g.add_argument("--precision", default="fp32")
    g.add_argument("--mode", default="eager", help=", ".join(Mode.values()))
    g.add_argument("--size", default=None, help="WIDTHxHEIGHT (snapped to the nearest bucket unless --no-snap)")
    g.add_argument("--no-snap", action="store_true", help="refuse sizes that are not a bucket")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--guidance", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt", default=None, help="default: the preset's first example prompt")
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--on-cold", choices=OnCold.values(), default=OnCold.WAIT.value,
                   help="at a bucket that is not compiled yet: wait for the compile, or run eagerly")
    g.add_argument("--cache", default="none", metavar="TEXT",
                   help=f"step cache: {step_cache_forms()} (`python -m engine step-caches` lists which run here)")
    g.add_argument("--lora", default=None, metavar="NAME[:SCALE]",
                   help="one of the preset's LoRA adapters (`python -m engine presets` lists them), scale 0-2 "
                        "(default: the preset's)")
    g.add_argument("--tp", type=int, default=1, help="run the engine over N ranks (torchrun sidecar)")
    g.add_argument("--parallel", choices=Parallel.values(), default=Parallel.TENSOR.value,
                   help="how --tp ranks split the transformer: tensor (weights sharded), ulysses or ring "
                        "(context parallel: tokens split)")
    g.add_argument("--out", default=None, help="write the PNG here")
    g.add_argument("--json", action="store_true", help="print one JSON object with the timings")
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)


def add_devices_parser(sub) -> None:
    d = sub.add_parser("devices", help="list devices: available, or why not")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)


def add_presets_parser(sub) -> None:
    p = sub.add_parser("presets", help="list model presets and their buckets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_presets)


def add_attention_parser(sub) -> None:
    a = sub.add_parser("attention", help="list diffusers attention backends: which can run here, and why not")
    a.add_argument("--device", default="auto")
    a.add_argument("--precision", default="bf16", help="flash, cuDNN, sage and FA3 kernels take bf16/fp16 only")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_attention)


def cmd_step_caches(args) -> int:
    from engine import devices
    from engine.pipeline import stepcache

    catalog = Catalog(*presets_from_args(args))
    preset = catalog.preset(args.preset)
    spec = devices.resolve_device(args.device) if args.device == devices.AUTO else devices.get_device(args.device)
    rows = stepcache.available_step_caches(preset, spec, args.mode)
    if args.json:
        print(json.dumps({"preset": preset.name, "device": spec.name, "mode": args.mode, "caches": rows}, indent=2))
        return 0
    print(f"step caches for {preset.name} on {spec.label} [{spec.name}], mode {args.mode}")
    print(stepcache.format_table(rows))
    return 0


def add_step_caches_parser(sub) -> None:
    s = sub.add_parser("step-caches", help="list diffusers step caches: which can run for a preset here, and why not")
    s.add_argument("--preset", default=DEFAULT_PRESET)
    s.add_argument("--device", default="auto")
    s.add_argument("--mode", default="eager", help=", ".join(Mode.values()))
    s.add_argument("--json", action="store_true")
    add_engine_arguments(s)
    s.set_defaults(func=cmd_step_caches)


def cmd_memory_levers(args) -> int:
    from engine import devices
    from engine.pipeline import memory

    spec = devices.resolve_device(args.device) if args.device == devices.AUTO else devices.get_device(args.device)
    if args.preset:
        return print_fit(args, spec)
    mode = Mode.parse(args.mode, "mode") if args.mode else None
    rows = memory.lever_table(spec, mode)
    if args.json:
        print(json.dumps({"device": spec.name, "mode": args.mode, "levers": rows}, indent=2))
        return 0
    print(f"memory levers on {spec.label} [{spec.name}]" + (f", mode {mode}" if mode else "")
          + " (engine: part of the engine key; request: set per request)")
    print(memory.format_table(rows))
    return 0


def print_fit(args, spec) -> int:
    """`memory-levers --preset P`: each lever set's estimate for P on `spec`, and what each policy picks."""
    from engine.serving import budget, fit

    catalog = Catalog(*presets_from_args(args))
    preset = catalog.preset(args.preset)
    size = Size.parse(args.size) if args.size else max(preset.buckets, key=lambda s: s.pixels)
    key = catalog.make_key(preset.name, spec.name, args.precision) if spec.probe().available else None
    source = None if key is None else Path(resolve_source(catalog.config(key, options_from_args(args),
                                                                         settings.cache_dir())))
    model = fit.model_for(preset, source if source is not None and source.is_dir() else None, args.precision)
    rows = fit.options(model, spec, size.width, size.height, spec.process_overhead_bytes)
    free = budget.parse_size(args.free) if args.free else (
        spec.default_memory_budget()[0] if spec.probe().available else None)
    if args.json:
        print(json.dumps({"preset": preset.name, "device": spec.name, "size": str(size), "estimates": [
            e.as_dict() for e in rows], "picks": {p: fit.choose(rows, free, p)[0].levers for p in fit.POLICIES}}))
        return 0
    print(f"{preset.name} {args.precision} at {size} on {spec.label} [{spec.name}]: estimated peak per lever set")
    for e in rows:
        print(f"  {e.levers or 'none':38s} {e.device_bytes / 2**30:7.2f} GiB  ≈ {e.time_factor:g}× the time")
    print(fit.advice_line(preset.name, args.precision, rows))
    for policy in fit.POLICIES:
        print(f"--memory {policy}: {fit.choose(rows, free, policy)[1]}")
    return 0


def add_memory_levers_parser(sub) -> None:
    m = sub.add_parser("memory-levers", help="list memory levers (offload, layerwise casting, VAE tiling, ...): which "
                                             "can run on a device, with which modes, and why not")
    m.add_argument("--device", default="auto")
    m.add_argument("--mode", default=None, help="only as combined with this mode: " + ", ".join(Mode.values()))
    m.add_argument("--preset", default=None, help="estimate this preset's memory with each lever set instead")
    m.add_argument("--precision", default="bf16")
    m.add_argument("--size", default=None, help="WxH (default: the preset's largest bucket)")
    m.add_argument("--free", default=None, metavar="SIZE", help="the memory --memory auto fits, e.g. 22GiB")
    m.add_argument("--json", action="store_true")
    add_engine_arguments(m)
    m.set_defaults(func=cmd_memory_levers)


def add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="build the aot (AOTInductor) packages of an engine's buckets ahead of time")
    e.add_argument("--preset", default=DEFAULT_PRESET)
    e.add_argument("--device", default="auto")
    e.add_argument("--precision", default="fp32")
    e.add_argument("--sizes", default=None, help="comma-separated WxH buckets (default: every bucket of the preset)")
    e.add_argument("--rebuild", action="store_true", help="build even where a valid package exists")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--json", action="store_true", help="print one JSON list, a row per bucket")
    e.add_argument("--push-to", default=None, metavar="REPO_ID",
                   help="then upload the preset's packages to this Hub model repo (created private; token: $HF_TOKEN); "
                        "the app downloads them with --aot-repo")
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
             "memory-bench", "oneshot", "fleet-bench")


def build_parser(command: str | None = None, commands: dict[str, str] | None = None,
                 prog: str = "python -m engine", description: str | None = __doc__) -> argparse.ArgumentParser:
    """The parser of every sub-command of `commands` (the engine's by default), or of `command` alone when
    it is one of them."""
    import importlib

    commands = COMMANDS if commands is None else commands
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("-v", "--verbose", action="store_true")
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
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party()  # the harmless library messages the app drops (engine/worker/logs.py)
    try:
        return args.func(args)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
