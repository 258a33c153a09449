"""The OpenAI-compatible images API (/v1, ui/openai_api.py) through the official `openai` SDK against the running
app (public mode, tiny-shapes on cpu), and plain HTTP for every error path."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import pytest
from helpers import engine_manager, launch_demo, spy_generate, wait_until
from PIL import Image

pytestmark = pytest.mark.slow  # launches the app and generates

openai = pytest.importorskip("openai", reason="the /v1 tests use the official openai SDK (the dev extra)")

PROMPT = "a red circle on a blue background"
EXTRA = {"device": "cpu", "precision": "fp32", "mode": "eager", "steps": 2}
VISITOR_KEY = "visitor-key-1-of-this-host"
ADMIN = "host-secret"


@pytest.fixture(scope="module")
def app(cache_dir, tmp_path_factory):
    """Public mode, one preset offered, keys required (a file and the admin token), one event per client; the
    engine batches up to 8 requests gathered within 300 ms (a loaded test machine sends n threads' requests
    further apart than the default 15 ms)."""
    from engine.serving.manager import HostPolicy
    from ui.edge import EdgeConfig
    from ui.handlers import UIDefaults

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# the visitors' keys\n{VISITOR_KEY}\n\n")
    policy = HostPolicy(public=True, presets=("tiny-shapes",))
    with engine_manager(cache_dir, {"max_batch": 8, "batch_wait_ms": 300}, policy=policy) as manager:
        demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager",
                                                    admin_token=ADMIN, api_keys=str(keys)),
                                edge=EdgeConfig(client_events=1))
        try:
            yield url, manager, keys
        finally:
            demo.close()


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app[0] + "v1", api_key=VISITOR_KEY, max_retries=0, timeout=300)


def png_of(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def post(url: str, body, key: str | None = VISITOR_KEY, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    kwargs.setdefault("timeout", 300)
    return httpx.post(url + "v1/images/generations", content=content,
                      headers={"content-type": "application/json", **headers}, **kwargs)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# -- the SDK ---------------------------------------------------------------------------------------------
def test_models_lists_the_presets_a_visitor_may_use(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-shapes"]  # public mode: the host's list only
    assert {"steps", "seed", "mode", "precision", "step_cache", "lora"} <= set(models.extra_fields)
    assert "swap" in models.data[0].loras
    model = client.models.retrieve("tiny-shapes")
    assert model.buckets[0] == "64x64" and model.steps == 8


def test_generate_returns_an_image_of_the_requested_bucket_with_its_timings(client):
    result = client.images.generate(model="tiny-shapes", prompt=PROMPT, size="128x64", extra_body={**EXTRA, "seed": 3})
    (image,) = result.data
    with png_of(image.b64_json) as png:
        assert png.size == (128, 64)
    assert result.size == "128x64"
    timings = image.timings  # the CLI's --json, as an object
    assert timings["seed"] == 3 and timings["engine"] == "tiny-shapes@cpu/fp32" and timings["steps"] == 2
    assert len(timings["timings"]["step_ms"]) == 2 and timings["timings"]["total_ms"] > 0


def test_a_size_between_buckets_is_snapped_and_says_so(client):
    result = client.images.generate(model="tiny-shapes", prompt=PROMPT, size="70x70", extra_body=EXTRA)
    assert result.size == "64x64"
    with png_of(result.data[0].b64_json) as png:
        assert png.size == (64, 64)
    assert any("70x70" in notice and "64x64" in notice for notice in result.notices), result.notices


def test_n_images_have_different_seeds_and_run_as_one_batched_call(client):
    result = client.images.generate(model="tiny-shapes", prompt=PROMPT, n=4, size="64x64",
                                    extra_body={**EXTRA, "seed": 10})
    assert [image.seed for image in result.data] == [10, 11, 12, 13]
    assert result.batch_sizes == [4, 4, 4, 4]  # one pipeline call made the four
    pixels = {png_of(image.b64_json).tobytes() for image in result.data}
    assert len(pixels) == 4  # four seeds, four images


def test_a_url_answer_points_at_the_apps_own_copy(client):
    result = client.images.generate(model="tiny-shapes", prompt=PROMPT, response_format="url", extra_body=EXTRA)
    (image,) = result.data
    assert image.b64_json is None and "/v1/images/files/" in image.url
    fetched = httpx.get(image.url, timeout=30)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    with Image.open(io.BytesIO(fetched.content)) as png:
        assert png.size == (64, 64)


def test_streaming_sends_partial_images_per_step_then_each_image(client):
    """partial_images=2 over 4 steps: each image's latents at steps 1 and 3 decoded as the SDK's partial_image
    events (two images batched in one call: each gets its own), then each image as a completed event."""
    stream = client.images.generate(model="tiny-shapes", prompt=PROMPT, n=2, stream=True, partial_images=2,
                                    extra_body={**EXTRA, "steps": 4, "seed": 5})
    events = list(stream)
    completed = [e for e in events if isinstance(e, openai.types.ImageGenCompletedEvent)]
    partial = [e for e in events if isinstance(e, openai.types.ImageGenPartialImageEvent)]
    assert len(completed) + len(partial) == len(events)
    assert sorted(e.seed for e in completed) == [5, 6] and completed[0].timings["steps"] == 4
    assert sorted((e.index, e.partial_image_index, e.step) for e in partial) == [(0, 0, 1), (0, 1, 3), (1, 0, 1),
                                                                                 (1, 1, 3)]
    assert all(events.index(p) < events.index(c) for p in partial for c in completed if c.index == p.index)
    for event in partial:
        with png_of(event.b64_json) as png:
            assert png.size == (64, 64) and event.size == "64x64"
    first = {e.index: png_of(e.b64_json).tobytes() for e in partial if e.step == 3}
    assert first[0] != first[1]  # each member's own latents
    final = {e.index: png_of(e.b64_json).tobytes() for e in completed}
    assert first[0] != final[0]  # a state along the way, not the result


def test_errors_arrive_as_the_sdks_typed_exceptions_with_the_apps_message(client, app):
    with pytest.raises(openai.PermissionDeniedError, match="preset 'tiny-flux' is not offered here"):
        client.images.generate(model="tiny-flux", prompt=PROMPT, extra_body=EXTRA)
    with pytest.raises(openai.BadRequestError, match="steps") as bad:
        client.images.generate(model="tiny-shapes", prompt=PROMPT, extra_body={**EXTRA, "steps": 1000})
    assert bad.value.body["param"] == "steps"
    with pytest.raises(openai.AuthenticationError, match="not one of this server's"):
        openai.OpenAI(base_url=app[0] + "v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="not offered here"):
        client.models.retrieve("tiny-flux")


def test_the_admin_token_is_a_key_and_the_host_may_use_every_preset(app):
    host = openai.OpenAI(base_url=app[0] + "v1", api_key=ADMIN, max_retries=0)
    assert "tiny-flux" in {m.id for m in host.models.list().data}


# -- plain HTTP: every error path ------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "status", "words", "param"), [
    (b"{not json", 400, "must be JSON", None),
    ([1, 2], 400, "must be a JSON object", None),
    ({"model": "tiny-shapes"}, 400, "prompt is required", "prompt"),
    ({"prompt": PROMPT, "colour": "red"}, 400, "unknown field 'colour'", "colour"),
    ({"prompt": PROMPT, "n": 0}, 400, "n must be at least 1", "n"),
    ({"prompt": PROMPT, "n": "four"}, 400, "n must be a whole number", "n"),
    ({"prompt": PROMPT, "n": 9, **EXTRA}, 400, "n must be from 1 to 8", "n"),
    ({"prompt": PROMPT, "response_format": "jpeg"}, 400, "response_format must be b64_json or url", "response_format"),
    ({"prompt": PROMPT, "output_format": "webp"}, 400, "PNG images only", "output_format"),
    ({"prompt": PROMPT, "seed": -1}, 400, "seed must be a whole number", "seed"),
    ({"prompt": PROMPT, "size": "64x64x2", **EXTRA}, 400, "size", "size"),
    ({"prompt": PROMPT, "mode": "warp", **{k: v for k, v in EXTRA.items() if k != "mode"}}, 400, "mode", "mode"),
    ({"prompt": PROMPT, "model": "tiny-flux"}, 403, "not offered here", None),
    ({"prompt": PROMPT, "steps": 200, "size": "128x128", **{k: v for k, v in EXTRA.items() if k != "steps"}}, 403,
     "this server allows 16,384 per request", None),
    ({"prompt": PROMPT, "n": 8, "steps": 60, "size": "128x128", "device": "cpu", "mode": "eager"}, 429,
     "per visitor at once", None),
])
def test_bad_requests_get_openais_error_shape_and_status(app, body, status, words, param):
    response = post(app[0], body)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert words in error["message"], error
    assert error["param"] == param


def test_keys_routes_and_methods(app):
    url = app[0]
    assert post(url, {"prompt": PROMPT}, key=None).status_code == 401
    missing = error_of(post(url, {"prompt": PROMPT}, key=None))
    assert "needs an API key" in missing["message"] and missing["code"] == "invalid_api_key"
    wrong = post(url, {"prompt": PROMPT}, key="not-a-key")
    assert wrong.status_code == 401 and VISITOR_KEY not in wrong.text and "not-a-key" not in wrong.text
    assert httpx.get(url + "v1/images/generations", timeout=30,
                     headers={"authorization": f"Bearer {VISITOR_KEY}"}).status_code == 405
    nowhere = httpx.get(url + "v1/nowhere", timeout=30)
    assert nowhere.status_code == 404 and "GET /v1/models" in error_of(nowhere)["message"]
    assert httpx.get(url + "v1/images/files/nothing.png", timeout=30).status_code == 404


def test_a_new_key_in_the_file_works_without_a_restart(app):
    url, _, keys = app
    assert httpx.get(url + "v1/models", headers={"authorization": "Bearer rotated-key-of-the-host"}, timeout=30).status_code == 401
    keys.write_text(f"{VISITOR_KEY}\nrotated-key-of-the-host\n")
    assert httpx.get(url + "v1/models", headers={"authorization": "Bearer rotated-key-of-the-host"}, timeout=30).status_code == 200


def test_a_v1_request_counts_against_the_same_per_client_bound_as_the_page(app, monkeypatch):
    """client_events=1: while a page /generate (gradio_client) runs, a /v1 request from the same address is
    refused with the edge's message; while a /v1 request runs, the page's join is refused."""
    from gradio_client import Client

    url, manager, _ = app
    page = Client(url, verbose=False)
    long = dict(prompt=PROMPT, preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64",
                steps="200", seed="1")
    job = page.submit(**long, api_name="/generate")
    wait_until(lambda: manager.flow.held("127.0.0.1") > 0, timeout=60, message="the page's run started")
    refused = post(url, {"prompt": PROMPT, **EXTRA})
    assert refused.status_code == 429, refused.text
    assert "at most 1 per visitor" in error_of(refused)["message"]
    job.cancel()
    page.predict(api_name="/cancel")
    wait_until(lambda: job.done(), timeout=60, message="the page's run ended")

    entered, release, real = threading.Event(), threading.Event(), manager.generate

    def held_generate(spec, **hooks):  # the /v1 request holds its place until the test lets it run
        entered.set()
        release.wait(60)
        return real(spec, **hooks)

    monkeypatch.setattr(manager, "generate", held_generate)
    answer = {}
    api = threading.Thread(target=lambda: answer.update(r=post(url, {"prompt": PROMPT, **EXTRA})))
    api.start()
    try:
        wait_until(entered.is_set, timeout=60, message="the /v1 request started")
        with pytest.raises(Exception, match="at most 1 per visitor|Queue is full"):
            page.predict(**{**long, "steps": "2"}, api_name="/generate")
    finally:
        release.set()
        api.join(timeout=300)
    assert answer["r"].status_code == 200


def test_a_client_that_goes_away_cancels_its_images(app, monkeypatch):
    from engine.errors import Cancelled

    url, manager, _ = app
    outcomes = spy_generate(manager, monkeypatch)
    with pytest.raises(httpx.ReadTimeout):  # 200 steps at 64x64: seconds of work, within the cost bounds
        answer = post(url, {"prompt": PROMPT, **EXTRA, "steps": 200, "size": "64x64", "n": 2},
                      timeout=httpx.Timeout(30, read=1.0))
        pytest.fail(f"answered within the second: {answer.status_code} {answer.text[:300]}")
    wait_until(lambda: len(outcomes) == 2, timeout=120, message="both images ended")
    assert all(isinstance(o, Cancelled) for o in outcomes), outcomes


def test_the_url_image_store_lives_in_the_cache_folder_and_keeps_its_last_files(tmp_path):
    from ui.openai_store import OutputStore

    store = OutputStore(kept=2, under=tmp_path / "v1")
    names = [store.put(bytes([i]) * 8) for i in range(3)]
    assert store.folder.parent == tmp_path / "v1"
    assert store.get(names[0]) is None and store.get(names[2]) == bytes([2]) * 8
    assert len(list(store.folder.iterdir())) == 2
    store.close()
    assert list((tmp_path / "v1").iterdir()) == []
