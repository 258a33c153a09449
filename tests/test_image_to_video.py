"""Image to video: presets that take "one source image, the clip's first frame" (inputs = "first-frame",
WanImageToVideoPipeline). The declaration decides: a text-to-video preset refuses an image, an image-to-video
one asks for it; the source is resized to the (size, frames) bucket with a notice and never enters the bucket
key, so a warm compiled bucket serves any source with no recompile; the tiny build (tiny-wan-i2v) makes a clip of
the bucket's frames from it through the manager and the CLI."""

from __future__ import annotations

import pytest
from helpers import png_bytes

from engine.config.presets import get_preset, load_presets
from engine.config.request import ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest
from engine.protocol import ImageInputs, decode_mp4

PROMPT = "a red circle moving right"


def png(size=(16, 16), colour=(200, 30, 30), seed: int | None = None) -> bytes:
    return png_bytes(size, colour, seed)


def _build(preset: str, **fields):
    spec = ImageRequest(**{"preset": preset, "prompt": PROMPT, **fields})
    return build_request(get_preset(preset), spec)


def test_image_to_video_presets_declare_one_required_first_frame():
    takers = {name for name, p in load_presets().items() if p.inputs is ImageInputs.FIRST_FRAME}
    assert takers == {"tiny-wan-i2v", "wan2.1-i2v-14b-480p", "tiny-ltx-i2v", "ltx-video-i2v"}
    for name in takers:
        preset = get_preset(name)
        assert preset.video and preset.max_references == 1 and preset.inputs.needs_source
        assert not preset.inputs.takes_strength and not preset.inputs.in_sequence
        assert preset.describe()["inputs"] == "first-frame"


def test_a_text_to_video_preset_refuses_an_image_naming_the_presets_that_take_one():
    with pytest.raises(InvalidRequest) as err:
        _build("tiny-wan", images=(png(),))
    assert str(err.value) == ("preset tiny-wan takes text to video only: remove the input image, or choose a preset "
                              "that takes images (tiny-wan-i2v, tiny-ltx-i2v, ltx-video-i2v, wan2.1-i2v-14b-480p)")


@pytest.mark.parametrize("preset", ["tiny-wan-i2v", "wan2.1-i2v-14b-480p", "tiny-ltx-i2v", "ltx-video-i2v"])
def test_an_image_to_video_preset_without_an_image_says_it_needs_one(preset):
    with pytest.raises(InvalidRequest, match=f"preset {preset} takes one source image, the clip's first frame: "
                                             "upload the image the clip starts from"):
        _build(preset)


@pytest.mark.parametrize(("fields", "words"), [
    (dict(images=(png(), png())), "takes at most 1 input image (one source image, the clip's first frame), got 2"),
    (dict(images=(png(),), strength=0.5), "no strength: strength is for img2img"),
])
def test_an_image_to_video_preset_refuses_what_its_declaration_does_not_take(fields, words):
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(").replace(")", r"\)")):
        _build("tiny-wan-i2v", **fields)


def test_the_source_is_resized_to_the_bucket_which_it_does_not_enter():
    request, notices = _build("tiny-wan-i2v", images=(png((100, 60)),), size="32x32", num_frames=9)
    assert str(request.bucket) == "eager:32x32x9f" and request.bucket.refs == ()
    assert (request.images[0].width, request.images[0].height) == (32, 32)
    assert "image 1 (100x60) resized to 32x32 (Lanczos, as the pipeline's image processor resizes; aspect not kept)" \
        in notices
    same_bucket, _ = _build("tiny-wan-i2v", images=(png((20, 70)),), size="32x32", num_frames=9)
    assert same_bucket.bucket == request.bucket  # another source's shape: the same graph
    shaped, _ = _build("tiny-wan-i2v", images=(png((64, 64)),))  # no size: the bucket nearest the source's
    assert (shaped.width, shaped.height, shaped.num_frames) == (64, 64, 17)


@pytest.mark.slow
def test_tiny_wan_i2v_makes_a_clip_of_the_buckets_frames_from_an_image_through_the_manager(manager):
    def clip(source: bytes):
        return manager.generate(ImageRequest(preset="tiny-wan-i2v", device="cpu", prompt=PROMPT, images=(source,),
                                             size="16x16", num_frames=10, steps=2), timeout=600)

    red, noise = clip(png((40, 24))), clip(png(seed=1))
    frames = decode_mp4(red.video_mp4)
    assert (len(frames), frames[0].shape, red.num_frames, str(red.bucket)) == (9, (16, 16, 3), 9, "eager:16x16x9f")
    assert any("snapped to the nearest frame bucket 9" in n for n in red.notices), red.notices
    assert any("image 1 (40x24) resized to 16x16" in n for n in red.notices), red.notices
    assert red.timings.encode_ms > 0 and len(red.timings.step_ms) == 2
    assert red.video_mp4 != noise.video_mp4  # the source image drives the clip (same prompt and seed)
    assert noise.bucket == red.bucket


@pytest.mark.slow
def test_cli_makes_a_clip_from_an_image(tmp_path, cache_dir):
    from test_cli import last_json, run_cli

    source, out = tmp_path / "first.png", tmp_path / "clip.mp4"
    source.write_bytes(png((48, 48)))
    proc = run_cli("generate", "--preset", "tiny-wan-i2v", "--device", "cpu", "--size", "16x16", "--steps", "2",
                   "--frames", "9", "--image", str(source), "--out", str(out), "--json", "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr
    shown = last_json(proc.stdout)
    assert (shown["frames"], shown["bucket"]) == (9, "16x16")
    assert any("image 1 (48x48) resized to 16x16" in n for n in shown["notices"]), shown["notices"]
    assert len(decode_mp4(out.read_bytes())) == 9
    refused = run_cli("generate", "--preset", "tiny-wan", "--device", "cpu", "--frames", "9", "--image", str(source),
                      "--out", str(tmp_path / "no.mp4"), "--cache-dir", str(cache_dir))
    assert refused.returncode != 0 and "takes text to video only" in refused.stderr


@pytest.mark.slow
def test_a_warm_regional_i2v_bucket_serves_other_sources_without_recompiling(cache_dir):
    from helpers import make_runner

    from engine.protocol import BucketKey, BucketState, Mode, Size

    runner = make_runner(cache_dir, "tiny-wan-i2v")
    bucket = BucketKey(Mode.REGIONAL, Size(16, 16), frames=9)
    assert runner.warm_bucket(bucket).state is BucketState.WARM  # warmed from a grey source of the bucket's size
    sources = [png((16, 16), (0, 0, 0)), png((40, 24), (255, 255, 255)), png((20, 64), (255, 0, 0))]
    requests = [_build("tiny-wan-i2v", images=(source,), size="16x16", num_frames=9, mode="regional", steps=2)[0]
                for source in sources]
    results = [runner.generate(request) for request in requests]
    assert [(r.warm, r.recompiles, r.bucket) for r in results] == [(True, 0, bucket)] * 3
    assert len({r.video_mp4 for r in results}) == 3  # each source its own clip


def test_ltx_video_takes_its_rate_as_a_call_argument_and_wan_takes_none():
    from diffusers import LTXImageToVideoPipeline, WanImageToVideoPipeline

    from engine.pipeline.calls import pipeline_call_kwargs

    for preset, cls, rate in (("tiny-ltx-i2v", LTXImageToVideoPipeline, {"frame_rate": 12}),
                              ("tiny-wan-i2v", WanImageToVideoPipeline, {})):
        request, _ = _build(preset, images=(png(),), size="32x32", num_frames=9, fps=12)
        kwargs = pipeline_call_kwargs(get_preset(preset), object.__new__(cls), request)  # its class is what counts
        assert {k: kwargs.get(k) for k in ("num_frames", "frame_rate") if k in kwargs} == {"num_frames": 9, **rate}
        assert kwargs["image"].size == (32, 32)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-ltx", "tiny-ltx-i2v"])
def test_ltx_video_makes_clips_of_its_8k_plus_1_frame_buckets(manager, preset):
    images = (png((40, 24)),) if preset.endswith("i2v") else ()
    result = manager.generate(ImageRequest(preset=preset, device="cpu", prompt=PROMPT, images=images, size="32x32",
                                           num_frames=12, steps=2), timeout=600)
    frames = decode_mp4(result.video_mp4)
    assert (len(frames), frames[0].shape, str(result.bucket), result.fps) == (9, (32, 32, 3), "eager:32x32x9f", 24)
    assert any("num_frames 12 is not 8k + 1; snapped to the nearest frame bucket 9" in n for n in result.notices)
