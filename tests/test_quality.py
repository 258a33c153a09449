"""Drift and fidelity: the bench's quality columns and targets (bench/quality.py), no model needed."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bench import quality
from bench.stats import compute_ratios, evaluate_targets, speedup_table


def _img(value, size=(8, 8)):
    return np.full((*size, 3), value, dtype=np.uint8)


def test_identical_images_have_no_psnr_and_zero_difference():
    d = quality.image_drift(_img(10), _img(10))
    assert d == {"psnr_db": None, "max_diff": 0}
    assert quality.fmt_drift(**{"psnr_db": None, "max_diff": 0}) == "identical"


def test_psnr_and_max_difference_follow_the_pixels():
    a = _img(100)
    b = a.copy()
    b[0, 0, 0] = 110  # one channel of one pixel off by 10
    d = quality.image_drift(a, b)
    mse = 100 / a.size
    assert d["max_diff"] == 10 and d["psnr_db"] == pytest.approx(10 * math.log10(255**2 / mse))
    assert quality.fmt_drift(d["psnr_db"], d["max_diff"]).endswith("dB / 10")


def test_the_worst_sample_is_kept():
    worst = quality.worst_drift([{"psnr_db": 60.0, "max_diff": 1}, {"psnr_db": 41.0, "max_diff": 9},
                                 {"psnr_db": None, "max_diff": 0}])
    assert worst == {"psnr_db": 41.0, "max_diff": 9}


def test_images_of_different_sizes_are_an_error():
    with pytest.raises(ValueError, match="different sizes"):
        quality.image_drift(_img(0, (8, 8)), _img(0, (8, 16)))


def test_measure_compares_every_configuration_with_eager_fp32_of_its_size():
    configs = [("fp32", "eager", "64x64"), ("fp32", "compile", "64x64"), ("bf16", "eager", "64x64")]
    offsets = {"eager": 0, "compile": 1}

    def draw(config, prompt, seed):
        precision, mode, _ = config
        return _img(100 + offsets[mode] + (3 if precision == "bf16" else 0))

    preset = type("P", (), {"fidelity": None})()
    rows = quality.measure(configs, draw, ["p", "p"], [1, 2], preset)
    assert rows[configs[0]]["drift_max_diff"] == 0
    assert rows[configs[1]]["drift_max_diff"] == 1 and rows[configs[2]]["drift_max_diff"] == 3
    assert "fidelity" not in rows[configs[0]]  # no checker for this model


def _row(precision, mode, size, **kw):
    return {"precision": precision, "mode": mode, "size": size, "step_ms_median": 1.0, "image_ms_median": 50.0,
            **kw}


def test_quality_targets_are_met_or_missed_from_the_columns():
    rows = [
        _row("fp32", "eager", "64x64", drift_psnr_db=None, drift_max_diff=0, fidelity=0.97, fidelity_held_out=0.85),
        _row("fp32", "compile", "64x64", drift_psnr_db=45.0, drift_max_diff=2, fidelity=0.96),
        _row("bf16", "eager", "64x64", drift_psnr_db=38.0, drift_max_diff=9, fidelity=0.93),
        _row("fp32", "eager", "128x128", drift_psnr_db=None, drift_max_diff=0, fidelity=0.84, fidelity_held_out=0.9),
    ]
    status = {t["key"]: t["status"] for t in evaluate_targets(compute_ratios(rows))}
    assert status["drift_compile"] == "met"  # 45 dB >= 40
    assert status["fidelity_first_bucket"] == "met"  # 97 %
    assert status["fidelity_other_buckets"] == "MISSED"  # 84 % < 85 %
    assert status["fidelity_held_out"] == "met"  # worst 85 % >= 80 %
    assert status["fidelity_gap"] == "MISSED"  # bf16 lost 4 points
    assert status["image_ms_reference"] == "met"
    assert speedup_table(rows)[2]["drift_max_diff"] == 9  # the columns reach the table (UI, JSON)


def test_the_shapes_checker_scores_grammar_prompts_and_skips_others():
    from training.shapes.grammar import render

    checker = quality.fidelity_checker(type("P", (), {"fidelity": "shapes"})())
    drawn = np.asarray(render("a yellow triangle on a purple background", 64, 64, rng=3))
    assert checker(drawn, "a yellow triangle on a purple background") is True
    assert checker(drawn, "a yellow square on a purple background") is False
    assert checker(drawn, "a red fox in the snow") is None  # outside the grammar: nothing to score


def _textured(seed=0, size=(48, 48)):
    rng = np.random.default_rng(seed)
    return (rng.random((*size, 3)) * 255).astype(np.uint8)


def test_ssim_is_one_for_identical_images_and_falls_with_noise():
    a = _textured()
    assert quality.ssim(a, a) == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    slight = np.clip(a + rng.normal(0, 5, a.shape), 0, 255).astype(np.uint8)
    heavy = np.clip(a + rng.normal(0, 40, a.shape), 0, 255).astype(np.uint8)
    s_slight, s_heavy = quality.ssim(slight, a), quality.ssim(heavy, a)
    assert 1.0 > s_slight > s_heavy > 0.0
    assert quality.ssim(a, slight) == pytest.approx(s_slight)  # symmetric


def test_ssim_sees_a_moved_object_that_keeps_the_colours():
    a = np.zeros((32, 32, 3), np.uint8)
    a[8:16, 8:16] = 255
    moved = np.roll(a, 8, axis=1)
    assert quality.ssim(moved, a) < 0.7


def test_the_heat_map_is_dark_where_images_agree_and_bright_where_they_differ():
    a = _img(100, (16, 16))
    b = a.copy()
    b[4, 4] = 200
    heat = np.asarray(quality.diff_heatmap(b, a))
    assert heat.shape == (16, 16, 3)
    assert heat[4, 4].tolist() == [255, 255, 255] and heat[0, 0].tolist() == [0, 0, 0]
    assert np.asarray(quality.diff_heatmap(a, a)).max() == 0


def test_score_reports_the_worst_ssim_beside_psnr():
    a = _textured(2)
    noisy = np.clip(a + np.random.default_rng(3).normal(0, 30, a.shape), 0, 255).astype(np.uint8)
    preset = type("P", (), {"fidelity": None})()
    row = quality.score([a, noisy], ["x", "y"], [a, a], preset)
    assert row["drift_ssim"] == pytest.approx(quality.ssim(noisy, a))
    assert quality.score([a], ["x"], None, preset)["drift_ssim"] is None


def test_a_lora_style_is_checked_against_what_the_style_implies():
    """A Compare card with a style on is scored as the style implies: the swapped picture of "a red circle
    on a blue background" is right for the "swap" style and wrong for the plain checker; a style the
    checker does not know is not scored at all."""
    from training.shapes import styles

    shapes = type("P", (), {"fidelity": "shapes"})()
    prompt = "a red circle on a blue background"
    swapped = styles.render(prompt, "swap")
    assert quality.fidelity_checker(shapes, "swap")(swapped, prompt) is True
    assert quality.fidelity_checker(shapes)(swapped, prompt) is False
    assert quality.fidelity_checker(shapes, "watercolour") is None
    row = quality.score([swapped, styles.render(prompt, "corner")], [prompt, prompt], None, shapes, "swap")
    assert row["fidelity"] == 0.5 and row["fidelity_samples"] == 2


def _clip(frames=6, seed=0):
    """A textured clip whose content moves one pixel a frame, in mid-grey levels (no clipping at +-20)."""
    base = np.random.default_rng(seed).integers(60, 196, size=(16, 24, 3), dtype=np.uint8)
    return [np.roll(base, i, axis=1)[:, :16] for i in range(frames)]


def test_a_clip_against_itself_has_no_drift_and_no_flicker():
    clip = _clip()
    d = quality.clip_drift(clip, [f.copy() for f in clip])
    assert (d["psnr_db"], d["median_psnr_db"], d["worst_frame"], d["max_diff"]) == (None, None, None, 0)
    assert d["frame_psnr_db"] == [None] * 6 and d["ssim"] == pytest.approx(1.0)
    assert d["flicker"] == 0.0 and d["transition_flicker"] == [0.0] * 5
    assert quality.fmt_clip_drift(d) == "identical"


def test_one_altered_frame_is_the_worst_frame():
    reference = _clip()
    clip = [f.copy() for f in reference]
    clip[3] = clip[3].copy()
    clip[3][2:6, 2:6] = 255 - clip[3][2:6, 2:6]  # a blotch on frame 4 (1-based)
    d = quality.clip_drift(clip, reference)
    assert d["worst_frame"] == 4 and d["psnr_db"] == d["frame_psnr_db"][3] is not None
    assert [p for i, p in enumerate(d["frame_psnr_db"]) if i != 3] == [None] * 5
    assert d["median_psnr_db"] is None  # most frames match: the median frame is identical
    assert d["ssim"] == d["frame_ssim"][3] < 1.0 and d["max_diff"] == int(np.max(np.abs(
        clip[3].astype(int) - reference[3].astype(int))))
    # the blotch appears and goes: the two transitions around it flicker, the others do not
    assert [t > 0 for t in d["transition_flicker"]] == [False, False, True, True, False]
    assert "worst" in quality.fmt_clip_drift(d) and "(frame 4/6)" in quality.fmt_clip_drift(d)


def test_a_jittering_clip_flickers_where_a_constant_offset_does_not():
    reference = _clip()
    offset = [(f.astype(int) + 12).astype(np.uint8) for f in reference]
    jitter = [(f.astype(int) + (12 if i % 2 else -12)).astype(np.uint8) for i, f in enumerate(reference)]
    steady, shaky = quality.clip_drift(offset, reference), quality.clip_drift(jitter, reference)
    assert steady["max_diff"] == shaky["max_diff"] == 12  # the same error in every frame, frame by frame
    assert steady["flicker"] == pytest.approx(0.0)
    assert shaky["flicker"] == pytest.approx(24.0)  # the error swings by 24 levels from frame to frame
    assert "flicker 24.00 px" in quality.fmt_clip_drift(shaky)


def test_clips_of_different_lengths_are_an_error():
    with pytest.raises(ValueError, match="clips of different lengths: 5 vs 6"):
        quality.clip_drift(_clip(5), _clip(6))


def test_a_video_preset_has_a_clip_checker_only_when_its_fidelity_value_names_one(monkeypatch):
    from engine.config.presets import get_preset

    wan = get_preset("tiny-wan")
    assert wan.fidelity is None and quality.clip_checker(wan) is None
    assert quality.clip_checker(get_preset("tiny-shapes")) is None  # an image preset: its checker is an image's
    monkeypatch.setitem(quality.CLIP_CHECKERS, "frames-test", "bench.quality:frame_change")
    assert quality.clip_checker(dataclasses.replace(wan, fidelity="frames-test")) is quality.frame_change
