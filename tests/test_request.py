"""The one request object: what each edge builds and build_request validates."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config.presets import get_preset
from engine.config.request import API_FIELDS, FORM_FIELDS, Caller, ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest
from engine.protocol import Size


def test_a_request_is_frozen_and_replaced_not_mutated():
    spec = ImageRequest("tiny-flux", prompt="a fox")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.prompt = "a cat"
    assert spec.replace(prompt="a cat").prompt == "a cat" and spec.prompt == "a fox"
    assert spec.caller is Caller.HOST and spec.client == ""


def test_the_form_lists_request_fields_and_the_api_its_own():
    names = {f.name for f in dataclasses.fields(ImageRequest)}
    assert set(FORM_FIELDS) <= names
    assert API_FIELDS == tuple(n for n in FORM_FIELDS if n not in ("lora_scale", "lora_fused"))


def test_size_then_width_and_height_then_the_first_bucket():
    preset = get_preset("tiny-flux")
    first = preset.buckets[0]
    assert ImageRequest("tiny-flux").dimensions(preset.buckets) == (first.width, first.height)
    assert ImageRequest("tiny-flux", width=64, height=128).dimensions(preset.buckets) == (64, 128)
    assert ImageRequest("tiny-flux", size="128x64", width=64, height=64).dimensions(preset.buckets) == (128, 64)
    assert ImageRequest("tiny-flux", size=Size(64, 64)).dimensions(preset.buckets) == (64, 64)
    with pytest.raises(InvalidRequest):
        ImageRequest("tiny-flux", size="big").dimensions(preset.buckets)


def test_build_request_validates_the_spec_and_keeps_its_client():
    preset = get_preset("tiny-flux")
    request, notices = build_request(preset, ImageRequest("tiny-flux", prompt="a fox", size="64x64", steps="3",
                                                          seed="7", client="10.0.0.1"))
    assert (request.width, request.height, request.steps, request.seed) == (64, 64, 3, 7)
    assert request.client == "10.0.0.1" and notices == ()
    with pytest.raises(InvalidRequest, match="steps must be between"):
        build_request(preset, ImageRequest("tiny-flux", steps=0))


def test_partial_images_are_bounded_and_spread_before_the_last_step():
    from engine.pipeline.preview import preview_steps

    preset = get_preset("tiny-shapes")
    request, _ = build_request(preset, ImageRequest("tiny-shapes", prompt="a red circle", previews="2"))
    assert request.previews == 2
    for bad in ("4", "-1", "two"):
        with pytest.raises(InvalidRequest, match="partial_images must be"):
            build_request(preset, ImageRequest("tiny-shapes", prompt="a red circle", previews=bad))
    assert preview_steps(4, 2) == {1, 3} and preview_steps(8, 3) == {2, 4, 6}
    assert preview_steps(2, 3) == {1} and preview_steps(1, 3) == set() and preview_steps(20, 0) == set()
