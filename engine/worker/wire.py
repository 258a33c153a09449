"""The worker protocol over a socket (a tensor-parallel sidecar's rank 0 serves on one): HMAC-authenticated
multiprocessing connections, with deadlines, keepalive and hang-up.

Why not `Listener(authkey=...)` / `Client(authkey=...)` as they are: both authenticate with blocking reads
and no deadline, so one peer that connects and says nothing stalls rank 0's accept loop for good (every
later client then hangs too), and a client dialling a socket nobody accepts on waits forever. Here the
handshake (multiprocessing's own challenge/response, the same bytes as Listener/Client) runs under one
deadline for the whole exchange: a per-read timeout alone lets a peer that sends a byte just inside it keep
the handshake open for ever, so at the deadline the socket is shut down and the pending read ends. TCP
keepalive makes a peer whose machine vanished show up as a closed connection within about a minute
instead of never.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from contextlib import contextmanager
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

HANDSHAKE_S = 10.0


def _sock_of(conn: Connection) -> socket.socket:
    return socket.socket(fileno=os.dup(conn.fileno()))  # a second handle on the same socket, for options


def set_io_timeout(conn: Connection, seconds: float) -> None:
    """Receive and send timeout of the socket under `conn` (0: none). A blocking read past it raises OSError."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    with _sock_of(conn) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def keepalive(conn: Connection, idle_s: int = 30, interval_s: int = 10, count: int = 3) -> None:
    """TCP keepalive, and no Nagle delay: a Connection sends a large message's length and its bytes in two
    writes, and Nagle held the second until the peer's delayed ACK (40 ms on Linux) came for the first."""
    with _sock_of(conn) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def shut_down(conn: Connection) -> None:
    """End the connection for both sides now, without closing the handle: the peer sees it at once, and a
    thread of this process blocked reading it wakes with end-of-file (a plain close() sends nothing while
    such a read is in flight, on Linux). Whoever reads the connection closes it afterwards."""
    try:
        with _sock_of(conn) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class HandshakeTimeout(TimeoutError):
    """The peer did not finish the handshake within its deadline."""


@contextmanager
def _deadline(conn: Connection, timeout_s: float):
    """Run the block within `timeout_s` in all: past it the socket is shut down, so whatever read or write
    is in flight ends at once (the per-read socket timeout stays as a second guard)."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        shut_down(conn)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    set_io_timeout(conn, timeout_s)
    timer.start()
    try:
        yield
    except (OSError, EOFError) as exc:
        if expired.is_set():
            raise HandshakeTimeout(f"no complete handshake within {timeout_s:g} s") from exc
        raise
    finally:
        timer.cancel()
    if expired.is_set():  # finished, but the socket was shut down under it
        raise HandshakeTimeout(f"no complete handshake within {timeout_s:g} s")
    set_io_timeout(conn, 0)


def authenticate_incoming(conn: Connection, token: bytes, timeout_s: float = HANDSHAKE_S) -> None:
    """Server side (what Listener.accept does), within `timeout_s` for the whole exchange. Raises
    AuthenticationError (wrong token) or OSError/EOFError (silent, slow or gone peer; HandshakeTimeout past
    the deadline)."""
    with _deadline(conn, timeout_s):
        deliver_challenge(conn, token)
        answer_challenge(conn, token)
    keepalive(conn)


def dial(host: str, port: int, token: bytes, timeout_s: float = HANDSHAKE_S) -> Connection:
    """Client side (what multiprocessing.connection.Client does), connect and handshake within `timeout_s`.
    Raises ConnectionRefusedError, AuthenticationError, TimeoutError/OSError."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)  # a Connection needs a blocking socket; the deadline comes from the socket options
    conn = Connection(sock.detach())
    try:
        with _deadline(conn, timeout_s):
            answer_challenge(conn, token)
            deliver_challenge(conn, token)
        keepalive(conn)
    except BaseException:
        conn.close()
        raise
    return conn
