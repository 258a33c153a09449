"""The denoiser bench (`--random-weights`): the preset's real denoiser architecture, random weights.

The denoiser class is built from the preset's `denoiser_config` (presets/models.toml) directly on the
device, in the benchmark dtype, and fed random inputs of the shapes its pipeline gives it at one step
of the bucket; each step is one synchronised forward. No download, real shapes: this is the GPU run
(scripts/bench_gpu.sh). Each mode's variant is built by the engine's own `runner.compile_denoiser`,
so the bench measures what the engine serves. Step time is set against the FLOPs of one forward
(analytic for Flux, FlopCounterMode on the meta device for any denoiser) and, with
`--matmul-roofline`, against the dense matmul rate measured on the same device.

Modes are measured one after another (each complete before the next) and `bench.json` is rewritten
after each, so a run cut short by a time limit keeps what finished.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.denoiser_shapes import (
    FLUX_PIPELINES,
    VIDEO_PIPELINES,
    DenoiserShape,
    count_flops_meta,
    denoiser_inputs,
    flux_step_flops,
    flux_tokens,
    sequence,
)
from bench.measure import error_text, inductor_cache_state, progress
from bench.modes import MODE_TABLE
from bench.plan import BenchPlan
from bench.report import assemble_report, write_outputs
from bench.stats import apply_speedups, empty_result, finish_result
from engine import devices
from engine.config.presets import load_presets
from engine.devices import DeviceSpec
from engine.errors import InvalidRequest, UnsupportedCombination
from engine.pipeline import recipes, runner
from engine.protocol import Mode, Precision, Size

log = logging.getLogger(__name__)

DENOISER_CLASSES = {
    "FluxPipeline": "FluxTransformer2DModel",
    "FluxKontextPipeline": "FluxTransformer2DModel",
    "WanPipeline": "WanTransformer3DModel",
    "StableDiffusion3Pipeline": "SD3Transformer2DModel",
    "StableDiffusionXLPipeline": "UNet2DConditionModel",
    "StableDiffusionPipeline": "UNet2DConditionModel",
}
DEFAULT_TEXT_LEN = {"FluxPipeline": 512, "FluxKontextPipeline": 512, "WanPipeline": 512,
                    "StableDiffusion3Pipeline": 333, "StableDiffusionXLPipeline": 77, "StableDiffusionPipeline": 77}
# Pipelines that run classifier-free guidance as two forwards of the batch (cond, then uncond) rather than one
# forward of twice the batch: a step is that many calls.
SEPARATE_GUIDANCE_CALLS = ("WanPipeline",)
# Engine modes that have a denoiser-only variant (defer-and-fuse switches the TPU runtime's eager
# mode for a whole pipeline run; it has no module of its own).
VARIANT_MODES = (Mode.EAGER, Mode.COMPILE, Mode.REGIONAL, Mode.AOT)
# torch.compile modes that replay CUDA graphs where the device has them: each step must be marked.
CUDA_GRAPH_COMPILE_MODES = ("max-autotune", "reduce-overhead")

# Published reference points (per image, FLUX.1-dev 1024x1024, 28 steps, bf16).
REFERENCE_POINTS = (
    "torch.compile took FLUX.1-dev on an H100 from 6.7 s to 4.5 s per image (1.49x)",
    "an H200 ran FLUX.1-dev compiled in 4.3 s per image",
)


def denoiser_class(pipeline: str):
    name = DENOISER_CLASSES.get(pipeline)
    if name is None:
        raise UnsupportedCombination(
            f"--random-weights knows the denoiser inputs of {', '.join(DENOISER_CLASSES)}; {pipeline} is not one"
        )
    # Imported here, after the device environment is applied: importing diffusers pulls in torch._dynamo,
    # which pins inductor's cache folder (see bench/pipeline.py).
    import diffusers

    return getattr(diffusers, name)


def measure_matmul_rate(spec: DeviceSpec, dtype, sizes: tuple[int, ...] | None = None,
                        iters: int | None = None) -> dict:
    """Best achieved dense matmul rate (TFLOP/s) in `dtype` on this device: the roofline the
    denoiser's step is compared with. Square matmuls, 2·n³ FLOPs each, synchronised wall time.
    Sizes and iterations come from the device spec (big enough to reach its peak, few enough to be quick)."""
    sizes = sizes or spec.matmul_probe_sizes
    iters = iters or spec.matmul_probe_iters
    best, rows = 0.0, []
    for n in sizes:
        a = torch.randn(n, n, device=spec.torch_device, dtype=dtype)
        b = torch.randn(n, n, device=spec.torch_device, dtype=dtype)
        for _ in range(3):
            a @ b
        spec.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            a @ b
        spec.synchronize()
        seconds = (time.perf_counter() - start) / iters
        tflops = 2 * n**3 / seconds / 1e12
        rows.append({"n": n, "ms": seconds * 1000, "tflops": tflops})
        best = max(best, tflops)
        del a, b
    return {"dtype": str(dtype).replace("torch.", ""), "tflops": best, "sizes": rows}


def denoiser_variant(model: torch.nn.Module, mode: str, options, spec: DeviceSpec,
                     inputs: dict | None = None) -> tuple[object, dict, list[str]]:
    """The denoiser a bench mode runs, built as the engine builds it (`runner.compile_denoiser`), with
    the torch.compile arguments the mode's options give on this device, and their notices. aot: an
    AOTInductor package exported at `inputs`, built in a temporary folder and loaded on the model's
    own weights (`aot_build_s` in the returned kwargs)."""
    bench_mode = MODE_TABLE[mode]
    if bench_mode.engine not in VARIANT_MODES:
        raise UnsupportedCombination(f"mode {mode!r} has no denoiser-only variant")
    if not bench_mode.compiled:
        return model, {}, []
    options = dataclasses.replace(options, **bench_mode.overrides)
    graph_notices = recipes.cuda_graphs_notices(options, spec, bench_mode.engine)  # refused off CUDA, as the engine does
    if bench_mode.engine is Mode.AOT:
        if Mode.AOT not in spec.modes:
            raise UnsupportedCombination(f"mode aot is not offered on {spec.name}: {spec.aot_refusal}")
        if inputs is None:
            raise UnsupportedCombination("mode aot needs the bucket's example inputs to export the denoiser")
        import tempfile

        from engine.pipeline import aot

        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="showcase-bench-aot-") as folder:
            package = aot.compile_module(model, (), inputs, recipes.aot_inductor_configs(options, spec), Path(folder))
        return package, {"aot_build_s": time.perf_counter() - start}, []
    kwargs, notices = recipes.compile_kwargs(options, spec, mode=bench_mode.engine)
    return runner.compile_denoiser(model, bench_mode.engine, kwargs), kwargs, notices + graph_notices


def _measure_denoiser(fn, inputs: dict, mode: str, cuda_graphs: bool, run: _Run, r: dict) -> None:
    """Compile (first forward), warm up, then `runs` images of `steps` synchronised steps each (a step is
    `run.calls_per_step` forwards: two where the pipeline runs guidance's halves one after the other)."""
    plan, spec, bar = run.plan, run.spec, run.bar

    def step() -> float:
        start = time.perf_counter()
        for _ in range(run.calls_per_step):
            if cuda_graphs:  # a new replay: outputs of the previous one may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            fn(**inputs)
        spec.synchronize()
        return (time.perf_counter() - start) * 1000

    eager = not MODE_TABLE[mode].compiled
    with torch.no_grad():  # as the pipelines run their denoiser
        spec.reset_peak_memory()
        r["compile_s"] = step() / 1000 if not eager else None
        warm = [step() for _ in range(plan.warmup_calls + (1 if eager else 0))]
        r["warmup_s"] = sum(warm) / 1000
        bar.update()
        step_ms: list[float] = []
        image_ms: list[float] = []
        for i in range(plan.runs):
            before = runner.compiles_in_this_thread()
            spec.reset_peak_memory()
            times = []
            for _ in range(plan.steps):
                times.append(step())
                bar.update()
            r["recompiles"] += runner.compiles_in_this_thread() - before
            peak = spec.peak_memory_bytes()
            if peak is not None:
                r["peak_memory_bytes"] = max(peak, r["peak_memory_bytes"] or 0)
            if i == 0:
                r["first_request_ms"] = sum(times)
            step_ms += times
            image_ms.append(sum(times))
    finish_result(r, step_ms, image_ms)
    if r.get("flops_per_step") and r["step_ms_median"]:
        r["tflops"] = r["flops_per_step"] / (r["step_ms_median"] / 1000) / 1e12


@dataclass
class _Run:
    """State the phases share."""

    plan: BenchPlan
    spec: DeviceSpec
    cls: type
    cfg: dict
    text_len: int
    batch: int
    bar: object
    started: float
    calls_per_step: int = 1
    notes: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    budget_hit: bool = False

    def checkpoint(self) -> None:
        if self.plan.out:  # partial results survive a timeout (the GPU run has a hard limit)
            apply_speedups(self.results)
            report = assemble_report(self.plan, self.spec, "denoiser", self.results, self.extras, self.notes,
                                     partial=True)
            write_outputs(report, self.plan.out, chart=False)

    def out_of_time(self) -> bool:
        budget = self.plan.time_budget_s
        return bool(budget) and time.perf_counter() - self.started > budget


def _check_preset(plan: BenchPlan) -> None:
    if not plan.preset.denoiser_config:
        with_config = [name for name, p in load_presets().items() if p.denoiser_config]
        raise InvalidRequest(
            f"preset {plan.preset.name} has no denoiser_config in presets/models.toml; --random-weights needs the "
            "architecture (presets with one: " + ", ".join(with_config) + ")"
        )


def _shape(run: _Run, size: Size) -> DenoiserShape:
    plan = run.plan
    return DenoiserShape(plan.preset.pipeline, run.cfg, size, run.text_len, run.batch,
                         references=plan.reference_sizes(size), frames=plan.frames)


def _flops_per_size(run: _Run) -> dict[str, dict]:
    """FLOPs per step, per size: analytic (Flux, Kontext) and FlopCounterMode on meta (any denoiser), times the
    forwards a step makes; and each size's self-attention sequence."""
    preset, flops = run.plan.preset, {}
    for size in run.plan.sizes:
        shape = _shape(run, size)
        counted = count_flops_meta(run.cls, shape, preset.guidance)
        analytic = None
        if preset.pipeline in FLUX_PIPELINES:
            refs = sum(flux_tokens(run.cfg, r.width, r.height) for r in shape.references)
            analytic = flux_step_flops(run.cfg, size.width, size.height, run.text_len, run.batch, reference_tokens=refs)
        calls = run.calls_per_step
        flops[str(size)] = {"analytic": analytic and analytic * calls, "counted": counted and counted * calls,
                            "used": (analytic or counted) and (analytic or counted) * calls}
        run.extras.setdefault("sequence", {})[str(size)] = sequence(shape)
    return flops


def _matmul_rooflines(run: _Run) -> dict:
    """Each precision is compared with the matmul rate in its own dtype on this machine."""
    rates = {}
    for precision in run.plan.precisions:
        run.bar.set_postfix_str(f"matmul roofline {precision}")
        rates[precision] = measure_matmul_rate(run.spec, devices.plan_precision(run.spec, precision).dtype)
    run.bar.update()
    return rates


def _keep_in_fp32(model: torch.nn.Module) -> None:
    """As from_pretrained loads the class: the parameters it keeps in fp32 (Wan: its norms, time embedder and
    modulation tables) stay fp32 whatever the benchmark dtype."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, param in model.named_parameters():
        if any(k in name.split(".") for k in keep):
            param.data = param.data.float()


def _build_denoiser(run: _Run, precision: str) -> tuple[torch.nn.Module, int, float]:
    """The denoiser with random weights, built directly in the benchmark dtype on the device (no fp32 copy)."""
    plan, spec, cls = run.plan, run.spec, run.cls
    dtype = devices.plan_precision(spec, precision).dtype
    run.bar.set_postfix_str(f"build {cls.__name__} {precision}")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in cls.from_config(run.cfg).parameters())
    need = n_params * torch.empty((), dtype=dtype).element_size()
    memory = spec.memory_info()
    avail = memory[0] if memory else None
    if avail is not None and need * 1.3 > avail and not plan.force:
        raise UnsupportedCombination(
            f"{cls.__name__} with this config has {n_params / 1e9:.2f}B parameters ({need / 2**30:.1f} GiB in "
            f"{precision}); {spec.name} has {avail / 2**30:.1f} GiB available. Use a smaller "
            "--denoiser-config-override, another device, or --force"
        )
    start = time.perf_counter()
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(spec.torch_device):
            model = cls.from_config(run.cfg)
    finally:
        torch.set_default_dtype(old_dtype)
    model.eval().requires_grad_(False)
    if not Precision(precision).quantized:
        _keep_in_fp32(model)
    elif getattr(model, "_keep_in_fp32_modules", None):
        # torchao's per-row float8 takes bf16 weights only: from_pretrained's fp32 modules would stop it
        run.notes.append(f"{precision}: {cls.__name__}'s fp32 modules ({', '.join(model._keep_in_fp32_modules)}) "
                         f"left in {dtype} so every linear layer quantizes (from_pretrained keeps them fp32)")
    if plan.preset.repeated_blocks:
        model._repeated_blocks = list(plan.preset.repeated_blocks)
    if plan.options.fuse_qkv:
        run.notes.append(recipes.step_fuse_qkv(types.SimpleNamespace(denoiser=model), "denoiser"))
    if Precision(precision).quantized:  # built in the base dtype, then quantized as the engine does
        run.notes.append(recipes.quantize_denoiser(types.SimpleNamespace(denoiser=model), "denoiser", precision))
    spec.synchronize()
    build_s = time.perf_counter() - start
    run.bar.update()
    return model, n_params, build_s


def _measure_config(run: _Run, model, precision: str, mode: str, size: Size, inputs: dict, r: dict) -> None:
    """One (precision, mode, size): build the variant, measure it; a failure is recorded, not raised."""
    run.bar.set_postfix_str(f"{precision} {mode} {size}: compile + warm-up")
    try:
        fn, kwargs, notices = denoiser_variant(model, mode, run.plan.options, run.spec, inputs)
        run.notes.extend(notices)
        cuda_graphs = run.spec.cuda_graphs and kwargs.get("mode") in CUDA_GRAPH_COMPILE_MODES
        _measure_denoiser(fn, inputs, mode, cuda_graphs, run, r)
        if kwargs.get("aot_build_s") is not None:  # export + AOT compile happened before the first forward
            r["compile_s"] = kwargs["aot_build_s"] + (r["compile_s"] or 0)
        rate = (run.extras.get("matmul") or {}).get(precision, {}).get("tflops")
        if r.get("tflops") is not None and rate:
            r["matmul_fraction"] = r["tflops"] / rate
    except Exception as exc:
        log.warning("%s %s %s failed: %s", precision, mode, size, exc)
        r["error"] = error_text(exc)[:500]


def _measure_precision(run: _Run, precision: str, flops: dict[str, dict]) -> None:
    """Every size and mode of one precision on one random-weights denoiser."""
    plan, spec = run.plan, run.spec
    plan_p = devices.plan_precision(spec, precision)
    devices.apply_precision(plan_p)
    model, n_params, build_s = _build_denoiser(run, precision)
    run.extras.setdefault("parameters", n_params)
    for size in plan.sizes:
        inputs = denoiser_inputs(_shape(run, size), spec.torch_device, plan_p.dtype, plan.preset.guidance)
        for mode in plan.modes:
            r = empty_result("denoiser", plan, precision, mode, size)
            r.update(load_s=build_s, batch=run.batch, text_len=run.text_len, parameters=n_params,
                     flops_per_step=flops[str(size)]["used"],
                     sequence_tokens=run.extras["sequence"][str(size)]["total"],
                     references=[str(s) for s in plan.reference_sizes(size)], frames=plan.frames or None)
            run.results.append(r)
            if run.out_of_time():
                r["error"] = f"skipped: time budget of {plan.time_budget_s:.0f}s spent"
                run.budget_hit = True
                run.bar.update(1 + plan.runs * plan.steps)
            else:
                _measure_config(run, model, precision, mode, size, inputs, r)
            run.checkpoint()
    del model
    spec.empty_cache()


def _sequence_notes(run: _Run) -> list[str]:
    plan, notes = run.plan, []
    for size, seq in run.extras.get("sequence", {}).items():
        if seq["total"] is None:
            continue
        if plan.preset.pipeline in VIDEO_PIPELINES:
            notes.append(f"sequence at {size} x {plan.frames} frames: {seq['total']} video tokens in self-attention "
                         f"({run.text_len} text tokens by cross-attention)")
        else:
            refs = plan.reference_sizes(Size.parse(size))
            ref_part = (f" + {seq['references']} reference ({', '.join(map(str, refs))})" if refs else "")
            notes.append(f"sequence at {size}: {seq['output']} output{ref_part} + {seq['text']} text = "
                         f"{seq['total']} tokens")
    return notes


def _closing_notes(run: _Run, cache_folder: str | None, cache_files: int) -> list[str]:
    plan = run.plan
    pipeline = plan.preset.pipeline
    calls = ("one step = one synchronised forward" if run.calls_per_step == 1 else
             f"one step = {run.calls_per_step} synchronised forwards (the pipeline runs guidance's halves one "
             "after the other)")
    notes = [
        f"denoiser only: {run.cls.__name__} from the preset's denoiser_config with random weights, batch "
        f"{run.batch}, {run.text_len} text tokens; {calls}; image ms = {plan.steps} steps",
        *_sequence_notes(run),
        f"compile s = first forward in this process (compiles); inductor cache at {cache_folder} "
        f"({cache_files} files at start); warm-up s = the next {plan.warmup_calls} step(s)",
        "modes are measured one after another (each complete before the next), so a time-limited run keeps "
        "finished modes",
        "TFLOP/s = FLOPs per step / median step time; FLOPs: "
        + ("analytic (flux_step_flops), cross-checked with FlopCounterMode on meta"
           if pipeline in FLUX_PIPELINES else "FlopCounterMode on the meta device"),
        *([f"reference: {p}" for p in REFERENCE_POINTS] if pipeline == "FluxPipeline" else []),
    ]
    if run.budget_hit:
        notes.append(f"time budget {plan.time_budget_s:.0f}s was spent: later configurations were skipped")
    return notes


def run_denoiser_bench(plan: BenchPlan) -> dict:
    started = time.perf_counter()
    _check_preset(plan)
    preset = plan.preset
    spec = devices.resolve_device(plan.device)
    env = devices.apply_environment(spec, plan.cache_dir)  # before diffusers loads (see denoiser_class)
    cls = denoiser_class(preset.pipeline)
    # Classifier-free guidance doubles the batch (or the calls, where the pipeline runs its halves one after the
    # other); a batched call (engine/pipeline/batching.py) multiplies the batch
    guided = 2 if preset.cfg and preset.guidance > 1.0 else 1
    calls = guided if preset.pipeline in SEPARATE_GUIDANCE_CALLS else 1
    batch = guided // calls * plan.images_per_call
    configs = plan.configs()
    total = len(plan.precisions) + len(configs) * (1 + plan.runs * plan.steps) + (1 if plan.matmul_roofline else 0)
    run = _Run(plan, spec, cls, cfg={**preset.denoiser_config, **(plan.config_override or {})},
               text_len=plan.text_len or DEFAULT_TEXT_LEN.get(preset.pipeline, 77), batch=batch,
               bar=progress(total, plan.progress, f"bench {preset.name} denoiser@{spec.name}"), started=started,
               calls_per_step=calls)
    run.extras.update(environment=env, batch=batch, images_per_call=plan.images_per_call, text_len=run.text_len,
                      config=run.cfg, calls_per_step=calls, frames=plan.frames or None,
                      references=[str(s) for s in plan.references] if plan.references is not None else None)
    cache_folder, cache_files = inductor_cache_state(spec, plan.cache_dir)
    runner._install_compile_counter()
    recipes.raise_recompile_limit(len(configs) * 2)
    run.notes += recipes.apply_inductor_flags(plan.options, spec)

    run.extras["flops_per_step"] = _flops_per_size(run)
    if plan.matmul_roofline:  # first (seconds), so a run cut short by a time limit still has it
        run.extras["matmul"] = _matmul_rooflines(run)
    for precision in plan.precisions:
        _measure_precision(run, precision, run.extras["flops_per_step"])
    run.bar.close()
    apply_speedups(run.results)
    return {"kind": "denoiser", "results": run.results, "extras": run.extras,
            "notes": run.notes + _closing_notes(run, cache_folder, cache_files)}
