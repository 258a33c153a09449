"""One compile scheduler per host: at most `jobs` bucket compiles at a time, across every engine.

Why: each engine compiles in its own worker process, and on a small machine a handful of engines
compiling at once starve the requests everyone is waiting for (docs/hosting.md). Workers ask before compiling (`CompileWanted`) and start only when
granted (`CompileGranted`); the scheduler picks by demand:

1. a bucket a request is waiting for (on_cold=wait),
2. then the bucket requested most often,
3. then the start-up warm list of the default engine (in its configured order),
4. then first come, first served.

A bucket a request waits for never waits for a slot held by background compiles (warm-up, requested but
not waited for): it starts at once beside them, up to `jobs` such compiles at a time. (Within one engine,
which compiles one bucket at a time, the worker sets its background compile aside: engine/worker/loop.py.)

An evicted or crashed engine's wanted compiles are dropped (`drop_engine`). The scheduler knows
engines only by an opaque handle with a `grant_compile(bucket)` method, so it is tested without
processes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from engine.protocol import BucketKey

log = logging.getLogger(__name__)


@dataclass
class _Wanted:
    engine: object
    bucket: BucketKey
    waiting: int  # requests blocked on this bucket's compile
    hits: int  # requests that asked for this bucket so far
    startup_rank: int | None  # position in the default engine's start-up warm list, else None
    order: int  # arrival, for first come first served
    since: float = field(default_factory=time.monotonic)

    def priority(self) -> tuple:
        startup = self.startup_rank is not None
        return (
            0 if self.waiting else 1,
            -self.hits,
            0 if startup else 1,
            self.startup_rank if startup else 0,
            self.order,
        )


class CompileScheduler:
    def __init__(self, jobs: int = 1):
        if jobs < 1:
            raise ValueError("compile jobs must be at least 1")
        self.jobs = jobs
        self._lock = threading.Lock()
        self._wanted: dict[tuple[int, BucketKey], _Wanted] = {}
        self._running: dict[tuple[int, BucketKey], tuple[object, float, int]] = {}  # engine, since, waiting
        self._order = itertools.count()
        self.granted_total = 0
        self.finished_total = 0

    def want(self, engine, bucket: BucketKey, *, waiting: int = 0, hits: int = 0,
             startup_rank: int | None = None) -> None:
        """An engine wants to compile `bucket` (again: its priority is updated)."""
        key = (id(engine), bucket)
        with self._lock:
            if key in self._running:
                return
            entry = self._wanted.get(key)
            if entry is None:
                self._wanted[key] = _Wanted(engine, bucket, waiting, hits, startup_rank, next(self._order))
            else:
                entry.waiting, entry.hits = waiting, max(hits, entry.hits)
                if startup_rank is not None:
                    entry.startup_rank = startup_rank
        self._grant()

    def finished(self, engine, bucket: BucketKey) -> None:
        """The engine is done with `bucket` (warm, failed, or it gave up)."""
        with self._lock:
            if self._running.pop((id(engine), bucket), None) is not None:
                self.finished_total += 1
            self._wanted.pop((id(engine), bucket), None)
        self._grant()

    def drop_engine(self, engine) -> int:
        """Forget an engine (evicted, crashed, closed): its queued compiles are dropped, its slot freed."""
        with self._lock:
            dropped = [k for k in self._wanted if k[0] == id(engine)]
            for k in dropped:
                del self._wanted[k]
            freed = [k for k in self._running if k[0] == id(engine)]
            for k in freed:
                del self._running[k]
        self._grant()
        return len(dropped)

    def _grant(self) -> None:
        grants = []
        with self._lock:
            while self._wanted:
                key, entry = min(self._wanted.items(), key=lambda kv: kv[1].priority())
                waited = sum(1 for _, _, waiting in self._running.values() if waiting)
                if len(self._running) >= self.jobs and not (entry.waiting and waited < self.jobs):
                    break
                del self._wanted[key]
                self._running[key] = (entry.engine, time.monotonic(), entry.waiting)
                self.granted_total += 1
                grants.append(entry)
        for entry in grants:
            try:
                entry.engine.grant_compile(entry.bucket)
            except Exception as exc:  # an engine that went away: free its slot
                log.warning("could not grant %s to %s: %s", entry.bucket, entry.engine, exc)
                self.finished(entry.engine, entry.bucket)

    def snapshot(self) -> dict:
        """For /status and the soak: what runs, what waits, in grant order."""
        with self._lock:
            running = [{"engine": str(getattr(e, "key", e)), "bucket": str(k[1]), "waiting": w,
                        "running_s": round(time.monotonic() - t, 1)} for k, (e, t, w) in self._running.items()]
            queued = sorted(self._wanted.values(), key=lambda w: w.priority())
            return {
                "jobs": self.jobs,
                "running": running,
                "queued": [{"engine": str(getattr(w.engine, "key", w.engine)), "bucket": str(w.bucket),
                            "waiting": w.waiting, "hits": w.hits} for w in queued],
                "granted": self.granted_total,
                "finished": self.finished_total,
            }
