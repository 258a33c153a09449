"""`python -m bench lora-bench`: what a LoRA costs and what a hot-swap costs, printed side by side.

Per mode (eager, compile, regional) on one engine whose preset lists adapters (default tiny-shapes):

- swap: the median hot-swap time between the preset's adapters on the warm bucket, and the recompiles it
  caused (the target: 0);
- the first request after a swap against a warm request with the adapter already in place (total ms);
- per step: no LoRA (a pipeline without the slot), unfused (the slot at scale 1: two extra matmuls per
  targeted layer) and fused (the engine's fused mode, eager), with the fuse a fused request waits for when
  the adapter changes and the fused copy's memory.

All figures are medians of `--repeats` runs (engine.metrics.median); the machine's load goes with them. The
engine runs in a worker process driven through the client (engine/worker/client.py), as the manager drives
it; the timings are the ones the worker reports per request. The bare baseline pipeline runs in this process.
"""

from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from engine.config.flags import from_args
from engine.metrics import median
from engine.protocol import (
    DEFAULT_PRESET,
    BucketInfo,
    BucketKey,
    EngineConfig,
    EngineKey,
    EngineOptions,
    GenerateRequest,
    Mode,
    Size,
)
from engine.worker.client import EngineEvents

LOAD_TIMEOUT_S = 600
COMPILE_TIMEOUT_S = 1800  # a regional compile of a large preset on a busy CPU
REQUEST_TIMEOUT_S = 600


def _request(preset, size: Size, mode: Mode, lora: str | None, seed: int = 0, fused: bool = False
             ) -> GenerateRequest:
    return GenerateRequest.checked(prompt=preset.example_prompt, width=size.width, height=size.height, steps=preset.steps,
                           guidance=preset.guidance, seed=seed, mode=mode, lora=lora, lora_fused=fused)


def _bare_pipeline(preset, source: str):
    """A bare eager pipeline of the engine's model, without the slot: the "no LoRA" baseline."""
    import diffusers
    import torch

    pipe = getattr(diffusers, preset.pipeline).from_pretrained(source, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _step_ms(preset, pipe, size: Size) -> float:
    """Median step ms of one eager call of a bare pipeline (steps 2 on: the first carries the set-up)."""
    import torch

    from engine.pipeline.calls import pipeline_call_kwargs

    marks = []
    kwargs = pipeline_call_kwargs(preset, pipe, _request(preset, size, Mode.EAGER, None))
    kwargs["callback_on_step_end"] = lambda p, i, t, kw: (marks.append(time.perf_counter()), {})[1]
    with torch.no_grad():
        pipe(**kwargs)
    return 1000 * median([b - a for a, b in zip(marks, marks[1:], strict=False)])


class _Compiles(EngineEvents):
    """Grants every compile at once (no host scheduler here) and tells when one has ended."""

    def __init__(self):
        self.finished: queue.Queue = queue.Queue()

    def compile_finished(self, engine, bucket: BucketKey) -> None:
        self.finished.put(bucket)


class _Engine:
    """The engine under test in a worker process of its own, driven through the client like the manager does."""

    def __init__(self, preset, cache_dir: Path):
        from engine import devices
        from engine.worker.client import ProcessClient

        self.preset = preset
        self.config = EngineConfig(EngineKey(preset.name, "cpu", "fp32"), preset,
                                   EngineOptions(warm_sizes=(), loras=True), str(cache_dir))
        self.compiles = _Compiles()
        env = devices.worker_environment(devices.get_device("cpu"), cache_dir)
        self.client = ProcessClient(self.config, env=env, events=self.compiles).start()

    def wait_ready(self) -> None:
        self.client.wait_ready(LOAD_TIMEOUT_S)
        if self.client.error is not None or self.client.info is None:
            raise SystemExit(f"the engine {self.config.key} did not load: {self.client.error or 'timed out'}")

    def generate(self, size: Size, mode: Mode, lora: str | None, seed: int = 0, fused: bool = False):
        return self.client.generate(_request(self.preset, size, mode, lora, seed, fused), timeout=REQUEST_TIMEOUT_S)

    def warm(self, bucket: BucketKey) -> BucketInfo | None:
        """Compile `bucket` and wait for the compile's end; its final state (None: the engine never said)."""
        self.client.warm(bucket)
        while True:
            try:
                done = self.compiles.finished.get(timeout=COMPILE_TIMEOUT_S)
            except queue.Empty:
                return None
            if done == bucket:
                return next((i for i in self.client.buckets() if i.bucket == bucket), None)

    def close(self) -> None:
        self.client.close()


def _eager_prices(engine: _Engine, size: Size, repeats: int, names: list[str]) -> dict:
    """No LoRA (a bare pipeline), unfused (the engine's slot at scale 1), the slot at scale 0 and fused (the
    engine's fused mode), timed round-robin so the machine's load falls on all of them alike; then the fuse a
    fused request waits for when the adapter changes."""
    from engine.config.resolve import resolve_source

    preset = engine.preset
    bare = _bare_pipeline(preset, resolve_source(engine.config))
    rows = {"no_lora_ms": [], "unfused_ms": [], "slot_at_scale_0_ms": [], "fused_ms": []}
    name = names[0]
    for i in range(repeats + 1):
        samples = (_step_ms(preset, bare, size),
                   engine.generate(size, Mode.EAGER, name, seed=i).timings.median_step_ms,
                   engine.generate(size, Mode.EAGER, None, seed=i).timings.median_step_ms,
                   engine.generate(size, Mode.EAGER, name, seed=i, fused=True).timings.median_step_ms)
        if i:  # the first round warms every pipeline
            for key, value in zip(rows, samples, strict=True):
                rows[key].append(value)
    fuses = [engine.generate(size, Mode.EAGER, names[(i + 1) % len(names)], seed=i, fused=True).lora_run.fuse_ms
             for i in range(repeats)]
    return {**{key: median(values) for key, values in rows.items()}, "fuse_ms": median(fuses),
            "fused_copy_mib": engine.client.lora.fused_bytes / 2**20}


def _mode_row(engine: _Engine, size: Size, mode: Mode, repeats: int, names: list[str]) -> dict:
    """Hot-swaps between the adapters on the warm bucket: their time, the recompiles, the request after one."""
    if mode.compiled:
        info = engine.warm(BucketKey(mode, size))
        if info is None or info.state.value != "warm":
            return {"error": info.error if info is not None else "the compile did not finish"}
    warm, after_swap, swaps, recompiles, step = [], [], [], 0, []
    engine.generate(size, mode, names[0])
    for i in range(repeats):
        name = names[(i + 1) % len(names)]
        first = engine.generate(size, mode, name, seed=i)
        again = engine.generate(size, mode, name, seed=i)
        swaps.append(first.lora_run.swap_ms)
        after_swap.append(first.timings.total_ms)
        warm.append(again.timings.total_ms)
        step.append(again.timings.median_step_ms)
        recompiles += first.recompiles + again.recompiles
    plain = [engine.generate(size, mode, None, seed=i).timings.median_step_ms for i in range(repeats)]
    return {"swap_ms": median(swaps), "recompiles": recompiles,
            "first_after_swap_ms": median(after_swap), "warm_ms": median(warm),
            "after_swap_ratio": median(after_swap) / median(warm),
            "unfused_step_ms": median(step), "slot_at_scale_0_step_ms": median(plain)}


def run_lora_bench(preset_name: str, size: Size, modes: tuple[Mode, ...], repeats: int, cache_dir) -> dict:
    from engine.config.presets import get_preset

    engine = _Engine(get_preset(preset_name), Path(cache_dir))
    try:
        engine.wait_ready()
        lora = engine.client.lora
        if lora is None or len(lora.adapters) < 2:
            notices = [n for n in engine.client.info.notices if "LoRA" in n]
            raise SystemExit(f"preset {preset_name} needs two hot-swappable LoRA adapters for this bench: "
                             f"{'; '.join(notices) or 'it lists fewer'}")
        names = list(lora.adapters)
        report = {"preset": preset_name, "size": str(size), "adapters": names, "target_rank": lora.target_rank,
                  "load": os.getloadavg()[0],
                  "modes": {str(mode): _mode_row(engine, size, mode, repeats, names) for mode in modes}}
        report["eager_per_step"] = _eager_prices(engine, size, repeats, names)
        return report
    finally:
        engine.close()


def format_report(report: dict) -> str:
    lines = [f"LoRA on {report['preset']} at {report['size']}: adapters {', '.join(report['adapters'])} "
             f"(hot-swap rank {report['target_rank']}); load average {report['load']:.1f}",
             f"{'mode':10s} {'swap ms':>8s} {'recompiles':>10s} {'1st after swap':>15s} {'warm':>8s} {'ratio':>6s} "
             f"{'step (LoRA)':>12s} {'step (scale 0)':>15s}"]
    for mode, row in report["modes"].items():
        if "error" in row:
            lines.append(f"{mode:10s} failed: {row['error']}")
            continue
        lines.append(f"{mode:10s} {row['swap_ms']:8.1f} {row['recompiles']:10d} {row['first_after_swap_ms']:15.1f} "
                     f"{row['warm_ms']:8.1f} {row['after_swap_ratio']:6.2f} {row['unfused_step_ms']:12.2f} "
                     f"{row['slot_at_scale_0_step_ms']:15.2f}")
    e = report["eager_per_step"]
    lines.append(f"eager per step, round-robin: no LoRA {e['no_lora_ms']:.2f} ms | unfused {e['unfused_ms']:.2f} ms "
                 f"| slot at scale 0 {e['slot_at_scale_0_ms']:.2f} ms | fused {e['fused_ms']:.2f} ms "
                 f"(fuse on a swap {e['fuse_ms']:.1f} ms; no unfuse: the fused copy, {e['fused_copy_mib']:.1f} MiB, "
                 "is the fused mode's own)")
    return "\n".join(lines)


@dataclass(frozen=True)
class LoraBenchOptions:
    """`lora-bench`'s flags."""

    preset: str = flags.preset(DEFAULT_PRESET)
    size: str = flags.size("64x64")
    modes: str = flags.text("eager,compile,regional")
    repeats: int = flags.count(5)
    cache_dir: str | None = flags.cache_dir()
    json: bool = flags.as_json()


def cmd_lora_bench(args) -> int:
    from engine import settings

    opts = from_args(LoraBenchOptions, args)
    modes = tuple(Mode.parse(m, "mode") for m in opts.modes.split(","))
    cache = Path(opts.cache_dir) if opts.cache_dir else settings.cache_dir()
    report = run_lora_bench(opts.preset, Size.parse(opts.size), modes, opts.repeats, cache)
    print(json.dumps(report, indent=2) if opts.json else format_report(report))
    return 0


def add_lora_bench_parser(sub) -> None:
    flags.add_command(sub, "lora-bench", LoraBenchOptions, cmd_lora_bench,
                      help="LoRA hot-swap time and recompiles, first request after a swap, and the per-step price "
                           "of no / unfused / fused LoRA (cpu)")
