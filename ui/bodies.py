"""Request bodies at the web edge: how fast they must arrive, and how much of them the server holds at once.

uvicorn bounds a request's head (ui/sockets.py adds a deadline) but not its body: its keep-alive timeout runs
only between requests, so a client that announces a Content-Length and sends one byte holds its connection,
and the handler waiting for the rest, for as long as it likes; and a body a handler reads into memory (a
multipart form on /v1) holds its bytes until the request ends. The edge middleware (ui/edge.py) reads every
body through a `BodyReader`:

- a deadline: past a grace, the body must arrive at `min_rate` bytes/s on average since the request's head was
  read (Kestrel's MinRequestBodyDataRate, Apache's mod_reqtimeout MinRate), and whole within `timeout_s`;
  a body that falls behind is answered 408 and its connection closed;
- a ledger of the body bytes that requests under way have announced (or, chunked, read), per client (public
  mode) and in total: past
  either, the request is answered 429 (the client's share) or 503 (everyone's) and its connection closed;
  the bytes count until the request ends, which it does as soon as its client goes.

At the socket (ui/sockets.py) a connection still waiting for its body may be closed at the connection cap, as
one still sending its head may.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import Counter
from dataclasses import dataclass

MIN_RATE = 240  # bytes/s on average past the grace, as Kestrel's default
GRACE_S = 10.0  # before the rate applies: a client's first bytes may wait on its own slow start
TIMEOUT_S = 300.0  # a whole body: a 65 MiB /v1 edit on a ~2 Mbit/s uplink
# Bytes of bodies read by requests under way: one client (public mode) may hold the largest body a route takes
# (ui/edge.py UPLOAD_ROUTES) and some; all together a few of those, whatever the connection count.
PER_CLIENT_BYTES = 80 * 2**20
TOTAL_BYTES = 512 * 2**20

# Bodies given back leave their pages in the C heap's free lists: past this much the heap is trimmed (a few ms)
# so the process's memory goes back down once the bodies are gone.
TRIM_AFTER_BYTES = 16 * 2**20

# refusal reason -> status
STATUSES = {"body timeout": 408, "body memory per client": 429, "body memory": 503}


@dataclass(frozen=True)
class BodyBounds:
    min_rate: float = MIN_RATE  # 0: no rate
    grace_s: float = GRACE_S
    timeout_s: float | None = TIMEOUT_S  # None: no total time
    per_client_bytes: int | None = None  # None: no per-client share (a developer's machine; see public_body_bounds)
    total_bytes: int | None = TOTAL_BYTES

    def seconds_left(self, started: float, read: int, now: float) -> float:
        """How long a body begun at `started` with `read` bytes so far may wait for its next bytes."""
        due = float("inf")
        if self.min_rate:
            due = started + max(self.grace_s, read / self.min_rate)
        if self.timeout_s:
            due = min(due, started + self.timeout_s)
        return due - now

    @property
    def timed(self) -> bool:
        return bool(self.min_rate or self.timeout_s)

    def late_message(self) -> str:
        parts = []
        if self.min_rate:
            parts.append(f"at least {self.min_rate:g} bytes/s after the first {self.grace_s:g} s")
        if self.timeout_s:
            parts.append(f"whole within {self.timeout_s:g} s")
        return f"The request's body did not arrive in time ({' and '.join(parts)}); send it again"


def public_body_bounds(min_rate: float = MIN_RATE, timeout_s: float | None = TIMEOUT_S) -> BodyBounds:
    return BodyBounds(min_rate=min_rate, timeout_s=timeout_s, per_client_bytes=PER_CLIENT_BYTES)


def _trim_heap() -> None:
    """Free the buffers handlers left in reference cycles (a cut-off handler's exception holds its frames), then
    return the C heap's free pages to the system (glibc's malloc_trim; elsewhere nothing)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class BodyLedger:
    """The body bytes read by requests under way, per client and in total. Taken on the event loop as bytes
    arrive; the lock only makes /system's snapshot (another thread) consistent."""

    def __init__(self, bounds: BodyBounds):
        self.bounds = bounds
        self._lock = threading.Lock()
        self.held: Counter[str] = Counter()
        self.total = 0
        self.peak = 0
        self._freed = 0  # bytes given back since the heap was last trimmed

    def take(self, client: str, n: int) -> tuple[str, str] | None:
        """Count `n` more bytes for `client` (always: `give` returns them), or (reason, message) when that
        passes a bound."""
        b = self.bounds
        with self._lock:
            self.held[client] += n
            self.total += n
            self.peak = max(self.peak, self.total)
            mine, total = self.held[client], self.total
        if b.per_client_bytes and mine > b.per_client_bytes:
            return "body memory per client", (f"Request bodies under way from your address hold over "
                                              f"{_mib(b.per_client_bytes)}, this server's share per visitor; wait "
                                              "for them to finish and retry")
        if b.total_bytes and total > b.total_bytes:
            return "body memory", "This server holds as many request bodies as it takes; retry in a few seconds"
        return None

    def give(self, client: str, n: int, read: int = 0) -> None:
        """Give back `n` bytes taken for `client`, of which `read` were read (what the heap may hand back)."""
        if not n:
            return
        with self._lock:
            self.total -= n
            self.held[client] -= n
            if self.held[client] <= 0:
                del self.held[client]
            self._freed += read

    def settle(self) -> None:
        """A request ended (its handler's buffers freed): trim the heap when enough bodies have gone since."""
        with self._lock:
            due = self._freed >= TRIM_AFTER_BYTES
            if due:
                self._freed = 0
        if due:
            _trim_heap()

    def snapshot(self) -> dict:
        b = self.bounds
        with self._lock:
            return {"min_rate": b.min_rate, "grace_s": b.grace_s, "timeout_s": b.timeout_s,
                    "per_client_bytes": b.per_client_bytes, "total_bytes": b.total_bytes, "held_bytes": self.total,
                    "held_peak_bytes": self.peak, "clients": len(self.held)}


class BodyReader:
    """One request's receive as its handler reads it: bytes counted against `limit` and the ledger, each wait for
    more of the body bounded by the deadline. Past a bound the handler sees its client go (http.disconnect) and
    `refusal` says why: (reason, status, message) for the edge to answer."""

    def __init__(self, receive, limit: int, limit_message: str, bounds: BodyBounds | None = None,
                 ledger: BodyLedger | None = None, client: str = "", announced: int = 0):
        self._receive, self.limit, self._limit_message = receive, limit, limit_message
        self.announced = announced  # the Content-Length, 0 when none (chunked)
        self.bounds, self.ledger, self.client = bounds, ledger, client
        self.waiting = bounds is not None and bounds.timed  # a body is announced and has not all arrived
        self.started_at = time.monotonic()
        self.read = 0
        self.held = 0
        self.refusal: tuple[str, int, str] | None = None

    async def receive(self):
        if self.refusal is not None:
            return {"type": "http.disconnect"}
        if self.waiting:
            left = self.bounds.seconds_left(self.started_at, self.read, time.monotonic())
            try:
                message = await asyncio.wait_for(self._receive(), max(left, 0.0))
            except TimeoutError:
                return self._cut("body timeout", 408, self.bounds.late_message())
        else:
            message = await self._receive()
        if message["type"] != "http.request":
            self.waiting = False
            return message
        size = len(message.get("body", b""))
        self.read += size
        if not message.get("more_body"):
            self.waiting = False
        if self.read > self.limit:
            return self._cut("body size", 413, self._limit_message)
        if self.ledger is not None and size and self.read > self.held:
            # An announced length is taken whole with the first bytes: a body the share cannot hold is refused
            # before it is read, not once it has been (and then freed); a chunked body is taken as it arrives.
            take = max(self.read, min(self.announced, self.limit)) - self.held
            self.held += take
            refusal = self.ledger.take(self.client, take)
            if refusal is not None:
                reason, text = refusal
                return self._cut(reason, STATUSES[reason], text)
        return message

    def _cut(self, reason: str, status: int, message: str):
        self.refusal = (reason, status, message)
        self.waiting = False
        self.release()
        return {"type": "http.disconnect"}

    def release(self) -> None:
        """Give the bytes held back to the ledger (the request ended, or was cut off)."""
        if self.ledger is not None:
            self.ledger.give(self.client, self.held, min(self.read, self.held))
        self.held = 0
