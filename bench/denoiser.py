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
from torch.utils.flop_counter import FlopCounterMode

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
    "StableDiffusion3Pipeline": "SD3Transformer2DModel",
    "StableDiffusionXLPipeline": "UNet2DConditionModel",
    "StableDiffusionPipeline": "UNet2DConditionModel",
}
DEFAULT_TEXT_LEN = {"FluxPipeline": 512, "StableDiffusion3Pipeline": 333, "StableDiffusionXLPipeline": 77,
                    "StableDiffusionPipeline": 77}
VAE_SCALE = 8
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


def flux_step_flops(cfg: dict, width: int, height: int, text_len: int = 512, batch: int = 1) -> int:
    """FLOPs of one FluxTransformer2DModel forward, counted analytically (multiply-add = 2 FLOPs).

    With D = heads·head_dim, N_img = (H/16)·(W/16) image tokens, N_txt text tokens, N = N_img + N_txt:
      linear layer:  2 · tokens · in · out;   attention (QKᵀ and AV): 4 · N² · D per layer
      double block:  qkv img+txt 6·N·D², out projections 2·N·D², MLP 4D 16·N·D²  -> 24·N·D² + 4·N²·D
                     + AdaLN modulation of the 1-token embedding for img and txt: 2 · 2·D·6D
      single block:  qkv 6·N·D², proj_mlp 8·N·D², proj_out (5D -> D) 10·N·D²   -> 24·N·D² + 4·N²·D
                     + AdaLN modulation 2·D·3D
      embedders:     x 2·N_img·C_in·D, context 2·N_txt·J·D, proj_out 2·N_img·D·C_out, norm_out 2·D·2D,
                     timestep (and guidance) 2·256·D + 2·D², pooled 2·P·D + 2·D²
    FLUX.1-dev at 1024² with 512 text tokens: ≈ 74.4 TFLOP per step. Everything times the batch.
    Checked against torch.utils.flop_counter.FlopCounterMode (tests/test_bench.py).
    """
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    d = heads * head_dim
    patch = cfg.get("patch_size", 1)
    c_in = cfg.get("in_channels", 64)
    c_out = (cfg.get("out_channels") or c_in) * patch * patch
    n_img = (height // (VAE_SCALE * 2)) * (width // (VAE_SCALE * 2)) // (patch * patch)
    n = n_img + text_len
    per_layer = 24 * n * d * d + 4 * n * n * d
    double = cfg.get("num_layers", 19) * (per_layer + 2 * 2 * d * 6 * d)
    single = cfg.get("num_single_layers", 38) * (per_layer + 2 * d * 3 * d)
    time_embeds = (2 * 256 * d + 2 * d * d) * (2 if cfg.get("guidance_embeds", False) else 1)
    pooled = 2 * cfg.get("pooled_projection_dim", 768) * d + 2 * d * d
    embed = (2 * n_img * c_in * d + 2 * text_len * cfg.get("joint_attention_dim", 4096) * d
             + 2 * n_img * d * c_out + 2 * d * 2 * d + time_embeds + pooled)
    return batch * (double + single + embed)


@dataclass(frozen=True)
class DenoiserShape:
    """What a pipeline hands its denoiser at one step: the pipeline class, the denoiser's config, the bucket,
    the text length in tokens and the batch."""

    pipeline: str
    cfg: dict
    size: object  # Size
    text_len: int
    batch: int = 1


def denoiser_inputs(shape: DenoiserShape, device: str, dtype, guidance: float = 3.5, seed: int = 0) -> dict:
    """Random inputs of the shapes the pipeline gives its denoiser at one step for this bucket."""
    pipeline, cfg, size, text_len, batch = shape.pipeline, shape.cfg, shape.size, shape.text_len, shape.batch
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    h, w = size.height // VAE_SCALE, size.width // VAE_SCALE
    if pipeline == "FluxPipeline":
        # Packed latents: 2x2 patches of the 16-channel latent -> (H/16)·(W/16) tokens of 64 channels.
        hp, wp = h // 2, w // 2
        img_ids = torch.zeros(hp, wp, 3)
        img_ids[..., 1] = torch.arange(hp)[:, None]
        img_ids[..., 2] = torch.arange(wp)[None, :]
        inputs = {
            "hidden_states": rnd(batch, hp * wp, cfg.get("in_channels", 64)),
            "encoder_hidden_states": rnd(batch, text_len, cfg.get("joint_attention_dim", 4096)),
            "pooled_projections": rnd(batch, cfg.get("pooled_projection_dim", 768)),
            "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),  # sigma; the model scales by 1000
            "img_ids": img_ids.reshape(hp * wp, 3).to(device=device, dtype=dtype),
            "txt_ids": torch.zeros(text_len, 3, device=device, dtype=dtype),
            "return_dict": False,
        }
        if cfg.get("guidance_embeds", False):
            inputs["guidance"] = torch.full((batch,), guidance, device=device, dtype=torch.float32)
        return inputs
    if pipeline == "StableDiffusion3Pipeline":
        return {
            "hidden_states": rnd(batch, cfg.get("in_channels", 16), h, w),
            "encoder_hidden_states": rnd(batch, text_len, cfg.get("joint_attention_dim", 4096)),
            "pooled_projections": rnd(batch, cfg.get("pooled_projection_dim", 2048)),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
            "return_dict": False,
        }
    # UNet2DConditionModel (SDXL: text_time micro-conditioning)
    inputs = {
        "sample": rnd(batch, cfg.get("in_channels", 4), h, w),
        "timestep": torch.full((batch,), 500.0, device=device, dtype=dtype),
        "encoder_hidden_states": rnd(batch, text_len, cfg.get("cross_attention_dim", 2048)),
        "return_dict": False,
    }
    if cfg.get("addition_embed_type") == "text_time":
        time_dim = cfg.get("addition_time_embed_dim", 256)
        text_dim = cfg.get("projection_class_embeddings_input_dim", 2816) - 6 * time_dim
        inputs["added_cond_kwargs"] = {"text_embeds": rnd(batch, text_dim), "time_ids": rnd(batch, 6)}
    return inputs


def count_flops_meta(cls, shape: DenoiserShape, guidance: float) -> int | None:
    """FLOPs of one forward counted by FlopCounterMode on the meta device (no memory, no compute).
    On meta, SDPA takes the math path, so attention's matmuls are counted too."""
    try:
        with torch.device("meta"):
            model = cls.from_config(shape.cfg)
        inputs = denoiser_inputs(shape, "meta", torch.float32, guidance)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(**inputs)
        return int(counter.get_total_flops())
    except Exception as exc:  # counting is informative; never fail the benchmark over it
        log.warning("FLOP count on meta failed: %s", exc)
        return None


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


def _measure_denoiser(fn, inputs: dict, mode: str, cuda_graphs: bool, plan: BenchPlan, spec: DeviceSpec,
                      r: dict, bar) -> None:
    """Compile (first forward), warm up, then `runs` images of `steps` synchronised forwards each."""

    def step() -> float:
        if cuda_graphs:  # a new replay: outputs of the previous one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        start = time.perf_counter()
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


def _flops_per_size(run: _Run) -> dict[str, dict]:
    """FLOPs per step, per size: analytic (Flux) and FlopCounterMode on meta (any denoiser)."""
    preset, flops = run.plan.preset, {}
    for size in run.plan.sizes:
        counted = count_flops_meta(run.cls, DenoiserShape(preset.pipeline, run.cfg, size, run.text_len, run.batch),
                                   preset.guidance)
        analytic = (flux_step_flops(run.cfg, size.width, size.height, run.text_len, run.batch)
                    if preset.pipeline == "FluxPipeline" else None)
        flops[str(size)] = {"analytic": analytic, "counted": counted, "used": analytic or counted}
    return flops


def _matmul_rooflines(run: _Run) -> dict:
    """Each precision is compared with the matmul rate in its own dtype on this machine."""
    rates = {}
    for precision in run.plan.precisions:
        run.bar.set_postfix_str(f"matmul roofline {precision}")
        rates[precision] = measure_matmul_rate(run.spec, devices.plan_precision(run.spec, precision).dtype)
    run.bar.update()
    return rates


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
        _measure_denoiser(fn, inputs, mode, cuda_graphs, run.plan, run.spec, r, run.bar)
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
        inputs = denoiser_inputs(DenoiserShape(plan.preset.pipeline, run.cfg, size, run.text_len, run.batch),
                                 spec.torch_device, plan_p.dtype, plan.preset.guidance)
        for mode in plan.modes:
            r = empty_result("denoiser", plan, precision, mode, size)
            r.update(load_s=build_s, batch=run.batch, text_len=run.text_len, parameters=n_params,
                     flops_per_step=flops[str(size)]["used"])
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


def _closing_notes(run: _Run, cache_folder: str | None, cache_files: int) -> list[str]:
    plan = run.plan
    notes = [
        f"denoiser only: {run.cls.__name__} from the preset's denoiser_config with random weights, batch "
        f"{run.batch}, {run.text_len} text tokens; one step = one synchronised forward; image ms = {plan.steps} steps",
        f"compile s = first forward in this process (compiles); inductor cache at {cache_folder} "
        f"({cache_files} files at start); warm-up s = the next {plan.warmup_calls} forward(s)",
        "modes are measured one after another (each complete before the next), so a time-limited run keeps "
        "finished modes",
        "TFLOP/s = FLOPs per step / median step time; FLOPs: "
        + ("analytic (flux_step_flops), cross-checked with FlopCounterMode on meta"
           if plan.preset.pipeline == "FluxPipeline" else "FlopCounterMode on the meta device"),
        *[f"reference: {p}" for p in REFERENCE_POINTS],
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
    # Classifier-free guidance doubles the batch; a batched call (engine/pipeline/batching.py) multiplies it
    batch = (2 if preset.cfg and preset.guidance > 1.0 else 1) * plan.images_per_call
    configs = plan.configs()
    total = len(plan.precisions) + len(configs) * (1 + plan.runs * plan.steps) + (1 if plan.matmul_roofline else 0)
    run = _Run(plan, spec, cls, cfg={**preset.denoiser_config, **(plan.config_override or {})},
               text_len=plan.text_len or DEFAULT_TEXT_LEN.get(preset.pipeline, 77), batch=batch,
               bar=progress(total, plan.progress, f"bench {preset.name} denoiser@{spec.name}"), started=started)
    run.extras.update(environment=env, batch=batch, images_per_call=plan.images_per_call, text_len=run.text_len,
                      config=run.cfg)
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
