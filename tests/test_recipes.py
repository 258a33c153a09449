"""Each optimisation option is one named step; each test checks that it took effect."""

from __future__ import annotations

import pytest
import torch
from helpers import make_runner, torch_configs_restored

from engine import devices
from engine.config.presets import get_preset
from engine.errors import UnsupportedCombination
from engine.pipeline import recipes
from engine.pipeline.runner import PipelineRunner, clone_module_tree
from engine.protocol import EngineConfig, EngineKey, EngineOptions


def test_fuse_qkv_fuses_attention_projections(cache_dir, tiny_models):
    runner = make_runner(cache_dir, fuse_qkv=True)
    fused = [m for m in runner.pipe.transformer.modules() if getattr(m, "fused_projections", False)]
    assert fused
    assert any("fused QKV" in n for n in runner.notices)


def test_channels_last_on_unet_and_vae(cache_dir, tiny_models):
    runner = make_runner(cache_dir, preset="tiny-sdxl", channels_last=True)
    conv = next(m for m in runner.pipe.unet.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()


def test_cpu_offload_installs_hooks_and_rules_out_full_compile(cache_dir, tiny_models):
    runner = make_runner(cache_dir, cpu_offload=True)
    assert hasattr(runner.pipe.text_encoder, "_hf_hook")
    assert "compile" not in runner.modes() and "regional" in runner.modes()
    with pytest.raises(UnsupportedCombination, match="CPU offload"):
        runner.check_mode("compile")


@pytest.fixture(scope="module")
def shapes_fp32(cache_dir):
    runner = make_runner(cache_dir, preset="tiny-shapes")
    return runner, _shapes_image(runner)


def _shapes_image(runner, mode="eager"):
    import numpy as np

    from engine.protocol import GenerateRequest

    size = runner.preset.buckets[0]
    request = GenerateRequest.checked(runner.preset.example_prompt, size.width, size.height, 8, 1.0, 1, mode=mode)
    return np.asarray(runner.generate(request).image().convert("RGB"))


@pytest.mark.parametrize("precision, tensor", [("int8wo", "Int8Tensor"), ("int8dq", "Int8Tensor")])
def test_quantized_precisions_quantize_the_denoiser_with_torchao(cache_dir, shapes_fp32, precision, tensor):
    import numpy as np

    from bench.quality import image_drift
    from training.shapes.fidelity import check

    runner = make_runner(cache_dir, preset="tiny-shapes", precision=precision)
    assert runner.precision.precision == precision and runner.precision.base == "fp32"
    linears = [m for m in runner.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m.weight).__name__ == tensor for m in linears)
    assert all(p.dtype == torch.float32 for p in runner.pipe.vae.parameters())  # only the denoiser is quantized
    assert any(f"{precision}:" in n and "torchao" in n for n in runner.notices)
    image = _shapes_image(runner)
    assert check(image, runner.preset.example_prompt).correct
    drift = image_drift(image, shapes_fp32[1])
    assert 0 < drift["max_diff"] and drift["psnr_db"] > 20  # quantized: close to fp32, not the same
    assert not np.array_equal(image, shapes_fp32[1])
    assert "aot" not in runner.modes()
    with pytest.raises(UnsupportedCombination, match="tensor subclasses"):
        runner.check_mode("aot")


def test_fp8_is_refused_on_cpu_and_below_sm89():
    from dataclasses import replace

    from engine.devices.spec import make_plan

    with pytest.raises(UnsupportedCombination, match="compute capability 8.9"):
        devices.plan_precision(devices.get_device("cpu"), "fp8")
    cuda = replace(devices.get_device("cuda"), precision_fn=make_plan)
    with pytest.raises(UnsupportedCombination, match="sm_86"):
        devices.plan_precision(replace(cuda, capability_fn=lambda: (8, 6)), "fp8")
    plan = devices.plan_precision(replace(cuda, capability_fn=lambda: (9, 0)), "fp8")
    assert plan.precision == "fp8" and plan.base == "bf16" and plan.dtype == torch.bfloat16
    table = devices.precision_support(devices.get_device("cpu"))
    assert table["int8wo"]["status"] == "ok" and table["fp8"]["status"] == "refused"


def test_inductor_flags_default_on_for_cuda_only():
    import torch._inductor.config as inductor_config

    cpu, cuda = devices.get_device("cpu"), devices.get_device("cuda")
    assert recipes.apply_inductor_flags(EngineOptions(), cpu) == []
    with torch_configs_restored():  # the flags are process-wide; later compiles here must not see them
        inductor_config.coordinate_descent_tuning = False
        notices = recipes.apply_inductor_flags(EngineOptions(), cuda)
        assert notices and inductor_config.coordinate_descent_tuning is True
        assert inductor_config.epilogue_fusion is False


def test_compile_kwargs_per_device_and_option():
    cpu, tpu = devices.get_device("cpu"), devices.get_device("tpu")
    kwargs, _ = recipes.compile_kwargs(EngineOptions(), cpu)
    assert kwargs == {"backend": "inductor", "fullgraph": True, "dynamic": False}
    kwargs, _ = recipes.compile_kwargs(EngineOptions(max_autotune=True, dynamic=True), cpu)
    assert kwargs["mode"] == "max-autotune" and kwargs["dynamic"] is True
    import torch.fx.experimental._config as fx_config

    assert fx_config.use_duck_shape is False
    kwargs, notices = recipes.compile_kwargs(EngineOptions(dynamic=True, max_autotune=True), tpu)
    assert kwargs["backend"] == "tpu" and kwargs["dynamic"] is False and "mode" not in kwargs
    assert any("static" in n for n in notices) and any("max-autotune" in n for n in notices)


def test_recompile_limit_covers_every_bucket():
    import torch._dynamo.config as dynamo_config

    limit = recipes.raise_recompile_limit(40)
    assert dynamo_config.recompile_limit >= 40 and limit >= 48


def test_variants_share_weights_and_keep_eager_eager(cache_dir, tiny_models):
    runner = make_runner(cache_dir, compile_vae=False)
    base = runner.pipe.transformer
    compiled = runner.variants.get("compile")
    assert compiled.transformer._orig_mod is base
    assert compiled.vae is runner.pipe.vae  # compile_vae=False leaves the VAE alone
    regional = runner.variants.get("regional").transformer
    assert regional is not base
    assert {p.data_ptr() for p in regional.parameters()} == {p.data_ptr() for p in base.parameters()}
    blocks = [m for m in regional.modules() if type(m).__name__ in base._repeated_blocks]
    assert blocks and all(m._compiled_call_impl is not None for m in blocks)
    assert all(m._compiled_call_impl is None for m in base.modules())


def test_compile_vae_wraps_decode_on_a_copy(cache_dir, tiny_models):
    runner = make_runner(cache_dir)
    variant = runner.variants.get("compile")
    assert variant.vae is not runner.pipe.vae
    assert variant.vae.decode is not runner.pipe.vae.decode
    assert "decode" not in runner.pipe.vae.__dict__


def test_clone_module_tree_is_structural():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    clone = clone_module_tree(module)
    assert clone[1] is not module[1] and clone[1][0].weight is module[1][0].weight
    clone[1][0].register_forward_hook(lambda *a: None)
    assert not module[1][0]._forward_hooks


# ---- CUDA graphs ----------------------------------------------------------------------------------


def test_cuda_graphs_refused_off_cuda_and_configured_where_graphs_exist():
    import dataclasses

    from engine.protocol import Mode

    cpu, options = devices.get_device("cpu"), EngineOptions(cuda_graphs=True)
    for mode in (Mode.COMPILE, Mode.AOT):
        with pytest.raises(UnsupportedCombination, match="CUDA graphs .* need a CUDA GPU"):
            recipes.cuda_graphs_notices(options, cpu, mode)
    assert recipes.cuda_graphs_notices(options, cpu, Mode.EAGER) == []
    assert "regional runs without them" in recipes.cuda_graphs_notices(options, cpu, Mode.REGIONAL)[0]
    assert recipes.cuda_graphs_notices(EngineOptions(), cpu, Mode.COMPILE) == []
    assert "reduce-overhead" in recipes.cuda_graphs_notices(options, devices.get_device("cuda"), Mode.COMPILE)[0]

    graphs = dataclasses.replace(cpu, cuda_graphs=True)  # a device that records CUDA graphs
    assert recipes.compile_kwargs(options, graphs, mode=Mode.COMPILE)[0]["mode"] == "reduce-overhead"
    assert "mode" not in recipes.compile_kwargs(options, graphs, mode=Mode.REGIONAL)[0]
    assert "mode" not in recipes.compile_kwargs(EngineOptions(), graphs)[0]
    assert "mode" not in recipes.compile_kwargs(options, cpu)[0]
    both = EngineOptions(cuda_graphs=True, max_autotune=True)
    assert recipes.compile_kwargs(both, graphs)[0]["mode"] == "max-autotune"  # records CUDA graphs too
    assert recipes.aot_inductor_configs(options, graphs)["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in recipes.aot_inductor_configs(options, cpu)
    assert recipes.aot_inductor_configs(EngineOptions(), cpu) == {"aot_inductor.package_constants_in_so": False}


def test_runner_refuses_cuda_graphs_off_cuda_and_keeps_other_modes(cache_dir):
    config = EngineConfig(EngineKey("tiny-flux", "cpu", "fp32"), get_preset("tiny-flux"),
                          EngineOptions(cuda_graphs=True), str(cache_dir))
    runner = PipelineRunner(config)  # nothing loads: the refusal comes first
    for mode in ("compile", "aot"):
        with pytest.raises(UnsupportedCombination, match="CUDA graphs"):
            runner.check_mode(mode)
    assert runner.check_mode("eager") == ()
    assert any("without them" in n for n in runner.check_mode("regional"))


class _FakeScheduler:
    def set_timesteps(self, num_inference_steps=None, **kwargs):
        self.timesteps = list(range(num_inference_steps))


class _FakePipe:
    """Runs its step callback as a diffusers pipeline does: each step's latents are a fresh output (as a CUDA
    graph replay's would be), and the callback's returned latents replace them."""

    def __init__(self):
        self.steps = []
        self._interrupt = False

    def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator, output_type,
                 callback_on_step_end, max_sequence_length=None):  # its family's adapter passes the token count
        from types import SimpleNamespace

        from PIL import Image

        self.scheduler.set_timesteps(num_inference_steps)
        latents = torch.zeros(1, 4)
        with self.progress_bar(total=num_inference_steps):
            for i in range(num_inference_steps):
                if self._interrupt:
                    break
                output = latents + 1
                returned = callback_on_step_end(self, i, i, {"latents": output}).pop("latents", output)
                self.steps.append((output, returned))
                latents = returned
        return SimpleNamespace(images=[Image.new("RGB", (8, 8))])

    def progress_bar(self, total=None):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_step_callback_reads_cloned_outputs_under_cuda_graphs(cache_dir, monkeypatch, cuda_graphs):
    import dataclasses
    import threading

    from engine.protocol import GenerateRequest

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    config = EngineConfig(EngineKey("tiny-flux", "cpu", "fp32"), get_preset("tiny-flux"),
                          EngineOptions(cuda_graphs=cuda_graphs), str(cache_dir))
    runner = PipelineRunner(config)
    runner.spec = dataclasses.replace(runner.spec, cuda_graphs=True)  # mock: a device that records graphs
    runner.caller.spec = runner.spec
    runner.caller.scheduler_template = _FakeScheduler()
    pipe, progress, cancel = _FakePipe(), [], threading.Event()
    req = GenerateRequest.checked(prompt="x", width=64, height=64, steps=5, guidance=3.5, seed=0, mode="compile")

    def on_step(p):
        progress.append(p)
        if p.step == 3:
            cancel.set()

    _, timings, cancelled_at = runner.caller.call(pipe, req, on_step=on_step, cancel=cancel)
    assert cancelled_at == 3 and len(pipe.steps) == 3  # cancel still stops between steps
    assert [p.step for p in progress] == [1, 2, 3] and all(p.step_ms > 0 for p in progress)
    assert len(timings.step_ms) == 3
    for output, returned in pipe.steps:
        assert torch.equal(output, returned)
        assert (returned.data_ptr() != output.data_ptr()) is cuda_graphs  # a clone only under CUDA graphs
    assert len(marks) == (3 if cuda_graphs else 0)  # each step ends a graph step
    eager = runner.caller.call(_FakePipe(), req.replace(mode="eager"))  # eager never replays graphs
    assert len(marks) == (3 if cuda_graphs else 0) and eager[2] is None


@pytest.mark.slow  # compiles a regional bucket of a quantized engine
def test_quantized_engine_compiles_regionally_and_takes_a_block_cache(cache_dir):
    from engine.protocol import BucketKey, BucketState, GenerateRequest, Mode

    runner = make_runner(cache_dir, preset="tiny-shapes", precision="int8wo")
    size = runner.preset.buckets[0]
    assert runner.warm_bucket(BucketKey(Mode.REGIONAL, size)).state is BucketState.WARM
    request = GenerateRequest.checked(runner.preset.example_prompt, size.width, size.height, 12, 1.0, 3, mode="regional",
                              step_cache="first-block:0.2")
    result = runner.generate(request)
    assert result.warm and result.recompiles == 0 and result.cached_steps
    assert type(runner.pipe.transformer.transformer_blocks[0].ff.net[2].weight).__name__ == "Int8Tensor"
