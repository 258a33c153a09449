"""Failed API-key checks, throttled per address with backoff.

A hostile run guessed /v1 keys at 118 a second from one address (1,295 × 401, then a 200) with nothing
logged or counted. Here each address may fail FREE_FAILURES times in a row; each failure past them shuts its
key checks for twice as long as the last (from FIRST_BACKOFF_S, at most MAX_BACKOFF_S), and a request from
a shut address is answered 429 with Retry-After without its key being compared, right or wrong, so guessing
costs time, not just requests. A success clears the address; FORGET_S without a failure forgets it. The
counts go to /metrics, the lines through the visitors' log budget (ui/quietlog.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

FREE_FAILURES = 5  # failures in a row an address may make at line rate (a mistyped key, a rotated one)
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 300.0
FORGET_S = 900.0  # an address with no failure for this long starts afresh
ADDRESSES_KEPT = 65_536  # addresses remembered (the least recently failed are forgotten first)


@dataclass
class _Record:
    failures: int = 0
    shut_until: float = 0.0
    last: float = 0.0


class KeyGuard:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._addresses: OrderedDict[str, _Record] = OrderedDict()
        self.counts: Counter[str] = Counter()  # "failed" (401s), "throttled" (429s)

    def shut_for(self, address: str) -> float:
        """Seconds until `address` may have a key checked again (0: now); counted as throttled when > 0."""
        now = self._clock()
        with self._lock:
            record = self._addresses.get(address)
            if record is None or record.shut_until <= now:
                return 0.0
            self.counts["throttled"] += 1
            return record.shut_until - now

    def failed(self, address: str) -> int:
        """Count a failed check; returns the address's failures in a row."""
        now = self._clock()
        with self._lock:
            record = self._addresses.pop(address, None) or _Record()
            if now - record.last > FORGET_S:
                record = _Record()
            record.failures += 1
            record.last = now
            past = record.failures - FREE_FAILURES
            if past > 0:
                record.shut_until = now + min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** min(past - 1, 30))
            self._addresses[address] = record
            while len(self._addresses) > ADDRESSES_KEPT:
                self._addresses.popitem(last=False)
            self.counts["failed"] += 1
            return record.failures

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._addresses.pop(address, None)


def retry_after(seconds: float) -> int:
    """Whole seconds for a Retry-After header (at least 1)."""
    return max(1, math.ceil(seconds))
