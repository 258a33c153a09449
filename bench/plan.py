"""A benchmark run as data: `BenchPlan`, built from the command line by `plan_from_args`.

Everything the user can get wrong (unknown mode, a precision the device refuses, a size that is not a
bucket, a malformed config override) is refused here, before a model loads, with the reason. The
plan also carries what the persistent-cache probe's child processes need to repeat the run's flags.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.modes import BENCH_MODES
from engine import devices, settings
from engine.config.flags import engine_flags_argv, model_roots_from_args, options_from_args
from engine.config.presets import get_preset, preset_for_model, route_size
from engine.errors import InvalidRequest
from engine.protocol import GENERIC_PROMPT, EngineOptions, ModelPreset, Size, StepCache


@dataclass
class BenchPlan:
    preset: ModelPreset
    device: str  # registry name after resolving "auto"
    modes: tuple[str, ...]  # bench modes (bench/modes.py)
    precisions: tuple[str, ...]
    sizes: tuple[Size, ...]
    steps: int
    runs: int
    options: EngineOptions
    cache_dir: Path
    allowed_roots: tuple[str, ...] = ()
    prompt: str = GENERIC_PROMPT
    overhead_pairs: int = 20
    cache_probe: str = "compile"  # mode the persistent-cache probe compiles, or "off"
    cold_start_probe: bool = False  # fresh processes: compile (empty / filled cache) vs aot with packages
    cold_start_runs: int = 5
    probe_timeout_s: float = 900.0
    progress: bool = True
    model_args: tuple[str, ...] = ()  # --model/--buckets/--model-root passed on to probe children
    # denoiser (random weights)
    random_weights: bool = False
    config_override: dict | None = None
    text_len: int | None = None
    matmul_roofline: bool = False
    warmup_calls: int = 1
    time_budget_s: float | None = None
    out: Path | None = None
    force: bool = False
    threads: int | None = None
    engine_args: tuple[str, ...] = ()  # engine flags passed on to probe children
    command: str = ""
    # Images per configuration for drift (and fidelity, for a model with a checker); 0 = skip.
    quality_samples: int = 3
    caches: tuple[str, ...] = ()  # step caches (canonical text): the levers bench (bench/levers.py)
    images_per_call: int = 1  # random weights: images per denoiser call (batching, engine/pipeline/batching.py)


    def configs(self) -> list[tuple[str, str, Size]]:
        """Every (precision, mode, size), in the order results are reported."""
        return [(p, m, s) for p in self.precisions for s in self.sizes for m in self.modes]


def _split(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def _load_override(text: str | None) -> dict | None:
    if not text:
        return None
    raw = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"--denoiser-config-override is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("--denoiser-config-override must be a JSON object")
    return value


def _preset_and_model_args(args, roots: list[Path]) -> tuple[ModelPreset, list[str]]:
    if not args.model:
        return get_preset(args.preset), []
    preset = preset_for_model(args.model, roots, buckets=args.buckets)
    model_args = ["--model", args.model] + (["--buckets", args.buckets] if args.buckets else [])
    for root in args.model_root:
        model_args += ["--model-root", str(root)]
    return preset, model_args


def _check_sizes(preset: ModelPreset, sizes: tuple[Size, ...], random_weights: bool) -> None:
    for size in sizes:
        if random_weights:  # any aligned size: the denoiser is fed inputs of that shape
            if size.width % preset.alignment or size.height % preset.alignment:
                raise InvalidRequest(f"size {size} is not divisible by {preset.alignment} ({preset.name})")
        else:
            route_size(preset, size.width, size.height, snap=False)  # must be one of the buckets


def plan_from_args(args) -> BenchPlan:
    cache_dir = Path(args.cache_dir) if args.cache_dir else settings.cache_dir()
    roots = model_roots_from_args(args)
    preset, model_args = _preset_and_model_args(args, roots)
    modes = _split(args.modes)
    for m in modes:
        if m not in BENCH_MODES:
            raise InvalidRequest(f"unknown mode {m!r}: choose from {', '.join(BENCH_MODES)}")
    precisions = _split(args.precisions)
    caches = tuple(dict.fromkeys(str(StepCache.parse(c)) for c in _split(args.caches or "")))
    if caches and args.random_weights:
        raise InvalidRequest("--caches runs the whole pipeline (step caches need its scheduler); drop --random-weights")
    if not modes or not precisions:
        raise InvalidRequest("--modes and --precisions need at least one value each")
    spec = devices.resolve_device(args.device)
    for p in precisions:
        devices.plan_precision(spec, p)  # refuses what the device cannot run, with the reason
    sizes = tuple(Size.parse(s) for s in _split(args.sizes)) if args.sizes else preset.buckets[:1]
    _check_sizes(preset, sizes, bool(args.random_weights))
    steps = args.steps or preset.steps
    if steps < 1 or args.runs < 1:
        raise InvalidRequest("--steps and --runs must be at least 1")
    overhead = args.overhead_runs if args.overhead_runs is not None else 2 * args.runs
    cold = getattr(args, "cold_start_probe", "off")
    cold_start = (cold == "on" or (cold == "auto" and "aot" in modes)) and not args.random_weights
    return BenchPlan(
        preset=preset, device=spec.name, modes=modes, precisions=precisions, sizes=sizes, steps=steps,
        runs=args.runs, options=options_from_args(args, warm_sizes=(), warm_modes=()), cache_dir=cache_dir,
        allowed_roots=tuple(str(r) for r in roots), prompt=args.prompt or preset.example_prompt, overhead_pairs=overhead,
        cache_probe=args.cache_probe, probe_timeout_s=args.probe_timeout, progress=not args.no_progress,
        cold_start_probe=cold_start, cold_start_runs=getattr(args, "cold_start_runs", 5),
        model_args=tuple(model_args), random_weights=bool(args.random_weights),
        config_override=_load_override(args.denoiser_config_override),
        text_len=args.text_len, matmul_roofline=args.matmul_roofline, warmup_calls=args.warmup_calls,
        time_budget_s=args.time_budget, out=Path(args.out) if args.out else None, force=args.force,
        threads=args.threads, engine_args=engine_flags_argv(args),
        quality_samples=(args.quality_samples if args.quality_samples is not None
                         else 100 if preset.fidelity else 3),
        caches=caches,
        images_per_call=max(1, getattr(args, "images_per_call", 1) or 1),
        command="python -m engine " + " ".join(a for a in sys.argv[1:] if a) if sys.argv else "",
    )
