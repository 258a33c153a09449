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

from bench.bench_options import BenchOptions
from bench.modes import BENCH_MODES
from engine import devices, settings
from engine.config.flags import (
    SourceFlags,
    engine_flags_argv,
    from_args,
    model_roots_from_args,
    options_from_args,
)
from engine.config.presets import get_preset, preset_for_model, route_size
from engine.errors import InvalidRequest
from engine.protocol import GENERIC_PROMPT, EngineOptions, ImageInputs, ModelPreset, Size, StepCache


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
    # random weights: an edit's reference sizes (None: one at each output size for an edit preset, else none)
    references: tuple[Size, ...] | None = None
    frames: int = 0  # random weights: a video preset's clip length (0: an image)

    def reference_sizes(self, size: Size) -> tuple[Size, ...]:
        """The references whose tokens join the sequence of an output of `size`."""
        if self.references is not None:
            return self.references
        return (size,) if self.preset.inputs is ImageInputs.EDIT else ()

    def configs(self) -> list[tuple[str, str, Size]]:
        """Every (precision, mode, size), in the order results are reported."""
        return [(p, m, s) for p in self.precisions for s in self.sizes for m in self.modes]


def _split(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def json_object_flag(text: str | None, flag: str) -> dict | None:
    """A flag's JSON object, given inline or as @FILE (None when not given); InvalidRequest naming `flag`."""
    if not text:
        return None
    raw = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{flag} must be a JSON object")
    return value


def _preset_and_model_args(preset_name: str, source: SourceFlags, roots: list[Path]) -> tuple[ModelPreset, list[str]]:
    if not source.model:
        return get_preset(preset_name), []
    preset = preset_for_model(source.model, roots, buckets=source.buckets)
    model_args = ["--model", source.model] + (["--buckets", source.buckets] if source.buckets else [])
    for root in source.model_root:
        model_args += ["--model-root", str(root)]
    return preset, model_args


def _check_sizes(preset: ModelPreset, sizes: tuple[Size, ...], random_weights: bool) -> None:
    for size in sizes:
        if random_weights:  # any aligned size: the denoiser is fed inputs of that shape
            if size.width % preset.alignment or size.height % preset.alignment:
                raise InvalidRequest(f"size {size} is not divisible by {preset.alignment} ({preset.name})")
        else:
            route_size(preset, size.width, size.height, snap=False)  # must be one of the buckets


def _references(preset: ModelPreset, text: str | None, random_weights: bool) -> tuple[Size, ...] | None:
    """--references read and checked: sizes aligned like the output's, no more than the preset takes."""
    if text is None:
        return None
    refs = () if text.strip().lower() == "none" else tuple(Size.parse(s) for s in _split(text))
    if refs and not random_weights:
        raise InvalidRequest("--references sizes the denoiser's inputs: it needs --random-weights")
    if len(refs) > preset.max_references:
        raise InvalidRequest(f"--references: {preset.name} takes at most {preset.max_references} reference(s), "
                             f"not {len(refs)}")
    _check_sizes(preset, refs, random_weights=True)
    return refs


def _frames(preset: ModelPreset, frames: int | None) -> int:
    """--frames checked against the preset: a video preset's default is its first frame bucket."""
    if not preset.video:
        if frames:
            raise InvalidRequest(f"--frames: {preset.name} makes images, not clips")
        return 0
    frames = frames or preset.frames[0]
    if (frames - 1) % preset.frame_step:
        raise InvalidRequest(f"--frames {frames}: {preset.name} takes 1 + a multiple of {preset.frame_step} frames")
    return frames


def plan_from_args(args) -> BenchPlan:
    """The plan of a parsed `bench` command line: its own flags (BenchOptions) and the engine's."""
    opts, source = from_args(BenchOptions, args), from_args(SourceFlags, args)
    cache_dir = Path(source.cache_dir) if source.cache_dir else settings.cache_dir()
    roots = model_roots_from_args(args)
    preset, model_args = _preset_and_model_args(opts.preset, source, roots)
    modes = _split(opts.modes)
    for m in modes:
        if m not in BENCH_MODES:
            raise InvalidRequest(f"unknown mode {m!r}: choose from {', '.join(BENCH_MODES)}")
    precisions = _split(opts.precisions)
    caches = tuple(dict.fromkeys(str(StepCache.parse(c)) for c in _split(opts.caches or "")))
    if caches and opts.random_weights:
        raise InvalidRequest("--caches runs the whole pipeline (step caches need its scheduler); drop --random-weights")
    if not modes or not precisions:
        raise InvalidRequest("--modes and --precisions need at least one value each")
    spec = devices.resolve_device(opts.device)
    for p in precisions:
        devices.plan_precision(spec, p)  # refuses what the device cannot run, with the reason
    sizes = tuple(Size.parse(s) for s in _split(opts.sizes)) if opts.sizes else preset.buckets[:1]
    _check_sizes(preset, sizes, bool(opts.random_weights))
    steps = opts.steps or preset.steps
    if steps < 1 or opts.runs < 1:
        raise InvalidRequest("--steps and --runs must be at least 1")
    overhead = opts.overhead_runs if opts.overhead_runs is not None else 2 * opts.runs
    cold = opts.cold_start_probe
    cold_start = (cold == "on" or (cold == "auto" and "aot" in modes)) and not opts.random_weights
    return BenchPlan(
        preset=preset, device=spec.name, modes=modes, precisions=precisions, sizes=sizes, steps=steps,
        runs=opts.runs, options=options_from_args(args, warm_sizes=(), warm_modes=()), cache_dir=cache_dir,
        allowed_roots=tuple(str(r) for r in roots), prompt=opts.prompt or preset.example_prompt, overhead_pairs=overhead,
        cache_probe=opts.cache_probe, probe_timeout_s=opts.probe_timeout, progress=not opts.no_progress,
        cold_start_probe=cold_start, cold_start_runs=opts.cold_start_runs,
        model_args=tuple(model_args), random_weights=bool(opts.random_weights),
        config_override=json_object_flag(opts.denoiser_config_override, "--denoiser-config-override"),
        text_len=opts.text_len, matmul_roofline=opts.matmul_roofline, warmup_calls=opts.warmup_calls,
        time_budget_s=opts.time_budget, out=Path(opts.out) if opts.out else None, force=opts.force,
        threads=opts.threads, engine_args=engine_flags_argv(args),
        quality_samples=(opts.quality_samples if opts.quality_samples is not None
                         else 100 if preset.fidelity else 3),
        caches=caches,
        images_per_call=max(1, opts.images_per_call or 1),
        references=_references(preset, opts.references, bool(opts.random_weights)),
        frames=_frames(preset, opts.frames) if opts.random_weights else 0,
        command="python -m engine " + " ".join(a for a in sys.argv[1:] if a) if sys.argv else "",
    )
