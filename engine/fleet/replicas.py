"""ReplicaSet: N copies of one engine on different nodes, behind the one EngineClient the manager holds.

Why Ray Core actors with this router rather than Ray Serve: the engines already speak the worker protocol
(per-step progress, cancel, bucket states, compile grants from the host's scheduler), which a Serve
deployment's request/response handles would have to re-carry; Serve would also start its own HTTP proxy and
controller actors, and route by queue length it cannot see inside our worker loop. Ray still places the
copies (the SPREAD strategy), watches their nodes and reports a lost one; the router picks among them.

Routing: a request goes to the answering, ready replica with the fewest requests in flight (ties: the one
used longest ago). A replica whose actor stops answering pings (a stopped or frozen process) gets none
until it answers again. A bucket warm on one replica is warmed on the others in the background. A lost
replica's requests fail naming its node; the set asks Ray for a new copy (bounded), and serves meanwhile
with the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import ray

from engine.errors import EngineCrashed, ShowcaseError
from engine.fleet.client import RayClient
from engine.fleet.config import ANYWHERE, FleetConfig, Placement
from engine.protocol import BucketInfo, BucketKey, GenerateRequest
from engine.worker.client import EngineEvents

log = logging.getLogger(__name__)
SERVED_BY_KEPT = 1024  # requests whose replica's node is remembered for their result

PING_EVERY_S = 0.5
PING_TIMEOUT_S = 1.5  # a replica silent this long is stalled: no new requests until it answers
MAX_REPLACEMENTS = 8  # lost replicas replaced over the set's life; past it the set serves with the rest


class _Relay(EngineEvents):
    """What the replicas tell, each wired straight to where it is handled (no hop between): readiness, loss
    and footprint to the set's handlers; compile wishes and ends to whoever serves the set, naming the
    replica (its scheduler grants the replica that asks, not the set)."""

    def __init__(self, ready: Callable, down: Callable, footprint: Callable, events: EngineEvents):
        self.engine_ready, self.engine_down, self.footprint_changed = ready, down, footprint
        self.serve(events)

    def serve(self, events: EngineEvents) -> None:
        """Hand the replicas' compile wishes and ends to `events` from now on."""
        self.compile_wanted, self.compile_finished = events.compile_wanted, events.compile_finished


class ReplicaSet:
    """Copies of one engine on several nodes; least-loaded routing among those that answer."""

    kind = "ray-replicas"
    evictable = True

    def __init__(self, config, env: dict[str, str], fleet: FleetConfig, placement: Placement = ANYWHERE,
                 events: EngineEvents | None = None):
        self.config, self.env, self.fleet, self.placement = config, env, fleet, placement
        self._key = config.key
        self.events = events or EngineEvents()
        self._relay = _Relay(self.replica_ready, self.replica_down, self._replica_footprint, self.events)
        self.replicas: list[RayClient] = []
        self.ready = threading.Event()
        self.error: ShowcaseError | None = None
        self.last_used = time.monotonic()
        self._lock = threading.Lock()
        self._routes: dict[str, RayClient] = {}  # request id -> the replica serving it
        self._served_by: OrderedDict[str, str] = OrderedDict()  # request id -> its replica's node (the last 1,024)
        self._stalled: set[int] = set()  # ids of replicas that did not answer the last ping
        self._used: dict[int, float] = {}  # id(replica) -> when it was last given a request
        self._closed = False
        self.replacements = 0

    @property
    def key(self):
        return self._key

    @property
    def info(self):
        return next((r.info for r in self.replicas if r.info is not None), None)

    @property
    def footprint(self):
        return next((r.footprint for r in self.replicas if r.footprint is not None), None)

    @property
    def alive(self) -> bool:
        return not self._closed and any(r.alive for r in self.replicas)

    def subscribe(self, events: EngineEvents) -> None:
        self.events = events
        self._relay.serve(events)

    def start(self) -> ReplicaSet:
        for _ in range(self.fleet.replicas):
            self.replicas.append(self._new_replica())
        threading.Thread(target=self._watch, name=f"replicas-{self.key}", daemon=True).start()
        return self

    def _new_replica(self) -> RayClient:
        return RayClient(self.config, self.env, self.fleet, self.placement, self._relay, spread=True).start()

    # -- what replicas tell ----------------------------------------------------------------------
    def replica_ready(self, replica: RayClient) -> None:
        first = not self.ready.is_set()
        self.ready.set()
        if first:
            self.events.engine_ready(self)
        self._spread_warm_buckets()

    def _replica_footprint(self, replica: RayClient) -> None:
        self.events.footprint_changed(self)  # the set's footprint is its first measured replica's

    def _release_compiles(self, replica: RayClient) -> None:
        """The host's compile slots a gone replica held or waited for are freed (the scheduler knows the
        replica, not the set, so dropping the set would not free them)."""
        for info in replica.buckets():
            if info.state in ("queued", "compiling"):
                self.events.compile_finished(replica, info.bucket)

    def replica_down(self, replica: RayClient) -> None:
        self._release_compiles(replica)
        with self._lock:
            if self._closed or replica not in self.replicas:
                return
            if replica.info is not None and self.replacements < MAX_REPLACEMENTS:
                self.replacements += 1
                self.replicas[self.replicas.index(replica)] = self._new_replica()
                log.warning("replica of %s on node %s lost (%s); Ray places a new one", self.key,
                            replica.node_name, replica.error)
                return
            if any(r.alive for r in self.replicas):
                return
            self.error = replica.error or EngineCrashed(f"every replica of {self.key} is down")
        self.ready.set()
        self.events.engine_down(self)

    # -- routing ---------------------------------------------------------------------------------
    def serving_replicas(self) -> list[RayClient]:
        """Ready, alive replicas that answered their last ping."""
        return [r for r in self.replicas if r.alive and r.ready.is_set() and r.error is None
                and id(r) not in self._stalled]

    def pick(self) -> RayClient:
        candidates = self.serving_replicas() or [r for r in self.replicas if r.alive]
        if not candidates:
            raise self.error or EngineCrashed(f"no replica of {self.key} is running")
        return min(candidates, key=lambda r: (r.pending(), self._used.get(id(r), 0.0)))

    def submit(self, request: GenerateRequest, on_progress=None) -> Future:
        self.last_used = time.monotonic()
        with self._lock:
            try:
                replica = self.pick()
            except ShowcaseError as exc:
                future: Future = Future()
                future.set_exception(exc)
                return future
            self._used[id(replica)] = time.monotonic()
            self._routes[request.request_id] = replica
            self._served_by[request.request_id] = replica.node_name
            while len(self._served_by) > SERVED_BY_KEPT:
                self._served_by.popitem(last=False)
            future = replica.submit(request, on_progress)
        future.add_done_callback(lambda _f, rid=request.request_id: self._routes.pop(rid, None))
        return future

    def node_of(self, request_id: str) -> str | None:
        """The node of the replica a request was sent to (its result names it)."""
        with self._lock:
            return self._served_by.get(request_id)

    def cancel(self, request_id: str) -> None:
        replica = self._routes.get(request_id)
        for r in [replica] if replica is not None else list(self.replicas):
            r.cancel(request_id)

    # -- the watcher -----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed:
            time.sleep(PING_EVERY_S)
            self._ping_all()
            self._spread_warm_buckets()

    def _ping_all(self) -> None:
        """Mark the replicas whose actor did not answer within PING_TIMEOUT_S (Ray's call, not our socket)."""
        refs = {r.actor.ping.remote(): r for r in list(self.replicas) if r.actor is not None and r.alive}
        if not refs:
            return
        answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PING_TIMEOUT_S)
        stalled = {id(r) for ref, r in refs.items() if ref not in answered}
        for ref in refs:
            if ref not in answered:
                ray.cancel(ref)
        if stalled != self._stalled:
            log.warning("replicas of %s not answering: %s", self.key,
                        [r.node_name for r in self.replicas if id(r) in stalled] or "none")
        self._stalled = stalled

    def _spread_warm_buckets(self) -> None:
        """Warm on every ready replica the buckets warm on any of them."""
        ready = self.serving_replicas()
        warm = {b.bucket for r in ready for b in r.buckets() if b.state == "warm"}
        for replica in ready:
            have = {b.bucket for b in replica.buckets() if b.state in ("warm", "queued", "compiling", "failed")}
            for bucket in sorted(warm - have, key=str):
                try:
                    replica.warm(bucket)
                except ShowcaseError:
                    pass

    # -- the rest of the engine interface --------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> bool:
        if not self.ready.wait(timeout):
            return False
        if self.error is not None and not self.alive:
            raise self.error
        return True

    def warm(self, bucket: BucketKey | None = None) -> None:
        for replica in self.serving_replicas():
            replica.warm(bucket)

    def grant_compile(self, bucket: BucketKey) -> None:
        for replica in self.serving_replicas():
            replica.grant_compile(bucket)

    def buckets(self) -> list[BucketInfo]:
        """Each bucket once: as the replica where it is warm shows it, else as the first one does."""
        merged: dict[BucketKey, BucketInfo] = {}
        for replica in self.replicas:
            for info in replica.buckets():
                if info.bucket not in merged or info.state == "warm":
                    merged[info.bucket] = info
        return sorted(merged.values(), key=lambda i: (i.bucket.mode, i.bucket.size))

    def pending(self) -> int:
        return sum(r.pending() for r in self.replicas)

    def busy(self) -> bool:
        return self.pending() > 0 or not self.ready.is_set()

    def status(self) -> dict:
        first = next((r for r in self.replicas if r.info is not None), self.replicas[0])
        row = first.status()
        rows = [{"node": r.node_name, "state": r.status()["state"], "pending": r.pending(), "pid": r.pid,
                 "answering": id(r) not in self._stalled, "error": str(r.error) if r.error else None}
                for r in self.replicas]
        row.update({"kind": self.kind, "pending": self.pending(), "buckets": [b.as_dict() for b in self.buckets()],
                    "node": ", ".join(r["node"] for r in rows), "replicas": rows,
                    "where": ", ".join(r.status()["where"] for r in self.replicas),
                    "state": "ready" if self.serving_replicas() else row["state"]})
        return row

    def close(self, timeout: float = 3.0) -> None:
        self._closed = True
        for replica in self.replicas:
            self._release_compiles(replica)
        threads = [threading.Thread(target=r.close, daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)


def start_on_fleet(config, env: dict[str, str], fleet: FleetConfig, events: EngineEvents,
                   placement: Placement = ANYWHERE):
    """The started client of `config` on the fleet: one RayClient, or a ReplicaSet of `fleet.replicas`."""
    if fleet.replicas <= 1:
        return RayClient(config, env, fleet, placement, events).start()
    return ReplicaSet(config, env, fleet, placement, events).start()
