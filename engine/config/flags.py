"""The engine flags, defined once: the CLI sub-commands, app.py and the bench all take them.

Nothing here imports torch, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine import settings
from engine.protocol import EngineOptions

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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--cache-dir", type=Path, default=None,
                   help="persistent folder for tiny models and compile caches (default: $SHOWCASE_CACHE_DIR or "
                        "~/.cache/diffusion-showcase)")
    g.add_argument("--model", default=None, help="serve any Hub id or local diffusers folder (buckets from its family)")
    g.add_argument("--model-root", action="append", default=[], type=Path,
                   help="a folder local models may be loaded from (repeatable)")
    g.add_argument("--buckets", default=None, help="comma-separated WxH buckets for --model")
    for flag, _, help_text in _SWITCHES:
        g.add_argument(flag, action="store_true", help=help_text)
    g.add_argument("--no-compile-vae", action="store_true", help="compile mode leaves vae.decode eager")
    g.add_argument("--no-loras", action="store_true",
                   help="no LoRA slot for the preset's adapters: no styles, and no per-step price for the slot")
    g.add_argument("--inductor-flags", action=argparse.BooleanOptionalAction, default=None,
                   help="flux-fast inductor flags (default: on for CUDA)")
    g.add_argument("--attention-backend", default="native", metavar="NAME",
                   help="diffusers attention backend of the denoiser (native, _native_flash, flex, flash, _flash_3_hub, "
                        "sage, ...); `python -m engine attention` lists which can run here and why not")
    g.add_argument("--max-batch", type=_positive_int, default=None, metavar="N",
                   help="at most N queued requests that can share a denoiser call (same bucket, steps, guidance, "
                        "step cache) run as one pipeline call; 1 turns batching off (default: the device's: cpu, "
                        "cuda, xpu 4, mps 2, neuron and tpu 1)")
    g.add_argument("--batch-wait-ms", type=float, default=EngineOptions.batch_wait_ms, metavar="MS",
                   help="how long a request waits after it arrives for others to share its call "
                        f"(default {EngineOptions.batch_wait_ms:g}; requests queued behind a running call join at once)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def options_from_args(args, **overrides) -> EngineOptions:
    values = {field: getattr(args, field) for _, field, _ in _SWITCHES}
    values.update(compile_vae=not args.no_compile_vae, inductor_flags=args.inductor_flags,
                  attention_backend=getattr(args, "attention_backend", None) or "native",
                  max_batch=getattr(args, "max_batch", None),
                  batch_wait_ms=getattr(args, "batch_wait_ms", EngineOptions.batch_wait_ms),
                  loras=not getattr(args, "no_loras", False))
    values.update(overrides)
    return EngineOptions(**values)


def engine_flags_argv(args) -> tuple[str, ...]:
    """The recipe flags of a parsed command line as argv again (for a child process that must match)."""
    flags = [flag for flag, field, _ in _SWITCHES if getattr(args, field, False)]
    if getattr(args, "no_compile_vae", False):
        flags.append("--no-compile-vae")
    if getattr(args, "no_loras", False):
        flags.append("--no-loras")
    if args.inductor_flags is not None:
        flags.append("--inductor-flags" if args.inductor_flags else "--no-inductor-flags")
    backend = getattr(args, "attention_backend", None) or "native"
    if backend != "native":
        flags += ["--attention-backend", backend]
    if getattr(args, "max_batch", None) is not None:
        flags += ["--max-batch", str(args.max_batch)]
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

