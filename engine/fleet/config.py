"""What `--ray` and `--replicas` resolve to, and where a request asks its engine to run. Imports no ray: the
flags and the request parser use it whether or not the app joins a cluster."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from engine.errors import InvalidRequest

MAX_REPLICAS = 16
LOCAL = "local"  # --ray local: start a cluster of this machine alone


@dataclass(frozen=True)
class FleetConfig:
    """The cluster the app drives: `address` as Ray takes it (host:port, ray://..., or LOCAL) and how many
    copies of each engine it keeps on different nodes."""

    address: str = LOCAL
    replicas: int = 1
    start_timeout_s: float = 120.0  # a node must take an engine's actor and start it within this

    def __post_init__(self):
        if not 1 <= int(self.replicas) <= MAX_REPLICAS:
            raise InvalidRequest(f"replicas {self.replicas}: allowed 1 to {MAX_REPLICAS}")


def resolve_address(flag: str | None, ray_address: str | None) -> str:
    """--ray's value: `auto` (or the bare flag) is Ray's RAY_ADDRESS when set, else a local cluster."""
    text = (flag or "auto").strip()
    if text == "auto":
        return ray_address or LOCAL
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


@dataclass(frozen=True)
class Placement:
    """Where a request asks its engine to run: a chip (`@cuda:H100`: Ray's accelerator_type) or a node
    (`@node:NAME`); empty: any node with the device."""

    chip: str = ""
    node: str = ""

    @classmethod
    def parse(cls, text: str | None) -> Placement:
        """'' / 'any', 'node:NAME', or a chip name (the part after `@device:`)."""
        text = (text or "").strip()
        if text in ("", "any"):
            return cls()
        kind, sep, value = text.partition(":")
        if sep and kind == "node":
            if not value.strip():
                raise InvalidRequest("placement 'node:' names no node; write node:NAME (the System tab lists them)")
            return cls(node=value.strip())
        if any(c in text for c in " ,;@/"):
            raise InvalidRequest(f"placement {text[:40]!r}: write a chip (e.g. H100) or node:NAME")
        return cls(chip=text)

    def __bool__(self) -> bool:
        return bool(self.chip or self.node)

    def __str__(self) -> str:
        return f"node:{self.node}" if self.node else self.chip


ANYWHERE = Placement()  # any node with the device
