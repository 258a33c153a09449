"""The request fields, each declared once (engine/protocol/params.py): the surfaces that derive from the
declarations, the one check per field, and the explicit way to build a request outside the gate."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config.presets import get_preset
from engine.config.request import API_FIELDS, FORM_FIELDS, ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest
from engine.protocol import GenerateRequest, Mode, OnCold, StepCache, params
from engine.protocol.params import Needs, Role


def test_the_form_keeps_its_positional_order():
    """gradio_client callers pass /generate's parameters by position: a field is appended, never moved."""
    assert FORM_FIELDS == ("prompt", "negative_prompt", "preset", "device", "precision", "mode", "size", "steps",
                           "guidance", "seed", "on_cold", "tp", "step_cache", "lora", "lora_scale", "lora_fused",
                           "memory", "num_frames", "fps", "images", "mask", "strength")
    assert "lora_scale" not in API_FIELDS and "lora_fused" not in API_FIELDS


def test_every_field_is_an_image_request_field_with_help_and_a_label():
    names = {f.name for f in dataclasses.fields(ImageRequest)}
    for field in params.FIELDS:
        assert field.name in names, field.name
        assert field.label and field.describe(get_preset("tiny-shapes")), field.name
        assert (field.check is not None) == (field.role is Role.SAMPLING), field.name


def test_a_field_its_family_does_not_take_is_noticed_by_its_declaration():
    flux = get_preset("tiny-flux")
    assert not Needs.NEGATIVE_PROMPT.taken_by(flux) and not Needs.VIDEO.taken_by(flux)
    value, notices = params.BY_NAME["negative_prompt"].parse("blurry", flux)
    assert value is None and notices == (f"{flux.pipeline} takes no negative prompt; it was ignored",)
    request, notices = build_request(flux, ImageRequest(preset=flux.name, prompt="a cat", negative_prompt="blurry"))
    assert request.negative_prompt is None and any("takes no negative prompt" in n for n in notices)


def test_the_gate_checks_each_field_once_into_a_canonical_request():
    preset = get_preset("tiny-shapes")
    request, _ = build_request(preset, ImageRequest(preset=preset.name, prompt="a red circle", mode="EAGER ",
                                                    on_cold="wait", step_cache="none", memory="none", steps="3"))
    assert (request.mode, request.on_cold, request.step_cache, request.memory, request.steps) == (
        Mode.EAGER, OnCold.WAIT, StepCache.parse("none"), "", 3)
    with pytest.raises(InvalidRequest, match="steps must be between 1 and 200"):
        build_request(preset, ImageRequest(preset=preset.name, steps=0))


def test_requests_built_outside_the_gate_are_made_canonical_explicitly():
    request = GenerateRequest.checked("a", 64, 64, 2, 1.0, 0, mode="compile", step_cache="first-block:0.2",
                                      lora="none", lora_fused=True, memory="none")
    assert request.mode is Mode.COMPILE and request.step_cache == StepCache.parse("first-block:0.2")
    assert (request.lora, request.lora_fused, request.memory) == (None, False, "")
    assert request.replace(mode="eager", on_cold="wait").on_cold is OnCold.WAIT


def test_the_cli_generate_flags_are_the_declared_fields():
    from engine.cli import GenerateFlags

    flags = {f.name for f in dataclasses.fields(GenerateFlags)}
    declared = {f.name for f in params.FIELDS if f.cli is not None}
    assert declared <= flags and {"no_snap", "parallel", "out", "json"} <= flags
    assert "lora_scale" not in flags


def test_the_batching_key_and_png_read_the_declarations():
    names = {f.name for f in params.BATCH_FIELDS}
    assert {"steps", "guidance", "negative_prompt", "strength", "lora", "memory"} <= names
    assert {"prompt", "seed"}.isdisjoint(names)  # each member's own
    assert {"prompt", "seed", "steps", "negative_prompt", "lora_scale"} <= set(params.PNG_FIELDS)
