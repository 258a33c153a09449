"""Presets as data and routing as a pure function (no model needed)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from engine.config.presets import get_preset, load_presets, preset_for_model, route_size
from engine.config.request import ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest, ModelLoadError
from engine.protocol import Size

SEED_PRESETS = {
    "flux2-klein-4b": ("Flux2KleinPipeline", "black-forest-labs/FLUX.2-klein-4B", 4),
    "flux1-schnell": ("FluxPipeline", "black-forest-labs/FLUX.1-schnell", 4),
    "sd35-medium": ("StableDiffusion3Pipeline", "stabilityai/stable-diffusion-3.5-medium", 40),
    "sdxl": ("StableDiffusionXLPipeline", "stabilityai/stable-diffusion-xl-base-1.0", 30),
    "flux2-dev": ("Flux2Pipeline", "black-forest-labs/FLUX.2-dev", 28),
}


def test_every_preset_is_complete_and_aligned():
    presets = load_presets()
    for name in ("tiny-flux", "tiny-flux2-klein", "tiny-sd3", "tiny-sdxl", *SEED_PRESETS):
        p = presets[name]
        assert p.buckets, name
        assert p.denoiser in ("transformer", "unet")
        for b in p.buckets:
            assert b.width % p.alignment == 0 and b.height % p.alignment == 0
        shapes = {"square" if b.width == b.height else ("portrait" if b.height > b.width else "landscape") for b in p.buckets}
        assert shapes == {"square", "portrait", "landscape"}, name


@pytest.mark.parametrize("name", list(SEED_PRESETS))
def test_seed_presets_match_the_seed_documents(name):
    pipeline, repo, steps = SEED_PRESETS[name]
    p = get_preset(name)
    assert (p.pipeline, p.source, p.steps) == (pipeline, repo, steps)
    assert max(b.pixels for b in p.buckets) >= 1024 * 1024 * 0.9


def test_seed_device_advice_is_data():
    assert get_preset("flux1-schnell").guidance == 0.0
    assert get_preset("flux1-schnell").options["tpu"] == {"cpu_offload": True}
    assert "NeuronCore" in get_preset("flux2-klein-4b").advice["neuron"]
    assert get_preset("sd35-medium").guidance == 4.5
    assert get_preset("flux2-dev").min_tp >= 2 and get_preset("flux2-dev").tp_text_encoder


def test_tiny_presets_are_random_weight_and_small():
    for name in ("tiny-flux", "tiny-flux2-klein", "tiny-sd3", "tiny-sdxl"):
        p = get_preset(name)
        assert p.random_tiny == name
        assert all(64 <= side <= 128 for b in p.buckets for side in (b.width, b.height))


def test_the_old_embedded_prefix_still_names_a_random_weight_pipeline():
    p = get_preset("tiny-flux")
    assert p.source == "random:tiny-flux"
    assert dataclasses.replace(p, source="embedded:tiny-flux").random_tiny == "tiny-flux"
    assert get_preset("tiny-shapes").random_tiny is None


def test_unknown_preset_lists_the_choices():
    with pytest.raises(InvalidRequest, match="tiny-flux"):
        get_preset("nope")


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        ((64, 64), (64, 64)),  # exact bucket
        ((128, 64), (128, 64)),
        ((100, 100), (128, 128)),  # square -> nearest square by pixels
        ((70, 70), (64, 64)),
        ((60, 130), (64, 128)),  # portrait snaps to portrait
        ((300, 140), (128, 64)),  # landscape
        ((4096, 4096), (128, 128)),
    ],
)
def test_route_snaps_to_nearest_bucket(requested, expected):
    size, notices = route_size(get_preset("tiny-flux"), *requested, snap=True)
    assert size == Size(*expected)
    assert bool(notices) == (requested != expected)


@pytest.mark.parametrize("bad", [(0, 64), (-64, 64), (64, 5000), ("x", 64), (64.5, 64), (None, 64), (math.nan, 64)])
def test_route_refuses_impossible_sizes(bad):
    with pytest.raises(InvalidRequest, match="pick one of"):
        route_size(get_preset("tiny-flux"), *bad)


def test_route_without_snap_refuses_with_the_list():
    with pytest.raises(InvalidRequest, match="64x64, 128x128"):
        route_size(get_preset("tiny-flux"), 96, 96, snap=False)


def test_size_parse():
    assert Size.parse("1024x768") == Size(1024, 768)
    assert Size.parse(" 64X128 ") == Size(64, 128)
    with pytest.raises(InvalidRequest, match="WIDTHxHEIGHT"):
        Size.parse("big")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("steps", 0, "steps must be between"),
        ("steps", 10_000, "steps must be between"),
        ("steps", 2.5, "whole number"),
        ("guidance", math.inf, "finite"),
        ("guidance", -1, "guidance must be between"),
        ("seed", -1, "seed must be between"),
        ("seed", 2**64, "seed must be between"),
        ("seed", "abc", "whole number"),
        ("prompt", "x" * 5000, "shorten it"),
        ("prompt", 42, "must be text"),
        ("mode", "turbo", "unknown mode"),
        ("on_cold", "later", "unknown on_cold"),
    ],
)
def test_request_validation_says_what_to_change(field, value, match):
    kwargs = dict(prompt="a fox", width=64, height=64, steps=4, guidance=3.5, seed=0, mode="eager")
    kwargs[field] = value
    with pytest.raises(InvalidRequest, match=match):
        build_request(get_preset("tiny-flux"), ImageRequest("tiny-flux", **kwargs))


def test_request_notices_for_empty_long_and_ignored_negative_prompt():
    _, notices = build_request(get_preset("tiny-flux"), ImageRequest("tiny-flux", prompt="", width=64,
                                                                     height=64, negative_prompt="blurry"))
    assert any("empty prompt" in n for n in notices)
    assert any("no negative prompt" in n for n in notices)
    request, notices = build_request(get_preset("tiny-sd3"), ImageRequest("tiny-sd3", prompt="word " * 500,
                                                                          width=64, height=64,
                                                                          negative_prompt="blurry"))
    assert request.negative_prompt == "blurry"
    assert any("truncated" in n for n in notices)
    assert request.steps == get_preset("tiny-sd3").steps  # preset default


def test_model_outside_roots_and_remote_code_are_refused(tmp_path):
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ModelLoadError, match="outside the allowed model roots"):
        preset_for_model(str(folder), allowed_roots=[tmp_path / "elsewhere"])
    p = preset_for_model(str(folder), allowed_roots=[tmp_path / "models"])
    assert p.pipeline == "FluxPipeline" and p.buckets[0] == Size(1024, 1024)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": ["evil_module", "EvilPipeline"]}))
    with pytest.raises(ModelLoadError, match="remote code is never trusted"):
        preset_for_model(str(folder), allowed_roots=[tmp_path / "models"])
    with pytest.raises(ModelLoadError, match="does not exist"):
        preset_for_model(str(tmp_path / "models" / "missing"), allowed_roots=[tmp_path / "models"])


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="cannot reach Hub model"):
        preset_for_model("someone/not-cached-model")
