"""The bucket board: each bucket's state, thread-safe, every change pushed to a listener (the worker sends it
on); and the one line a failed compile shows on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from engine.errors import scrub_paths
from engine.protocol import BucketInfo, BucketKey, BucketState, EngineKey


def describe_failure(exc: BaseException, limit: int = 500) -> str:
    """One line for the board: the error and, if different, its root cause (dynamo wraps errors). Visitors
    read it: a compiler's failure is told by its first error line, never its command line, and every server
    path is replaced (the log keeps the whole error)."""

    def line(e: BaseException) -> str:
        if isinstance(getattr(e, "cmd", None), list | tuple) and isinstance(getattr(e, "output", None), str):
            errors = [ln.strip() for ln in e.output.splitlines() if "error" in ln.lower()]  # a C++ compile error
            return f"{type(e).__name__}: the C++ compiler failed" + (f": {errors[0]}" if errors else "")
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".strip()

    root = exc
    while (nxt := getattr(root, "inner_exception", None) or root.__cause__) is not None and nxt is not root:
        root = nxt
    text = line(exc) if root is exc else f"{line(exc)} (cause: {line(root)})"
    return scrub_paths(text)[:limit]


class BucketBoard:
    """Thread-safe bucket states; every change is pushed to `listener` (the worker sends it on)."""

    def __init__(self, key: EngineKey, listener: Callable[[BucketInfo], None] | None = None):
        self.key = key
        self.listener = listener
        self._lock = threading.Lock()
        self._infos: dict[BucketKey, BucketInfo] = {}
        self._warm_events: dict[BucketKey, threading.Event] = {}

    def add(self, bucket: BucketKey, state: BucketState = BucketState.COLD) -> None:
        with self._lock:
            if bucket in self._infos:
                return
        self.update(bucket, state=state)

    def get(self, bucket: BucketKey) -> BucketInfo | None:
        with self._lock:
            return self._infos.get(bucket)

    def is_warm(self, bucket: BucketKey) -> bool:
        info = self.get(bucket)
        return info is not None and info.state == BucketState.WARM

    def all(self) -> list[BucketInfo]:
        with self._lock:
            return sorted(self._infos.values(), key=lambda i: (i.bucket.mode, i.bucket.size, len(i.bucket.refs)))

    def event(self, bucket: BucketKey) -> threading.Event:
        with self._lock:
            return self._warm_events.setdefault(bucket, threading.Event())

    def update(self, bucket: BucketKey, **changes) -> BucketInfo:
        with self._lock:
            info = self._infos.get(bucket) or BucketInfo(self.key, bucket, BucketState.COLD)
            info = replace(info, updated_at=time.time(), **changes)
            self._infos[bucket] = info
            event = self._warm_events.setdefault(bucket, threading.Event())
            if info.state in (BucketState.WARM, BucketState.FAILED):
                event.set()
            else:
                event.clear()
        if self.listener:
            self.listener(info)
        return info

    def served(self, bucket: BucketKey, requests: int = 1) -> None:
        """One pipeline call at `bucket` served `requests` requests (more than one in a batch). An eager
        batch size seen first here needs nothing compiled: its row starts warm."""
        info = self.get(bucket)
        state = {} if info is not None or bucket.mode.compiled else {"state": BucketState.WARM}
        self.update(bucket, requests_served=(info.requests_served if info else 0) + requests,
                    batches_served=(info.batches_served if info else 0) + 1, **state)
