"""Issue 30, bounded at the socket: connection caps, the header deadline and header bounds (ui/sockets.py).

Most tests run a minimal uvicorn server on the bounded protocol, once per HTTP parser uvicorn may pick (h11,
httptools); the last ones launch the app and check the hook into Gradio's launch() and /system. Visitors
connect from distinct loopback addresses (127.0.0.2, 127.0.0.3, ...), as distinct clients would.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from helpers import free_port, wait_until

from ui.sockets import SocketBounds, SocketGuard

PARSERS = ("h11", "httptools")


async def hello(scope, receive, send):
    """The app behind the bounds: reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if b"/heartbeat/" in scope["raw_path"]:  # held open, as Gradio's heartbeat is, until the client goes
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"event: heartbeat\ndata: {}\n\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        return
    body = f"ok {size}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serve(parser: str, bounds: SocketBounds | None, trusted=(), record: list | None = None, app=hello,
          guard: SocketGuard | None = None):
    """A uvicorn server on 127.0.0.1 with `parser` behind the socket bounds (or `guard`'s); yields (guard,
    port). `record` collects the size of every chunk the HTTP parser itself was handed; `app`: the ASGI app
    served."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    guard = guard or SocketGuard(bounds, trusted)
    base = import_from_string(HTTP_PROTOCOLS[parser])
    if record is not None:
        class Recording(base):
            def data_received(self, data):
                record.append(len(data))
                super().data_received(data)
        base = Recording
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=guard.protocol(base),
                                           ws="none", log_level="warning", lifespan="off"))  # as the app's hook
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=10, message="the uvicorn server to start")
    try:
        yield guard, port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def connect(port: int, source: str = "127.0.0.2") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not within `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def request(port: int, source: str = "127.0.0.3", raw: bytes | None = None) -> bytes:
    sock = connect(port, source)
    try:
        sock.sendall(raw or b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return read_all(sock)
    finally:
        sock.close()


def status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("parser", PARSERS)
def test_slow_headers_closed_at_the_deadline(parser):
    with serve(parser, SocketBounds(header_timeout_s=1.5)) as (guard, port):
        slow = connect(port)
        silent = connect(port)
        slow.sendall(b"GET / HTTP/1.1\r\n")
        slow.settimeout(0.4)
        answer, lines = b"", 0
        for i in range(20):  # a header line every 0.4 s or more, as slowloris does every 5 s
            try:
                slow.sendall(b"X-Slow-%d: 1\r\n" % i)
                lines += 1
                chunk = slow.recv(4096)
            except (BrokenPipeError, ConnectionResetError):
                break
            except TimeoutError:
                continue
            answer += chunk
            if not chunk:
                break
        assert status(answer) == 408, answer
        # The deadline is the header's as a whole: a per-line one would never close it (every line comes
        # within 1.5 s of the last); the guard counts it as a header timeout below.
        assert 1 <= lines < 20, lines
        assert read_all(silent, timeout=3) == b""  # connected and sent nothing: closed too, without an answer
        assert guard.snapshot()["refused"]["header timeout"] == 2
        wait_until(lambda: guard.snapshot()["open"] == 0, timeout=5, message="the closed sockets to be released")
        assert status(request(port)) == 200


@pytest.mark.parametrize("parser", PARSERS)
def test_a_kept_alive_connection_gets_a_deadline_per_request(parser):
    with serve(parser, SocketBounds(header_timeout_s=1.5)) as (guard, port):
        sock = connect(port)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # idle between requests: uvicorn's keep-alive timeout (5 s), not the header deadline
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the next request's headers, never finished
        assert read_all(sock).startswith(b"HTTP/1.1 408")  # the header deadline's answer (counted below)
        assert guard.snapshot()["refused"] == {"header timeout": 1}


@pytest.mark.parametrize("parser", PARSERS)
def test_oversized_headers_get_431_and_are_never_buffered(parser):
    limit = 8 * 1024
    handed = []
    with serve(parser, SocketBounds(max_header_bytes=limit), record=handed) as (guard, port):
        sock = connect(port)
        sent = 0

        def flood():  # 8 MiB of one header, as fast as the server reads it
            nonlocal sent
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
            chunk = b"a" * 65536
            try:
                for _ in range(128):
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass

        writer = threading.Thread(target=flood, daemon=True)
        writer.start()
        answer = read_all(sock)
        writer.join(timeout=10)
        sock.close()
        assert status(answer) == 431, answer
        assert b"size limit" in answer
        assert sum(handed) <= limit  # the parser never saw the header past the bound
        assert guard.snapshot()["refused"] == {"headers too large": 1}
        # Just under the bound is served.
        filler = b"y" * (limit - 200)
        assert status(request(port, raw=b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-F: " + filler
                              + b"\r\n\r\n")) == 200


@pytest.mark.parametrize("parser", PARSERS)
def test_too_many_headers_get_431(parser):
    with serve(parser, SocketBounds(max_headers=20)) as (guard, port):
        def get(extra: int) -> bytes:  # Host + `extra` + Connection header lines
            lines = b"".join(b"X-H%d: 1\r\n" % i for i in range(extra))
            return request(port, raw=b"GET / HTTP/1.1\r\nHost: x\r\n" + lines + b"Connection: close\r\n\r\n")

        assert status(get(18)) == 200
        answer = get(19)
        assert status(answer) == 431 and b"more header lines" in answer
        assert guard.snapshot()["refused"] == {"too many headers": 1}


@pytest.mark.parametrize("parser", PARSERS)
def test_bodies_and_pipelined_requests_are_not_headers(parser):
    """Bytes past a head (a Content-Length body, a chunked one, a next pipelined request) are not counted as
    header bytes: a 64 KiB body passes an 8 KiB header bound, and each pipelined head gets its own bound."""
    with serve(parser, SocketBounds(max_header_bytes=8 * 1024, max_headers=20)) as (guard, port):
        body = b"b" * 65536
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (b"c" * 5000, b"d" * 7000)) + b"0\r\n\r\n"
        sock = connect(port)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
                     + b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                     + b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_all(sock)
        sock.close()
        assert answers.count(b"HTTP/1.1 200") == 3, answers
        assert b"ok 65536" in answers and b"ok 12000" in answers
        assert guard.snapshot()["refused"] == {}


@pytest.mark.parametrize("parser", PARSERS)
def test_connections_capped_per_address(parser):
    with serve(parser, SocketBounds(per_client=3, header_timeout_s=30)) as (guard, port):
        held = [connect(port, "127.0.0.2") for _ in range(3)]
        wait_until(lambda: guard.snapshot()["open"] == 3, timeout=5, message="three connections counted")
        answer = read_all(connect(port, "127.0.0.2"))
        assert status(answer) == 503 and b"your address" in answer  # refused at once: the 30 s deadline says 408
        assert status(request(port, "127.0.0.3")) == 200  # another address is still served
        snapshot = guard.snapshot()
        assert snapshot["refused"] == {"too many from one address": 1}
        assert snapshot["open_peak"] == 4 and snapshot["clients"] == 1
        for sock in held:
            sock.close()
        wait_until(lambda: guard.snapshot()["open"] == 0, timeout=5, message="the held connections to be released")
        assert status(request(port, "127.0.0.2")) == 200


def test_trusted_proxy_counts_only_in_the_total():
    import ipaddress

    proxy = (ipaddress.ip_network("127.0.0.2/32"),)
    with serve("httptools", SocketBounds(per_client=2, header_timeout_s=30), trusted=proxy) as (guard, port):
        held = [connect(port, "127.0.0.2") for _ in range(4)]  # four visitors behind one proxy
        assert status(request(port, "127.0.0.2")) == 200
        assert guard.snapshot()["refused"] == {}
        for sock in held:
            sock.close()


@pytest.mark.parametrize("parser", PARSERS)
def test_total_cap_refuses_then_makes_room(parser):
    """At the cap a new connection gets 503 while every open one is young; once the oldest has been idle (or
    in its headers) EVICT_AFTER_S, it is closed for the newcomer, so a flood of slow sockets from many
    addresses cannot keep a real visitor out."""
    from ui.sockets import EVICT_AFTER_S

    with serve(parser, SocketBounds(max_connections=16, header_timeout_s=30)) as (guard, port):
        held = [connect(port, f"127.0.1.{i + 1}") for i in range(16)]
        wait_until(lambda: guard.snapshot()["open"] == 16, timeout=5, message="sixteen connections counted")
        answer = read_all(connect(port, "127.0.0.9"))
        assert status(answer) == 503 and b"too many open connections" in answer
        time.sleep(EVICT_AFTER_S + 0.2)
        assert status(request(port, "127.0.0.9")) == 200
        assert read_all(held[0], timeout=3) == b""  # the oldest was closed to make room
        snapshot = guard.snapshot()
        assert snapshot["refused"] == {"too many connections": 1, "evicted at the cap": 1}
        assert snapshot["open_peak"] == 16
        for sock in held:
            sock.close()


@pytest.mark.parametrize("parser", PARSERS)
def test_at_the_cap_the_busiest_address_makes_room_at_once(parser):
    """One address holding every place: its own next connection is refused, another address's is served
    at once, in the place of the busy address's oldest idle connection."""
    with serve(parser, SocketBounds(max_connections=16, header_timeout_s=30)) as (guard, port):
        held = [connect(port, "127.0.0.2") for _ in range(16)]
        wait_until(lambda: guard.snapshot()["open"] == 16, timeout=5, message="sixteen connections counted")
        assert status(read_all(connect(port, "127.0.0.2"))) == 503
        assert status(request(port, "127.0.0.9")) == 200
        assert read_all(held[0], timeout=3) == b""
        assert guard.snapshot()["refused"] == {"too many connections": 1, "evicted at the cap": 1}
        for sock in held:
            sock.close()


def hold_stream(port: int, source: str) -> socket.socket:
    """A heartbeat stream held open from `source` (its first event read)."""
    sock = connect(port, source)
    sock.sendall(b"GET /gradio_api/heartbeat/%s HTTP/1.1\r\nHost: x\r\n\r\n" % source.encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.parametrize("parser", PARSERS)
def test_held_streams_capped_per_address(parser):
    """Issue 37: held streams were counted only as connections. Past its share of streams an address gets 429
    at once; another address's stream and an ordinary request are served; a closed stream frees its place."""
    with serve(parser, SocketBounds(per_client=64, streams_per_client=3, header_timeout_s=30)) as (guard, port):
        held = [hold_stream(port, "127.0.0.2") for _ in range(3)]
        assert guard.snapshot()["streams"] == 3
        answer = request(port, "127.0.0.2", b"GET /gradio_api/heartbeat/more HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(answer) == 429 and b"event streams from your address" in answer
        assert status(request(port, "127.0.0.2")) == 200  # not a stream: served
        other = hold_stream(port, "127.0.0.3")
        held[0].close()
        wait_until(lambda: guard.snapshot()["streams"] == 3, timeout=5, message="the closed stream released")
        held[0] = hold_stream(port, "127.0.0.2")
        snapshot = guard.snapshot()
        assert snapshot["refused"] == {"too many streams from one address": 1}
        assert snapshot["streams_peak"] == 4 and snapshot["streams_per_client"] == 3
        for sock in (*held, other):
            sock.close()
        wait_until(lambda: guard.snapshot()["streams"] == 0 and guard.snapshot()["open"] == 0, timeout=5,
                   message="every stream released")


@pytest.mark.parametrize("parser", PARSERS)
def test_at_the_cap_held_streams_make_room(parser):
    """Issue 37: 17 addresses × 64 held heartbeat streams filled the cap with connections that were never idle,
    so nothing could be evicted and every other visitor got 503. At the cap the address holding the most
    gives up its oldest stream for a newcomer from an address holding fewer."""
    with serve(parser, SocketBounds(max_connections=16, per_client=8, header_timeout_s=30)) as (guard, port):
        held = [hold_stream(port, source) for source in ("127.0.1.1", "127.0.1.2") for _ in range(8)]
        assert guard.snapshot()["open"] == 16
        visitor = []
        for i in range(4):  # a visitor's page opens four kept-alive connections while the streams are held
            sock = connect(port, "127.0.0.9")
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), i
            visitor.append(sock)
        refused = guard.snapshot()["refused"]
        assert refused == {"evicted at the cap": 4}, refused
        for oldest in (held[0], held[1], held[8], held[9]):  # each address gave up its two oldest streams
            read_all(oldest, timeout=5)  # (fails when the server keeps it open)
        assert guard.snapshot()["streams"] == 12
        for sock in held + visitor:
            sock.close()


def test_streams_behind_a_trusted_proxy_count_for_the_client_it_names():
    """Behind a proxy the socket layer sees one address carrying every visitor: the held streams are counted
    per forwarded client at the edge instead."""
    import asyncio
    import ipaddress

    from ui.edge import EdgeConfig, EdgeGuard

    guard = EdgeGuard(EdgeConfig(trusted_proxies=(ipaddress.ip_network("10.0.0.1/32"),),
                                 sockets=SocketBounds(streams_per_client=2)))

    async def main():
        release = asyncio.Event()

        async def stream(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await release.wait()
            await send({"type": "http.response.body", "body": b""})

        spec = guard.middleware()  # as Starlette builds it
        middleware = spec.cls(stream, *spec.args, **spec.kwargs)

        async def call(client: str):
            scope = {"type": "http", "method": "GET", "path": "/gradio_api/heartbeat/x", "query_string": b"",
                     "headers": [(b"x-forwarded-for", client.encode())], "client": ("10.0.0.1", 4000)}
            sent = []

            async def send(message):
                sent.append(message)

            task = asyncio.create_task(middleware(scope, release.wait, send))
            for _ in range(100):
                if sent:
                    break
                await asyncio.sleep(0.01)
            return task, sent[0]["status"]

        held = [await call("203.0.113.5") for _ in range(2)]
        assert [status for _, status in held] == [200, 200]
        third, status = await call("203.0.113.5")
        assert status == 429
        other, status = await call("198.51.100.7")  # another visitor behind the same proxy
        assert status == 200
        release.set()
        await asyncio.gather(third, other, *(task for task, _ in held))

    asyncio.run(main())
    assert guard.refused["too many streams from one address"] == 1
    assert not guard.streams._proxied


@pytest.mark.parametrize("parser", PARSERS)
def test_uvicorns_warnings_per_connection_are_logged_once_per_interval(parser, caplog):
    """Issue 37, log flood: uvicorn warned for every invalid request, and twice for every Upgrade request
    (without a websocket library), a line any visitor could repeat with each connection."""
    uvicorn_log = logging.getLogger("uvicorn.error")  # (uvicorn's logging config does not propagate it)
    with serve(parser, SocketBounds()) as (guard, port), caplog.at_level("WARNING"):
        uvicorn_log.addHandler(caplog.handler)
        for i in range(20):
            assert status(request(port, raw=b"NOT HTTP AT ALL\x00\r\n\r\n")) == 400, i
        for i in range(20):
            answer = request(port, raw=b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n"
                                       b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: %s\r\n\r\n"
                                       % b"dGhlIHNhbXBsZSBub25jZQ==")
            assert status(answer) == 200, i  # served as plain HTTP
        wait_until(lambda: guard.snapshot()["open"] == 0, timeout=5, message="the connections released")
        uvicorn_log.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 3 and any("Invalid HTTP request received. (1 so far" in line for line in lines), lines
    assert guard.warned["Invalid HTTP request received."] == 20
    assert guard.warned["Unsupported upgrade request."] == 20


def test_refusals_are_logged_once_per_interval(caplog):
    with serve("httptools", SocketBounds(per_client=1, header_timeout_s=30)) as (guard, port):
        held = connect(port, "127.0.0.2")
        wait_until(lambda: guard.snapshot()["open"] == 1, timeout=5, message="one connection counted")
        with caplog.at_level("WARNING", logger="ui.sockets"):
            for _ in range(20):
                read_all(connect(port, "127.0.0.2"))
            wait_until(lambda: any("refused" in r.message for r in caplog.records), timeout=5, message="a log line")
        lines = [r.message for r in caplog.records if r.name == "ui.sockets"]
        assert len(lines) == 1 and "too many from one address" in lines[0], lines
        held.close()


# -- the app: Gradio's launch() serves with the bounds, /system counts the refusals ---------------------------
@pytest.fixture(scope="module")
def app(manager):
    from helpers import launch_demo

    from ui.edge import EdgeConfig
    from ui.handlers import UIDefaults

    edge = EdgeConfig(sockets=SocketBounds(per_client=4, header_timeout_s=2, max_header_bytes=4096, max_headers=50))
    demo, url = launch_demo(manager, UIDefaults(device="cpu", mode="eager"), edge=edge)
    yield demo, int(url.rstrip("/").rsplit(":", 1)[1])
    demo.close()


@pytest.mark.slow
def test_launched_app_is_bounded_and_system_counts_it(app, manager):
    from ui.system import web_server

    demo, port = app

    def sockets():
        return web_server(manager.serving(), demo.edge)["edge"]["sockets"]

    before = sockets()
    assert before["max_header_bytes"] == 4096 and before["per_client"] == 4
    page = request(port, raw=b"GET /config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status(page) == 200  # a visitor's request is served as before
    answer = request(port, raw=b"GET / HTTP/1.1\r\nHost: x\r\nCookie: " + b"c" * 8192 + b"\r\n\r\n")
    assert status(answer) == 431
    held = [connect(port, "127.0.0.4") for _ in range(4)]
    wait_until(lambda: sockets()["open"] >= 4, timeout=5, message="four connections counted")
    assert status(read_all(connect(port, "127.0.0.4"))) == 503
    slow = connect(port, "127.0.0.5")
    slow.sendall(b"GET / HTTP/1.1\r\n")
    assert status(read_all(slow, timeout=6)) == 408
    refused = sockets()["refused"]
    assert refused["headers too large"] == 1 and refused["too many from one address"] == 1
    assert refused["header timeout"] >= 1  # (the held sockets reach it too)
    for sock in held:
        sock.close()


# -- the flags ----------------------------------------------------------------------------------------------
def test_flag_defaults_are_the_module_defaults():
    import app as app_module
    from ui import sockets

    args = app_module.build_parser().parse_args([])
    assert (args.max_connections, args.header_timeout, args.max_header_bytes, args.max_headers) == (
        sockets.MAX_CONNECTIONS, sockets.HEADER_TIMEOUT_S, sockets.MAX_HEADER_BYTES, sockets.MAX_HEADERS)
    assert app_module.edge_config(args, public=True).sockets == sockets.public_bounds()
    # a developer's machine: no per-address cap (load tests come from one address)
    assert app_module.edge_config(args, public=False).sockets == SocketBounds()
    args = app_module.build_parser().parse_args(["--max-connections-per-client", "0", "--max-header-bytes", "16KiB"])
    assert app_module.edge_config(args, public=True).sockets == SocketBounds(
        per_client=None, streams_per_client=sockets.STREAMS_PER_CLIENT, max_header_bytes=16384)
    args = app_module.build_parser().parse_args(["--max-streams-per-client", "4"])
    assert app_module.edge_config(args, public=False).sockets == SocketBounds(streams_per_client=4)


@pytest.mark.parametrize("flag, value, says", [
    ("--max-connections", "5", "out of range; allowed: 16..1000000"),
    ("--max-connections-per-client", "-1", "allowed: 1..1000000, or 0 (unbounded)"),
    ("--max-streams-per-client", "many", "allowed: 1..1000000, or 0 (unbounded)"),
    ("--header-timeout", "0", "out of range; allowed: 1..600"),
    ("--header-timeout", "soon", "'soon' is not a number"),
    ("--max-header-bytes", "100", "not a size from 1KiB to 1MiB"),
    ("--max-header-bytes", "2GiB", "not a size from 1KiB to 1MiB"),
    ("--max-header-bytes", "lots", "not a size from 1KiB to 1MiB"),
    ("--max-headers", "3", "out of range; allowed: 8..10000"),
])
def test_bad_flag_values_exit_2_naming_the_flag(flag, value, says, capsys):
    import app as app_module

    with pytest.raises(SystemExit) as exit_:
        app_module.build_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in error, error
    assert says in error, error


def test_environment_values_are_checked_as_the_flags(monkeypatch, capsys):
    import app as app_module

    monkeypatch.setenv("SHOWCASE_MAX_HEADER_BYTES", "16KiB")
    assert app_module.build_parser().parse_args([]).max_header_bytes == 16384
    monkeypatch.setenv("SHOWCASE_MAX_CONNECTIONS", "5")
    with pytest.raises(SystemExit) as exit_:
        app_module.build_parser().parse_args([])
    assert exit_.value.code == 2
    assert "argument --max-connections: 5 is out of range" in capsys.readouterr().err
