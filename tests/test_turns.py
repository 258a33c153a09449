"""Issue 50, item 1: turns at an engine, not a global cap. Callers flooding within their bounds kept an engine
full ("has 16 requests waiting") and a fresh visitor got 59 of 60 tries refused; now a request past the
engine's places waits, and a new client gets the next place (engine/serving/turns.py)."""

from __future__ import annotations

import threading

import pytest
from helpers import engine_manager, wait_until

from engine.errors import Cancelled, EngineBusy
from engine.serving.turns import Turns, reserved

KEY = "engine"


class Flood:
    """Requests of several clients at one engine of `capacity` places; each holds its place until released.
    `placed` lists the clients in the order they got a place."""

    def __init__(self, turns: Turns, capacity: int):
        self.turns, self.capacity = turns, capacity
        self.placed: list[str] = []
        self.errors: dict[str, BaseException] = {}
        self.release: dict[str, threading.Event] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.finished: set[str] = set()
        self._lock = threading.Lock()

    def send(self, client: str, name: str, cost: int = 100) -> None:
        self.release[name] = threading.Event()

        def run() -> None:
            try:
                with self.turns.turn(KEY, client, cost, self.capacity, request_id=name):
                    with self._lock:
                        self.placed.append(name)
                    self.release[name].wait(30)
            except BaseException as exc:  # noqa: BLE001 - recorded for the test
                self.errors[name] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads[name] = thread

    def waiting(self) -> int:
        return self.turns.snapshot()["engines"].get(KEY, {}).get("waiting", 0)

    def finish(self, name: str) -> None:
        """Release `name`'s place and wait until the next request (if any may) has taken it."""
        self.release[name].set()
        self.threads[name].join(10)
        assert not self.threads[name].is_alive()
        self.finished.add(name)

        def settled() -> bool:
            line = self.turns.snapshot()["engines"].get(KEY, {"placed": 0, "waiting": 0})
            free = line["placed"] < self.capacity - reserved(self.capacity)
            return not (line["waiting"] and free) and len(self.placed) - len(self.finished) == line["placed"]

        wait_until(settled, timeout=10)  # the next ones placed, and each placed thread has said so


def test_a_fresh_client_is_placed_at_once_while_two_clients_keep_the_engine_full():
    """An engine of 3 places, one kept for requests not ahead of their share: two clients each sending 3 hold
    the other 2, their next 4 wait; a fresh client's request takes the kept place at once (so the worker runs it
    after the call under way), and the floods then alternate."""
    turns = Turns()
    flood = Flood(turns, capacity=3)
    for i in range(3):
        flood.send("10.0.0.1", f"a{i}")
        wait_until(lambda i=i: len(flood.placed) + flood.waiting() == 2 * i + 1, timeout=10)
        flood.send("10.0.0.2", f"b{i}")
        wait_until(lambda i=i: len(flood.placed) + flood.waiting() == 2 * i + 2, timeout=10)
    assert flood.placed == ["a0", "b0"] and flood.waiting() == 4
    flood.send("10.0.0.9", "fresh")
    wait_until(lambda: "fresh" in flood.placed, timeout=10)
    assert flood.placed == ["a0", "b0", "fresh"] and flood.waiting() == 4  # ahead of the four that waited
    for name in ("a0", "b0", "fresh", "a1", "b1"):
        flood.finish(name)
    # no client served twice before the other once (two placed by one release wake in either order)
    assert set(flood.placed[3:5]) == {"a1", "b1"} and set(flood.placed[5:]) == {"a2", "b2"}, flood.placed
    assert not flood.errors


def test_a_newcomer_goes_ahead_of_the_round_under_way_when_many_clients_each_keep_one_request():
    """Six clients each keeping one request at an engine of 3 places (one kept for fresh clients): in plain
    start-time fair queueing a newcomer's tag ties with the waiting requests of the round under way and it waited
    behind all of them (20 such flooders: 5 s against 0.4 s). A client with nothing served this round goes first."""
    turns = Turns()
    flood = Flood(turns, capacity=3)
    clients = [f"10.1.0.{i}" for i in range(6)]
    owner, sent = {}, 0
    for client in clients:
        owner[f"r{sent}"] = client
        flood.send(client, f"r{sent}")
        sent += 1
        wait_until(lambda sent=sent: len(flood.placed) + flood.waiting() == sent, timeout=10)
    for _ in range(12):  # rounds go by: each client sends its next request when its last one ends
        done = next(name for name in flood.placed if name not in flood.finished)
        flood.finish(done)
        owner[f"r{sent}"] = owner[done]
        flood.send(owner[done], f"r{sent}")
        sent += 1
        wait_until(lambda sent=sent: len(flood.placed) + flood.waiting() == sent, timeout=10)
    waiting, first_after = flood.waiting(), len(flood.placed)
    assert waiting >= 3  # the engine full, the rest of the round in line
    flood.send("10.2.0.1", "fresh")
    wait_until(lambda: "fresh" in flood.placed or flood.waiting() > waiting, timeout=10)
    if "fresh" not in flood.placed:  # all places held: it takes the first one freed, ahead of all that waited
        flood.finish(next(name for name in flood.placed if name not in flood.finished))
    assert flood.placed[first_after:] == ["fresh"], flood.placed[first_after:]
    assert not flood.errors


def test_costlier_requests_take_fewer_turns():
    """By cost, not by count: a client sending requests 4 times as costly gets a turn a quarter as often."""
    turns = Turns(waiting_per_place=8)
    flood = Flood(turns, capacity=1)
    flood.send("big", "big0", cost=400)
    wait_until(lambda: flood.placed == ["big0"], timeout=10)
    for i in range(1, 3):
        flood.send("big", f"big{i}", cost=400)
    for i in range(5):
        flood.send("small", f"small{i}", cost=100)
    wait_until(lambda: flood.waiting() == 7, timeout=10)
    for _ in range(7):
        flood.finish(flood.placed[-1])
    order = [name.rstrip("0123456789") for name in flood.placed]
    assert order[:6] == ["big", "small", "small", "small", "small", "big"], flood.placed


def test_a_full_waiting_line_sheds_the_heaviest_clients_newest_request_never_a_newcomers():
    turns = Turns(waiting_per_place=2)
    flood = Flood(turns, capacity=1)
    flood.send("hog", "hog0")
    wait_until(lambda: flood.placed == ["hog0"], timeout=10)
    for i in range(1, 3):
        flood.send("hog", f"hog{i}")
    wait_until(lambda: flood.waiting() == 2, timeout=10)
    flood.send("10.0.0.9", "fresh")  # the line holds 2: the hog's newest goes, the newcomer stays
    wait_until(lambda: "hog2" in flood.errors, timeout=10)
    error = flood.errors["hog2"]
    assert isinstance(error, EngineBusy) and "you have the most requests in it" in str(error)
    assert error.retry_after() >= 1
    flood.finish("hog0")
    assert flood.placed == ["hog0", "fresh"] and "fresh" not in flood.errors
    assert turns.snapshot()["shed"] == 1


def test_a_request_cancelled_while_it_waits_for_its_turn_stops_there():
    turns = Turns()
    flood = Flood(turns, capacity=1)
    flood.send("a", "first")
    wait_until(lambda: flood.placed == ["first"], timeout=10)
    flood.send("b", "second")
    wait_until(lambda: flood.waiting() == 1, timeout=10)
    assert turns.cancel("second") and not turns.cancel("nobody")
    wait_until(lambda: "second" in flood.errors, timeout=10)
    assert isinstance(flood.errors["second"], Cancelled)
    flood.release["first"].set()
    wait_until(lambda: turns.snapshot()["engines"] == {}, timeout=10)  # its place given back, nobody waits


@pytest.mark.slow
def test_a_fresh_visitor_is_served_while_two_visitors_flood_an_engine_within_their_bounds(cache_dir, tiny_models):
    """Through the manager, public mode: two visitors each keep requests at an engine of 2 places (within their
    cost bound); a third visitor's first request is served, not refused, and the engine's turns put it ahead
    of the floods' queued requests."""
    from engine.config.request import ImageRequest
    from engine.protocol import Mode, Precision
    from engine.serving.hosting import HostPolicy
    from engine.serving.manager import Caller

    policy = HostPolicy(public=True, presets=("tiny-shapes",), precisions=(Precision.FP32,), modes=(Mode.EAGER,))
    with engine_manager(cache_dir, options=dict(max_queue=2, max_batch=1), policy=policy) as manager:
        def request(client: str, steps: int, seed: int) -> ImageRequest:
            return ImageRequest(preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64",
                                steps=steps, seed=seed, prompt="a red circle", caller=Caller.VISITOR, client=client)

        manager.generate(request("warm", 1, 0))
        finished: list[str] = []
        refused: list[str] = []
        stop = threading.Event()

        def flood(client: str) -> None:
            seed = 0
            while not stop.is_set():
                seed += 1
                try:
                    manager.generate(request(client, 12, seed))
                    finished.append(client)
                except EngineBusy:
                    refused.append(client)

        floods = [threading.Thread(target=flood, args=(c,), daemon=True) for c in ("10.0.0.1", "10.0.0.1",
                                                                                   "10.0.0.2", "10.0.0.2")]
        for thread in floods:
            thread.start()
        wait_until(lambda: len(finished) >= 4, timeout=120)
        before = len(finished)
        manager.generate(request("10.0.0.9", 2, 7))  # served on its first try: no EngineBusy raised
        served_ahead = len(finished) - before
        stop.set()
        for thread in floods:
            thread.join(120)
    assert served_ahead <= 3, f"{served_ahead} flood requests finished while the fresh visitor waited"
    assert not refused, refused


@pytest.mark.slow
def test_a_run_stopped_before_it_is_sent_never_reaches_its_engine(cache_dir, tiny_models, monkeypatch):
    """A stop while the request's engine loads, or while it waits for its turn, stops it there: it used to be
    sent once its turn came and cancelled at once (its run knew its id only once sent)."""
    from engine.config.request import ImageRequest
    from engine.serving.stream import Run
    from engine.worker.client import ConnectionClient

    sent: list[str] = []
    submit = ConnectionClient.submit
    monkeypatch.setattr(ConnectionClient, "submit",
                        lambda self, request, on_progress=None: (sent.append(request.request_id),
                                                                 submit(self, request, on_progress))[1])

    def request(steps: int, size: str = "64x64") -> ImageRequest:
        return ImageRequest(preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size=size,
                            steps=steps, seed=1, prompt="a red circle on a blue background")

    def start(manager, spec, run, **hooks) -> dict:
        outcome: dict = {}

        def work() -> None:
            try:
                outcome["result"] = manager.generate(spec, on_admitted=run.admitted, **hooks)
            except BaseException as exc:  # noqa: BLE001 - read by the test
                outcome["error"] = exc

        outcome["thread"] = threading.Thread(target=work, daemon=True)
        outcome["thread"].start()
        return outcome

    with engine_manager(cache_dir, options=dict(max_queue=1, max_batch=1)) as manager:
        # 1. stopped while its engine is still loading
        loading = Run(manager.cancel)
        first = start(manager, request(2), loading)
        wait_until(lambda: loading.request_id is not None, timeout=30)
        loading.stop()
        first["thread"].join(120)
        assert isinstance(first.get("error"), Cancelled), first
        assert sent == []

        # 2. stopped while it waits for its turn behind a long request
        stepping = threading.Event()
        long_run = Run(manager.cancel)
        long = start(manager, request(100, "128x128"), long_run, on_progress=lambda p: stepping.set())
        wait_until(stepping.is_set, timeout=120)
        waiting = Run(manager.cancel)
        second = start(manager, request(2), waiting)
        wait_until(lambda: sum(line["waiting"] for line in manager.turns.snapshot()["engines"].values()) == 1,
                   timeout=30)
        waiting.stop()
        second["thread"].join(30)
        assert isinstance(second.get("error"), Cancelled), second
        assert sent == [long_run.request_id], sent  # only the long request reached the engine
        long_run.stop()
        long["thread"].join(60)
        assert isinstance(long.get("error"), Cancelled), long  # a sent request still stops between steps
