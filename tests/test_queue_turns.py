"""Issue 50, "Gradio's own queue is first come across /call addresses": two addresses each keeping their
events in the engines' group queued ahead of a newcomer, whose event then started after all of theirs. A
group's waiting events now take turns between clients (ui/edge.py `in_turns`)."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import gradio as gr
import httpx
from helpers import free_port, wait_until

from ui.edge import EdgeConfig, EdgeGuard, in_turns


def events(*clients: str) -> list:
    return [SimpleNamespace(client=c, name=f"{c}{i}") for i, c in enumerate(clients)]


def order(waiting: list, running: Counter | None = None) -> list[str]:
    return [e.name for e in in_turns(waiting, lambda e: e.client, running or Counter())]


def test_a_newcomers_event_goes_before_the_second_round_of_earlier_clients():
    waiting = events("a", "a", "a", "b", "b", "b", "c")
    assert order(waiting) == ["a0", "b3", "c6", "a1", "b4", "a2", "b5"]


def test_running_events_count_as_earlier_rounds():
    waiting = events("a", "b")
    assert order(waiting, Counter({"a": 2})) == ["b1", "a0"]
    assert order(waiting, Counter({"a": 0, "b": 0})) == ["a0", "b1"]  # arrival order within a round


def test_one_clients_events_keep_their_order():
    waiting = events("a", "b", "a", "a", "b")
    names = order(waiting, Counter({"b": 5}))
    assert [n for n in names if n.startswith("a")] == ["a0", "a2", "a3"]
    assert [n for n in names if n.startswith("b")] == ["b1", "b4"]


def test_a_fresh_address_through_call_starts_next_among_two_flooding_addresses():
    """Through Gradio's /call API and the edge's queue hook: one slot, two addresses each with four events
    queued, then a third address; its event starts within the next two, not ninth."""
    started: list[str] = []
    release = threading.Semaphore(0)

    def hold(tag: str) -> str:
        started.append(tag)
        release.acquire(timeout=60)
        return tag

    with gr.Blocks() as demo:
        box = gr.Textbox()
        box.submit(hold, box, box, api_name="hold", concurrency_limit=1)
    demo.queue()
    EdgeGuard(EdgeConfig(client_events=8, sockets=None)).install(demo)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, ssr_mode=False)
    url = f"http://127.0.0.1:{port}/gradio_api/call/hold"
    clients = {address: httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)
               for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4")}
    listeners = []

    def join(address: str, tag: str) -> None:
        event_id = clients[address].post(url, json={"data": [tag]}).json()["event_id"]
        listener = threading.Thread(target=lambda: clients[address].get(f"{url}/{event_id}", timeout=120),
                                    daemon=True)
        listener.start()
        listeners.append(listener)

    try:
        join("127.0.0.2", "a0")
        wait_until(lambda: started == ["a0"], timeout=30)
        for i in range(1, 5):
            join("127.0.0.2", f"a{i}")
        for i in range(4):
            join("127.0.0.3", f"b{i}")
        join("127.0.0.4", "fresh")
        for n in range(2, 11):
            release.release()
            wait_until(lambda n=n: len(started) >= n, timeout=30)
        assert started.index("fresh") <= 2, started  # first come first served put it ninth
        assert started[1:3] == ["b0", "fresh"], started
    finally:
        for _ in range(12):
            release.release()
        for listener in listeners:
            listener.join(10)
        for client in clients.values():
            client.close()
        demo.close()
