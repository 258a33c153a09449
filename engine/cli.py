"""Headless command line: `python -m engine {generate,devices,presets,bench}`.

The argument helpers here are shared with app.py so both accept the same engine flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from engine import settings
from engine.errors import ShowcaseError
from engine.recipes import EngineOptions


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--cache-dir", type=Path, default=None,
                   help="persistent folder for tiny models and compile caches (default: $SHOWCASE_CACHE_DIR or ~/.cache/diffusion-showcase)")
    g.add_argument("--model", default=None, help="serve any Hub id or local diffusers folder (buckets from its family)")
    g.add_argument("--model-root", action="append", default=[], type=Path,
                   help="a folder local models may be loaded from (repeatable)")
    g.add_argument("--buckets", default=None, help="comma-separated WxH buckets for --model")
    g.add_argument("--fuse-qkv", action="store_true", help="fuse the denoiser's QKV projections")
    g.add_argument("--channels-last", action="store_true", help="channels_last for UNet/VAE convolutions")
    g.add_argument("--cpu-offload", action="store_true", help="model CPU offload (then only regional compile)")
    g.add_argument("--max-autotune", action="store_true", help="torch.compile mode=max-autotune (inductor)")
    g.add_argument("--dynamic", action="store_true", help="dynamic-shape compile where the device allows")
    g.add_argument("--no-compile-vae", action="store_true", help="compile mode leaves vae.decode eager")
    g.add_argument("--inductor-flags", action=argparse.BooleanOptionalAction, default=None,
                   help="flux-fast inductor flags (default: on for CUDA)")
    g.add_argument("--int8", action="store_true", help="torchao int8 dynamic quantisation of the denoiser")


def options_from_args(args, **overrides) -> EngineOptions:
    values = dict(
        fuse_qkv=args.fuse_qkv,
        channels_last=args.channels_last,
        cpu_offload=args.cpu_offload,
        max_autotune=args.max_autotune,
        dynamic=args.dynamic,
        compile_vae=not args.no_compile_vae,
        inductor_flags=args.inductor_flags,
        int8=args.int8,
    )
    values.update(overrides)
    return EngineOptions(**values)


def make_manager(args, options: EngineOptions):
    from engine.manager import EngineManager
    from engine.presets import preset_for_model

    cache_dir = args.cache_dir or settings.cache_dir()
    roots = [*settings.model_roots(), *[r.resolve() for r in args.model_root]]
    extra = {}
    if args.model:
        model_path = Path(args.model).expanduser()
        if model_path.exists() or args.model.startswith((".", "/", "~")):
            roots.append(model_path.resolve().parent)  # a path typed on the command line is allowed
        preset = preset_for_model(args.model, roots, buckets=args.buckets)
        extra[preset.name] = preset
        args.preset = preset.name
    return EngineManager(cache_dir=cache_dir, options=options, allowed_roots=roots, extra_presets=extra)


def cmd_generate(args) -> int:
    from engine.protocol import Size

    size = Size.parse(args.size) if args.size else None
    # A one-shot run warms only the bucket it needs, and waits for it unless --on-cold eager.
    manager = make_manager(args, options_from_args(args, warm_sizes=(), warm_modes=(args.mode,)))
    try:
        result = manager.generate(
            preset=args.preset, device=args.device, precision=args.precision, mode=args.mode, size=size,
            prompt=args.prompt, negative_prompt=args.negative_prompt, steps=args.steps, guidance=args.guidance,
            seed=args.seed, tp=args.tp, snap=not args.no_snap, on_cold=args.on_cold,
        )
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
    from engine.presets import load_presets

    presets = load_presets()
    if args.json:
        print(json.dumps([p.describe() for p in presets.values()], indent=2))
        return 0
    for p in presets.values():
        print(f"{p.name:18s} {p.pipeline:28s} steps={p.steps:<3d} guidance={p.guidance:<4g} "
              f"buckets={','.join(str(b) for b in p.buckets)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one image and print its timings")
    g.add_argument("--preset", default="tiny-flux")
    g.add_argument("--device", default="auto")
    g.add_argument("--precision", default="fp32")
    g.add_argument("--mode", default="eager")
    g.add_argument("--size", default=None, help="WIDTHxHEIGHT (snapped to the nearest bucket unless --no-snap)")
    g.add_argument("--no-snap", action="store_true", help="refuse sizes that are not a bucket")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--guidance", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt", default="a red fox in the snow")
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--on-cold", choices=("wait", "eager"), default="wait",
                   help="at a bucket that is not compiled yet: wait for the compile, or run eagerly")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel over N ranks (torchrun sidecar)")
    g.add_argument("--out", default=None, help="write the PNG here")
    g.add_argument("--json", action="store_true", help="print one JSON object with the timings")
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("devices", help="list devices: available, or why not")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)

    p = sub.add_parser("presets", help="list model presets and their buckets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_presets)

    try:
        from engine.bench import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ShowcaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
