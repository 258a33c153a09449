"""Turns at an engine: requests past what it may hold wait here, and clients take turns by cost.

An engine holds at most `capacity` requests sent to its worker (its max_queue). A request beyond that used
to be refused ("engine ... has 16 requests waiting"), so a few clients each within their bounds kept it
full and refused everyone else. Here it waits instead, and the next place goes to the client whose
turn is due: start-time fair queueing by cost (each client's requests are tagged with the token-steps
served to it before them; the smallest tag goes first, a client that has not asked lately starts at the
engine's current tag, ahead of the round under way), the cost-weighted form of round-robin the cost budgets
price (engine/serving/cost.py). A new client's request therefore takes the next free place, and an eighth of
the places are kept for such requests: clients ahead of their share leave them free, so a newcomer is sent to the
worker at once and runs after the call under way (the worker takes turns between clients too).

The waiting list is bounded too; when it is full the request refused is the newest of the client with the
most waiting, never a newcomer's because of others. A refusal says when to retry (EngineBusy.retry_after_s,
from the recent time a place was held). Pure bookkeeping on one condition: no engine, no process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import Cancelled, EngineBusy

WAITING_PER_PLACE = 4  # requests that may wait per place at the engine
HELD_S_WEIGHT = 0.2  # how much the newest held time moves the running estimate


@dataclass
class _Waiter:
    client: str
    start: float  # its virtual start tag: cost served to the client before it
    seq: int
    request_id: str | None
    fresh: bool = False  # its client had nothing served this round (new, or its last request behind `now`)
    state: str = "waiting"  # waiting -> placed | shed | cancelled
    since: float = field(default_factory=time.monotonic)


def reserved(capacity: int) -> int:
    """Places kept for requests not ahead of their share: an eighth, at least one (none at a 1-place engine)."""
    return max(1, capacity // 8) if capacity > 1 else 0


class _Line:
    """One engine's places and waiting list (under Turns' condition)."""

    def __init__(self):
        self.placed = 0
        self.waiting: list[_Waiter] = []
        self.now = 0.0  # the virtual time: the start tag of the last request placed
        self.finish: dict[str, float] = {}  # client -> the end tag of its last request
        self.held_s = 0.0  # running estimate of how long a request holds its place

    def tag(self, client: str, cost: int) -> tuple[float, bool]:
        """(start tag, fresh): a fresh client's last request ended before the virtual time (or it has none)."""
        last = self.finish.get(client)
        fresh = last is None or last < self.now
        start = self.now if fresh else last
        self.finish[client] = start + max(1, cost)
        if len(self.finish) > 4096:  # forget clients whose tags no longer matter (they start at `now`)
            self.finish = {c: f for c, f in self.finish.items() if f > self.now}
        return start, fresh

    @staticmethod
    def order(waiter: _Waiter) -> tuple:
        """Smallest tag first; at a tie a fresh client's request first: plain start-time fair queueing would put a
        newcomer behind every request of the round under way (20 flooders: a 5 s wait)."""
        return waiter.start, not waiter.fresh, waiter.seq

    def grant(self, capacity: int) -> bool:
        """Place waiting requests in `order`. The last `reserved(capacity)` places only take a fresh client's
        request (a newcomer, or one owed its share): so callers keeping the engine full leave a place for the next
        caller, who then runs right after the call under way."""
        granted = False
        while self.waiting:
            first = min(self.waiting, key=self.order)
            limit = capacity if first.fresh else capacity - reserved(capacity)
            if self.placed >= limit:
                break
            self.waiting.remove(first)
            first.state = "placed"
            self.placed += 1
            self.now = max(self.now, first.start)
            granted = True
        return granted

    def shed(self) -> _Waiter:
        """The newest waiting request of the client with the most waiting."""
        counts = Counter(w.client for w in self.waiting)
        heaviest = max(counts.values())
        return max((w for w in self.waiting if counts[w.client] == heaviest), key=self.order)


class Turns:
    """Every engine's line, keyed by whatever names an engine (its EngineKey)."""

    def __init__(self, waiting_per_place: int = WAITING_PER_PLACE):
        self.waiting_per_place = waiting_per_place
        self._cond = threading.Condition()
        self._lines: dict[object, _Line] = {}
        self._seq = itertools.count()
        self._by_id: dict[str, tuple[_Line, _Waiter]] = {}
        self.shed_count = 0

    @contextlib.contextmanager
    def turn(self, key, client: str, cost: int, capacity: int, request_id: str | None = None,
             timeout: float | None = None):
        """Hold one of engine `key`'s `capacity` places while the block runs: at once when one is free and
        nobody waits, else when this request's turn comes. EngineBusy (with when to retry) when it is shed
        from a full waiting list or waits past `timeout`; Cancelled when cancel(request_id) stops it."""
        with self._cond:
            line = self._lines.setdefault(key, _Line())
            start, fresh = line.tag(client, cost)
            waiter = _Waiter(client, start, next(self._seq), request_id, fresh)
            line.waiting.append(waiter)
            self._limit(line, capacity)
            if line.grant(capacity):
                self._cond.notify_all()
            if request_id is not None:
                self._by_id[request_id] = (line, waiter)
            try:
                self._await(line, waiter, capacity, timeout)
            finally:
                if request_id is not None:
                    self._by_id.pop(request_id, None)
        placed_at = time.monotonic()
        try:
            yield waiter
        finally:
            with self._cond:
                line.placed -= 1
                held = time.monotonic() - placed_at
                line.held_s = held if not line.held_s else (1 - HELD_S_WEIGHT) * line.held_s + HELD_S_WEIGHT * held
                line.grant(capacity)
                self._cond.notify_all()

    def _limit(self, line: _Line, capacity: int) -> None:
        """Under the condition: shed past the waiting list's bound (the heaviest client's newest)."""
        while len(line.waiting) > max(1, capacity * self.waiting_per_place):
            shed = line.shed()
            line.waiting.remove(shed)
            shed.state = "shed"
            self.shed_count += 1
            self._cond.notify_all()

    def _await(self, line: _Line, waiter: _Waiter, capacity: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiter.state == "waiting":
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                line.waiting.remove(waiter)
                raise EngineBusy(f"no turn at this engine within {timeout:.0f}s; retry later",
                                 retry_after_s=self._retry_after(line, capacity))
            self._cond.wait(left)
        if waiter.state == "shed":
            raise EngineBusy(f"this engine's waiting line is full and you have the most requests in it "
                             f"({capacity} run or wait at the engine, {len(line.waiting)} more in line); "
                             "retry when one of yours has finished", retry_after_s=self._retry_after(line, capacity))
        if waiter.state == "cancelled":
            raise Cancelled("cancelled while waiting for its turn at the engine")

    @staticmethod
    def _retry_after(line: _Line, capacity: int) -> float:
        """When a place is likely free for a retry: the places ahead, at the recent time one is held."""
        return max(1.0, (line.held_s or 5.0) * max(1, len(line.waiting)) / max(1, capacity))

    def cancel(self, request_id: str) -> bool:
        """Stop a request still waiting for its turn (it raises Cancelled); False if none waits under that id."""
        with self._cond:
            found = self._by_id.get(request_id)
            if found is None or found[1].state != "waiting":
                return False
            line, waiter = found
            line.waiting.remove(waiter)
            waiter.state = "cancelled"
            self._cond.notify_all()
            return True

    def snapshot(self) -> dict:
        """Per engine: places held and requests waiting; and how many were shed."""
        with self._cond:
            return {"engines": {str(k): {"placed": line.placed, "waiting": len(line.waiting)}
                                for k, line in self._lines.items() if line.placed or line.waiting},
                    "shed": self.shed_count}



class InFlight:
    """Where each admitted request is until it answers, so that a cancel finds it: waiting for its turn (Turns),
    admitted but not sent yet (marked: it stops before it is sent, instead of being sent and cancelled at
    once), or sent (its engine stops it between steps)."""

    def __init__(self, turns: Turns):
        self.turns = turns
        self.sent: dict[str, object] = {}  # request id -> the engine it was sent to
        self._marks: dict[str, threading.Event] = {}  # request id -> set once cancelled before it was sent
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def admitted(self, request_id: str, on_admitted: Callable[[str], None] | None = None):
        """The request is in flight while the block runs; `on_admitted` hears its id first."""
        with self._lock:
            self._marks.setdefault(request_id, threading.Event())
        try:
            if on_admitted:
                on_admitted(request_id)
            yield
        finally:
            with self._lock:
                self._marks.pop(request_id, None)

    def check(self, request_id: str) -> None:
        """Cancelled if the request was stopped before it was sent."""
        with self._lock:
            marked = self._marks.get(request_id)
        if marked is not None and marked.is_set():
            raise Cancelled("cancelled before it was sent to its engine")

    def cancel(self, request_id: str) -> bool:
        """Stop the request wherever it is; False if none is in flight under that id."""
        if self.turns.cancel(request_id):
            return True
        with self._lock:
            marked = self._marks.get(request_id)
        if marked is not None:
            marked.set()
        # Read after marking: a request is put in `sent` before its mark is checked, so one of the two sees it.
        engine = self.sent.get(request_id)
        if engine is not None:
            engine.cancel(request_id)
        return marked is not None or engine is not None
