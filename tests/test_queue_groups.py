"""Issue 37, item 1: the queue that lets the engines see their visitors.

Gradio keeps the lowest concurrency limit of a shared concurrency id, lowered for good by the first event of
a lower limit that joins (gradio/queueing.py `create_event_queue_for_fn`). The Advisor sat in the engines'
group with a limit of 1: one visitor pressing Advise (refused in public mode) made every Generate and
Compare run one at a time for everyone, so no batch formed and the per-visitor cost budget never refused.

The structure tests build the app and read its queue groups; the slow ones drive the page's own queue
(Gradio's queue protocol: join, then read the session's event stream) from several loopback addresses,
in the hostile run's configuration and the default one (eager: a batch forms the same way in every mode).
"""

from __future__ import annotations

import json
import threading
import uuid
from contextlib import contextmanager

import gradio as gr
import httpx
import pytest
from helpers import engine_manager, launch_demo, wait_until

from engine.serving.manager import HostPolicy
from ui import build_demo
from ui.common import ENGINE_QUEUE
from ui.generate import GENERATE_API_PARAMS
from ui.handlers import UIDefaults

CONFIGS = {  # the hostile run's: --public --presets tiny-shapes,tiny-flux --mcp --loras; the default: --public
    "hostile": dict(policy=HostPolicy(public=True, presets=("tiny-shapes", "tiny-flux")), loras=True, mcp=True),
    "default": dict(policy=HostPolicy(public=True), loras=False, mcp=False),
}
FIELDS = {"prompt": "a red circle on a blue background", "negative_prompt": "", "preset": "tiny-shapes",
          "device": "cpu", "precision": "fp32", "mode": "eager", "size": "64x64", "steps": "8", "guidance": "",
          "seed": "1", "on_cold": "eager", "tp": "1", "step_cache": "none", "lora": "none",
          "memory": "", "num_frames": "", "fps": "",
          "images": None, "mask": None, "strength": ""}
COSTLIEST = dict(size="128x128", steps="64")  # 16,384 token-steps: --max-request-cost's default


def api_data(**fields) -> list:
    values = {**FIELDS, **fields}
    return [values[name] for name in GENERATE_API_PARAMS]


@contextmanager
def built(config: str, cache_dir):
    c = CONFIGS[config]
    with engine_manager(cache_dir, options=dict(loras=c["loras"]), policy=c["policy"]) as manager:
        yield manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager")


# -- structure -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_no_event_with_a_lower_limit_joins_the_engines_group(config, cache_dir):
    from ui.blocks import queue_groups

    with built(config, cache_dir) as (manager, defaults):
        demo = build_demo(manager.serving(), defaults)
        slots = demo.fns[next(i for i, f in demo.fns.items() if f.api_name == "generate")].concurrency_limit
        engines = queue_groups(demo)[ENGINE_QUEUE]
        assert set(engines) == {"generate", "generate_ui", "generate_video", "generate_video_ui", "compare"}, engines
        assert set(engines.values()) == {slots} and slots >= 8, engines
        # The group's queue exists from the start with that limit: no later event can lower it.
        assert demo._queue.event_queue_per_concurrency_id[ENGINE_QUEUE].concurrency_limit == slots
        advise = next(f for f in demo.fns.values() if f.api_name == "advise")
        assert advise.concurrency_id != ENGINE_QUEUE and advise.concurrency_limit == 1


def test_an_app_whose_shared_group_mixes_limits_is_not_built():
    from ui.blocks import settle_queue_groups

    with gr.Blocks() as demo:
        button = gr.Button()
        button.click(lambda: None, concurrency_id=ENGINE_QUEUE, concurrency_limit=16, api_name="run")
        button.click(lambda: None, concurrency_id=ENGINE_QUEUE, concurrency_limit=1, api_name="slow")
    demo.queue()
    with pytest.raises(ValueError, match="queue group 'engines' mixes concurrency limits"):
        settle_queue_groups(demo)


# -- the page's own queue ----------------------------------------------------------------------------
class Page:
    """One browser session on its own loopback address, speaking Gradio's queue protocol as the page does."""

    def __init__(self, url: str, address: str, timeout: float = 300.0):
        self.url = url
        self.http = httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout)
        self.session = uuid.uuid4().hex[:11]

    def call(self, fn_index: int, data: list) -> tuple[bool, dict]:
        """(success, output) of one event: join, then read the session's stream until it completes."""
        joined = self.http.post(f"{self.url}gradio_api/queue/join", json={
            "data": data, "fn_index": fn_index, "session_hash": self.session, "event_data": None,
            "trigger_id": None})
        if joined.status_code != 200:
            return False, {"error": joined.text, "status": joined.status_code}
        event_id = joined.json()["event_id"]
        with self.http.stream("GET", f"{self.url}gradio_api/queue/data", params={"session_hash": self.session}) as s:
            for line in s.iter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("event_id") == event_id and message.get("msg") == "process_completed":
                    return bool(message.get("success")), message.get("output") or {}
        raise AssertionError("the event stream ended before the event completed")


def all_at_once(calls) -> list:
    """Run the calls in threads released together; their results in order."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i, call):
        barrier.wait()
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def app(request, cache_dir, tiny_models):
    config = CONFIGS[request.param]
    launch = {}
    if config["mcp"]:
        pytest.importorskip("mcp", reason='the MCP server needs the mcp extra: pip install ".[mcp]"')
        launch["mcp_server"] = True
    with built(request.param, cache_dir) as (manager, defaults):
        demo, url = launch_demo(manager, defaults, queue_size=64, **launch)
        fns = {f.api_name: i for i, f in demo.fns.items() if f.api_name}
        try:
            yield manager, demo, url, fns
        finally:
            demo.close()


@pytest.mark.slow
def test_a_burst_from_eight_addresses_forms_a_batch_and_the_cost_budget_refuses(app):
    manager, demo, url, fns = app
    # A visitor presses Advise first (refused in public mode): the event that used to set the engines' limit to 1.
    form = ["tiny-shapes", "cpu", "64x64", 2, 1.0, 1, 30, "none", ""]  # AdvisorForm's fields, as the tab sends them
    ok, output = Page(url, "127.0.0.9").call(fns["advise"], form)
    assert not ok and "public mode" in str(output), output
    ok, output = Page(url, "127.0.0.10").call(fns["generate"], api_data())  # the engine loaded
    assert ok, output

    # Another address keeps the engine busy while the burst joins, so the burst waits together on the engine.
    blocker = threading.Thread(target=Page(url, "127.0.0.19").call, args=(fns["generate"], api_data(steps="64")))
    blocker.start()
    wait_until(lambda: any(row.get("pending") for row in manager.residency.status_rows()), 60)
    burst = all_at_once([lambda i=i: Page(url, f"127.0.0.{11 + i}").call(fns["generate"], api_data(seed=str(i)))
                         for i in range(8)])
    blocker.join()
    assert all(ok for ok, _ in burst), [o for ok, o in burst if not ok]
    sizes = [int(output["data"][1]["batch_size"]) for _, output in burst]
    print(f"burst of 8 from 8 addresses: batch sizes {sorted(sizes)}")
    assert max(sizes) >= 4, sizes

    # Eight of the costliest Generates from one address, each from its own page: two fit the visitor's budget.
    costly = all_at_once([lambda i=i: Page(url, "127.0.0.20").call(fns["generate"], api_data(**COSTLIEST, seed=str(i)))
                          for i in range(8)])
    admitted = [output for ok, output in costly if ok]
    refused = [output for ok, output in costly if not ok]
    print(f"eight costliest from one address: {len(admitted)} admitted, {len(refused)} refused")
    assert len(admitted) == 2 and len(refused) == 6, refused
    assert all("wait for yours to finish" in str(o.get("error")) for o in refused), refused
