"""Compare on a video preset (ui/compare_run.py with ui/compare_clips.py): every configuration runs a clip of the
same prompt, seed, size and frame count, and each card carries the clip's frames, its time per clip and frame and
its drift against eager fp32's clip frame by frame with the temporal flicker (bf16 here: the cheapest
configuration that differs; eager on cpu, nothing compiles)."""

from __future__ import annotations

import pytest
from helpers import NoProgress

from ui.handlers import Handlers, UIDefaults

pytestmark = pytest.mark.slow  # loads tiny-wan's engine and runs two configurations' clips


@pytest.fixture(scope="module")
def handlers(manager):
    return Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))


def compare(handlers, **form):
    return list(handlers.compare(**{**dict(prompt="a red circle moving right", preset="tiny-wan", size="16x16",
                                           steps=2, guidance=None, seed=3, devices=["cpu"], precisions=None,
                                           modes=None, wait_for_warm=False, timing_s=0), **form},
                                 request=None, progress=NoProgress()))


@pytest.fixture(scope="module")
def clips(handlers):
    """A comparison of eager fp32 and bf16 clips at 16x16 x 9 frames, and its cards as the page renders them."""
    gallery, payload, thumbnails = compare(handlers, configurations="eager/fp32; eager/bf16", num_frames=9,
                                           fps=8)[-1]
    cards = handlers.render_compare(payload, thumbnails)[3]
    return payload, thumbnails, cards


def test_every_configuration_runs_the_same_clip(clips):
    payload, _, _ = clips
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == ["cpu/fp32/eager", "cpu/bf16/eager"], payload
    assert all("error" not in r for r in results.values()), results
    assert [(r["frames"], r["fps"], r["bucket"]) for r in results.values()] == [(9, 8, "16x16")] * 2
    assert all(len(r["timings"]["step_ms"]) == 2 and r["timings"]["decode_ms"] > 0 for r in results.values())


def test_a_clip_drifts_frame_by_frame_against_the_reference_clip(clips):
    payload, _, _ = clips
    reference, bf16 = payload["results"]
    assert reference["reference"] and "clip_drift" not in reference  # measured against, not measured
    drift = bf16["clip_drift"]
    assert drift["frames"] == 9 and len(drift["frame_psnr_db"]) == len(drift["frame_ssim"]) == 9
    assert len(drift["transition_flicker"]) == 8 and drift["flicker"] >= 0
    assert drift["max_diff"] > 0 and 1 <= drift["worst_frame"] <= 9  # bf16 rounds differently: some frame differs
    assert drift["psnr_db"] == min(p for p in drift["frame_psnr_db"] if p is not None)
    assert (bf16["drift_psnr_db"], bf16["drift_max_diff"], bf16["flicker"]) == (
        drift["psnr_db"], drift["max_diff"], drift["flicker"])
    assert "fidelity" not in bf16 and "fidelity_this" not in bf16  # tiny-wan names no clip checker
    # frame 1 is also kept lossless (the poster): its drift before the codec, and the codec's own loss on it
    assert bf16["first_frame_max_diff"] is not None and reference["codec_max_diff"] is not None
    assert "frame 1 before the MP4" in bf16["codec_note"]
    print(f"{bf16['codec_note']}")
    print(f"bf16 clip against eager fp32's: {bf16['drift']}")


def test_the_cards_show_each_clip_its_time_and_drift(clips):
    payload, thumbnails, cards = clips
    reference_card, bf16_card = cards.split('<div class="c-card">')[1:]
    assert "the reference" in reference_card and "drift: reference" in reference_card
    for card in (reference_card, bf16_card):
        assert card.count("<img") >= 9 - 1 and 'class="c-strip"' in card  # the strip: every frame of 9
        assert "s / clip" in card and "ms / frame" in card and "VAE decode" in card and "9 frames at 8 fps" in card
    assert "drift per frame: PSNR median" in bf16_card and "worst" in bf16_card and "flicker:" in bf16_card
    assert "difference at frame" in bf16_card and "fidelity" not in bf16_card
    assert "frame 1 before the MP4" in bf16_card  # frame 1 before the codec, and the codec's own loss on it
    assert "MP4 codec loss on frame 1" in bf16_card and "MP4 codec loss on frame 1" in reference_card
    strip = payload["results"][1]["strip"]
    assert [caption for _, caption in strip] == [f"frame {i}" for i in range(1, 10)]
    assert all(thumbnails[i].startswith("data:image/png;base64,") for i, _ in strip)


def test_compare_shows_frames_and_fps_for_video_presets_only(handlers):
    row, frames, fps = handlers.compare_clip_fields("tiny-wan")
    assert row["visible"] is True and (frames["value"], fps["value"]) == (17, 16)
    assert handlers.compare_clip_fields("tiny-shapes")[0]["visible"] is False


def test_an_image_preset_in_compare_is_not_sent_the_hidden_clip_fields(handlers):
    payload = compare(handlers, preset="tiny-shapes", size="64x64", configurations="eager/fp32", num_frames=17,
                      fps=16, fidelity_prompts=0)[-1][1]
    (result,) = payload["results"]
    assert "frames" not in result and result["notices"] == [], result  # no "num_frames ignored" notice


def moves(frames, prompt: str) -> bool | None:
    """A clip checker for the test below: a clip 'draws' a prompt that says "moving" when its frames change (None: a
    prompt it cannot score)."""
    from bench.quality import frame_change

    if "moving" not in prompt:
        return None
    return (frame_change(frames) or 0.0) > 0


def test_a_video_preset_whose_fidelity_names_a_clip_checker_scores_every_clip(handlers, monkeypatch):
    """The checker is looked up by the preset's `fidelity` value (bench/quality.py CLIP_CHECKERS), as an image
    preset's is: here tiny-wan as a host would declare it with one, its checker this module's `moves`."""
    import dataclasses

    from bench import quality

    wan = dataclasses.replace(handlers.serving.preset("tiny-wan"), fidelity="moves-test")
    real = handlers.serving.preset
    monkeypatch.setattr(handlers.serving, "preset", lambda name: wan if name == "tiny-wan" else real(name))
    monkeypatch.setitem(quality.CLIP_CHECKERS, "moves-test", "test_compare_clips:moves")
    payload = compare(handlers, configurations="eager/fp32", num_frames=9, fidelity_prompts=2)[-1][1]
    (result,) = payload["results"]
    assert result["fidelity_this"] is True  # random weights draw noise that changes every frame
    assert (result["fidelity"], result["fidelity_samples"]) == (1.0, 2)  # the main prompt repeated, seeds 1000-1001
    cards = handlers.render_compare(payload, [])[3]
    assert "fidelity: 100 % (2/2 prompts) · ✓ draws the prompt" in cards
