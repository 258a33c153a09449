"""What `--ray` and `--replicas` resolve to (where a request asks its engine to run is
engine/config/placement.py). Imports no ray: the flags use it whether or not the app joins a cluster."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from engine.config.placement import ANYWHERE, Placement
from engine.errors import InvalidRequest

__all__ = ["ANYWHERE", "LOCAL", "MAX_REPLICAS", "FleetConfig", "Placement", "address_host", "private_address",
           "resolve_address"]

MAX_REPLICAS = 16
LOCAL = "local"  # --ray local: start a cluster of this machine alone
# Ray's sockets are <temp>/session_<date>_<time>_<micros>_<pid>/sockets/plasma_store: about 70 characters past
# its temp folder, and a socket path may have at most 107 bytes.
RAY_TEMP_DIR_CHARS = 36
RAY_DEFAULT_TEMP_DIR = "/tmp/ray"


@dataclass(frozen=True)
class FleetConfig:
    """The cluster the app drives: `address` as Ray takes it (host:port, ray://..., or LOCAL) and how many
    copies of each engine it keeps on different nodes."""

    address: str = LOCAL
    replicas: int = 1
    start_timeout_s: float = 120.0  # a node must take an engine's actor and start it within this
    temp_dir: str | None = None  # a local cluster's session folders and logs (the app's: <cache-dir>/ray)

    def local_temp_dir(self) -> str:
        """Where a local cluster keeps its sessions and logs: `temp_dir` when Ray's socket paths under it stay
        within AF_UNIX's 107 bytes, else Ray's own default folder."""
        if self.temp_dir and len(self.temp_dir) <= RAY_TEMP_DIR_CHARS:
            return self.temp_dir
        return RAY_DEFAULT_TEMP_DIR

    def __post_init__(self):
        if not 1 <= int(self.replicas) <= MAX_REPLICAS:
            raise InvalidRequest(f"replicas {self.replicas}: allowed 1 to {MAX_REPLICAS}")


def resolve_address(flag: str | None, ray_address: str | None, current_cluster: str | None = None) -> str:
    """The address the app will join, resolved before anything joins (so a public app's check applies to it):
    `auto` (or the bare flag) is Ray's RAY_ADDRESS when set, else the cluster Ray's ray_current_cluster file
    names (what ray.init("auto") would join), else a local cluster; `local` starts a cluster of this machine
    whatever the environment names."""
    text = (flag or "auto").strip()
    if text == "auto":
        return ray_address or current_cluster or LOCAL
    return text


def address_host(address: str) -> str:
    """The host part of a Ray address (host:port, ray://host:port)."""
    text = address.split("://", 1)[-1].rstrip("/")
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def private_address(address: str) -> bool:
    """A local cluster, or an address on loopback or a private network (the only ones `--public` joins)."""
    if address == LOCAL:
        return True
    host = address_host(address)
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: where it points is not known here
    return ip.is_loopback or ip.is_private
