"""The pipeline bench: the real engine path, every configuration measured side by side in one process.

One `PipelineRunner` per precision (and per set of option overrides a bench-only mode needs), so
weights load once each. Phases, in order: load the engines; warm every bucket (compiled modes
compile here) before any timed request; the first request at each pre-warmed bucket; the timed
requests, round-robin over all configurations with the starting configuration rotating each round,
so drift in a shared machine's load hits every configuration alike; the engine overhead (engine
request vs a bare diffusers call on the same compiled pipeline, interleaved); the persistent-cache
probe (bench/cache_probe.py); the cold-start probe (bench/cold_start.py: fresh processes
warming every bucket, compile vs aot packages).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from bench import quality
from bench.cache_probe import run_cache_probe
from bench.cold_start import COLD_START_STEPS, run_cold_start_probe
from bench.measure import build_runner, error_text, inductor_cache_state, progress
from bench.modes import COMPILED_MODES, MODE_TABLE
from bench.plan import BenchPlan
from bench.report import fmt
from bench.stats import apply_speedups, empty_result, finish_result, median, ratio
from engine import devices
from engine.devices import DeviceSpec
from engine.pipeline.runner import PipelineRunner, compiles_in_this_thread, pipeline_call_kwargs
from engine.protocol import BucketKey, BucketState, GenerateRequest, Mode, OnCold, Size

log = logging.getLogger(__name__)

# The engine overhead is measured on the first of these that ran: a full compile preferred (the
# engine's own default variant), eager last.
OVERHEAD_PREFERENCE = ("compile", "regional", "max-autotune", "eager")

Config = tuple[str, str, Size]  # (precision, bench mode, size)


@dataclass
class _Run:
    """State the phases share: the plan, the device, the progress bar, the engines and the results."""

    plan: BenchPlan
    spec: DeviceSpec
    bar: object
    runners: dict[tuple, PipelineRunner] = field(default_factory=dict)  # by (precision, options key)
    load_s: dict[tuple, float] = field(default_factory=dict)
    results: dict[Config, dict] = field(default_factory=dict)

    @staticmethod
    def engine_id(precision: str, mode: str) -> tuple:
        return precision, MODE_TABLE[mode].options_key

    def engine(self, precision: str, mode: str) -> tuple[PipelineRunner, Mode]:
        """The runner a configuration runs on, activated (process-wide precision state), and its engine mode."""
        runner = self.runners[self.engine_id(precision, mode)]
        devices.apply_precision(runner.precision)  # process-wide (TF32); engines may differ
        return runner, MODE_TABLE[mode].engine

    def request(self, mode: Mode, size: Size, seed: int, steps: int | None = None,
                rid: str | None = None) -> GenerateRequest:
        kwargs = {"request_id": rid} if rid else {}
        return GenerateRequest.checked(
            prompt=self.plan.prompt, width=size.width, height=size.height, steps=steps or self.plan.steps,
            guidance=self.plan.preset.guidance, seed=seed, mode=mode, on_cold=OnCold.EAGER, **kwargs,
        )


def _prepare_process(plan: BenchPlan) -> DeviceSpec:
    spec = devices.resolve_device(plan.device)
    # The cache folder first: importing torch._dynamo (diffusers does, at import) pins inductor's
    # default folder (/tmp/torchinductor_<user>) in os.environ, after which apply_environment's
    # setdefault no longer takes effect. So diffusers is imported here, never at module level.
    devices.apply_environment(spec, plan.cache_dir)
    import diffusers

    getattr(diffusers, plan.preset.pipeline)  # import the pipeline module now, not inside the timed load
    _quiet_loading()
    return spec


def _quiet_loading() -> None:
    """No per-component loading bars from diffusers/transformers: the bench has its own bar."""
    try:
        import diffusers.utils.logging as dlog

        dlog.disable_progress_bar()
        import transformers.utils.logging as tlog

        tlog.disable_progress_bar()
    except Exception:
        pass


def _prime_compiler(spec: DeviceSpec) -> float:
    """A throwaway compile, so the first measured bucket does not pay inductor's one-time start-up
    (imports, toolchain checks, compile worker pool) that every later bucket skips."""
    start = time.perf_counter()
    fn = torch.compile(lambda x: torch.nn.functional.gelu(x * 2.0 + 1.0), backend=spec.compile_backend)
    with torch.no_grad():
        fn(torch.ones(8, device=spec.torch_device))
    spec.synchronize()
    return time.perf_counter() - start


def _load_engines(run: _Run, configs: list[Config]) -> None:
    """One runner per (precision, option overrides), weights loaded once each."""
    plan = run.plan
    engines = {run.engine_id(p, m): (p, MODE_TABLE[m]) for p, m, _ in configs}
    for key in sorted(engines, key=lambda k: (plan.precisions.index(k[0]), len(k[1]), k[1])):
        precision, mode = engines[key]
        overrides = "".join(f" {name}" for name in mode.overrides)
        run.bar.set_postfix_str(f"load {precision}{overrides}")
        runner = build_runner(plan, run.spec, precision, mode)
        run.load_s[key] = runner.load()
        run.runners[key] = runner
        run.bar.update()


def _new_results(run: _Run, configs: list[Config]) -> None:
    for precision, mode, size in configs:
        r = empty_result("pipeline", run.plan, precision, mode, size)
        key = run.engine_id(precision, mode)
        r["load_s"] = run.load_s[key]
        r["notices"] = list(dict.fromkeys(run.runners[key].notices))
        run.results[(precision, mode, size)] = r


def _warm_buckets(run: _Run, configs: list[Config]) -> None:
    """Warm every bucket (compiled modes compile here), before any timed request."""
    for precision, mode, size in configs:
        r = run.results[(precision, mode, size)]
        run.bar.set_postfix_str(f"warm {precision} {mode} {size}")
        runner, engine_mode = run.engine(precision, mode)
        try:
            runner.check_mode(engine_mode)
            if engine_mode.compiled:
                info = runner.warm_bucket(BucketKey(engine_mode, size))
                if info.state != BucketState.WARM:
                    r["error"] = info.error or f"bucket is {info.state.value}"
                r["compile_s"], r["warmup_s"] = info.compile_s, info.warmup_s
                # FX-graph cache hits/misses while compiling: says whether compile_s was cold or cached.
                r["compile_cache_hits"], r["compile_cache_misses"] = info.cache_hits, info.cache_misses
                r["origin"] = info.origin  # aot: loaded from a package, or built now
            else:
                start = time.perf_counter()
                runner.generate(run.request(engine_mode, size, seed=0, steps=runner.options.warm_steps, rid="warm"))
                r["warmup_s"] = time.perf_counter() - start
        except Exception as exc:  # one configuration failing must not end the benchmark
            log.warning("%s %s %s failed: %s", precision, mode, size, exc)
            r["error"] = error_text(exc)
        run.bar.update()


def _first_requests(run: _Run, live: list[Config]) -> None:
    """The first request at each pre-warmed bucket (the warm-hit ratio's numerator)."""
    for precision, mode, size in live:
        r = run.results[(precision, mode, size)]
        run.bar.set_postfix_str(f"first request {precision} {mode} {size}")
        runner, engine_mode = run.engine(precision, mode)
        res = runner.generate(run.request(engine_mode, size, seed=1))
        r["first_request_ms"] = res.timings.total_ms
        r["recompiles_first_request"] = res.recompiles
        if res.eager_fallback:
            r["notices"].append("first request fell back to eager: the bucket was not warm")
        run.bar.update()


def _timed_runs(run: _Run, live: list[Config]) -> None:
    """Timed requests, round-robin over configurations; the starting configuration rotates."""
    steps_by: dict[Config, list[float]] = {c: [] for c in live}
    images_by: dict[Config, list[float]] = {c: [] for c in live}
    for i in range(run.plan.runs):
        order = live[i % len(live):] + live[: i % len(live)] if live else []
        for c in order:
            precision, mode, size = c
            r = run.results[c]
            run.bar.set_postfix_str(f"run {i + 1}/{run.plan.runs} {precision} {mode} {size}")
            runner, engine_mode = run.engine(precision, mode)
            res = runner.generate(run.request(engine_mode, size, seed=100 + i))
            steps_by[c].extend(res.timings.step_ms)
            images_by[c].append(res.timings.total_ms)
            r["recompiles"] += res.recompiles
            if res.eager_fallback:
                r["eager_fallbacks"] = r.get("eager_fallbacks", 0) + 1
            peak = res.peak_memory_bytes
            if peak is not None:
                r["peak_memory_bytes"] = max(peak, r["peak_memory_bytes"] or 0)
            run.bar.update()
    for c in live:
        finish_result(run.results[c], steps_by[c], images_by[c])


def _quality(run: _Run, live: list[Config]) -> None:
    """Drift against eager fp32 (and fidelity where the model has a checker) on the same fixed samples."""
    plan = run.plan
    if plan.quality_samples <= 0 or not live:
        return
    prompts = quality.sample_prompts(plan.preset, plan.quality_samples, seed=quality.PROMPT_SEED, fallback=plan.prompt)
    seeds = quality.image_seeds(len(prompts))

    def draw(config: Config, prompt: str, seed: int) -> bytes:
        precision, mode, size = config
        runner, engine_mode = run.engine(precision, mode)
        request = run.request(engine_mode, size, seed=seed).replace(prompt=prompt)
        run.bar.set_postfix_str(f"quality {precision} {mode} {size}")
        return runner.generate(request).image_png

    for config, row in quality.measure(live, draw, prompts, seeds, plan.preset).items():
        run.results[config].update(row)
    if quality.fidelity_checker(plan.preset) is None:
        return
    held = quality.sample_prompts(plan.preset, plan.quality_samples, seed=11, fallback=plan.prompt, held_out=True)
    references = [c for c in live if (c[0], c[1]) == quality.REFERENCE]
    for config, row in quality.measure(references, draw, held, seeds, plan.preset).items():
        run.results[config]["fidelity_held_out"] = row.get("fidelity")


def _overhead_config(live: list[Config]) -> Config | None:
    for wanted in OVERHEAD_PREFERENCE:
        for c in live:
            if c[1] == wanted:
                return c
    return live[0] if live else None


def _engine_overhead(run: _Run, live: list[Config]) -> dict:
    """Engine overhead, on one compiled configuration (full compile preferred)."""
    target = _overhead_config(live)
    if not target or run.plan.overhead_pairs <= 0:
        return {"skipped": "no configuration ran" if not target else "--overhead-runs 0"}
    precision, mode, size = target
    runner, engine_mode = run.engine(precision, mode)
    plan = run.plan
    out = measure_engine_overhead(runner, engine_mode, size, plan.steps, plan.overhead_pairs, plan.prompt,
                                  plan.preset.guidance, run.bar)
    out.update(precision=precision, mode=mode, size=str(size))
    return out


def _cache_probe(run: _Run) -> dict:
    """Persistent cache: cold vs filled inductor cache in fresh child processes."""
    if run.plan.cache_probe == "off":
        return {"skipped": "--cache-probe off"}
    if run.spec.compile_backend != "inductor":
        run.bar.update(2)
        return {"skipped": f"{run.spec.name} compiles with {run.spec.compile_backend}, not inductor"}
    return run_cache_probe(run.plan, run.spec.name, run.plan.cache_probe, run.bar)


def _cold_start_probe(run: _Run) -> dict:
    """Fresh processes warming every bucket: compile (empty / filled inductor cache) against aot packages."""
    if not run.plan.cold_start_probe:
        return {"skipped": "--cold-start-probe off (auto: on with mode aot)"}
    if Mode.AOT not in run.spec.modes:
        run.bar.update(COLD_START_STEPS)
        return {"skipped": f"{run.spec.name} has no aot mode: {run.spec.aot_refusal}"}
    return run_cold_start_probe(run.plan, run.spec.name, run.bar)


def _notes(plan: BenchPlan, spec: DeviceSpec, startup_s: float | None, cache_folder: str | None,
           cache_files: int) -> list[str]:
    if spec.compile_backend == "inductor":
        compiled_label = (
            "compile s = first call at the bucket in this process (compiles the graph, includes one "
            f"{plan.options.warm_steps}-step run), after a throwaway compile paid inductor's one-time start-up "
            f"({fmt(startup_s)} s), with the persistent inductor cache at {cache_folder} ({cache_files} files at "
            "start): cache hits make it shorter than a cold compile; the persistent-cache probe gives the cold number"
        )
    else:
        compiled_label = "compile s = first call at the bucket in this process (compiles the graph)"
    notes = [
        compiled_label,
        "load s = from_pretrained + .to(device) for the precision's engine (shared by its modes; diffusers "
        "imported beforehand)",
        "warm-up s = the run after compiling (eager: the first run), "
        f"{plan.options.warm_steps} steps; first req ms = the first full request at the warmed bucket; "
        "image ms = the engine's per-request total (encode + denoise + decode)",
        f"steady numbers: {plan.runs} requests per configuration, round-robin over all configurations; "
        "per-step median/p90 over every step of those requests",
        f"peak memory: {spec.describe_memory() or 'device peak'}",
        "speedups compare against eager at the same precision and size, measured in the same run",
    ]
    if Mode.AOT in plan.modes:
        notes.append("aot: compile s = loading the bucket's AOTInductor packages (denoiser per batch shape, and the "
                     "VAE decoder) from the cache folder, or building them (origin column); weights are the "
                     "engine's, shared by every package")
    if plan.options.attention_backend != "native":
        notes.append(f"attention backend {plan.options.attention_backend} in every configuration (column attention)")
    if Mode.COMPILE in plan.modes and plan.options.compile_vae:
        notes.append("mode compile also compiles vae.decode (engine default); regional compiles the denoiser's "
                     "repeated blocks only")
    return notes


def run_pipeline_bench(plan: BenchPlan) -> dict:
    spec = _prepare_process(plan)
    configs = plan.configs()
    n_engines = len({_Run.engine_id(p, m) for p, m, _ in configs})
    total = (n_engines + len(configs) * (2 + plan.runs) + 2 * plan.overhead_pairs
             + (2 if plan.cache_probe != "off" else 0) + (COLD_START_STEPS if plan.cold_start_probe else 0))
    run = _Run(plan, spec, progress(total, plan.progress, f"bench {plan.preset.name}@{spec.name}"))

    _load_engines(run, configs)
    cache_folder, cache_files = inductor_cache_state(spec, plan.cache_dir)
    startup_s = None
    if any(m in COMPILED_MODES for m in plan.modes) and spec.compile_backend == "inductor":
        run.bar.set_postfix_str("compiler start-up")
        startup_s = _prime_compiler(spec)
    _new_results(run, configs)
    _warm_buckets(run, configs)
    live = [c for c in configs if not run.results[c]["error"]]
    _first_requests(run, live)
    _timed_runs(run, live)
    _quality(run, live)
    run.bar.update((1 + plan.runs) * (len(configs) - len(live)))  # the steps failed configurations skipped
    ordered = [run.results[c] for c in configs]
    apply_speedups(ordered)
    extras = {"engine_overhead": _engine_overhead(run, live), "cache_probe": _cache_probe(run),
              "cold_start": _cold_start_probe(run)}
    run.bar.set_postfix_str("done")
    run.bar.close()
    return {
        "kind": "pipeline",
        "results": ordered,
        "extras": extras,
        "notes": _notes(plan, spec, startup_s, cache_folder, cache_files),
        "compile_startup_s": startup_s,
        "inductor_cache": {"dir": cache_folder, "files_at_start": cache_files},
    }


def measure_engine_overhead(runner: PipelineRunner, mode: Mode, size: Size, steps: int, pairs: int, prompt: str,
                            guidance: float, bar=None) -> dict:
    """runner.generate(request) vs calling the same (compiled) pipeline object directly with the same
    arguments, interleaved (the order alternates each pair), wall time around each call; medians."""
    pipe = runner.variants.get(mode)
    spec = runner.spec
    engine_ms: list[float] = []
    bare_ms: list[float] = []
    bare_recompiles = 0

    def engine_call(seed: int) -> None:
        req = GenerateRequest.checked(prompt=prompt, width=size.width, height=size.height, steps=steps,
                              guidance=guidance, seed=seed, mode=mode, on_cold=OnCold.EAGER)
        start = time.perf_counter()
        runner.generate(req)
        spec.synchronize()
        engine_ms.append((time.perf_counter() - start) * 1000)

    def bare_call(seed: int) -> None:
        nonlocal bare_recompiles
        before = compiles_in_this_thread()
        start = time.perf_counter()
        # Exactly what a user writes (the pipeline's own no_grad, as in the engine): any different grad
        # mode (e.g. inference_mode) would fail the graphs' guards and recompile.
        request = GenerateRequest.checked(prompt=prompt, width=size.width, height=size.height, steps=steps,
                                  guidance=guidance, seed=seed, mode=mode)
        pipe(**pipeline_call_kwargs(runner.preset, pipe, request))
        spec.synchronize()
        bare_ms.append((time.perf_counter() - start) * 1000)
        bare_recompiles += compiles_in_this_thread() - before

    bare_call(0)  # the bare path's own first call (e.g. lazy state on the shared scheduler), untimed
    bare_ms.clear()
    first_call_recompiles, bare_recompiles = bare_recompiles, 0
    for i in range(pairs):
        if bar:
            bar.set_postfix_str(f"engine overhead {i + 1}/{pairs}")
        first, second = (engine_call, bare_call) if i % 2 == 0 else (bare_call, engine_call)
        first(500 + i)
        second(500 + i)
        if bar:
            bar.update(2)
    e, b = median(engine_ms), median(bare_ms)
    return {
        "pairs": pairs,
        "engine_ms_median": e,
        "bare_ms_median": b,
        "ratio": ratio(e, b),
        "bare_recompiles": bare_recompiles,
        "bare_first_call_recompiles": first_call_recompiles,
        "engine_ms": [round(x, 4) for x in engine_ms],
        "bare_ms": [round(x, 4) for x in bare_ms],
        "note": f"{mode} {size}, {pairs} interleaved pairs; engine adds a pipeline copy, its own scheduler, "
                "per-step callbacks and PNG encoding",
    }
