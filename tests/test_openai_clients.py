"""Third-party clients of the OpenAI-compatible API (/v1, ui/openai_api.py) as they are, against the running app:
LangChain's DallEAPIWrapper (it names dall-e-2 and reads `.url`), and what every client assumes of `model` and
`response_format`. Open WebUI, a 5-minute install, has its own script: scripts/openwebui_images.py."""

from __future__ import annotations

import io
import types

import httpx
import pytest
from helpers import engine_manager, launch_demo
from PIL import Image

pytestmark = pytest.mark.slow  # launches the app and generates

openai = pytest.importorskip("openai", reason="the /v1 tests use the official openai SDK (the dev extra)")
dalle = pytest.importorskip("langchain_community.utilities.dalle_image_generator",
                            reason="LangChain's image tool (langchain-community, the dev extra)")

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def url(cache_dir, tiny_models):
    """The app on the host's defaults for the embedded model: tiny-shapes on cpu, eager (no compile waits)."""
    from ui.handlers import UIDefaults

    with engine_manager(cache_dir) as manager:
        demo, address = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"))
        try:
            yield address
        finally:
            demo.close()


def post(url: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(url + "v1/images/generations", json=body, headers=headers, timeout=300)


def png(address: str) -> Image.Image:
    fetched = httpx.get(address, timeout=30)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png", fetched.text[:200]
    return Image.open(io.BytesIO(fetched.content))


def test_langchains_dalle_wrapper_gets_a_url_of_an_image_that_reads_right(url, monkeypatch):
    """The wrapper sends model=dall-e-2 and no response_format, then joins `.url` of each image (a b64_json answer
    failed with "sequence item 0: expected str instance, NoneType found")."""
    from training.shapes.fidelity import check
    from ui import openai_api

    monkeypatch.setattr(openai_api, "random", types.SimpleNamespace(randint=lambda low, high: 0))  # the seed: 0
    tool = dalle.DallEAPIWrapper(api_key="unused", base_url=url + "v1", size="64x64", max_retries=0)
    answer = tool.run(PROMPT)
    assert answer.startswith(url + "v1/images/files/"), answer
    with png(answer) as image:
        assert image.size == (64, 64)
        reading = check(image.convert("RGB"), PROMPT)
    assert reading.correct, reading


@pytest.mark.parametrize(("model", "form"), [("dall-e-3", "url"), ("gpt-image-1", "b64_json"),
                                             ("tiny-shapes", "b64_json"), (None, "b64_json")])
def test_the_default_response_format_follows_the_family_the_client_names(url, model, form):
    body = {"prompt": PROMPT, "size": "64x64", "steps": 2, **({"model": model} if model else {})}
    response = post(url, body)
    assert response.status_code == 200, response.text
    (image,) = response.json()["data"]
    assert set(image) & {"url", "b64_json"} == {form}
    assert response.json()["model"] == "tiny-shapes"
    said = " ".join(response.json()["notices"])
    assert (f"model {model} is served by tiny-shapes" in said) == (model not in (None, "tiny-shapes")), said


def test_an_unknown_model_is_refused_naming_the_models_to_send(url):
    client = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as refused:
        client.images.generate(model="stable-diffusion-9", prompt=PROMPT)
    message = refused.value.body["message"]
    assert "'stable-diffusion-9' is not a model of this server" in message and "tiny-shapes" in message
    assert "dall-e-3" in message and refused.value.body["param"] == "model"
    assert refused.value.body["code"] == "model_not_found"


def test_a_url_answer_is_the_address_the_client_reached(url):
    """Behind a proxy the URL names the proxy's host and scheme (X-Forwarded-Host, -Proto); its path serves the
    image here."""
    response = post(url, {"prompt": PROMPT, "model": "dall-e-2", "size": "64x64", "steps": 2},
                    **{"x-forwarded-host": "images.example.org", "x-forwarded-proto": "https"})
    (image,) = response.json()["data"]
    assert image["url"].startswith("https://images.example.org/v1/images/files/"), image
    with png(url + image["url"].split("/", 3)[3]) as fetched:
        assert fetched.size == (64, 64)
