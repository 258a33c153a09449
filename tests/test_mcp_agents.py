"""Issue 37, items 5 and 6: MCP agents are visitors like any other, kept apart from each other and from pages.

The slow tests launch the app (public mode, tiny-shapes) with its MCP server and call it through the official
`mcp` client, each agent from its own loopback address.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from helpers import engine_manager, launch_demo, spy_generate, wait_until

from engine.errors import Cancelled
from ui.common import session_id
from ui.runs import RunRegistry

PROMPT = "a red circle on a blue background"
CALL = dict(prompt=PROMPT, preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64",
            steps="2", seed="3")
LONG = dict(CALL, steps="200")  # 12,800 token-steps: within a visitor's budget, seconds of engine time


def request_of(session: str, agent: str | None = None):
    """What a handler reads of a gr.Request: its session hash, and the agent the web edge signed for."""
    return SimpleNamespace(session_hash=session, request=SimpleNamespace(state=SimpleNamespace(mcp_caller=agent)))


def test_a_visitor_cannot_choose_an_agents_identity_and_cancel_its_run():
    """Agents' runs were keyed `mcp:<address>`; a visitor choosing that string as its session hash cancelled them."""
    agent = request_of("a-session-of-gradios", agent="127.0.0.21")
    visitor = request_of("mcp:127.0.0.21")
    assert session_id(agent) != session_id(visitor)
    runs = RunRegistry(cancel=lambda request_id: True)
    with runs.open(session_id(agent), exclusive=True) as run:
        run.admitted("r1")
        assert runs.cancel(session_id(visitor)) == "nothing to cancel"
        assert not run.cancelled
        assert runs.cancel(session_id(agent)) == "cancelling r1"  # the agent's own cancel still stops it


# -- through the MCP server ------------------------------------------------------------------------------
pytest.importorskip("mcp", reason='the MCP server needs the mcp extra: pip install ".[mcp]"')


@pytest.fixture(scope="module")
def mcp_app(cache_dir, tiny_models):
    from engine.serving.manager import HostPolicy
    from ui import mcp
    from ui.handlers import UIDefaults

    with engine_manager(cache_dir, policy=HostPolicy(public=True, presets=("tiny-shapes",))) as manager:
        demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"),
                                queue_size=64, mcp_server=True)
        mcp.serve(demo)
        try:
            yield manager, url + "gradio_api/mcp/"
        finally:
            demo.close()


async def as_agent(url: str, address: str, work):
    """work(session) with an initialised MCP client session connecting from `address`."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address),
                             timeout=httpx.Timeout(30, read=300))
    async with http, streamable_http_client(url, http_client=http) as (read, write, _), \
            ClientSession(read, write) as session:
        await session.initialize()
        return await work(session)


def texts(result) -> list[str]:
    return [c.text for c in result.content if c.type == "text"]


@pytest.mark.slow
def test_a_call_whose_agent_hung_up_is_cancelled(mcp_app, monkeypatch):
    manager, url = mcp_app
    asyncio.run(as_agent(url, "127.0.0.22", lambda s: s.call_tool("generate", CALL)))  # the engine loaded
    outcomes = spy_generate(manager, monkeypatch)

    def stepping() -> bool:
        return any(row.get("pending") for row in manager.residency.status_rows())

    async def hang_up(session):
        call = asyncio.ensure_future(session.call_tool("generate", LONG))
        while not stepping() and not call.done():
            await asyncio.sleep(0.05)
        assert not call.done(), texts(call.result())
        call.cancel()  # and the connection closes with the session below

    asyncio.run(as_agent(url, "127.0.0.22", hang_up))
    wait_until(lambda: outcomes, 120, message="the hung-up call's request never ended")
    assert isinstance(outcomes[0], Cancelled), outcomes[0]  # before: it ran its 250 steps to the end


@pytest.mark.slow
def test_agents_share_no_client_and_leave_no_threads_behind(mcp_app):
    """Six agents × eight calls at once: each agent's calls count against that agent only (one runs, the rest
    are told it already has one running), another agent's status is answered, and the web process's threads
    come back to where they were within a minute (Gradio's shared client kept a thread pool it filled and never
    shrank: 16 -> 138 threads in the hostile run, 133 nine minutes later)."""
    _, url = mcp_app
    asyncio.run(as_agent(url, "127.0.0.30", lambda s: s.call_tool("generate", CALL)))
    before = threading.active_count()

    async def eight(session):
        return await asyncio.gather(*(session.call_tool("generate", dict(CALL, seed=str(i)))
                                      for i in range(8)))

    async def all_agents():
        busy = [asyncio.ensure_future(as_agent(url, f"127.0.0.{31 + a}", eight)) for a in range(6)]
        status = await as_agent(url, "127.0.0.40", lambda s: s.call_tool("status", {}))
        return status, await asyncio.gather(*busy)

    status, per_agent = asyncio.run(all_agents())
    assert not status.isError, texts(status)
    for results in per_agent:
        served = [r for r in results if not r.isError]
        refused = [" ".join(texts(r)) for r in results if r.isError]
        assert served, refused  # every agent got its own turn
        assert all("already have a request running" in t or "at most 8 per visitor" in t for t in refused), refused
    def back_to_start() -> bool:  # under light traffic: an agent's status call (idle threads retire on use)
        asyncio.run(as_agent(url, "127.0.0.40", lambda s: s.call_tool("status", {})))
        return threading.active_count() <= before + 10

    wait_until(back_to_start, 60, interval=1.0, message=lambda: (
        f"threads stayed up: {before} before, now {Counter(t.name.split('_')[0] for t in threading.enumerate())}"))


@pytest.mark.slow
def test_agents_on_several_addresses_batch_like_pages(mcp_app):
    """The same burst as the page's (tests/test_queue_groups.py) through MCP: 8 agents on 8 addresses, one call
    each, while another agent keeps the engine busy: their requests share pipeline calls."""
    import re

    manager, url = mcp_app

    async def burst():
        blocker = asyncio.ensure_future(as_agent(url, "127.0.0.50", lambda s: s.call_tool("generate", LONG)))
        while not any(row.get("pending") for row in manager.residency.status_rows()):
            await asyncio.sleep(0.05)
        calls = [as_agent(url, f"127.0.0.{51 + i}", lambda s, i=i: s.call_tool("generate", dict(CALL, seed=str(i))))
                 for i in range(8)]
        results = await asyncio.gather(*calls)
        await blocker
        return results

    results = asyncio.run(burst())
    assert not any(r.isError for r in results), [texts(r) for r in results if r.isError]
    sizes = [int(re.search(r"['\"]batch_size['\"]: (\d+)", " ".join(texts(r))).group(1)) for r in results]
    print(f"8 agents on 8 addresses: batch sizes {sorted(sizes)}")
    assert max(sizes) >= 4, sizes
