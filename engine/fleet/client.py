"""RayClient: an engine in a Ray actor (engine/fleet/actor.py), reached as any engine is, over the worker
protocol (a ConnectionClient on an authenticated socket).

Starting it returns at once, as a worker process's client does: a thread asks Ray for an actor on a node
with the device (engine/fleet/cluster.py actor_options), hands it a fresh token, dials it and attaches;
until then messages wait for the connection. A cluster with no node able to take it fails the engine at
once, saying which nodes it has. A watcher waits on the actor's `lifetime`: when Ray reports the actor or
its node lost, the connection is ended, every request in flight fails naming the node, and the manager's
usual restart asks Ray for another node with the device.
"""

from __future__ import annotations

import logging
import threading

import ray

from engine.errors import EngineCrashed, ShowcaseError
from engine.fleet import cluster
from engine.fleet.actor import EngineActor
from engine.fleet.config import ANYWHERE, FleetConfig, Placement
from engine.tp.tokens import new_token
from engine.worker.client import ConnectionClient, EngineEvents
from engine.worker.wire import dial

log = logging.getLogger(__name__)

VERDICT_WAIT_S = 3.0  # how long a lost connection waits for Ray's word on why, to name the node


class RayClient(ConnectionClient):
    """One engine in a Ray actor on a node Ray chose (or the one its placement names)."""

    kind = "ray"

    def __init__(self, config, env: dict[str, str], fleet: FleetConfig, placement: Placement = ANYWHERE,
                 events: EngineEvents | None = None, *, spread: bool = False):
        super().__init__(config.key, events)
        self.spread = spread  # one of several replicas: Ray spreads them over the nodes
        self.config = config
        self.env = env
        self.fleet = fleet
        self.placement = placement
        self.actor = None
        self.group = None  # a tensor-parallel engine's placement group
        self.node: cluster.FleetNode | None = None
        self.where: dict = {}  # what the actor reported: host, port, node_id, pid
        self._attached = threading.Event()
        self._verdict: str | None = None  # why Ray says the actor ended
        self._verdict_known = threading.Event()

    def start(self) -> RayClient:
        threading.Thread(target=self._place, name=f"ray-place-{self.key}", daemon=True).start()
        return self

    def _place(self) -> None:
        try:
            if (why := cluster.feasible(self.key.device, self.placement)) is not None:
                raise ShowcaseError(f"engine {self.key}: {why}")
            token = new_token()
            options = self._options()
            self.actor = EngineActor.options(**options).remote()
            try:
                self.where = ray.get(self.actor.start.remote(self.config, self.env, token),
                                     timeout=self.fleet.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ShowcaseError(f"engine {self.key}: no node of the Ray cluster took it within "
                                    f"{self.fleet.start_timeout_s:g} s (all busy?)") from None
            self.node = cluster.node_by_id(self.where["node_id"])
            conn = dial(self.where["host"], int(self.where["port"]), token)
        except Exception as exc:  # noqa: BLE001 - the engine fails with the reason, the app goes on
            self.error = exc if isinstance(exc, ShowcaseError) else ShowcaseError(
                f"engine {self.key}: could not start on the Ray cluster: {type(exc).__name__}: {exc}")
            self._kill()
            self._attached.set()
            self._went_down()
            return
        if self._closed:  # closed while Ray placed it: end what was just made
            conn.close()
            self._kill()
            return
        log.info("engine %s runs on node %s (pid %s)", self.key, self.node_name, self.where.get("pid"))
        self.attach(conn)
        self._attached.set()
        threading.Thread(target=self._watch, name=f"ray-watch-{self.key}", daemon=True).start()

    def _options(self) -> dict:
        """Where Ray puts the actor: one unit of the device's resource, or for a tensor-parallel engine all its
        ranks' units on one node (a placement group, engine/fleet/tp.py)."""
        if self.key.tp <= 1:
            return cluster.actor_options(self.key.device, self.placement, spread=self.spread)
        if self.placement:
            raise ShowcaseError(f"engine {self.key}: a tensor-parallel engine on the fleet goes where Ray finds "
                                f"{self.key.tp} free units on one node; name no chip or node ({self.placement})")
        options, self.group = cluster.reserve_node(self.key.device, self.key.tp, self.fleet.start_timeout_s)
        return options

    def _watch(self) -> None:
        """Wait on the actor's lifetime: Ray's word that the actor or its node is gone ends the connection."""
        try:
            ray.get(self.actor.lifetime.remote())
            self._verdict = "the engine stopped"
        except Exception as exc:  # noqa: BLE001 - ActorDiedError, ActorUnavailableError, a lost node
            self._verdict = f"Ray reports the actor lost ({type(exc).__name__}: {first_line(exc)})"
        self._verdict_known.set()
        self.hang_up()

    @property
    def node_name(self) -> str:
        if self.node is not None:
            return self.node.name
        return self.where.get("host", "?")

    def node_of(self, request_id: str) -> str:
        """The node that serves this engine's requests (its result names it)."""
        return self.node_name

    def describe_exit(self) -> str:
        self._verdict_known.wait(VERDICT_WAIT_S)
        node = cluster.node_by_id(self.where["node_id"]) if self.where and ray.is_initialized() else None
        state = "left the cluster" if node is not None and not node.alive else "is still in the cluster"
        text = f"its Ray actor on node {self.node_name} ({self.where.get('host', '?')}) is gone; the node {state}"
        return f"{text}; {self._verdict}" if self._verdict else text

    def send(self, message) -> None:
        if self.conn is None and not self._closed:
            self._attached.wait(self.fleet.start_timeout_s + 30)
            if self.conn is None:
                raise self.error or EngineCrashed(f"engine {self.key} is not running")
        super().send(message)

    @property
    def pid(self) -> int | None:
        return self.where.get("pid")

    def status(self) -> dict:
        row = super().status()
        chips = f" ({', '.join(self.node.chips)})" if self.node and self.node.chips else ""
        row.update({"node": self.node_name, "where": f"{self.node_name}{chips}", "node_id": self.where.get("node_id"), "address": self.where.get("host"),
                    "chips": list(self.node.chips) if self.node else [], "placement": str(self.placement) or None,
                    "pid": self.pid})
        return row

    def close(self, timeout: float = 3.0) -> None:
        """Ask the engine to stop, then have Ray end the actor (and its process on the node)."""
        super().close()
        self._closed = True
        self._attached.set()
        self.hang_up()
        self._kill()

    def _kill(self) -> None:
        """Ray ends the actor (and its process on the node), and frees a tensor-parallel engine's node."""
        if not ray.is_initialized():
            return
        try:
            if self.actor is not None:
                ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("killing the actor of %s: %s", self.key, exc)
        if self.group is not None:
            cluster.release_node(self.group)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
