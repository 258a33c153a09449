"""The videos API (/v1/videos, ui/openai_videos.py) through the official `openai` SDK against the running app
(public mode, tiny-wan and tiny-wan-i2v on cpu): a job polled to completion and its MP4 downloaded with the frames
asked for, its thumbnail and per-frame strip, a clip from the SDK's input_reference, a clip priced by its tokens,
and errors in OpenAI's shape; the same image-to-video clip through /generate_video and the MCP tool."""

from __future__ import annotations

import io

import httpx
import pytest
from helpers import engine_manager, launch_demo
from PIL import Image

from engine.protocol import decode_mp4

pytestmark = pytest.mark.slow  # launches the app and generates

openai = pytest.importorskip("openai", reason="the /v1 tests use the official openai SDK (the dev extra)")

PROMPT = "a yellow triangle moving left on a purple background"
KEY = "visitor-key-for-the-clips"  # keys are at least 16 characters
OTHER_KEY = "another-visitors-key-here"


@pytest.fixture(scope="module")
def app(cache_dir, tmp_path_factory):
    """Public mode offering tiny-wan and tiny-flux; a request may cost 500 token-steps (a 16x16 clip of 9 frames
    in 2 steps costs 12, a 64x64 one of 33 frames in 4 steps 1152)."""
    from engine.serving.cost import CostBudget
    from engine.serving.manager import HostPolicy
    from ui.handlers import UIDefaults

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEY + "\n" + OTHER_KEY + "\n")
    from ui import mcp

    policy = HostPolicy(public=True, presets=("tiny-wan", "tiny-wan-i2v", "tiny-flux"),
                        cost=CostBudget(request=500, visitor=1000))
    with engine_manager(cache_dir, policy=policy) as manager:
        demo, url = launch_demo(manager, UIDefaults(preset="tiny-wan", device="cpu", mode="eager", api_keys=str(keys)),
                                mcp_server=True)
        mcp.serve(demo)
        try:
            yield url
        finally:
            demo.close()


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app + "v1", api_key=KEY, max_retries=0, timeout=300)


def test_create_and_poll_then_download_gives_a_playable_mp4_of_the_asked_frames(client):
    video = client.videos.create_and_poll(model="tiny-wan", prompt=PROMPT, size="16x16", poll_interval_ms=100,
                                          extra_body={"num_frames": 9, "steps": 2, "seed": 3})
    assert (video.status, video.progress, video.size, video.object) == ("completed", 100, "16x16", "video")
    assert video.model == "tiny-wan" and video.error is None and video.completed_at >= video.created_at
    frames = decode_mp4(client.videos.download_content(video.id).read())
    assert (len(frames), frames[0].shape) == (9, (16, 16, 3))
    assert video.seconds == f"{9 / 16:.2f}" and video.timings["frames"] == 9
    thumbnail = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read()))
    strip = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="spritesheet").read()))
    assert (thumbnail.size, strip.size) == ((16, 16), (9 * 16, 16))
    assert client.videos.retrieve(video.id).status == "completed"
    assert video.id in [v.id for v in client.videos.list().data]


def test_seconds_become_frames_snapped_to_a_bucket(client):
    video = client.videos.create_and_poll(model="tiny-wan", prompt=PROMPT, size="16x16", seconds="4",
                                          poll_interval_ms=100, extra_body={"fps": 4, "steps": 2})
    assert video.status == "completed", video.error
    assert video.timings["frames"] == 17  # 4 s x 4 fps + 1
    assert len(decode_mp4(client.videos.download_content(video.id).read())) == 17


def test_a_clip_over_the_budget_is_refused_naming_what_fits(client):
    with pytest.raises(openai.PermissionDeniedError) as err:
        client.videos.create(model="tiny-wan", prompt=PROMPT, size="64x64", extra_body={"num_frames": 33})
    assert "this clip costs 1,152 token-steps" in str(err.value) and "allows 500 per request" in str(err.value)


@pytest.mark.parametrize(("fields", "words"), [
    ({"model": "tiny-flux"}, "model tiny-flux makes images, not clips; choose a video model: tiny-wan, tiny-wan-i2v"),
    ({"num_frames": "lots"}, "num_frames must be a whole number"),
    ({"fps": "900"}, "fps must be from 1 to 60"),
    ({"colour": "red"}, "unknown field 'colour'"),
    ({"seconds": "inf"}, "seconds must be a number of seconds written in digits 0-9, got 'inf'"),
    ({"seconds": "1e308"}, "seconds must be a number of seconds written in digits 0-9, got '1e308'"),
    ({"num_frames": "\u0663\u0663"}, "num_frames must be a whole number written in digits 0-9"),
    ({"seconds": "2", "fps": "x"}, "fps must be a whole number"),  # a bad fps is named as fps
])
def test_bad_fields_are_refused_with_the_apps_message(client, fields, words):
    body = {"model": "tiny-wan", "prompt": PROMPT, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(**{k: body.pop(k) for k in ("model", "prompt")}, extra_body=body)
    assert words in str(err.value)


def test_unknown_jobs_and_unready_content_answer_in_openais_shape(app):
    headers = {"authorization": f"Bearer {KEY}"}
    missing = httpx.get(app + "v1/videos/video_nope", headers=headers, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    bad = httpx.post(app + "v1/videos", json={"model": "tiny-wan"}, headers=headers, timeout=30)
    assert bad.status_code == 400 and "prompt is required" in bad.json()["error"]["message"]
    assert httpx.get(app + "v1/videos", timeout=30).status_code == 401  # keys are required here


def test_generate_video_gives_gradio_client_the_clip_its_frames_and_figures(app):
    from gradio_client import Client

    from ui.generate_video import clip_summary

    video, frames, timings = Client(app, verbose=False).predict(
        prompt=PROMPT, negative_prompt="", preset="tiny-wan", device="cpu", precision="fp32", mode="eager",
        size="16x16", num_frames=10, fps=8, steps=2, guidance=5.0, seed=1, on_cold="eager", api_name="/generate_video")
    with open(video, "rb") as f:
        assert len(decode_mp4(f.read())) == 9
    assert len(frames) == 9 and (timings["frames"], timings["fps"], timings["bucket"]) == (9, 8, "16x16")
    assert "num_frames 10 is not 4k + 1; snapped to the nearest frame bucket 9 (9, 17, 33)" in timings["notices"]
    summary = clip_summary(timings)
    assert "**9 frames** at 8 fps" in summary and "ms per frame" in summary and "VAE decode" in summary


def test_an_agent_finds_generate_video_among_the_mcp_tools(app):
    from test_mcp import session_run

    async def work(session):
        return (await session.list_tools()).tools

    tools = {t.name: t for t in session_run(app + "gradio_api/mcp/", work)}
    assert "clip" in tools["generate_video"].description
    assert {"prompt", "preset", "size", "num_frames", "fps", "steps"} <= set(tools["generate_video"].inputSchema["properties"])


# -- image to video: the source image through each door ------------------------------------------------------
def png(size=(24, 40), colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def test_the_sdks_input_reference_makes_a_clip_from_an_image_that_downloads_as_an_mp4(client):
    video = client.videos.create_and_poll(prompt=PROMPT, size="16x16", input_reference=("first.png", png(), "image/png"),
                                          poll_interval_ms=100, extra_body={"num_frames": 9, "steps": 2})
    assert (video.status, video.model, video.size) == ("completed", "tiny-wan-i2v", "16x16"), video.error
    frames = decode_mp4(client.videos.download_content(video.id).read())
    assert (len(frames), frames[0].shape) == (9, (16, 16, 3))
    assert any("image 1 (24x40) resized to 16x16" in n for n in video.timings["notices"]), video.timings["notices"]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"model": "tiny-wan", "input_reference": ("first.png", png(), "image/png")}, "input_reference",
     "model tiny-wan makes clips from text only, so it takes no input_reference; choose a model that starts from an "
     "image: tiny-wan-i2v"),
    ({"model": "tiny-wan-i2v"}, None, "takes one source image, the clip's first frame: upload the image the clip "
                                      "starts from"),
    ({"model": "tiny-wan-i2v", "input_reference": ("first.png", b"not an image", "image/png")}, None,
     "image 1 is not an image this server reads"),
])
def test_an_input_reference_a_model_cannot_use_is_refused_naming_the_param(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt=PROMPT, size="16x16", **fields)
    assert words in str(err.value)
    if param:
        assert err.value.param == param


def test_a_reference_by_url_is_refused_asking_for_the_file(app):
    """The SDK sends input_reference as a file only; a hand-made body naming an image_url (JSON, or the form's
    flattened field) is told to send the file."""
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-wan-i2v", "prompt": PROMPT, "input_reference": {"image_url": "https://example.com/a.png"}}
    as_json = httpx.post(app + "v1/videos", json=body, headers=headers, timeout=30)
    as_form = httpx.post(app + "v1/videos", headers=headers, timeout=30, files={"prompt": (None, PROMPT)},
                         data={"input_reference[image_url]": "https://example.com/a.png"})
    for answer in (as_json, as_form):
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == "input_reference", error
        assert "input_reference must be an image file (a multipart file part)" in error["message"]


def test_an_input_reference_over_the_bound_is_refused_before_it_is_read_whole(client):
    from engine.config.images import MAX_UPLOAD_BYTES

    with pytest.raises(openai.APIStatusError) as err:
        client.videos.create(model="tiny-wan-i2v", prompt=PROMPT,
                             input_reference=("big.png", b"\x89PNG" + b"\0" * MAX_UPLOAD_BYTES, "image/png"))
    assert err.value.status_code == 413 and "input_reference" in str(err.value)


def test_generate_video_and_the_mcp_tool_take_the_source_image(app, tmp_path):
    import base64
    import json

    from gradio_client import Client, handle_file
    from test_mcp import session_run

    source = tmp_path / "first.png"
    source.write_bytes(png((48, 32)))
    call = dict(prompt=PROMPT, negative_prompt="", preset="tiny-wan-i2v", device="cpu", precision="fp32", mode="eager",
                size="16x16", num_frames=9, fps=16, steps=2, guidance=5.0, seed=1, on_cold="eager")
    video, frames, timings = Client(app, verbose=False).predict(**call, images=[handle_file(str(source))],
                                                                api_name="/generate_video")
    with open(video, "rb") as f:
        assert len(decode_mp4(f.read())) == 9
    assert "image 1 (48x32) resized to 16x16" in " ".join(timings["notices"])

    url = "data:image/png;base64," + base64.b64encode(png((48, 32))).decode("ascii")

    as_text = {name: str(value) for name, value in call.items()}  # MCP's fields are text, as /generate's are

    async def work(session):
        return (await session.call_tool("generate_video", {**as_text, "images": [url]}),
                await session.call_tool("generate_video", {**as_text, "preset": "tiny-wan", "images": [url]}))

    made, refused = session_run(app + "gradio_api/mcp/", work)
    assert not made.isError, [c.text for c in made.content if c.type == "text"]
    shown = json.loads(next(c.text for c in made.content if c.type == "text" and "notices" in c.text))
    assert shown["frames"] == 9 and "image 1 (48x32) resized to 16x16" in " ".join(shown["notices"])
    assert refused.isError and "takes text to video only" in " ".join(c.text for c in refused.content
                                                                        if c.type == "text")


def test_a_deleted_job_is_gone_and_frees_the_visitors_one_running_request(app):
    from helpers import wait_until

    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-wan", "prompt": PROMPT, "size": "16x16", "num_frames": 9, "steps": 60}
    job = httpx.post(app + "v1/videos", json=body, headers=headers, timeout=60).json()
    assert job["status"] in ("queued", "in_progress") and job["progress"] < 100
    deleted = httpx.delete(app + f"v1/videos/{job['id']}", headers=headers, timeout=30).json()
    assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert httpx.get(app + f"v1/videos/{job['id']}", headers=headers, timeout=30).status_code == 404

    def next_job_accepted():  # public mode: one running request per visitor, released once the stopped job ends
        return httpx.post(app + "v1/videos", json={**body, "steps": 2}, headers=headers, timeout=60).status_code == 200

    wait_until(next_job_accepted, timeout=120, interval=0.5, message="a new job after the deleted one")


def test_another_key_cannot_see_fetch_or_stop_a_job(app):
    from helpers import wait_until

    mine, theirs = ({"authorization": f"Bearer {key}"} for key in (KEY, OTHER_KEY))
    body = {"model": "tiny-wan", "prompt": PROMPT, "size": "16x16", "num_frames": 9, "steps": 2}
    posted = []

    def accepted():  # public mode: one running request per visitor (an earlier test's may still be ending)
        posted.append(httpx.post(app + "v1/videos", json=body, headers=mine, timeout=60))
        return posted[-1].status_code == 200

    wait_until(accepted, timeout=120, interval=0.5, message="a job for the first key")
    job = posted[-1].json()
    answers = [httpx.get(app + f"v1/videos/{job['id']}", headers=theirs, timeout=30),
               httpx.get(app + f"v1/videos/{job['id']}/content", headers=theirs, timeout=30),
               httpx.delete(app + f"v1/videos/{job['id']}", headers=theirs, timeout=30)]
    assert [a.status_code for a in answers] == [404, 404, 404], [a.text for a in answers]
    listed = httpx.get(app + "v1/videos", headers=theirs, timeout=30).json()["data"]
    assert job["id"] not in [j["id"] for j in listed]
    assert job["id"] in [j["id"] for j in httpx.get(app + "v1/videos", headers=mine, timeout=30).json()["data"]]
    assert httpx.get(app + f"v1/videos/{job['id']}", headers=mine, timeout=30).status_code == 200  # still its own


def test_100_malformed_video_and_edit_calls_are_typed_4xx_within_the_log_budget(app, caplog):
    import logging

    from bench.hostile import scan_bomb, wide_png

    headers = {"authorization": f"Bearer {KEY}"}
    bomb, wide = scan_bomb(512, 500), wide_png(4096, 4096)
    videos = [{"seconds": "inf"}, {"seconds": "1e308"}, {"num_frames": "\u0663\u0663"}, {"fps": "-1", "seconds": "2"},
              {"num_frames": "9e9"}, {"colour": "red"}]

    def video(i: int) -> httpx.Response:
        if i % 8 == 6:  # an input_reference that is a scan bomb
            return httpx.post(app + "v1/videos", headers=headers, timeout=60,
                              data={"model": "tiny-wan-i2v", "prompt": PROMPT}, files={"input_reference": ("b.jpg", bomb)})
        if i % 8 == 7:
            return httpx.post(app + "v1/videos", headers={**headers, "content-type": "application/json"},
                              content=b"{not json", timeout=60)
        return httpx.post(app + "v1/videos", headers=headers, timeout=60,
                          json={"model": "tiny-wan", "prompt": PROMPT, **videos[i % len(videos)]})

    def edit(i: int) -> httpx.Response:
        image = (bomb, wide, b"not an image", b"\x89PNG\r\n\x1a\n")[i % 4]
        return httpx.post(app + "v1/images/edits", headers=headers, timeout=60,
                          data={"model": "tiny-flux", "prompt": PROMPT}, files={"image": ("x.png", image)})

    with caplog.at_level(logging.INFO):
        answers = [video(i) for i in range(50)] + [edit(i) for i in range(50)]
    statuses = [a.status_code for a in answers]
    assert all(400 <= s < 500 for s in statuses), [(s, a.text[:120]) for s, a in zip(statuses, answers, strict=True) if s >= 500]
    assert all(a.json()["error"]["message"] for a in answers)
    served = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert not any(r.exc_info for r in served)
    assert sum(len(r.getMessage()) for r in served) < 40_000
