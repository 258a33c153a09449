"""The engine inside a Ray actor: the worker loop a worker process runs (engine/worker/loop.py serve_engine),
serving one HMAC-authenticated connection from the app (engine/worker/wire.py).

`start` opens a socket on the node's address and returns where it listens; the token arrives as that
method's argument (a method call's arguments go straight to the actor and are not kept in Ray's control
store, as an actor's constructor arguments are for restarts). The app dials within ACCEPT_S; a peer without
the token is refused and the actor keeps waiting for the right one until then. `lifetime` returns when the
engine stopped: the app waits on it, so a lost actor or node ends the connection even where the socket
would take a minute of keepalive to notice. Ray kills the actor (and the node's raylet its process) when
the app closes the engine, leaves the cluster or dies.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

import ray

from engine.worker.loop import serve_engine
from engine.worker.wire import authenticate_incoming

log = logging.getLogger(__name__)

ACCEPT_S = 60.0


def accept_one(listener: socket.socket, token: bytes, deadline: float) -> Connection | None:
    """The first peer that proves the token before `deadline` (others are hung up on); None at the deadline."""
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            sock, peer = listener.accept()
        except (TimeoutError, OSError):
            return None
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            authenticate_incoming(conn, token)
            return conn
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("refused a connection from %s: %s", peer[0], exc)
            conn.close()
    return None


def at_normal_priority() -> None:
    """This thread (and the engine's threads it starts) back at niceness 0, from which serve_engine lowers
    it as a worker process's: Ray starts its workers at a low priority (nice 15), which on cores shared
    with other programs made every request wait for a core."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
    except OSError:  # not allowed to raise its priority here: it stays where Ray put it
        pass


@ray.remote(max_concurrency=4)  # start, lifetime and ping may be in flight together
class EngineActor:
    def __init__(self):
        self.done = threading.Event()
        self.node_id = ray.get_runtime_context().get_node_id()

    def start(self, config, env: dict[str, str], token: bytes) -> dict:
        """Listen on this node's address; serve the engine to the first peer with `token` (a tensor-parallel
        engine: its ranks on this node, engine/fleet/tp.py)."""
        host = ray.util.get_node_ip_address()
        listener = socket.create_server((host, 0), backlog=4)
        port = listener.getsockname()[1]
        threading.Thread(target=self._serve, args=(listener, config, env, token), name="engine-serve",
                         daemon=True).start()
        return {"host": host, "port": port, "node_id": self.node_id, "pid": os.getpid()}

    def _serve(self, listener: socket.socket, config, env: dict[str, str], token: bytes) -> None:
        at_normal_priority()
        try:
            with listener:
                conn = accept_one(listener, token, time.monotonic() + ACCEPT_S)
            if conn is not None and config.key.tp > 1:
                from engine.fleet.tp import serve_sidecar

                serve_sidecar(conn, config, env)
            elif conn is not None:
                serve_engine(config, conn, env, own_group=False)
        except BaseException:  # noqa: BLE001 - logged; the app sees the connection end
            log.exception("the engine stopped")
        finally:
            self.done.set()

    def lifetime(self) -> str:
        """Returns when the engine stopped serving (raises in the caller when the actor or its node is lost)."""
        self.done.wait()
        return "stopped"

    def ping(self) -> int:
        return os.getpid()
