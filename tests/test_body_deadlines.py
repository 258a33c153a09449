"""Request bodies at the edge (ui/bodies.py): a body that falls behind its deadline is answered 408 and closed,
the bytes bodies under way hold are bounded per client and in total, and at the connection cap a connection
still waiting for its body makes room as one still sending its head does.

The first tests serve a minimal ASGI app behind the edge middleware and the socket bounds on uvicorn (both HTTP
parsers); the last ones launch the app. Visitors connect from distinct loopback addresses (127.0.x.y).
"""

from __future__ import annotations

import json
import select
import socket
import time

import pytest
from helpers import wait_until
from test_socket_bounds import PARSERS, connect, hello, read_all, request, serve, status

from ui.sockets import SocketBounds


def edge_app(bodies, sockets: SocketBounds | None = None):
    """(the edge guard, `hello` behind its middleware) with body bounds `bodies`."""
    from ui.edge import EdgeConfig, EdgeGuard

    guard = EdgeGuard(EdgeConfig(sockets=sockets or SocketBounds(header_timeout_s=30), bodies=bodies))
    middleware = guard.middleware()
    return guard, middleware.cls(hello, *middleware.args, **middleware.kwargs)


def still_open_after(sock, seconds: float) -> bool:
    """Whether the server neither answered nor closed `sock` for `seconds`."""
    sock.settimeout(seconds)
    try:
        sock.recv(1, socket.MSG_PEEK)  # returns at the first byte of an answer, or b"" once closed
    except TimeoutError:
        return True
    except OSError:
        return False
    return False


def answered(sock) -> bool:
    """Whether the server has sent something (or closed) on `sock`, without waiting."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def post_head(path: str, length: int, content_type: str = "application/octet-stream") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("content_type", ["application/octet-stream", "application/json"])
def test_a_stalled_body_gets_408_and_is_closed_once_the_grace_is_over(parser, content_type):
    """A Content-Length of 100,000 and one byte: uvicorn would wait for the rest for as long as the client likes."""
    from ui.bodies import BodyBounds

    guard, app = edge_app(BodyBounds(min_rate=240, grace_s=1.0, timeout_s=30))
    with serve(parser, None, app=app, guard=guard.sockets) as (_, port):
        sock = connect(port)
        sock.sendall(post_head("/gradio_api/queue/join", 100_000, content_type) + b"{")
        assert still_open_after(sock, 0.6), "closed before its 1 s of grace were over"
        answer = read_all(sock, timeout=3.5)  # fails unless closed within a few seconds of the grace's end
        assert status(answer) == 408 and b"at least 240 bytes/s" in answer, answer[:300]
        assert guard.refused["body timeout"] == 1
        assert status(request(port)) == 200  # and it keeps serving
        assert guard.bodies.snapshot()["held_bytes"] == 0


@pytest.mark.parametrize("parser", PARSERS)
def test_a_body_trickled_at_the_rate_is_closed_at_its_total_time(parser):
    from ui.bodies import BodyBounds

    guard, app = edge_app(BodyBounds(min_rate=10, grace_s=0.5, timeout_s=2.0))
    with serve(parser, None, app=app, guard=guard.sockets) as (_, port):
        sock = connect(port)
        sock.sendall(post_head("/upload-anything", 100_000))
        sent = 0
        try:
            while sent < 40 and not answered(sock):  # 100 bytes every 0.1 s, ten times the rate, for at most 4 s
                sock.sendall(b"x" * 100)
                sent += 1
                time.sleep(0.1)
        except OSError:
            pass  # closed by the server while still sending
        answer = read_all(sock, timeout=8)
        assert status(answer) == 408 and b"whole within 2 s" in answer, answer[:300]
        assert sent < 35, f"answered only after {sent} of the 40 trickles: the 2 s total was not kept"


@pytest.mark.parametrize("parser", PARSERS)
def test_a_body_that_keeps_the_rate_is_read_whole(parser):
    from ui.bodies import BodyBounds

    guard, app = edge_app(BodyBounds(min_rate=240, grace_s=0.5, timeout_s=20))
    with serve(parser, None, app=app, guard=guard.sockets) as (_, port):
        sock = connect(port)
        sock.sendall(post_head("/x", 3000) + b"x" * 500)
        for _ in range(5):  # 500 bytes each 0.4 s: 1,250 bytes/s, past the grace
            time.sleep(0.4)
            sock.sendall(b"x" * 500)
        answer = sock.recv(4096)
        assert status(answer) == 200 and answer.endswith(b"ok 3000"), answer
        sock.close()
        assert guard.refused["body timeout"] == 0


@pytest.mark.parametrize("parser", PARSERS)
def test_bytes_held_by_bodies_are_bounded_per_address_and_given_back_when_the_client_goes(parser):
    """Two bodies of one address announcing 300 KB each: the first (halfway) holds its length of the address's
    400 KB share, the second passes it and gets 429; another address is served; when the first client goes,
    nothing is held any more."""
    from ui.bodies import BodyBounds

    guard, app = edge_app(BodyBounds(timeout_s=60, per_client_bytes=400_000, total_bytes=10_000_000))
    with serve(parser, None, app=app, guard=guard.sockets) as (_, port):
        first = connect(port, "127.0.0.2")
        first.sendall(post_head("/v1/images/edits", 300_000) + b"x" * 150_000)
        wait_until(lambda: guard.bodies.snapshot()["held_bytes"] >= 150_000, timeout=5,
                   message="the first body's bytes counted")
        second = connect(port, "127.0.0.2")
        second.sendall(post_head("/v1/images/edits", 300_000))
        try:
            second.sendall(b"x" * 150_000)
        except OSError:
            pass
        answer = read_all(second, timeout=5)
        assert status(answer) == 429 and b"share per visitor" in answer, answer[:300]
        assert guard.refused["body memory per client"] == 1
        assert status(request(port, "127.0.0.3", post_head("/x", 1000) + b"y" * 1000)) == 200
        first.close()
        wait_until(lambda: guard.bodies.snapshot()["held_bytes"] == 0, timeout=5,
                   message="the bytes given back when the client went")


@pytest.mark.parametrize("parser", PARSERS)
def test_at_the_cap_connections_waiting_for_their_body_make_room(parser):
    """Sixteen connections each with a body begun and never ended fill the cap: once the oldest has waited
    EVICT_AFTER_S it is closed for a newcomer, as a connection still sending its head would be."""
    from ui.sockets import EVICT_AFTER_S

    with serve(parser, SocketBounds(max_connections=16, header_timeout_s=30)) as (guard, port):
        held = []
        for i in range(16):
            sock = connect(port, f"127.0.1.{i + 1}")
            sock.sendall(post_head("/gradio_api/queue/join", 100_000) + b"x")
            held.append(sock)
        wait_until(lambda: guard.snapshot()["open"] == 16, timeout=5, message="sixteen connections counted")
        time.sleep(EVICT_AFTER_S + 0.2)
        assert status(request(port, "127.0.0.9")) == 200
        assert guard.snapshot()["refused"] == {"evicted at the cap": 1}
        for sock in held:
            sock.close()


# -- the app -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(manager):
    """The app at --max-connections 200 with the public mode's socket and body bounds (defaults but the cap)."""
    from helpers import launch_demo

    from ui.bodies import public_body_bounds
    from ui.edge import EdgeConfig
    from ui.handlers import UIDefaults
    from ui.sockets import public_bounds

    sockets = SocketBounds(**{**public_bounds().__dict__, "max_connections": 200})
    edge = EdgeConfig(sockets=sockets, bodies=public_body_bounds())
    demo, url = launch_demo(manager, UIDefaults(device="cpu", mode="eager"), edge=edge)
    yield demo, int(url.rstrip("/").rsplit(":", 1)[1])
    demo.close()


def unfinished(port: int, source: str, path: str = "/gradio_api/queue/join"):
    sock = connect(port, source)
    sock.sendall(post_head(path, 100_000, "application/json") + b"{")
    return sock


def closed(sock) -> bool:
    """Whether the server has closed `sock` (what it answered first is read and dropped)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


@pytest.mark.slow
def test_240_unfinished_bodies_from_8_addresses_keep_no_visitor_out_and_are_closed(app):
    demo, port = app
    held = [unfinished(port, f"127.0.2.{a + 1}") for a in range(8) for _ in range(30)]
    # request() fails when a read waits over 10 s: the page and its config come through the held bodies
    page = request(port, "127.0.3.1", b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    config = request(port, "127.0.3.1", b"GET /config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status(page) == 200 and status(config) == 200
    # The default deadline (10 s of grace at 240 bytes/s) closes each well within a minute.
    wait_until(lambda: all(closed(sock) for sock in held), timeout=60, interval=0.5,
               message=lambda: f"{sum(not closed(s) for s in held)} unfinished bodies still open")
    snapshot = demo.edge.snapshot()
    assert snapshot["refused"].get("body timeout", 0) + snapshot["sockets"]["refused"].get(
        "evicted at the cap", 0) + snapshot["sockets"]["refused"].get("too many connections", 0) >= 240
    for sock in held:
        sock.close()


def rss() -> int:
    with open("/proc/self/status") as status_file:
        for line in status_file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_96_held_multipart_bodies_hold_a_bounded_memory_given_back_when_they_close(app):
    """/v1/images/edits reads its multipart body into memory as it arrives: 96 bodies of 28 MB of 30 from two
    addresses held 32 MiB a connection for as long as the client liked. Each address's share is taken by the
    length its bodies announce, so past it a body is refused before it is read."""
    demo, port = app
    boundary = "b0undary"
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()
    length, sent_each, chunk = 30 * 2**20, 28 * 2**20, b"\x89" * 2**20
    before = rss()
    held = []
    for i in range(96):
        sock = connect(port, f"127.0.4.{i % 2 + 1}")
        sock.settimeout(5)
        held.append(sock)
        try:
            sock.sendall(post_head("/v1/images/edits", length, f"multipart/form-data; boundary={boundary}") + part)
            for _ in range(sent_each // len(chunk)):
                sock.sendall(chunk)
        except OSError:
            continue  # refused (its address holds its share) and closed
    time.sleep(1.0)
    grown = rss() - before
    held_bytes = demo.edge.bodies.snapshot()["held_bytes"]
    for sock in held:
        sock.close()
    assert grown <= 256 * 2**20, f"web RSS grew {grown / 2**20:.0f} MiB (bodies hold {held_bytes / 2**20:.0f} MiB)"
    assert demo.edge.snapshot()["refused"].get("body memory per client", 0) >= 90
    wait_until(lambda: demo.edge.bodies.snapshot()["held_bytes"] == 0, timeout=10,
               message="the bytes given back when the clients went")
    wait_until(lambda: rss() - before <= 64 * 2**20, timeout=10,
               message=lambda: f"web RSS still {(rss() - before) / 2**20:.0f} MiB over what it was")
    answer = request(port, "127.0.4.1", b"GET /config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status(answer) == 200 and json.loads(answer.split(b"\r\n\r\n", 1)[1])


# -- the flags -----------------------------------------------------------------------------------------------
def test_body_flags_default_to_the_module_defaults_and_zero_turns_them_off():
    import app as app_module
    from ui import bodies

    args = app_module.build_parser().parse_args([])
    assert app_module.edge_config(args, public=True).bodies == bodies.public_body_bounds()
    assert app_module.edge_config(args, public=False).bodies == bodies.BodyBounds()
    args = app_module.build_parser().parse_args(["--body-min-rate", "0", "--body-timeout", "0"])
    off = app_module.edge_config(args, public=False).bodies
    assert not off.timed and off.seconds_left(0.0, 0, 1e9) == float("inf")


@pytest.mark.parametrize("flag, value, says", [
    ("--body-min-rate", "-5", "out of range"),
    ("--body-timeout", "soon", "'soon' is not a number"),
    ("--body-timeout", "inf", "out of range"),
])
def test_bad_body_flags_exit_2_naming_the_flag(flag, value, says, capsys):
    import app as app_module

    with pytest.raises(SystemExit) as exit_:
        app_module.build_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in error and says in error, error
