"""Which rank is gone, and on which node: heartbeats through torchrun's rendezvous store.

Why: a collective that fails says little ("Connection closed by peer", or nothing at all until the
collective timeout when a machine vanished without closing its sockets), and across nodes rank 0 cannot
look at another node's process ids. So every rank bumps its own counter in the TCPStore that node 0's
torchrun hosts (MASTER_ADDR:MASTER_PORT, which every rank already reaches) every BEAT_S seconds:

- rank 0, when a collective failed, samples the counters for a moment and names the ranks whose counter
  stopped ("rank 1 (node 1, host gpu-b, pid 4242)"), so the failed request says which node to look at;
- rank 0 also watches the counters while it serves: a rank silent for `--node-timeout` seconds is declared
  gone even when no collective has failed yet (a powered-off machine), instead of waiting out the
  collective timeout;
- a follower that cannot reach the store for `--node-timeout` seconds knows node 0 is gone (it hosts the
  store) and exits, instead of waiting a day for rank 0's next operation.

The store client is torch.distributed.TCPStore (public API), with wait_for_workers=False so it does not
count as a rendezvous participant; the keys live under their own prefix.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence

from engine import settings

log = logging.getLogger(__name__)

BEAT_S = 0.5
NODE_TIMEOUT_S = 30.0
STORE_OP_TIMEOUT_S = 5.0
PREFIX = "showcase-tp/beat"


def connect_store(timeout_s: float = STORE_OP_TIMEOUT_S):
    """A client of the store that node 0's torchrun hosts (this process's own connection: one per thread)."""
    import torch.distributed as dist

    addr, port = settings.torchrun_master()
    store = dist.TCPStore(addr, int(port), is_master=False,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(PREFIX, store)


def describe_rank(ranks: Sequence[dict], rank: int) -> str:
    """'rank 1 (node 1, host gpu-b, pid 4242)' from the ranks gathered at load."""
    info = next((r for r in ranks if r.get("rank") == rank), None)
    if not info:
        return f"rank {rank}"
    node = info.get("node")
    where = [f"node {node}" if node is not None else None, f"host {info.get('host')}", f"pid {info.get('pid')}"]
    return f"rank {rank} ({', '.join(w for w in where if w)})"


class Liveness:
    """Heartbeats of one rank, and (rank 0) the view of everybody's."""

    def __init__(self, rank: int, world: int, node_timeout_s: float = NODE_TIMEOUT_S,
                 store_factory: Callable = connect_store, beat_s: float = BEAT_S):
        self.rank = rank
        self.world = world
        self.node_timeout_s = node_timeout_s
        self.beat_s = beat_s
        self._factory = store_factory
        self._stop = threading.Event()
        self._reader = None
        self._reader_lock = threading.Lock()

    # -- every rank ------------------------------------------------------------------------------
    def start(self, on_store_lost: Callable[[float], None] | None = None) -> Liveness:
        """Beat until stopped. `on_store_lost(seconds)` runs once the store was unreachable that long
        (followers: node 0 is gone)."""
        threading.Thread(target=self._beat, args=(on_store_lost,), name="tp-heartbeat-store", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()  # kept: the thread's own stop event, not a part; callers need no Event of ours

    def _beat(self, on_store_lost) -> None:
        store, last_ok = None, time.monotonic()
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._factory()
                store.add(str(self.rank), 1)
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any store failure counts as "unreachable"
                store = None
                lost = time.monotonic() - last_ok
                log.warning("rank %d: rendezvous store unreachable for %.1f s (%s)", self.rank, lost, exc)
                if on_store_lost is not None and lost >= self.node_timeout_s:
                    on_store_lost(lost)
                    return
            self._stop.wait(self.beat_s)

    # -- rank 0 ----------------------------------------------------------------------------------
    def counters(self) -> list[int | None]:
        """Every rank's beat count now (None: the store did not answer)."""
        with self._reader_lock:
            try:
                if self._reader is None:
                    self._reader = self._factory()
                return [int(self._reader.add(str(r), 0)) for r in range(self.world)]
            except Exception as exc:  # noqa: BLE001
                self._reader = None
                log.warning("cannot read heartbeats: %s", exc)
                return [None] * self.world

    def silent_ranks(self, window_s: float | None = None, max_wait_s: float = 4.0) -> list[int]:
        """Ranks whose counter did not move for `window_s` (default: four beats), sampled for at most
        `max_wait_s`; [] when every rank kept beating (or the store cannot tell)."""
        window_s = window_s if window_s is not None else 4 * self.beat_s
        first = self.counters()
        started = time.monotonic()
        last_change = {r: started for r in range(self.world)}
        seen = list(first)
        while time.monotonic() - started < max_wait_s:
            time.sleep(self.beat_s / 2)
            now = self.counters()
            t = time.monotonic()
            for r, (a, b) in enumerate(zip(seen, now, strict=True)):
                if a is None or b is None or a != b:
                    last_change[r] = t
            seen = now
            if t - started >= window_s:
                silent = [r for r in range(self.world) if r != self.rank and t - last_change[r] >= window_s]
                if silent or t - started >= window_s * 2:
                    return silent
        return []

    def watch(self, on_silent: Callable[[list[int], float], None], interval_s: float = 1.0) -> None:
        """Rank 0: call `on_silent(ranks, seconds)` once when some rank stopped beating for node_timeout_s."""

        def run() -> None:
            seen = self.counters()
            changed = [time.monotonic()] * self.world
            while not self._stop.wait(interval_s):
                now, t = self.counters(), time.monotonic()
                if all(c is None for c in now):
                    continue  # the store itself did not answer: no verdict about the ranks
                for r, (a, b) in enumerate(zip(seen, now, strict=True)):
                    if b is not None and a != b:
                        changed[r] = t
                seen = [b if b is not None else a for a, b in zip(seen, now, strict=True)]
                silent = [r for r in range(self.world) if r != self.rank and t - changed[r] >= self.node_timeout_s]
                if silent:
                    on_silent(silent, max(t - changed[r] for r in silent))
                    return

        threading.Thread(target=run, name="tp-heartbeat-watch", daemon=True).start()
