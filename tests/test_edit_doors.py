"""The doors that take images, against the running app (public mode, edit / inpaint / reference presets on cpu):
POST /v1/images/edits (ui/openai_edits.py) through the official `openai` SDK's `images.edit`, and plain HTTP
for malformed uploads (each a clear 4xx naming its field, the app still serving after them, a decompression
bomb refused within a memory bound); the MCP `generate` tool with an image, through the official `mcp` client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import engine_manager, launch_demo
from PIL import Image, ImageDraw

pytestmark = pytest.mark.slow  # launches the app and edits

openai = pytest.importorskip("openai", reason="the /v1 tests use the official openai SDK (the dev extra)")

PRESETS = ("tiny-shapes-edit", "tiny-shapes-inpaint", "tiny-flux2-klein", "tiny-shapes")
EXTRA = {"device": "cpu", "precision": "fp32", "mode": "eager", "steps": 2}
EDIT = "make the circle green"


def png(size=(64, 64), colour=(220, 30, 30), mode="RGB", fmt="PNG") -> bytes:
    image = Image.new(mode, size, (30, 30, 200) if mode == "RGB" else 0)
    if mode == "RGB":
        ImageDraw.Draw(image).ellipse((size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4), fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def png_bomb(side: int = 36000) -> bytes:
    """A PNG whose header claims side x side RGB pixels (1.3 gigapixels at 36000) over a few bytes of data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"\0" * (1 + 3 * side) * 4, 9)  # four rows of zeros; the rest is missing
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def image_of(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


@pytest.fixture(scope="module")
def app(cache_dir):
    """Public mode, the edit presets offered; the engine batches requests gathered within 300 ms."""
    from engine.serving.manager import HostPolicy
    from ui import mcp
    from ui.handlers import UIDefaults

    policy = HostPolicy(public=True, presets=PRESETS)
    with engine_manager(cache_dir, {"max_batch": 4, "batch_wait_ms": 300}, policy=policy) as manager:
        demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"),
                                mcp_server=True)
        mcp.serve(demo)
        try:
            yield url
        finally:
            demo.close()


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app + "v1", api_key="none", max_retries=0, timeout=300)


def edit(client, extra: dict | None = None, **fields):
    fields.setdefault("model", "tiny-shapes-edit")
    fields.setdefault("prompt", EDIT)
    return client.images.edit(**fields, extra_body={**EXTRA, **(extra or {})})


# -- the SDK ---------------------------------------------------------------------------------------------
def test_one_image_is_edited_at_its_own_size(client):
    result = edit(client, image=("source.png", png((128, 64)), "image/png"), extra={"seed": 4})
    (image,) = result.data
    with image_of(image.b64_json) as out:
        assert out.size == (128, 64)  # no size: the edit follows its source
    assert result.size == "128x64" and image.seed == 4
    assert image.timings["engine"] == "tiny-shapes-edit@cpu/fp32" and image.timings["steps"] == 2


def test_n_edits_run_as_one_pipeline_call(client):
    result = edit(client, image=("source.png", png(), "image/png"), n=2, extra={"seed": 10})
    assert [image.seed for image in result.data] == [10, 11]
    assert result.batch_sizes == [2, 2]  # one batched pipeline call made both
    assert image_of(result.data[0].b64_json).tobytes() != image_of(result.data[1].b64_json).tobytes()


def test_n_edits_decode_their_upload_once_admitted_once(client, monkeypatch):
    from engine.config import images

    decodes = []
    decoded = images._decoded
    monkeypatch.setattr(images, "_decoded", lambda name, *a: decodes.append(name) or decoded(name, *a))
    result = edit(client, image=("source.png", png(), "image/png"), n=2, extra={"seed": 20})
    assert [image.seed for image in result.data] == [20, 21]
    assert decodes == ["image 1"]  # one decode for both images: the run reuses what admission decoded


def test_a_scan_bomb_and_crafted_exif_are_answered_as_typed_400s_and_a_notice(app, client, monkeypatch):
    from PIL import ImageFile

    from bench.hostile import crafted_exif_jpeg, scan_bomb

    loads = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.format) or load(self))
    response = post(app, fields(scan_bomb(1024, 5000)))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "5,001 scans; this server decodes at most 64" in error["message"] and loads == []
    result = edit(client, image=("crafted.jpg", crafted_exif_jpeg(), "image/jpeg"))
    assert len(result.data) == 1 and any("EXIF" in notice for notice in result.notices), result.notices


def test_several_images_are_references_of_one_edit(client):
    result = edit(client, model="tiny-flux2-klein", size="64x64",
                  image=[("a.png", png(), "image/png"), ("b.png", png((128, 128), (20, 200, 20)), "image/png")])
    (image,) = result.data
    assert image.timings["engine"] == "tiny-flux2-klein@cpu/fp32"
    assert any("image 2" in notice and "resized to 64x64" in notice for notice in result.notices), result.notices
    with pytest.raises(openai.BadRequestError, match="at most 1 input image") as refused:
        edit(client, image=[("a.png", png(), "image/png"), ("b.png", png(), "image/png")])
    assert refused.value.body["param"] == "model"  # the preset's limit: choose another model


def openai_mask(size=(64, 64), edit=(0, 0, 32, 64)) -> bytes:
    """An OpenAI-style mask: opaque, fully transparent (alpha 0) over the `edit` box (x0, y0, x1, y1)."""
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), edit)
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()


def test_a_mask_edits_where_it_is_transparent_and_keeps_the_rest_exactly(client):
    source = png()
    result = edit(client, model="tiny-shapes-inpaint", image=("source.png", source, "image/png"),
                  mask=("mask.png", openai_mask(), "image/png"), prompt="a yellow square on a green background",
                  extra={"steps": 4, "strength": "1"})
    with image_of(result.data[0].b64_json) as out, Image.open(io.BytesIO(source)) as before:
        out, before = np.asarray(out.convert("RGB"), dtype=np.int16), np.asarray(before, dtype=np.int16)
    # the opaque half is the source's own pixels, pasted back (beyond the mask's few pixels of feathered edge)
    assert np.abs(out[:, 40:] - before[:, 40:]).max() == 0
    assert np.abs(out[:, :24] - before[:, :24]).mean() > 20  # the transparent half was repainted


def test_an_opaque_mask_is_refused_naming_the_convention_and_a_keep_all_mask_says_so(client):
    grey = Image.new("L", (64, 64), 255)  # white everywhere: "repaint all" on the page, no alpha at all here
    buffer = io.BytesIO()
    grey.save(buffer, "PNG")
    with pytest.raises(openai.BadRequestError, match="fully transparent") as refused:
        edit(client, model="tiny-shapes-inpaint", image=("source.png", png(), "image/png"),
             mask=("mask.png", buffer.getvalue(), "image/png"))
    assert refused.value.body["param"] == "mask"
    source = png()
    kept = edit(client, model="tiny-shapes-inpaint", image=("source.png", source, "image/png"),
                mask=("mask.png", openai_mask(edit=(0, 0, 0, 0)), "image/png"), extra={"steps": 2})
    assert any("keeps every pixel" in notice for notice in kept.notices), kept.notices
    with image_of(kept.data[0].b64_json) as out, Image.open(io.BytesIO(source)) as before:
        assert out.convert("RGB").tobytes() == before.convert("RGB").tobytes()  # the source itself comes back


def test_streaming_sends_partial_images_then_the_edit(client):
    stream = edit(client, image=("source.png", png(), "image/png"), stream=True, partial_images=1,
                  extra={"steps": 2})
    events = list(stream)
    kinds = [type(event).__name__ for event in events]
    assert kinds == ["ImageEditPartialImageEvent", "ImageEditCompletedEvent"], kinds
    with image_of(events[-1].b64_json) as out:
        assert out.size == (64, 64)


# -- malformed uploads -----------------------------------------------------------------------------------
BOUNDARY = "showcase-test-boundary"


def multipart(*parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def fields(image: bytes | None = None, model: str = "tiny-shapes-edit", **more) -> bytes:
    parts = [("prompt", None, EDIT.encode()), ("model", None, model.encode()), ("device", None, b"cpu")]
    parts += [(name, None, str(value).encode()) for name, value in more.items()]
    return multipart(*parts, *([("image", "source.png", image)] if image is not None else []))


def post(url: str, body: bytes, content_type: str = f"multipart/form-data; boundary={BOUNDARY}") -> httpx.Response:
    return httpx.post(url + "v1/images/edits", content=body, headers={"content-type": content_type}, timeout=120)


def _too_wide() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (5000, 8)).save(buffer, "PNG")
    return buffer.getvalue()


MALFORMED = [  # (what, body, content type or None, status, words, param)
    ("json body", b'{"prompt": "x"}', "application/json", 400, "multipart/form-data", None),
    ("no boundary", fields(png()), "multipart/form-data", 400, "multipart/form-data", None),
    ("garbage", b"\x00\x01 not multipart at all", None, 400, "multipart body is malformed", None),
    ("cut short", fields(png())[:300], None, 400, "closing boundary", None),
    ("no image", fields(), None, 400, "image is required", "image"),
    ("image as text", multipart(("prompt", None, b"x"), ("image", None, b"abc")), None, 400,
     "must be an uploaded file", "image"),
    ("prompt as file", multipart(("prompt", "p.txt", b"x"), ("image", "a.png", png())), None, 400,
     "not a file field", "prompt"),
    ("empty file", fields(b""), None, 400, "image 1 is empty", "image"),
    ("text file", fields(b"hello, this is not a picture"), None, 400, "not an image this server reads", "image"),
    ("svg", fields(b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"/>'), None, 400,
     "not an image this server reads", "image"),
    ("pdf", fields(b"%PDF-1.4\n1 0 obj<<>>endobj\n"), None, 400, "not an image this server reads", "image"),
    ("truncated png", fields(png()[:-40]), None, 400, "truncated or damaged", "image"),
    ("header only", fields(png()[:33]), None, 400, "image 1", "image"),
    ("too wide", fields(_too_wide()), None, 400, "upload at most 4096x4096", "image"),
    ("unknown field", fields(png(), colour="red"), None, 400, "unknown field 'colour'", "colour"),
    ("no prompt", multipart(("image", "a.png", png())), None, 400, "prompt is required", "prompt"),
    ("stream maybe", fields(png(), stream="maybe"), None, 400, "stream must be true or false", "stream"),
    ("n zero", fields(png(), n=0), None, 400, "n must be at least 1", "n"),
    ("strength on an edit", fields(png(), strength="0.5"), None, 400, "no strength", "model"),
    ("mask on an edit", multipart(("prompt", None, b"x"), ("model", None, b"tiny-shapes-edit"),
                                  ("image", "a.png", png()), ("mask", "m.png", png())), None, 400, "no mask", "model"),
    ("inpaint without mask", fields(png(), model="tiny-shapes-inpaint"), None, 400, "upload a mask", "model"),
    ("mask of another size", multipart(("prompt", None, b"x"), ("model", None, b"tiny-shapes-inpaint"),
                                       ("image", "a.png", png()), ("mask", "m.png", openai_mask((32, 32)))),
     None, 400, "draw the mask at the source image's size", "mask"),
    ("strength out of range", multipart(("prompt", None, b"x"), ("model", None, b"tiny-shapes-inpaint"),
                                        ("strength", None, b"7"), ("image", "a.png", png()),
                                        ("mask", "m.png", openai_mask())), None, 400, "strength must be above 0",
     "strength"),
    ("text-only preset", fields(png(), model="tiny-shapes"), None, 400, "takes text to image only", "model"),
    ("too many parts", multipart(*[("image[]", f"{i}.png", b"x") for i in range(60)]), None, 400,
     "more than", None),
]


@pytest.mark.parametrize(("what", "body", "content_type", "status", "words", "param"), MALFORMED,
                         ids=[case[0] for case in MALFORMED])
def test_a_malformed_upload_gets_a_clear_error(app, what, body, content_type, status, words, param):
    response = post(app, body, *([content_type] if content_type else []))
    assert response.status_code == status, (what, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], (what, error)
    assert error["param"] == param, (what, error)


def test_a_file_over_the_bound_is_refused_before_it_is_read_whole(app):
    from engine.config.images import MAX_UPLOAD_BYTES

    response = post(app, fields(b"\x89PNG" + b"\0" * MAX_UPLOAD_BYTES))
    assert response.status_code == 413 and "image" in response.json()["error"]["message"]


def test_the_edge_bounds_the_route_as_the_route_does():
    from ui.edge import UPLOAD_ROUTES
    from ui.openai_edits import EDIT_BODY_BYTES, PATH
    from ui.openai_videos import VIDEO_BODY_BYTES

    assert UPLOAD_ROUTES == {PATH: EDIT_BODY_BYTES, "/v1/videos": VIDEO_BODY_BYTES}


def _rss_peak_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _status_kb(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def test_a_gigapixel_png_bomb_is_refused_without_its_pixels_and_the_app_keeps_serving(app, client):
    """The app serves in this process: its peak RSS across the request bounds what the bomb cost."""
    bomb = png_bomb()
    assert len(bomb) < 4096  # 36000 x 36000 x 3 = 3.9 GB of pixels, declared in a few hundred bytes
    before = _status_kb("VmRSS:")
    peak_reset = _rss_peak_reset()
    response = post(app, fields(bomb))
    grown_mb = ((_status_kb("VmHWM:") if peak_reset else _status_kb("VmRSS:")) - before) / 1024
    assert response.status_code == 400, response.text
    assert "Pillow's limit" in response.json()["error"]["message"] or "at most 4096x4096" in response.text
    print(f"PNG bomb (36000x36000 declared, {len(bomb)} bytes): RSS growth {grown_mb:.1f} MB "
          f"({'peak' if peak_reset else 'current'})")
    assert grown_mb < 50, grown_mb
    # every malformed upload above, then this: the app still edits
    result = edit(client, image=("source.png", png(), "image/png"))
    assert len(result.data) == 1


# -- MCP ---------------------------------------------------------------------------------------------------
def mcp_run(url: str, work):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def main():
        async with streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await work(session)

    return asyncio.run(main())


def test_an_agent_edits_through_the_mcp_generate_tool(app):
    pytest.importorskip("mcp", reason='the MCP server needs the mcp extra: pip install ".[mcp]"')
    source = "data:image/png;base64," + base64.b64encode(png((128, 64))).decode("ascii")
    call = dict(prompt=EDIT, preset="tiny-shapes-edit", device="cpu", precision="fp32", mode="eager", steps="2",
                seed="3", images=[source])

    async def work(session):
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        text = {**{k: v for k, v in call.items() if k != "images"}, "preset": "tiny-shapes", "size": "64x64",
                "prompt": "a red circle on a blue background"}
        return tools["generate"], await session.call_tool("generate", call), \
            await session.call_tool("generate", {**call, "images": ["data:image/png;base64,bm90IGFuIGltYWdl"]}), \
            await session.call_tool("generate", text)

    tool, result, refused, text = mcp_run(app, work)
    assert not text.isError, [c.text for c in text.content if c.type == "text"]  # no image: text to image
    schema = tool.inputSchema["properties"]
    assert "url" in json.dumps(schema["images"]).lower() and "mask" in schema  # files, as URLs
    assert not {"images", "mask"} & set(tool.inputSchema.get("required", []))  # text to image sends none
    assert "data:image/png;base64" in tool.description and "make the circle green" in tool.description
    assert "upload_file_to_gradio" not in tool.description  # Gradio's note names a tool this server has not
    assert not result.isError, [c.text for c in result.content if c.type == "text"]
    (image,) = [c for c in result.content if c.type == "image"]
    with Image.open(io.BytesIO(base64.b64decode(image.data))) as out:
        assert out.size == (128, 64)  # the edit followed its source's size
    timings = json.loads(next(c.text for c in result.content if c.type == "text" and "request_id" in c.text))
    assert timings["engine"] == "tiny-shapes-edit@cpu/fp32"
    assert refused.isError and "not an image this server reads" in " ".join(
        c.text for c in refused.content if c.type == "text")
