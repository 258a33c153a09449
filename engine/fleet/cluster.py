"""Joining the Ray cluster and reading what it has: its nodes, their resources, and which devices of the
showcase each node can run (a device's `ray_resource`, engine/devices/), which is the device list the UI
shows under `--ray`.

The app is a Ray driver: it never starts a dashboard or a client server itself. A node's name is its
`showcase-node` label when the host gave one (`ray start --labels showcase-node=h100-a`), else its
address (with the start of its id where several nodes share an address, as simulated nodes do).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import ray

from engine import devices, settings
from engine.errors import ShowcaseError
from engine.fleet.config import LOCAL, FleetConfig, Placement

log = logging.getLogger(__name__)

NAME_LABEL = "showcase-node"
ACCELERATOR_PREFIX = "accelerator_type:"


@dataclass(frozen=True)
class FleetNode:
    """One node of the cluster as the GCS reports it."""

    node_id: str
    name: str
    address: str
    alive: bool
    resources: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)

    @property
    def chips(self) -> tuple[str, ...]:
        """Its accelerator types (`H100`, `TPU-V6E`, ...), as Ray detected or the host declared them."""
        return tuple(sorted(r.removeprefix(ACCELERATOR_PREFIX) for r in self.resources
                            if r.startswith(ACCELERATOR_PREFIX)))

    def has(self, resource: str) -> bool:
        return self.resources.get(resource, 0) > 0

    def as_dict(self) -> dict:
        shown = {k: v for k, v in self.resources.items() if not k.startswith(("node:", "accelerator_type:"))}
        return {"name": self.name, "node_id": self.node_id, "address": self.address, "alive": self.alive,
                "chips": list(self.chips), "resources": shown}


def join(config: FleetConfig) -> None:
    """Make this process a driver of the cluster `config.address` names (LOCAL: start one of this machine).
    Idempotent. ShowcaseError naming the address when it cannot be reached."""
    if ray.is_initialized():
        return
    try:
        if config.address == LOCAL:
            # address="local": Ray starts a cluster of this machine and reads neither RAY_ADDRESS nor its
            # ray_current_cluster file (address=None reads both). Its sessions and logs go under the cache
            # folder where its path is short enough for Ray's sockets (FleetConfig.local_temp_dir)
            ignored = settings.ray_address()
            if ignored:
                log.warning("--ray local: starting a Ray cluster of this machine; RAY_ADDRESS (%s) is ignored",
                            ignored)
            temp_dir = config.local_temp_dir()
            if temp_dir != config.temp_dir and config.temp_dir:
                log.info("Ray's session logs: %s (the cache folder's path is too long for Ray's sockets)", temp_dir)
            ray.init(address=LOCAL, include_dashboard=False, configure_logging=False, log_to_driver=False,
                     _temp_dir=temp_dir)
        else:
            ray.init(address=config.address, configure_logging=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ShowcaseError(f"--ray {config.address}: cannot join the Ray cluster ({exc}); start it with "
                            "`ray start --head` and pass its address (docs/multinode.md)") from None
    # Ray builds its serializers with the first object it sends, importing pydantic.v1 then: from an engine's
    # start thread that import raced the web server's threads (KeyError: 'pydantic.v1'). Build them here.
    ray.put(None)
    log.warning("joined the Ray cluster at %s: %d node(s)", config.address, len(nodes()))


def leave() -> None:
    """Disconnect the driver: Ray ends every actor this app owns (engines are not detached)."""
    if ray.is_initialized():
        ray.shutdown()


def nodes(alive_only: bool = True) -> list[FleetNode]:
    """The cluster's nodes, the head without resources of its own left out."""
    raw = [n for n in ray.nodes() if n.get("Alive") or not alive_only]
    counts = Counter(n.get("NodeManagerAddress", "") for n in raw)
    found = []
    for n in raw:
        address = n.get("NodeManagerAddress", "")
        labels = dict(n.get("Labels") or {})
        name = labels.get(NAME_LABEL) or (address if counts[address] == 1 else f"{address}#{n['NodeID'][:6]}")
        resources = {k: v for k, v in (n.get("Resources") or {}).items()
                     if k not in ("memory", "object_store_memory")}
        found.append(FleetNode(n["NodeID"], name, address, bool(n.get("Alive")), resources, labels))
    return sorted(found, key=lambda node: node.name)


def node_by_id(node_id: str) -> FleetNode | None:
    return next((n for n in nodes(alive_only=False) if n.node_id == node_id), None)


def find_node(name: str) -> FleetNode:
    """The alive node `@node:NAME` names (its name, address or the start of its id)."""
    alive = nodes()
    for node in alive:
        if name in (node.name, node.node_id) or (len(name) >= 6 and node.node_id.startswith(name)):
            return node
    matches = [n for n in alive if n.address == name]
    if len(matches) == 1:
        return matches[0]
    raise ShowcaseError(f"no node {name!r} in the Ray cluster; its nodes: "
                        f"{', '.join(n.name for n in alive) or 'none'}")


def actor_options(device: str, placement: Placement, spread: bool = False) -> dict:
    """Ray options placing an engine of `device` (one unit of its resource) where `placement` asks; `spread`:
    Ray's SPREAD strategy, so the replicas of one engine land on different nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = devices.get_device(device).ray_actor_resources()
    if placement.chip:
        options["accelerator_type"] = placement.chip
    if placement.node:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(find_node(placement.node).node_id, soft=False)
    elif spread:
        options["scheduling_strategy"] = "SPREAD"
    return options


def reserve_node(device: str, tp: int, timeout_s: float):
    """(actor options, placement group): `tp` units of the device's resource on one node (a STRICT_PACK
    group, its one bundle taken whole by the actor, so e.g. CUDA_VISIBLE_DEVICES names all `tp` GPUs for
    the ranks it starts). ShowcaseError when no node frees that many within `timeout_s`."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = devices.get_device(device).ray_resource
    group = placement_group([{resource: tp}], strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ShowcaseError(f"no node of the Ray cluster has {tp} {resource} free for a tp{tp} engine on {device} "
                            f"within {timeout_s:g} s (nodes: {'; '.join(map(describe_resources, nodes()))})") from None
    options = {name: ({r: n * tp for r, n in value.items()} if isinstance(value, dict) else value * tp)
               for name, value in devices.get_device(device).ray_actor_resources().items()}
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return options, group


def release_node(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def feasible(device: str, placement: Placement) -> str | None:
    """Why no alive node can ever take an engine of `device` at `placement` (None: at least one can)."""
    resource = devices.get_device(device).ray_resource
    alive = nodes()
    able = [n for n in alive if n.has(resource)]
    where = f"{device} ({resource})"
    if placement.chip:
        able = [n for n in able if placement.chip in n.chips]
        where += f" with chip {placement.chip}"
    if placement.node:
        try:
            target = find_node(placement.node).node_id
        except ShowcaseError as exc:
            return str(exc)
        able = [n for n in able if n.node_id == target]
        where += f" on node {placement.node}"
    if able:
        return None
    listed = "; ".join(f"{n.name}: {describe_resources(n)}" for n in alive) or "none"
    return f"no node with {where} left in the Ray cluster (nodes: {listed})"


def resource_units(resource: str) -> float:
    """Units of `resource` the cluster's alive nodes declare together (0 before the app joined)."""
    if not ray.is_initialized():
        return 0.0
    return float(ray.cluster_resources().get(resource, 0.0))


def why_lacking(device: str, placement: Placement) -> str | None:
    """Why no node can take an engine of `device` at `placement` (None: one can); the device list's reason."""
    if not ray.is_initialized():
        return "the app has not joined the Ray cluster (yet)"
    return feasible(device, placement)


def describe_resources(node: FleetNode) -> str:
    parts = [f"{k} {v:g}" for k, v in sorted(node.resources.items()) if not k.startswith("node:")]
    return ", ".join(parts) or "no resources"


def device_list() -> list[dict]:
    """Every device of the showcase with the nodes that have it and their chips (the cluster as the device
    list): name, nodes, chips {type: nodes}, and why where no node has it."""
    alive = nodes()
    rows = []
    for name in devices.device_names():
        if name == "auto":
            continue
        resource = devices.get_device(name).ray_resource
        able = [n for n in alive if n.has(resource)]
        chips = Counter(chip for n in able for chip in n.chips)
        rows.append({"device": name, "resource": resource, "nodes": [n.name for n in able], "chips": dict(chips),
                     "why": None if able else f"no node declares {resource}"})
    return rows


def fleet_report(local: list[dict]) -> list[dict]:
    """The device report (engine/devices/report.py rows) of the cluster: each device available where a node
    has its resource, with its nodes; then a row per chip type (`cuda:H100`, with its node count) and per
    node (`cpu:node:host-a`), so a request can name either. `auto` is the first device a node has."""
    alive = nodes()
    rows = []
    for row in local:
        resource = devices.get_device(row["name"]).ray_resource
        able = [n for n in alive if n.has(resource)]
        base = {**row, "available": bool(able), "auto": False, "nodes": [n.name for n in able],
                "reason": "" if able else f"no node of the Ray cluster declares {resource}",
                "label": f"{row['label']} · {len(able)} node(s)"}
        rows.append(base)
        chips = Counter(chip for n in able for chip in n.chips)
        rows += [{**base, "name": f"{row['name']}:{chip}", "label": f"{chip} · {count} node(s)",
                  "nodes": [n.name for n in able if chip in n.chips]} for chip, count in sorted(chips.items())]
        rows += [{**base, "name": f"{row['name']}:node:{n.name}", "nodes": [n.name],
                  "label": f"node {n.name}" + (f" ({', '.join(n.chips)})" if n.chips else "")} for n in able]
    first = next((r for r in rows if r["available"]), None)
    if first is not None:
        first["auto"] = True
    return rows


def summary() -> dict:
    """What /status, /metrics and the System tab show of the cluster."""
    alive = nodes()
    return {"nodes": [n.as_dict() for n in alive], "devices": device_list(),
            "total": dict(ray.cluster_resources()), "available": dict(ray.available_resources())}
