"""Attention backends: the table says which can run here and why not; the engine refuses the others
before loading anything and sets a usable one on the denoiser."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import make_runner

from engine import devices
from engine.errors import UnsupportedCombination
from engine.pipeline import attention

CPU = devices.get_device("cpu")


def gpu(capability=(9, 0)):
    """A CUDA-like spec on this machine: the cuda spec's kernel families, a given compute capability."""
    return dataclasses.replace(devices.get_device("cuda"), probe_fn=lambda: devices.Availability(True),
                               capability_fn=lambda: capability)


def row(rows, name):
    return next(r for r in rows if r["name"] == name)


@pytest.fixture(autouse=True)
def native_backend_afterwards():
    # set_attention_backend also sets diffusers' process-wide active backend: put it back for other tests.
    yield
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def test_table_lists_every_diffusers_backend_with_a_reason():
    from diffusers.models.attention_dispatch import AttentionBackendName

    rows = attention.attention_table(CPU, "fp32")
    assert {r["name"] for r in rows} >= {m.value for m in AttentionBackendName}
    for r in rows:
        assert r["usable"] or r["reason"], r
    usable = {r["name"] for r in rows if r["usable"]}
    assert {"native", "_native_math", "flex"} <= usable  # measured to run on this CPU in fp32
    assert "_native_flash" not in usable and "bf16 or fp16 only" in row(rows, "_native_flash")["reason"]
    assert "_native_flash" in {r["name"] for r in attention.attention_table(CPU, "bf16") if r["usable"]}
    assert "has no flash-attn kernels" in row(rows, "flash")["reason"]  # the device, before the package
    assert "has no sdpa-cudnn kernels" in row(rows, "_native_cudnn")["reason"]


def test_reasons_on_a_gpu_package_capability_and_dtype():
    rows = attention.attention_table(gpu((9, 0)), "bf16")
    flash = row(rows, "flash")
    assert not flash["usable"] and "flash-attn" in flash["reason"]  # not installed here: diffusers says what to install
    assert "FA3" in row(rows, "_flash_3")["reason"]
    ampere = attention.attention_table(gpu((8, 6)), "bf16")
    assert "sm_90" in row(ampere, "_flash_3")["reason"] and "sm_86" in row(ampere, "_flash_3")["reason"]
    turing = attention.attention_table(gpu((7, 5)), "fp16")
    assert "sm_80+" in row(turing, "_native_cudnn")["reason"]
    assert "bf16 or fp16 only, not fp32" in row(attention.attention_table(gpu(), "fp32"), "_native_flash")["reason"]
    assert row(rows, "_native_cudnn")["usable"] and row(rows, "native")["usable"]


def test_hub_kernels_need_the_kernels_package_and_a_download(monkeypatch):
    rows = attention.attention_table(gpu((9, 0)), "bf16")
    assert "kernels" in row(rows, "_flash_3_hub")["reason"]
    # With the package present: online it downloads on first use; offline without a cached copy it cannot.
    monkeypatch.setattr(attention, "_package_problem", lambda name: None)
    monkeypatch.setattr(attention, "_hub_cached", lambda repo: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = row(attention.attention_table(gpu((9, 0)), "bf16"), "_flash_3_hub")
    assert not offline["usable"] and "offline" in offline["reason"] and "kernels-community/flash-attn3" in offline["reason"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    online = row(attention.attention_table(gpu((9, 0)), "bf16"), "_flash_3_hub")
    assert online["usable"] and "downloads kernels-community/flash-attn3" in online["note"]


def test_check_backend_refuses_with_the_reason():
    assert attention.check_backend("native", CPU, "fp32") == []
    with pytest.raises(UnsupportedCombination, match="no flash-attn kernels"):
        attention.check_backend("flash", CPU, "bf16")
    with pytest.raises(UnsupportedCombination, match="flash-attn"):
        attention.check_backend("flash", gpu(), "bf16")  # package missing
    with pytest.raises(UnsupportedCombination, match="bf16 or fp16 only"):
        attention.check_backend("_native_flash", CPU, "fp32")
    with pytest.raises(UnsupportedCombination, match="unknown attention backend"):
        attention.check_backend("warp-speed", CPU, "fp32")
    assert "math kernel" in attention.check_backend("_native_math", CPU, "fp32")[0]


def test_engine_refuses_an_unusable_backend_before_loading(cache_dir, tiny_models):
    runner = make_runner(cache_dir, load=False, attention_backend="flash")
    with pytest.raises(UnsupportedCombination, match="attention backend 'flash' cannot run"):
        runner.load()
    assert runner.pipe is None  # nothing was loaded
    with pytest.raises(UnsupportedCombination, match="bf16 or fp16 only"):
        make_runner(cache_dir, load=False, attention_backend="_native_flash").load()


def test_engine_sets_a_usable_backend_on_the_denoiser(cache_dir, tiny_models):
    runner = make_runner(cache_dir, attention_backend="_native_math")
    processors = [m.processor for m in runner.pipe.transformer.modules() if hasattr(m, "processor")]
    assert processors and all(str(p._attention_backend.value) == "_native_math" for p in processors)
    assert any("attention backend _native_math" in n for n in runner.notices)
    default = make_runner(cache_dir)
    assert not any("attention backend" in n for n in default.notices)


def test_attention_command_and_flag(capsys):
    from engine.cli import build_parser, main
    from engine.config.flags import engine_flags_argv, options_from_args

    assert main(["attention", "--device", "cpu", "--precision", "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and row(report["backends"], "native")["usable"]
    assert main(["attention", "--device", "cpu"]) == 0
    assert "_native_flash" in capsys.readouterr().out
    args = build_parser().parse_args(["generate", "--attention-backend", "_native_math", "--cuda-graphs"])
    options = options_from_args(args)
    assert options.attention_backend == "_native_math" and options.cuda_graphs
    assert engine_flags_argv(args) == ("--cuda-graphs", "--attention-backend", "_native_math")
    assert options_from_args(build_parser().parse_args(["generate"])).attention_backend == "native"
