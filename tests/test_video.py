"""Clips: a video preset's fields (num_frames, fps) checked and routed to (size, frames) buckets, the tiny Wan
pipeline's clip as a playable MP4 with the requested frame count, a clip's price by its tokens, and a warm
compiled video bucket serving clips with no recompile."""

from __future__ import annotations

import pytest
from helpers import make_runner

from engine.config.presets import get_preset, load_presets
from engine.config.request import ImageRequest
from engine.config.validation import build_request
from engine.config.video import warm_bucket
from engine.errors import Cancelled, InvalidRequest, NotAllowed
from engine.protocol import BucketKey, BucketState, Mode, Size, decode_mp4
from engine.serving import cost


def _build(**fields):
    spec = ImageRequest(**{"preset": "tiny-wan", "prompt": "a red circle moving right", **fields})
    return build_request(get_preset(spec.preset), spec)


def test_video_presets_declare_frame_buckets_of_their_rule():
    videos = {name: p for name, p in load_presets().items() if p.video}
    assert {"tiny-wan", "wan2.1-t2v-1.3b", "wan2.2-ti2v-5b"} <= set(videos)
    for preset in videos.values():
        assert all((f - 1) % preset.frame_step == 0 for f in preset.frames), preset.name
    assert not get_preset("tiny-flux").video


def test_frames_route_to_a_frame_bucket_with_a_notice():
    request, notices = _build(size="32x32", num_frames="10", fps="8")
    assert (request.num_frames, request.fps, str(request.bucket)) == (10 - 1, 8, "eager:32x32x9f")
    assert any("num_frames 10 is not 4k + 1; snapped to the nearest frame bucket 9" in n for n in notices)
    request, notices = _build(num_frames="", fps="")  # the preset's first bucket and rate
    assert (request.num_frames, request.fps, notices) == (17, 16, ())
    request, notices = _build(num_frames=21)  # 4k + 1 but not a bucket
    assert request.num_frames == 17 and "is not one of its buckets" in notices[0]


@pytest.mark.parametrize(("fields", "words"), [
    ({"num_frames": "many"}, "num_frames must be a whole number"),
    ({"num_frames": 10_000}, "num_frames must be from 1 to"),
    ({"num_frames": 2.5}, "num_frames must be a whole number"),
    ({"fps": 0.5}, "fps must be a whole number"),
    ({"fps": 500}, "fps must be from 1 to 60"),
    ({"num_frames": 13, "snap": False}, "not a frame bucket of tiny-wan"),
])
def test_bad_video_fields_say_what_to_change(fields, words):
    with pytest.raises(InvalidRequest, match=words):
        _build(**fields)


def test_an_image_preset_ignores_frames_with_a_notice():
    spec = ImageRequest(preset="tiny-flux", prompt="x", num_frames=17)
    request, notices = build_request(get_preset("tiny-flux"), spec)
    assert request.num_frames == 0 and request.bucket.frames == 0
    assert "tiny-flux makes images; num_frames ignored" in notices


def test_a_clip_costs_its_tokens_frames_times_size():
    wan = get_preset("tiny-wan")
    one_frame = cost.price(wan, Size(32, 32), 4)
    assert cost.price(wan, Size(32, 32), 4, frames=17) == one_frame * 5  # 17 frames: 5 latent frames
    budget = cost.CostBudget(request=one_frame * 5, visitor=None)
    assert cost.check_generate(budget, wan, Size(32, 32), 4, frames=17) == one_frame * 5
    with pytest.raises(NotAllowed, match=r"9 latent frames \(33 frames\).*at most 17 frames"):
        cost.check_generate(budget, wan, Size(32, 32), 4, frames=33)


def test_tiny_wan_makes_a_playable_clip_of_the_asked_frames(cache_dir):
    runner = make_runner(cache_dir, "tiny-wan")
    assert {str(i.bucket) for i in runner.board.all()} >= {"compile:32x32x17f", "regional:16x16x9f"}
    request, _ = _build(size="16x16", num_frames=9, steps=2)
    result = runner.generate(request)
    frames = decode_mp4(result.video_mp4)
    assert (len(frames), frames[0].shape, result.num_frames, result.fps) == (9, (16, 16, 3), 9, 16)
    assert result.image().size == (16, 16)  # the poster: the first frame
    assert result.as_dict()["frames"] == 9 and result.timings.decode_ms > 0
    assert Mode.AOT not in runner.modes()


def test_vae_tiling_is_a_lever_of_a_wan_clip(cache_dir):
    """Wan's VAE tiles each latent frame in space (its decode already goes frame by frame in time): a clip asks
    for it per request; below the tile size (256 px) the decode is the plain one, pixel for pixel."""
    runner = make_runner(cache_dir, "tiny-wan")
    request, _ = _build(size="16x16", num_frames=9, steps=2, seed=3)
    plain = decode_mp4(runner.generate(request).video_mp4)
    tiled = decode_mp4(runner.generate(request.replace(memory="vae-tiling")).video_mp4)
    assert len(tiled) == 9 and all((a == b).all() for a, b in zip(plain, tiled, strict=True))
    assert not runner.pipe.vae.use_tiling  # one request's lever, put back after it


def test_a_warm_names_a_video_bucket_by_size_and_frames():
    wan = get_preset("tiny-wan")
    assert warm_bucket(wan, "compile", "32x32x9") == BucketKey(Mode.COMPILE, Size(32, 32), frames=9)
    assert warm_bucket(wan, "regional", "16x16").frames == 17  # its first (most-used) frame count
    with pytest.raises(InvalidRequest, match="13 frames is not a frame bucket of tiny-wan; pick one of 17, 9, 33"):
        warm_bucket(wan, "compile", "32x32x13")
    assert warm_bucket(get_preset("tiny-flux"), "compile", "64x64") == BucketKey(Mode.COMPILE, Size(64, 64))


def test_the_board_shows_a_video_buckets_frames():
    from ui.buckets_views import board_rows

    engine = {"engine": "tiny-wan@cpu/fp32", "state": "ready",
              "buckets": [{"mode": "compile", "size": "32x32", "frames": 17, "state": "warm", "requests_served": 5}]}
    assert board_rows([engine])[0][4] == "32x32 × 17 frames"


def test_a_clip_cancelled_mid_run_stops_between_steps(cache_dir):
    import threading

    runner = make_runner(cache_dir, "tiny-wan")
    request, _ = _build(size="16x16", num_frames=9, steps=4)
    cancel, seen = threading.Event(), []

    def on_step(progress):
        seen.append(progress.step)
        cancel.set()  # asked to stop during the first step

    with pytest.raises(Cancelled, match="cancelled after step 1 of 4"):
        runner.generate(request, on_step=on_step, cancel=cancel)
    assert seen == [1]


@pytest.mark.slow
def test_a_warm_regional_video_bucket_serves_five_clips_without_recompiling(cache_dir):
    runner = make_runner(cache_dir, "tiny-wan")
    bucket = BucketKey(Mode.REGIONAL, Size(32, 32), frames=17)
    assert runner.warm_bucket(bucket).state is BucketState.WARM
    request, _ = _build(size="32x32", num_frames=17, mode="regional", steps=2)
    results = [runner.generate(request.replace(seed=seed, request_id=f"clip-{seed}")) for seed in range(5)]
    assert [(r.warm, r.recompiles, r.bucket) for r in results] == [(True, 0, bucket)] * 5
    assert all(len(decode_mp4(r.video_mp4)) == 17 for r in results)
    assert runner.board.get(bucket).requests_served == 5


@pytest.mark.slow
def test_cli_writes_the_clip_as_mp4(tmp_path, cache_dir):
    from test_cli import last_json, run_cli

    out = tmp_path / "clip.mp4"
    proc = run_cli("generate", "--preset", "tiny-wan", "--device", "cpu", "--size", "16x16", "--steps", "2",
                   "--frames", "10", "--out", str(out), "--json", "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr
    shown = last_json(proc.stdout)
    assert (shown["frames"], shown["bucket"], shown["fps"]) == (9, "16x16", 16)
    assert any("snapped to the nearest frame bucket 9" in n for n in shown["notices"])
    assert len(decode_mp4(out.read_bytes())) == 9


def test_the_video_bench_prints_per_clip_and_per_frame_with_the_ratio_and_spread():
    from bench.video import format_report

    row = {"clip_s": {"median": 0.2, "p10": 0.18, "p90": 0.25}, "frame_ms": {"median": 11.8}, "decode_share": 0.25,
           "recompiles": 0, "warm": True, "motion": 3.25}
    report = {"preset": "tiny-wan", "size": "32x32", "frames": 17, "steps": 4, "repeats": 5, "load": 6.0,
              "modes": {"eager": row, "regional": {**row, "vs_eager": {"median": 0.7, "p10": 0.6, "p90": 0.8},
                                                   "drift": {"worst_frame_psnr_db": 41.0, "max_diff": 9, "ssim": 0.981,
                                                             "flicker": 0.42}}},
              "errors": {"compile": "a reason"}}
    lines = format_report(report).splitlines()
    assert lines[0].startswith("video on tiny-wan at 32x32 x 17 frames, 4 steps, 5 rounds")
    assert "0.70 (0.60-0.80)" in lines[3] and "11.8" in lines[3] and "25%" in lines[3] and "3.2" in lines[3]
    assert lines[3].endswith("41.0 dB / 9, SSIM 0.981, flicker 0.42 px") and lines[2].endswith("—")
    assert lines[4] == "compile   failed to compile: a reason"


def test_the_generate_page_shows_frames_and_fps_for_video_presets_only(manager):
    from ui.generate_video import VideoHandlers

    h = VideoHandlers(manager.serving())
    assert h.clip_fields("tiny-wan")["visible"] is True
    assert h.clip_fields("tiny-flux")["visible"] is False
    assert "tiny-wan" in h.video_presets() and "tiny-flux" not in h.video_presets()
    negative, sizes, frames, fps, steps, guidance = h.video_defaults("tiny-wan")  # Wan takes a negative prompt
    assert (sizes["value"], frames["value"], fps["value"], steps["value"], guidance["value"]) == ("32x32", 17, 16, 4, 5.0)
    negative, sizes, frames, fps, steps, guidance = h.video_defaults("tiny-shapes-video")  # its own, not tiny-wan's
    assert negative["visible"] is False and (frames["value"], fps["value"], steps["value"], guidance["value"]) == (
        17, 8, 8, 1.0)


def test_the_video_tab_starts_on_the_embedded_video_model_and_derives_its_fields(manager):
    from engine.protocol import params
    from ui.generate_video import VIDEO_FIELDS, VideoHandlers

    assert VideoHandlers(manager.serving()).first_video_preset().name == "tiny-shapes-video"
    assert VIDEO_FIELDS == params.clip_fields()
    assert {"prompt", "negative_prompt", "num_frames", "fps", "images", "memory"} <= set(VIDEO_FIELDS)
    assert not {"tp", "mask", "strength", "step_cache", "lora"} & set(VIDEO_FIELDS)  # a clip takes none of them


def test_clip_drift_and_motion_read_frames():
    import numpy as np

    from bench.quality import clip_drift, frame_change

    still = [np.full((4, 4, 3), 100, np.uint8)] * 3
    moving = [np.full((4, 4, 3), 100 + 10 * i, np.uint8) for i in range(3)]
    assert frame_change(still) == 0.0 and frame_change(moving) == 10.0 and frame_change(still[:1]) is None
    assert clip_drift(moving, still)["max_diff"] == 20
    with pytest.raises(ValueError, match="clips of different lengths"):
        clip_drift(moving, still[:2])


def test_a_gpu_calls_duration_is_learnt_per_clip_length():
    from engine.serving.gpu import Durations

    short, long = BucketKey(Mode.EAGER, Size(32, 32), frames=9), BucketKey(Mode.EAGER, Size(32, 32), frames=33)
    assert (short.shape, long.shape, BucketKey(Mode.EAGER, Size(32, 32)).shape) == ("32x32x9f", "32x32x33f", "32x32")
    durations = Durations(default_s=60, max_s=120)
    durations.record("eager", short.shape, 4, (100.0,) * 4)
    assert durations.for_request("eager", short.shape, 4) < 60  # learnt
    assert durations.for_request("eager", long.shape, 4) == 60  # not taken from a clip a quarter as long
