"""A tensor-parallel engine on the fleet: its N torchrun ranks on one node, reserved by a STRICT_PACK
placement group of N units of the device's resource, started there by the engine's actor exactly as the
app starts a local sidecar (engine/tp/client.py SidecarClient: launch, token, rank 0 on loopback).

The actor relays bytes between the app's authenticated connection and rank 0's: both ends speak the same
framed worker protocol, so the relay reads no message, and the app's client is the RayClient it is for a
one-device engine. The ranks watch the actor (`--parent-pid`), so they end with it when Ray ends it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from engine.errors import ShowcaseError
from engine.tp.client import SidecarClient

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class NodeSidecar(SidecarClient):
    """The sidecar on this node; its rank 0's connection goes to the relay instead of a reader thread."""

    def __init__(self, config, env: dict[str, str]):
        super().__init__(config, env=env)
        self.rank0 = None
        self.connected = threading.Event()
        self.failure: ShowcaseError | None = None

    def attach(self, conn) -> None:
        self.rank0 = conn
        self.connected.set()

    def _fail_start(self, error) -> None:
        self.failure = error
        super()._fail_start(error)
        self.connected.set()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes one way until either side ends; then end both, so the other direction stops too."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def relay(app_conn, rank0_conn) -> None:
    """Bytes between the app and rank 0, both ways, until either hangs up."""
    app = socket.socket(fileno=os.dup(app_conn.fileno()))
    rank0 = socket.socket(fileno=os.dup(rank0_conn.fileno()))
    for sock in (app, rank0):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(rank0, app), name="relay-back", daemon=True)
    back.start()
    _pump(app, rank0)
    back.join()
    for sock in (app, rank0):
        sock.close()


def serve_sidecar(app_conn, config, env: dict[str, str]) -> None:
    """Start the sidecar on this node and relay the app's connection to its rank 0 until either ends."""
    sidecar = NodeSidecar(config, env).start()
    try:
        sidecar.connected.wait(sidecar.connect_timeout + 30)
        if sidecar.rank0 is None:
            log.error("the sidecar did not start: %s", sidecar.failure or "rank 0 never listened")
            return
        relay(app_conn, sidecar.rank0)
    finally:
        sidecar.close()
        app_conn.close()
