"""Typed configurations for Compare (bench/configs.py): the form, the refusals, the ready-made lists."""

from __future__ import annotations

import json

import pytest

from bench import configs
from bench.advise import result_path
from bench.configs import Configuration, parse_configurations
from engine import devices
from engine.config.presets import get_preset
from engine.protocol import LoraChoice


def test_the_documented_form_parses_in_order_without_duplicates():
    typed = "eager/fp32/none; compile/fp32/none\nregional/bf16; eager/fp32/first-block:0.2; eager/fp32; compile/bf16@cuda"
    assert parse_configurations(typed) == [
        Configuration("eager", "fp32"), Configuration("compile", "fp32"), Configuration("regional", "bf16"),
        Configuration("eager", "fp32", "first-block:0.2"), Configuration("compile", "bf16", device="cuda")]
    assert [c.text() for c in parse_configurations(typed)][-2:] == ["eager/fp32/first-block:0.2", "compile/bf16@cuda"]
    assert parse_configurations(" ; \n") == []


def test_a_lora_part_names_one_adapter_and_its_scale_before_or_after_the_device():
    typed = "compile/fp32+lora=swap; compile/fp32+lora=Swap:0.5@cpu; eager/fp32/first-block:0.2@cpu+lora=corner; " \
            "eager/fp32+lora=none"
    assert parse_configurations(typed) == [
        Configuration("compile", "fp32", lora=LoraChoice("swap")),
        Configuration("compile", "fp32", device="cpu", lora=LoraChoice("swap", 0.5)),
        Configuration("eager", "fp32", "first-block:0.2", "cpu", LoraChoice("corner")), Configuration("eager", "fp32")]
    assert [c.text() for c in parse_configurations(typed)][1:3] == ["compile/fp32+lora=swap:0.5@cpu",
                                                                    "eager/fp32/first-block:0.2+lora=corner@cpu"]
    assert parse_configurations("; ".join(c.text() for c in parse_configurations(typed))) == \
        parse_configurations(typed)
    fused = parse_configurations("eager/fp32+lora=swap:0.5:fused")[0]
    assert fused.lora == LoraChoice("swap", 0.5, fused=True) and fused.text() == "eager/fp32+lora=swap:0.5:fused"


def test_lora_configurations_are_refused_with_the_engines_reasons():
    spec = devices.resolve_device("cpu")
    shapes = get_preset("tiny-shapes")
    swap = Configuration("compile", "fp32", lora=LoraChoice("swap"))
    assert configs.refusal(shapes, spec, swap, loras=True) is None
    assert "turns them on with --loras" in configs.refusal(shapes, spec, swap)
    assert configs.refusal(shapes, spec, Configuration("eager", "fp32", lora=LoraChoice("nope")), loras=True) == \
        "unknown LoRA 'nope' for tiny-shapes: choose one of swap, small, corner (or none)"
    assert "not run in aot mode" in configs.refusal(shapes, spec, Configuration("aot", "fp32", lora=LoraChoice("swap")), loras=True)
    assert configs.refusal(shapes, spec, Configuration("eager", "int8wo", lora=LoraChoice("swap")), loras=True) is None
    assert "fused LoRA is not served on int8wo" in configs.refusal(
        shapes, spec, Configuration("eager", "int8wo", lora=LoraChoice("swap", fused=True)), loras=True)
    assert "fused LoRA runs in eager mode only" in configs.refusal(
        shapes, spec, Configuration("regional", "fp32", lora=LoraChoice("swap", fused=True)), loras=True)
    assert configs.refusal(shapes, spec, Configuration("eager", "fp32", lora=LoraChoice("swap", fused=True)), loras=True) is None
    assert "choose one of none" in configs.refusal(get_preset("tiny-flux"), spec, swap, loras=True)


@pytest.mark.parametrize(("typed", "message"), [
    ("eager", r"write mode/precision\[/step cache\]\[\+lora=NAME\[:SCALE\]\[:fused\]\]\[\+mem=LEVERS\]\[@device\]"),
    ("eager/fp32+lora=swap+lora=corner", r"one LoRA per configuration .*list an entry per adapter"),
    ("eager/fp32+lora=", r"\+lora= names no adapter; write \+lora=NAME\[:SCALE\]"),
    ("eager/fp32+lora=swap:3", r"'eager/fp32\+lora=swap:3': LoRA scale 3 is outside \[0, 2\]"),
    ("eager/fp32+swap", r"write the LoRA as \+lora=NAME\[:SCALE\], e.g. compile/fp32\+lora=swap:0.5"),
    ("eagr/fp32", r"unknown mode 'eagr'; modes: eager, compile"),
    ("eager/fp33", r"unknown precision 'fp33'; precisions: fp32"),
    ("eager/fp32/sometimes", r"unknown step cache 'sometimes'; valid forms: none, first-block"),
    ("eager/fp32/none/extra", r"configuration 'eager/fp32/none/extra': write"),
    (";".join(["eager/fp32"] * 13), r"13 configurations listed; list at most 12"),
])
def test_a_wrong_entry_says_which_and_the_form_to_use(typed, message):
    with pytest.raises(ValueError, match=message):
        parse_configurations(typed)


def test_refusals_are_the_engines_own_reasons():
    spec = devices.resolve_device("cpu")
    preset = get_preset("tiny-flux")
    assert configs.refusal(preset, spec, Configuration("eager", "fp32", "first-block:0.2")) is None
    why = configs.refusal(preset, spec, Configuration("compile", "fp32", "first-block:0.2"))
    assert why.startswith("step cache first-block with compile: compile traces the whole denoiser") and len(why) <= 200
    assert "fp8" in configs.refusal(preset, spec, Configuration("eager", "fp8"))
    assert "does not run mode defer-and-fuse" in configs.refusal(preset, spec, Configuration("defer-and-fuse", "fp32"))


def test_the_levers_one_at_a_time_and_the_advisors_frontier(tmp_path):
    spec = devices.resolve_device("cpu")
    preset = get_preset("tiny-shapes")
    levers = configs.levers_one_at_a_time(preset, spec)
    assert levers[0] == Configuration("eager", "fp32") and len(levers) == 6
    assert all(configs.refusal(preset, spec, c) is None for c in levers)
    assert {c.mode for c in levers} >= {"compile", "regional"} and any(c.step_cache != "none" for c in levers)
    rows = [{"precision": "fp32", "mode": "eager", "step_cache": "none", "attention": "native", "eligible": True,
             "speedup": 1.0},
            {"precision": "bf16", "mode": "regional", "step_cache": "none", "attention": "native", "eligible": True,
             "speedup": 1.6},
            {"precision": "bf16", "mode": "eager", "step_cache": "taylorseer:3:2", "attention": "native",
             "eligible": False, "speedup": 2.0}]
    path = result_path(tmp_path, "tiny-shapes", "cpu", "64x64", 8)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rows": rows}))
    assert [c.text() for c in configs.saved_frontier(tmp_path, "tiny-shapes", "cpu", "64x64", 8)] == [
        "eager/fp32", "regional/bf16"]
    assert configs.saved_frontier(tmp_path, "tiny-shapes", "cpu", "64x64", 4) == []
