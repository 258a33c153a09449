"""The app as an MCP server, through the official `mcp` client over Streamable HTTP (public mode, tiny-shapes)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import psutil
import pytest
from helpers import engine_manager, launch_demo, wait_until
from PIL import Image

from engine.protocol import params

pytestmark = pytest.mark.slow  # launches the app and generates through MCP tool calls

pytest.importorskip("mcp", reason='the MCP server needs the mcp extra: pip install ".[mcp]"')

PROMPT = "a red circle on a blue background"
CALL = dict(prompt=PROMPT, preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64",
            steps="2", seed="3")


@pytest.fixture(scope="module")
def mcp_url(cache_dir):
    from engine.serving.manager import HostPolicy
    from ui import mcp
    from ui.edge import EdgeConfig
    from ui.handlers import UIDefaults

    policy = HostPolicy(public=True, presets=("tiny-shapes",))
    with engine_manager(cache_dir, policy=policy) as manager:
        demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager",
                                                    admin_token="host-secret"),
                                edge=EdgeConfig(client_events=1), mcp_server=True)
        mcp.serve(demo)
        try:
            yield url + "gradio_api/mcp/"
        finally:
            demo.close()


def session_run(url: str, work):
    """asyncio.run(work(session)) with an initialised MCP client session on `url`."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def main():
        async with streamablehttp_client(url) as (read, write, _), ClientSession(read, write) as session:
            await session.initialize()
            return await work(session)

    return asyncio.run(main())


def texts(result) -> list[str]:
    return [c.text for c in result.content if c.type == "text"]


def test_an_agent_lists_the_public_endpoints_as_tools_with_descriptions(mcp_url):
    async def work(session):
        return (await session.list_tools()).tools

    tools = {t.name: t for t in session_run(mcp_url, work)}
    assert {"generate", "compare", "status", "system", "warm", "cancel", "advise_start", "advise_poll"} <= set(tools)
    assert "restart" not in tools  # a host operation: not offered on a public server
    generate = tools["generate"]
    assert "image" in generate.description and "timings" in generate.description
    assert {"prompt", "preset", "size", "steps", "seed"} <= set(generate.inputSchema["properties"])
    assert "warm" in tools["status"].description  # says what it is for
    advise = tools["advise_start"].inputSchema["properties"]  # each parameter says what it takes
    assert "1-30" in advise["max_minutes"]["description"] and "tiny-shapes" in advise["preset"]["description"]
    compare = tools["compare"].inputSchema["properties"]
    assert all(p.get("description") for p in compare.values()) and "1-200" in compare["steps"]["description"]
    # a video preset's clip fields, described by their declarations (engine/protocol/params.py)
    assert compare["num_frames"]["description"] == params.BY_NAME["num_frames"].describe()
    assert "frames" in compare["fps"]["description"] and "clip" in tools["compare"].description


def test_generate_returns_the_image_and_its_timings(mcp_url):
    async def work(session):
        return await session.call_tool("generate", CALL)

    result = session_run(mcp_url, work)
    assert not result.isError, texts(result)
    (image,) = [c for c in result.content if c.type == "image"]
    assert image.mimeType == "image/png"
    with Image.open(io.BytesIO(base64.b64decode(image.data))) as png:
        assert png.size == (64, 64)
    timings = [t for t in texts(result) if "request_id" in t]
    assert timings, texts(result)
    figures = json.loads(timings[0])  # JSON an agent can read, not Python's repr
    assert figures["engine"] == "tiny-shapes@cpu/fp32" and figures["seed"] == 3
    assert len(figures["timings"]["step_ms"]) == 2
    assert not [t for t in texts(result) if "gradio_api/file=" in t or "/web/" in t]  # no server path


def test_a_refusal_in_public_mode_is_a_tool_error_with_the_apps_message(mcp_url):
    async def work(session):
        return await session.call_tool("generate", {**CALL, "preset": "tiny-flux"})

    result = session_run(mcp_url, work)
    assert result.isError
    assert "preset 'tiny-flux' is not offered here; choose one of: tiny-shapes" in " ".join(texts(result))


def test_host_operations_need_the_admin_token(mcp_url):
    async def work(session):
        refused = await session.call_tool("warm", {"preset": "tiny-shapes", "device": "cpu", "precision": "fp32",
                                                   "mode": "compile", "size": "all"})
        return refused

    result = session_run(mcp_url, work)
    assert result.isError
    assert "warming every bucket is up to the host" in " ".join(texts(result))


def test_the_per_client_bound_holds_for_agents_with_the_edges_message(mcp_url):
    """client_events=1: of two calls at once from one agent, one runs and the other is refused at the web edge,
    and the agent reads the edge's message (not gradio_client's "Queue is full!")."""
    async def work(session):
        long_call = {**CALL, "steps": "150"}
        return await asyncio.gather(session.call_tool("generate", long_call),
                                    session.call_tool("generate", long_call))

    results = session_run(mcp_url, work)
    refused = [r for r in results if r.isError]
    assert len(refused) == 1, [texts(r) for r in results]
    assert "at most 1 per visitor" in " ".join(texts(refused[0]))
    served = next(r for r in results if not r.isError)
    assert any(c.type == "image" for c in served.content)


def test_status_is_a_tool_an_agent_can_read(mcp_url):
    async def work(session):
        await session.call_tool("generate", CALL)  # the engine is loaded by now
        return await session.call_tool("status", {})

    result = session_run(mcp_url, work)
    assert not result.isError
    (engine,) = [e for e in json.loads(texts(result)[0]) if e["engine"] == "tiny-shapes@cpu/fp32"]
    assert engine["state"] == "ready" and isinstance(engine["buckets"], list)


def test_the_advisor_is_a_host_only_start_poll_pair(mcp_url):
    """It measures for minutes: advise_start returns a job at once, advise_poll follows it (and cancels it);
    on a public server only the host (admin_token) may start one, and one runs at a time."""
    start = dict(preset="tiny-shapes", device="cpu", size="64x64", steps="2", max_minutes="1")

    async def work(session):
        refused = await session.call_tool("advise_start", start)
        started = await session.call_tool("advise_start", {**start, "admin_token": "host-secret"})
        busy = await session.call_tool("advise_start", {**start, "admin_token": "host-secret"})
        job = json.loads(texts(started)[0])["job"]
        polled = await session.call_tool("advise_poll", {"job": job})
        cancelled = await session.call_tool("advise_poll", {"job": job, "cancel": "true"})
        unknown = await session.call_tool("advise_poll", {"job": "nope"})
        return refused, started, busy, polled, cancelled, unknown

    refused, started, busy, polled, cancelled, unknown = session_run(mcp_url, work)
    assert refused.isError and "host operation" in " ".join(texts(refused))
    assert not started.isError and json.loads(texts(started)[0])["state"] == "running"
    assert busy.isError and "still running (one at a time)" in " ".join(texts(busy))
    assert not polled.isError and "progress" in json.loads(texts(polled)[0])
    assert json.loads(texts(cancelled)[0])["state"] == "cancelled"
    assert unknown.isError and "no advisor job 'nope'" in " ".join(texts(unknown))

    def advisors():
        return [p for p in psutil.Process().children(recursive=True) if "advise" in " ".join(p.cmdline())]

    wait_until(lambda: not advisors(), timeout=30, message="the cancelled advisor's process is still running")


def test_an_mcp_body_nested_too_deep_or_with_a_4500_digit_number_is_a_400_not_a_500(mcp_url):
    """Issue 50: the MCP server's JSON parser recursed past Python's limit, or refused to read the int: HTTP 500
    and a traceback each. The web edge reads JSON bodies strictly first (engine/config/strict.py)."""
    import httpx

    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    deep = httpx.post(mcp_url, content="[" * 100_000 + "]" * 100_000, headers=headers, timeout=60)
    long = httpx.post(mcp_url, content='{"jsonrpc": "2.0", "id": ' + "9" * 4500 + ', "method": "tools/list"}',
                      headers=headers, timeout=60)
    assert (deep.status_code, long.status_code) == (400, 400), (deep.text[:200], long.text[:200])
    assert "more than 32 deep" in deep.json()["detail"] and "more than 40 digits" in long.json()["detail"]
