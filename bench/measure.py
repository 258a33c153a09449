"""What the measuring paths share: the progress bar, the state of the persistent inductor cache at
start, how a failed configuration is recorded, and the engine a bench mode runs on (the pipeline
bench and the persistent-cache probe's child build it the same way).

Only the measuring modules import this: it imports torch (through the runner).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from bench.modes import BenchMode
from engine import settings
from engine.config.resolve import resolve_source
from engine.devices import INDUCTOR_CACHE_VAR, DeviceSpec
from engine.pipeline.progress import progress_bar
from engine.pipeline.runner import PipelineRunner
from engine.protocol import EngineConfig, EngineKey


def progress(total: int, enabled: bool, desc: str):
    """A tqdm bar on stderr (stdout carries the report), or one that does nothing."""
    return progress_bar(total, enabled, desc)


def inductor_cache_state(spec, cache_dir: Path) -> tuple[str | None, int]:
    """The persistent inductor cache folder in force and how many files it held at start: says in the notes
    whether a compile time was cold or served from the cache."""
    if spec.compile_backend != "inductor":
        return None, 0
    folder = settings.inductor_cache_dir() or spec.environment(cache_dir).get(INDUCTOR_CACHE_VAR)
    if not folder or not Path(folder).is_dir():
        return folder, 0
    return folder, sum(len(files) for _, _, files in os.walk(folder))


def error_text(exc: BaseException) -> str:
    """A failed configuration's `error`: exception type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def build_runner(plan, spec: DeviceSpec, precision: str, mode: BenchMode) -> PipelineRunner:
    """The engine a bench mode runs on: the plan's options, the preset's for this device, the mode's
    overrides. Its model source is resolved (a missing tiny model is built) but nothing is loaded."""
    options = dataclasses.replace(plan.options, **plan.preset.options.get(spec.name, {}))
    options = dataclasses.replace(options, **mode.overrides)
    runner = PipelineRunner(EngineConfig(
        key=EngineKey(plan.preset.name, spec.name, precision, memory=options.memory),
        preset=plan.preset,
        options=options,
        cache_dir=str(plan.cache_dir),
        allowed_roots=plan.allowed_roots,
    ))
    resolve_source(runner.config)  # build a tiny model now if missing: not part of the load time
    return runner
