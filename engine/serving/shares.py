"""Engines and compiles shared fairly between visitors (public mode).

In public mode an engine a visitor used in the last `--public-evict-after` seconds is not evicted for another
visitor. Alone, that let one address keep every engine of a device "recently used" (three 1-step Generates
every 30 s held 4 of 4 cpu engines; another visitor got "No room on this server" for minutes), and a visitor's
`/warm` of one bucket at a time queued as many compiles as it asked for. Here: which client used which engine
lately, so that protection covers at most a share of a device's engines per client; which compiles each
client asked for, so one client has at most VISITOR_COMPILES queued or running; which engines visitors
started, so those unload when idle. Pure bookkeeping: the manager asks and acts.
"""

from __future__ import annotations

import threading
import time

from engine.errors import EngineBusy
from engine.protocol import BucketKey, BucketState, EngineKey

VISITOR_COMPILES = 1  # compiles one client may have queued or running at once (its /warm calls)
UNFINISHED = (BucketState.QUEUED, BucketState.COMPILING)
ASKED_S = 30.0  # a bucket still cold this long after its /warm: the worker has not queued it yet


def engine_share(max_engines: int | None) -> int:
    """The most engines of a device one client's recent use keeps from eviction: half of them, at least one."""
    return max(1, (max_engines or 2) // 2)


class VisitorShares:
    def __init__(self, window_s: float):
        self.window_s = window_s  # how long a use protects an engine (HostPolicy.evict_idle_after_s)
        self._uses: dict[EngineKey, dict[str, float]] = {}  # engine -> client -> when it last used it
        self._warms: dict[str, list[tuple]] = {}  # client -> (engine, bucket, when) it asked for
        self.visitor_started: set[EngineKey] = set()
        self._lock = threading.Lock()

    def used(self, key: EngineKey, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            uses = self._uses.setdefault(key, {})
            uses[client] = now
            for other, at in list(uses.items()):  # a bounded record: only uses that still protect
                if now - at > self.window_s:
                    del uses[other]

    def overheld(self, keys: list[EngineKey], max_engines: int | None, now: float | None = None) -> set[EngineKey]:
        """Of `keys` (one device's engines), those whose recent use does not protect them: each client whose
        recent use alone protects more than its share loses that protection on the least recently used ones."""
        now = time.monotonic() if now is None else now
        share = engine_share(max_engines)
        held: dict[str, list[tuple[float, EngineKey]]] = {}
        with self._lock:
            for key in keys:
                recent = {c: at for c, at in self._uses.get(key, {}).items() if now - at <= self.window_s}
                if len(recent) == 1:  # an engine several clients use is everyone's
                    ((client, at),) = recent.items()
                    held.setdefault(client, []).append((at, key))
        over: set[EngineKey] = set()
        for engines in held.values():
            engines.sort(key=lambda pair: pair[0])
            over.update(key for _, key in engines[:max(0, len(engines) - share)])
        return over

    def check_warm(self, client: str, engine, bucket: BucketKey) -> None:
        """EngineBusy when `client` already has VISITOR_COMPILES compiles queued or running; else remember this one."""
        with self._lock:
            mine = [w for w in self._warms.get(client, []) if _unfinished(*w)]
            if len(mine) >= VISITOR_COMPILES:
                asked = ", ".join(f"{e.key} {b}" for e, b, _ in mine)
                raise EngineBusy(f"your compile of {asked} is still queued or running (at most {VISITOR_COMPILES} per "
                                 "visitor at once): poll status until it is warm, then warm the next bucket")
            self._warms[client] = [*mine, (engine, bucket, time.monotonic())]
            if len(self._warms) > 4096:  # clients whose compiles ended are forgotten first
                for other in [c for c, warms in self._warms.items() if not any(_unfinished(*w) for w in warms)]:
                    del self._warms[other]


def _unfinished(engine, bucket: BucketKey, asked_at: float) -> bool:
    """The bucket's compile has not ended on that engine: queued, compiling, or asked for just now."""
    if not engine.alive:
        return False
    info = next((b for b in engine.buckets() if b.bucket == bucket), None)
    if info is not None and info.state in UNFINISHED:
        return True
    return (info is None or info.state is BucketState.COLD) and time.monotonic() - asked_at < ASKED_S
