"""Who sent a request (ui/edge.py): the peer address, or the forwarded one when the peer is a trusted proxy."""

from __future__ import annotations

import ipaddress

from ui.sockets import in_networks


def parse_proxies(text: str | None) -> tuple:
    """'10.0.0.0/8,127.0.0.1' -> networks; raises ValueError naming the bad entry."""
    nets = []
    for item in (text or "").split(","):
        if item.strip():
            try:
                nets.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise ValueError(f"--trusted-proxies: {item.strip()!r} is not an address or network "
                                 "(e.g. 10.0.0.0/8,127.0.0.1)") from None
    return tuple(nets)


def client_address(peer: str | None, forwarded_for: str | None, trusted=()) -> str:
    """Who sent a request: the connection's peer address; when that peer is a trusted proxy, the
    right-most X-Forwarded-For hop that is not itself a trusted proxy (hops to its left are whatever
    the client wrote and are never believed)."""
    peer = peer or "unknown"
    if not trusted or not in_networks(peer, trusted):
        return peer
    hops = [h.strip() for h in (forwarded_for or "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not in_networks(hop, trusted):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:
                return "invalid-forwarded-for"
    return peer
