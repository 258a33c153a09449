"""One request, one async event stream (engine/serving/stream.py): the events of a run, a failure and a cancel
on the tiny models, and every door (the page, /generate and MCP, /v1, Compare, the CLI) reading that stream."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing, closing
from types import SimpleNamespace

import httpx
import pytest
from gradio_client import Client
from helpers import launch_demo, spy_generate, wait_until

from engine import cli
from engine.config.request import ImageRequest
from engine.errors import Cancelled, InvalidRequest
from engine.serving import stream
from engine.serving.stream import Failed, Finished, Idle, Partial, Run, Started, Step, Stopped, Submitted
from ui.handlers import Handlers, UIDefaults

SPEC = dict(preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64",
            prompt="a red circle on a blue background", seed=1)
FORM = dict(prompt=SPEC["prompt"], negative_prompt="", preset="tiny-shapes", device="cpu", precision="fp32",
            mode="eager", size="64x64", steps=2, guidance="", seed=1, on_cold="eager")


def read_all(manager, spec: ImageRequest, **options) -> list:
    async def main():
        async with aclosing(stream.request_events(manager, spec, **options)) as events:
            return [event async for event in events]

    return asyncio.run(main())


class Progress:
    def __call__(self, *args, **kwargs):
        return None


# -- the stream ----------------------------------------------------------------------------------------
def test_a_run_streams_its_start_steps_and_partial_images_then_its_result(manager):
    key = manager.gate.make_key("tiny-shapes", "cpu", "fp32")
    events = [e for e in read_all(manager, ImageRequest(**SPEC, steps=4, previews=2), key=key)
              if not isinstance(e, Idle)]
    kinds = [type(e) for e in events]
    assert kinds[0] is Started and manager.residency.get(key) is not None  # generate started its engine
    assert kinds[1] is Submitted and kinds[-1] is Finished, kinds
    assert [e.progress.step for e in events if isinstance(e, Step)] == [1, 2, 3, 4]
    partials = [i for i, e in enumerate(events) if isinstance(e, Partial)]
    assert len(partials) == 2
    for i in partials:  # each right after the step it was drawn at
        assert isinstance(events[i - 1], Step) and events[i - 1].progress.step == events[i].step
        assert events[i].png.startswith(b"\x89PNG") and events[i].total == 4
    result = events[-1].result
    assert result.steps == 4 and result.request_id == events[1].request_id
    assert set(kinds) <= {Started, Submitted, Step, Partial, Finished}


def test_bad_input_ends_the_stream_with_a_failed_event_naming_the_field_and_the_server_keeps_serving(manager):
    events = read_all(manager, ImageRequest(**SPEC, steps=0))
    assert [type(e) for e in events] == [Started, Failed]
    assert isinstance(events[-1].error, InvalidRequest) and "steps" in str(events[-1].error)
    with pytest.raises(InvalidRequest, match="steps"):
        stream.result_of(events[-1])
    assert isinstance(read_all(manager, ImageRequest(**SPEC, steps=1))[-1], Finished)


@pytest.mark.parametrize("how", ["aclose", "task cancelled", "blocking reader closed"])
def test_a_consumer_that_goes_away_mid_run_cancels_the_request_in_its_worker(manager, monkeypatch, how):
    outcomes = spy_generate(manager, monkeypatch)
    run = Run(manager.cancel)
    spec = ImageRequest(**SPEC, steps=200)
    seen = []

    async def consume():
        events = stream.request_events(manager, spec, run=run)
        if how == "aclose":
            async for event in events:
                seen.append(event)
                if isinstance(event, Step):
                    break
            await events.aclose()
            return

        async def read_on():  # a handler Gradio cancels: its task, at whichever await it waits
            async for event in events:
                seen.append(event)

        task = asyncio.create_task(read_on())
        while not any(isinstance(event, Step) for event in seen):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    if how == "blocking reader closed":
        with closing(stream.blocking(stream.request_events(manager, spec, run=run))) as events:
            for event in events:
                seen.append(event)
                if isinstance(event, Step):
                    break
    else:
        asyncio.run(consume())
    assert any(isinstance(event, Step) for event in seen)
    wait_until(lambda: outcomes, 60, message="the request ended")
    assert isinstance(outcomes[0], Cancelled), outcomes
    assert run.cancelled and run.request_id is None
    assert isinstance(read_all(manager, ImageRequest(**SPEC, steps=1))[-1], Finished)  # the engine keeps serving


def test_a_run_cancelled_before_it_starts_sends_nothing(manager, monkeypatch):
    outcomes = spy_generate(manager, monkeypatch)
    run = Run(manager.cancel)
    run.stop()
    events = read_all(manager, ImageRequest(**SPEC, steps=2), run=run)
    assert [type(e) for e in events] == [Stopped] and "before it started" in str(events[0].error)
    assert outcomes == []


# -- every door reads it -------------------------------------------------------------------------------
@pytest.fixture
def opened(monkeypatch) -> list:
    """The spec of every stream a door opens (request_events spied on)."""
    specs, real = [], stream.request_events

    def spy(manager, spec, **options):
        specs.append(spec)
        return real(manager, spec, **options)

    monkeypatch.setattr(stream, "request_events", spy)
    return specs


@pytest.fixture(scope="module")
def app_url(manager):
    launch = {"mcp_server": True} if _has_mcp() else {}
    demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"), **launch)
    if launch:
        from ui import mcp

        mcp.serve(demo)
    try:
        yield url
    finally:
        demo.close()


def _has_mcp() -> bool:
    from ui import mcp

    return mcp.missing() is None


def test_the_pages_handler_reads_the_stream(manager, opened):
    handlers = Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))
    outputs = list(handlers.generate(**FORM, request=None, progress=Progress()))
    assert len(opened) == 1 and outputs[-1][1]["cancelled"] is False and outputs[-1][0].size == (64, 64)


def test_the_generate_api_handler_reads_the_stream(manager, opened):
    handlers = Handlers(manager.serving(), UIDefaults(device="cpu", mode="eager"))

    async def main():
        return [out async for out in handlers.generate_api(request=None, progress=Progress(),
                                                           **{k: str(v) for k, v in FORM.items()})]

    image, timings = asyncio.run(main())[-1]
    assert len(opened) == 1 and image["path"].endswith(".png") and len(timings["timings"]["step_ms"]) == 2


def test_gradio_client_and_compare_read_the_stream(app_url, opened):
    client = Client(app_url, verbose=False)
    _, timings = client.predict(**{k: str(v) for k, v in FORM.items()}, api_name="/generate")
    assert len(opened) == 1 and timings["steps"] == 2
    gallery, payload = client.predict(prompt=SPEC["prompt"], preset="tiny-shapes", size="64x64", steps=2,
                                      guidance=3.5, seed=1, devices=["cpu"], precisions=["fp32"], modes=["eager"],
                                      api_name="/compare")
    assert len(opened) > 1 and len(gallery) == 1 and not payload["results"][0].get("error")


def test_an_mcp_tool_call_reads_the_stream(app_url, opened):
    if not _has_mcp():
        pytest.skip("the MCP server needs the mcp extra")
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def main():
        async with streamablehttp_client(app_url + "gradio_api/mcp/") as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await session.call_tool("generate", {k: str(v) for k, v in FORM.items()})

    result = asyncio.run(main())
    assert not result.isError and len(opened) == 1


def test_the_v1_api_and_its_partial_images_read_the_stream(app_url, opened):
    body = {"model": "tiny-shapes", "prompt": SPEC["prompt"], "n": 2, "stream": True, "partial_images": 1,
            "steps": 2, "device": "cpu", "mode": "eager"}
    answer = httpx.post(app_url + "v1/images/generations", json=body, timeout=120)
    kinds = [json.loads(line[6:])["type"] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert kinds.count("image_generation.partial_image") == 2 and kinds.count("image_generation.completed") == 2
    assert len(opened) == 2  # a stream per image


def test_the_cli_reads_the_stream(manager, opened, monkeypatch, capsys):
    for name in ("SHOWCASE_WORKER_NICENESS", "SHOWCASE_COMPILE_NICENESS"):  # the command sets them for its workers
        monkeypatch.setenv(name, "0")
    # the session's manager, which the command must not shut down
    shared = SimpleNamespace(catalog=manager.catalog, engine=manager.engine, generate=manager.generate,
                             cancel=manager.cancel, shutdown=lambda: None)
    monkeypatch.setattr("engine.serving.manager.make_manager", lambda *args, **kwargs: shared)
    assert cli.main(["generate", "--preset", "tiny-shapes", "--device", "cpu", "--mode", "eager", "--steps", "2",
                     "--size", "64x64", "--json"]) == 0
    assert len(opened) == 1 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
