"""Bounds at the socket: what a connection may hold before a request exists.

The body bound and the queue bounds (ui/edge.py) act on requests; these act on connections, before the
HTTP parser sees a byte: a cap on open connections (in total, and per client address in public mode), a
deadline for a request's headers (slowloris), and a bound on header bytes and header lines. httptools, the
parser uvicorn picks when it is installed, has no header limit of its own, so an ASGI middleware (which runs
once the headers are parsed) is too late: the bounds live in a subclass of uvicorn's protocol class,
whichever one the server would use, and count the bytes in `data_received` before handing them on.

How it reaches the server: Gradio's `launch()` builds uvicorn's Config itself and offers no `http=` option.
It constructs its server through `gradio.http_server.Server`; `install_server_hook` replaces that name with a
subclass that, for an app whose Blocks carries an edge guard, sets the Config's `http` to the bounded
protocol class before uvicorn loads it (uvicorn's own, supported hook for a protocol class). Any other app's
server is built as before.

Past a bound: a new connection is refused with 503 (at the total cap, an idle connection, one still
sending a head or a body, or one holding a stream may be closed to make room instead: see SocketGuard.admit), a
request's head over a bound gets 431, a head past its deadline 408, a stream past its address's share 429,
and the connection is closed. Each refusal is counted by reason (/system) and logged at most once per
LOG_EVERY_S.

Streams: a request that holds its connection for as long as the client likes (Gradio's heartbeat and event
streams, an MCP stream, a websocket) is never idle, so idleness alone let held streams fill the cap for good.
Such a request is recognised from its head (is_stream), counted per address while it lasts, refused past
`streams_per_client`, and at the total cap the address holding the most gives up its oldest stream as it
would an idle connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Defaults a 2-core public Space survives; app.py's flags carry the same numbers (tests/test_socket_bounds.py).
MAX_CONNECTIONS = 1000  # all clients together; the descriptor limit is raised to fit (fit_descriptors)
PER_CLIENT = 64  # public mode: one address (a browser opens ~6 per site; an office behind NAT shares one)
STREAMS_PER_CLIENT = 16  # public mode: held streams of one address (a page holds one heartbeat and one event stream)
HEADER_TIMEOUT_S = 10.0  # from connect (or a request's first byte) to the end of its headers
MAX_HEADER_BYTES = 32 * 1024  # request line + headers, as nginx's 4 x 8 KiB
MAX_HEADERS = 100  # header lines, as Envoy's and Apache's default
EVICT_AFTER_S = 1.0  # at the total cap, any connection idle or in its headers this long may be closed for a new one
LINGER_S = 1.0  # after a 431/400 the rest of what the client sends is read and dropped this long, so it sees the answer
LINGER_BYTES = 64 * 1024  # ... or this much: past it the client is sending for sending's sake, and the socket is reset
LOG_EVERY_S = 30.0
FD_RESERVE = 512  # descriptors beyond the connections: engine workers' pipes, model and cache files, logs

REASONS = {  # refusal reason -> (status, what the visitor reads); status None: closed without an answer
    "too many connections": (503, "This server has too many open connections; retry in a few seconds"),
    "too many from one address": (503, "Too many open connections from your address; close some and retry"),
    "evicted at the cap": (None, ""),
    "too many streams from one address": (429, "Too many open event streams from your address; close some "
                                               "tabs or streams and retry"),
    "header timeout": (408, "The request's headers did not arrive in time"),
    "headers too large": (431, "The request's headers are over this server's size limit"),
    "too many headers": (431, "The request has more header lines than this server accepts"),
    "bad framing": (400, "The request's Content-Length or chunk size is not a number"),
}
_PHRASES = {400: "Bad Request", 408: "Request Timeout", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}
# GET paths whose answer is a stream held open (Gradio's heartbeat, its queue's and the simple API's event
# streams, MCP's): matched anywhere in the path, so a mount prefix does not hide them.
STREAM_ROUTES = (b"/heartbeat/", b"/queue/data", b"/call/", b"/mcp")


@dataclass(frozen=True)
class SocketBounds:
    max_connections: int = MAX_CONNECTIONS
    per_client: int | None = None  # None: no per-address cap (a developer's machine; see public_bounds)
    streams_per_client: int | None = None  # held streams per address; None: no cap (as per_client)
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADERS


def public_bounds() -> SocketBounds:
    return SocketBounds(per_client=PER_CLIENT, streams_per_client=STREAMS_PER_CLIENT)


def is_stream_path(path: bytes) -> bool:
    return any(route in path for route in STREAM_ROUTES)


def is_stream(request_line: bytes, upgrade: bool) -> bool:
    """Whether a request (its request line, and whether it asks for an Upgrade) holds its connection open for
    as long as the client likes."""
    if upgrade:
        return True
    method, _, rest = request_line.partition(b" ")
    if method != b"GET":
        return False
    return is_stream_path(rest.rsplit(b" ", 1)[0].split(b"?", 1)[0])


def _answer(status: int, message: str) -> bytes:
    body = json.dumps({"detail": message}).encode()
    return (f"HTTP/1.1 {status} {_PHRASES[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


# -- where each request's head begins and ends in a connection's bytes --------------------------------------
HEAD, BODY, CHUNK_LINE, CHUNK_DATA, CHUNK_END, TRAILERS, PASS = range(7)


class HeadScanner:
    """Follows HTTP/1.1 framing (Content-Length, chunked, pipelining) just enough to know which bytes are a
    request's head, and bounds those. It keeps at most one unfinished line (itself bounded). A connection
    upgraded to a websocket leaves the protocol: `stop()` ends the scan."""

    def __init__(self, max_bytes: int, max_headers: int):
        self.max_bytes = max_bytes
        self.max_headers = max_headers
        self.state = HEAD
        self.line = bytearray()
        self.head_bytes = 0  # bytes of the current head (or chunk line / trailers)
        self.lines = 0
        self.heads = 0  # heads completed on this connection
        self.stream = False  # the last completed head asked for a stream (is_stream)
        self._reset_head()

    def _reset_head(self) -> None:
        self.head_bytes = 0
        self.lines = 0
        self.length = 0
        self.chunked = False
        self.request_line = b""
        self.upgrade = False

    def stop(self) -> None:
        self.state = PASS
        self.line.clear()

    @property
    def in_body(self) -> bool:
        """A request's head has ended and its body has not."""
        return self.state in (BODY, CHUNK_LINE, CHUNK_DATA, CHUNK_END, TRAILERS)

    @property
    def mid_head(self) -> bool:
        """A request's head has begun and not ended."""
        return self.state == HEAD and self.head_bytes > 0

    def feed(self, data: bytes) -> str | None:
        """Account for `data`; the refusal reason when it breaks a bound, else None."""
        i, n = 0, len(data)
        while i < n:
            state = self.state
            if state == PASS:
                return None
            if state in (BODY, CHUNK_DATA):
                take = min(self.length, n - i)
                self.length -= take
                i += take
                if self.length == 0:
                    self.state = HEAD if state == BODY else CHUNK_END
                continue
            j = data.find(b"\n", i)
            end = n if j < 0 else j + 1
            self.head_bytes += end - i
            if self.head_bytes > self.max_bytes:
                return "headers too large"
            if j < 0:
                self.line += data[i:end]
                return None
            line = bytes(self.line) + data[i:j] if self.line else data[i:j]
            self.line.clear()
            i = end
            refusal = self._line(line.rstrip(b"\r"))
            if refusal:
                return refusal
        return None

    def _line(self, text: bytes) -> str | None:
        state = self.state
        if state == CHUNK_END:  # the CRLF after a chunk's data
            self.state, self.head_bytes = CHUNK_LINE, 0
            return None
        if state == CHUNK_LINE:
            try:
                size = int(text.split(b";", 1)[0].strip(), 16)
            except ValueError:
                return "bad framing"
            self.head_bytes = 0
            if size == 0:
                self.state = TRAILERS
            else:
                self.state, self.length = CHUNK_DATA, size
            return None
        if not text:
            if state == TRAILERS:
                self.state = HEAD
                self._reset_head()
            elif self.lines:  # the end of a head
                self.heads += 1
                self.stream = is_stream(self.request_line, self.upgrade)
                length = self.length
                self.state = CHUNK_LINE if self.chunked else BODY if length else HEAD
                self._reset_head()
                self.length = length if self.state == BODY else 0
            return None  # (blank lines before a request line are tolerated, as parsers do)
        self.lines += 1
        if state == TRAILERS:
            return "too many headers" if self.lines > self.max_headers else None
        if self.lines == 1:
            self.request_line = text[:512]
            return None
        if self.lines - 1 > self.max_headers:
            return "too many headers"
        return self._header(text)

    def _header(self, text: bytes) -> str | None:
        """A header line of a request's head: the ones framing and streams depend on are kept."""
        name, _, value = text.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            try:
                self.length = int(value.strip())
            except ValueError:
                return "bad framing"
            if self.length < 0:
                return "bad framing"
        elif name == b"transfer-encoding":
            self.chunked = b"chunked" in value.lower()
        elif name == b"upgrade":
            self.upgrade = True
        return None


# -- the guard ---------------------------------------------------------------------------------------------
def in_networks(host: str, nets) -> bool:
    """Whether `host` (an address as text) lies in one of `nets` (ip networks); not an address: False."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in net for net in nets)


class SocketGuard:
    """One per app: the connection counts and refusals. Protocol callbacks run on the server's event loop;
    the lock only makes /system's snapshot (another thread) consistent."""

    def __init__(self, bounds: SocketBounds | None = None, trusted_proxies=()):
        self.bounds = bounds or SocketBounds()
        self.trusted_proxies = tuple(trusted_proxies)  # their connections carry many visitors: total cap only
        self._lock = threading.Lock()
        self.open = 0
        self.peak = 0
        self.per_client: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._last_log = 0.0
        self._log_pending = False
        # Connections that may be closed at the cap (idle between requests, still sending a head or a body): all of
        # them oldest first, and per address; addresses by how many connections they hold, for fair shares.
        self._idle: OrderedDict = OrderedDict()  # connection -> when it became idle or began its headers
        self._idle_of: dict[str, OrderedDict] = {}
        self._holding: dict[int, set] = {}  # n -> addresses holding n connections
        self._streams: dict[str, OrderedDict] = {}  # address -> its connections holding a stream, oldest first
        self.streams_open = 0
        self.streams_peak = 0
        self.warned: Counter[str] = Counter()  # uvicorn's per-connection warnings, by message
        self._warned_at: dict[str, float] = {}
        self._top = 0  # the most any address holds
        self._classes: dict = {}

    # -- counts --------------------------------------------------------------------------------------
    def admit(self, conn, host: str) -> str | None:
        """Count a new connection, or the reason it is refused. At the total cap the newcomer takes the place
        of an idle connection (or else the oldest stream) of the address holding the most, when that address
        holds at least two more than the newcomer's (a fair share of the cap for every address, however many
        sockets one of them opens and whatever they hold); failing that, of the oldest idle connection once it
        has been idle EVICT_AFTER_S."""
        b = self.bounds
        victim = None
        with self._lock:
            mine = self.per_client[host]
            if b.per_client and mine >= b.per_client and not in_networks(host, self.trusted_proxies):
                return "too many from one address"
            if self.open >= b.max_connections:
                victim = self._victim(mine)
                if victim is None:
                    return "too many connections"
                self._release(victim)
            self.open += 1
            self.peak = max(self.peak, self.open)
            self._move(host, +1)
            self._set_idle(conn, True)
        if victim is not None:
            self.count("evicted at the cap")
            victim.close(None)
        return None

    def _victim(self, mine: int):
        for n in range(self._top, mine + 1, -1):
            hosts = self._holding.get(n, ())
            for held in (self._idle_of, self._streams):  # an idle connection first, else a held stream
                for host in hosts:
                    conns = held.get(host)
                    if conns:
                        return next(iter(conns))
        if self._idle:
            conn, since = next(iter(self._idle.items()))
            if time.monotonic() - since >= EVICT_AFTER_S:
                return conn
        return None

    def _move(self, host: str, step: int) -> None:
        n = self.per_client[host]
        if n:
            self._holding[n].discard(host)
        n += step
        if n > 0:
            self.per_client[host] = n
            self._holding.setdefault(n, set()).add(host)
            self._top = max(self._top, n)
        else:
            del self.per_client[host]
        while self._top and not self._holding.get(self._top):
            self._top -= 1

    def _set_idle(self, conn, idle: bool) -> None:
        host = conn.host
        if idle:
            if conn not in self._idle:
                self._idle[conn] = time.monotonic()
                self._idle_of.setdefault(host, OrderedDict())[conn] = None
        elif self._idle.pop(conn, None) is not None:
            mine = self._idle_of[host]
            del mine[conn]
            if not mine:
                del self._idle_of[host]

    def _release(self, conn) -> None:
        if not conn.counted:
            return
        conn.counted = False
        self.open -= 1
        self._move(conn.host, -1)
        self._set_idle(conn, False)
        self._end_stream(conn)

    def _end_stream(self, conn) -> None:
        if not conn.stream:
            return
        conn.stream = False
        self.streams_open -= 1
        mine = self._streams[conn.host]
        del mine[conn]
        if not mine:
            del self._streams[conn.host]

    def stream(self, conn, holding: bool) -> str | None:
        """`conn` begins (or ends) holding a stream; the reason it is refused when its address holds its share."""
        with self._lock:
            if not conn.counted:
                return None
            if not holding:
                self._end_stream(conn)
                return None
            if conn.stream:
                return None
            cap, mine = self.bounds.streams_per_client, self._streams.get(conn.host)
            if cap and mine and len(mine) >= cap and not in_networks(conn.host, self.trusted_proxies):
                return "too many streams from one address"
            self._streams.setdefault(conn.host, OrderedDict())[conn] = None
            conn.stream = True
            self.streams_open += 1
            self.streams_peak = max(self.streams_peak, self.streams_open)
        return None

    def release(self, conn) -> None:
        with self._lock:
            self._release(conn)

    def idle(self, conn, idle: bool) -> None:
        """Whether `conn` may be closed at the cap: idle between requests, or still sending a head or a body."""
        with self._lock:
            if conn.counted:
                self._set_idle(conn, idle)

    def count(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1
            self._unlogged[reason] += 1
            if self._log_pending:
                return
            self._log_pending = True
            wait = max(0.0, self._last_log + LOG_EVERY_S - time.monotonic())
        try:
            asyncio.get_running_loop().call_later(wait, self._log)
        except RuntimeError:  # not on a loop (a direct call): log now
            self._log()

    def _log(self) -> None:
        with self._lock:
            counts, self._unlogged = dict(self._unlogged), Counter()
            self._log_pending = False
            self._last_log = time.monotonic()
            open_now = self.open
        if counts:
            log.warning("connections refused at the socket bounds: %s (%d open now, cap %d)",
                        ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items())), open_now,
                        self.bounds.max_connections)

    def warn(self, logger, message, args) -> None:
        """One of uvicorn's per-connection warnings ("Invalid HTTP request received.", "Unsupported upgrade
        request.", ...): a line any visitor could repeat with every connection, so each message is logged at
        most once per LOG_EVERY_S, with how many times it happened."""
        text = str(message) % args if args else str(message)
        with self._lock:
            self.warned[text] += 1
            now = time.monotonic()
            due = now - self._warned_at.get(text, -LOG_EVERY_S) >= LOG_EVERY_S
            if due:
                if len(self._warned_at) >= 64:  # (uvicorn's messages are few; this keeps the table bounded)
                    self._warned_at.clear()
                self._warned_at[text] = now
            n = self.warned[text]
        if due:
            logger.warning("%s (%d so far; logged at most once per %.0f s)", text, n, LOG_EVERY_S)

    def fit_descriptors(self) -> None:
        """Raise this process's soft descriptor limit (up to the hard one) so the cap, not the kernel, is
        what a flood meets: at the limit accept() fails for every visitor alike."""
        try:
            import resource
        except ImportError:  # Windows has no descriptor limit to raise
            return
        want = self.bounds.max_connections + FD_RESERVE
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
        if soft != resource.RLIM_INFINITY and soft < want:
            log.warning("--max-connections %d needs about %d file descriptors; this process may open %d (ulimit "
                        "-n): lower --max-connections or raise the limit", self.bounds.max_connections, want, soft)

    def snapshot(self) -> dict:
        b = self.bounds
        with self._lock:
            return {"max_connections": b.max_connections, "per_client": b.per_client,
                    "streams_per_client": b.streams_per_client, "header_timeout_s": b.header_timeout_s,
                    "max_header_bytes": b.max_header_bytes, "max_headers": b.max_headers, "open": self.open,
                    "open_peak": self.peak, "streams": self.streams_open, "streams_peak": self.streams_peak,
                    "clients": len(self.per_client), "refused": dict(self.refused)}

    # -- the protocol --------------------------------------------------------------------------------
    def protocol(self, base: type) -> type:
        """`base` (a uvicorn HTTP protocol class) with these bounds in front of its parser."""
        if base not in self._classes:
            self._classes[base] = _bounded_protocol(base, self)
        return self._classes[base]

    def protocol_for(self, http) -> type:
        """The bounded class for a uvicorn Config's `http` setting ('auto', 'h11', 'httptools', a class)."""
        if isinstance(http, str):
            from uvicorn.config import HTTP_PROTOCOLS
            from uvicorn.importer import import_from_string

            http = import_from_string(HTTP_PROTOCOLS.get(http, http))
        return self.protocol(http)


class ConnectionBounds:
    """One connection as the guard sees it (counted, idle, evicted): its address, its head scanner and the
    deadline of the head under way, and, once refused, the answer and the linger that lets the client read it."""

    def __init__(self, guard: SocketGuard, transport):
        peer = transport.get_extra_info("peername")
        self.guard, self.bounds, self.transport = guard, guard.bounds, transport
        self.host = str(peer[0]) if isinstance(peer, tuple | list) and peer else "local"
        self.scan = HeadScanner(self.bounds.max_header_bytes, self.bounds.max_headers)
        self.done = False  # refused or closed: what still arrives is dropped
        self.admitted = False  # handed to uvicorn's protocol
        self.counted = False  # in the guard's counts (SocketGuard._release clears it)
        self.stream = False  # holding a stream, counted as such (SocketGuard.stream)
        self.responses = 0
        self._timer = None
        self._linger = None
        self._drained = 0

    # -- phases of the connection --------------------------------------------------------------------
    def admit(self) -> bool:
        """Count the connection, or answer its refusal and close it (False)."""
        self.counted = True  # admit() undoes it when it refuses
        refusal = self.guard.admit(self, self.host)
        if refusal:
            self.counted, self.done = False, True
            self.guard.count(refusal)
            status, message = REASONS[refusal]
            self.transport.write(_answer(status, message))
            self.transport.close()
            return False
        self.admitted = True
        return True

    @property
    def passing(self) -> bool:
        """Upgraded (a websocket): its frames go to the parser unscanned."""
        return not self.done and self.scan.state == PASS

    def screen(self, data: bytes) -> bool:
        """Scan bytes of a head before the parser sees them: True to hand them on, False when dropped or refused."""
        if self.done:  # refused: dropped, never parsed
            self._drained += len(data)
            if self._drained > LINGER_BYTES:
                self.transport.abort()
            return False
        scan, heads, in_body = self.scan, self.scan.heads, self.scan.in_body
        refusal = scan.feed(data)
        if refusal:
            self.guard.count(refusal)
            self.close(refusal)
            return False
        if scan.mid_head:
            if self._timer is None:  # a next request on a kept-alive connection began
                self.arm_deadline()
                self.guard.idle(self, True)
        elif scan.heads != heads:
            self._cancel()
            # Still waiting for its body, it may be closed at the cap as one still sending its head may.
            self.guard.idle(self, scan.in_body)
            refusal = self.guard.stream(self, True) if scan.stream else None
            if refusal:
                self.refuse_stream(refusal)
                return False
        elif in_body and not scan.in_body:  # the body arrived whole: the request is the handler's now
            self.guard.idle(self, False)
        return True

    def refuse_stream(self, reason: str) -> None:
        """The stream just asked for is over its address's share: answered (when no earlier request on the
        connection is still unanswered) and closed, never parsed."""
        self.guard.count(reason)
        self.done = True
        self._cancel()
        if self.responses >= self.scan.heads - 1:
            self.transport.write(_answer(*REASONS[reason]))
        self.transport.close()

    def after_parse(self, protocol) -> None:
        upgraded = self.transport.get_protocol()
        if upgraded is not protocol:
            # A websocket: its frames are not requests, but it stays counted (as the stream it is) until it
            # closes, which only the protocol it now speaks hears.
            self.scan.stop()
            self._cancel()
            ended = upgraded.connection_lost

            def connection_lost(exc, ended=ended):
                self.lost()
                ended(exc)

            upgraded.connection_lost = connection_lost

    def response_complete(self) -> None:
        scan = self.scan
        if self.responses >= scan.heads:
            if self.stream:
                self.guard.stream(self, False)
            if scan.state == HEAD and not scan.mid_head:
                self.guard.idle(self, True)  # kept alive for a next request (uvicorn's keep-alive timeout applies)

    def lost(self) -> None:
        self.guard.release(self)
        self._cancel()
        if self._linger is not None:
            self._linger.cancel()

    # -- the head's deadline and the close -----------------------------------------------------------
    def arm_deadline(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.bounds.header_timeout_s, self._late)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        scan = self.scan
        if self.done or not (scan.mid_head or scan.heads == 0) or scan.state != HEAD:
            return
        self.guard.count("header timeout")
        # A connection that sent nothing is closed silently, as an idle keep-alive one is: a client about to
        # use it would otherwise read the 408 as its request's answer.
        self.close("header timeout" if scan.mid_head else None)

    def close(self, reason: str | None) -> None:
        """Answer (unless a response is under way or `reason` is None) and close. After a 431 the client
        may still be sending: its bytes are read and dropped for LINGER_S so it can read the answer."""
        if self.done:
            return
        self.done = True
        self._cancel()
        transport = self.transport
        status = REASONS[reason][0] if reason else None
        if status is None or self.responses < self.scan.heads:
            transport.close()
            return
        transport.write(_answer(status, REASONS[reason][1]))
        if status == 408:
            transport.close()
            return
        try:
            transport.resume_reading()
            transport.write_eof()
        except (NotImplementedError, RuntimeError, OSError):  # TLS transports cannot half-close
            transport.close()
            return
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)


class _QuietLogger:
    """uvicorn's logger as one connection's protocol sees it: warnings through SocketGuard.warn."""

    def __init__(self, logger, guard: SocketGuard):
        self._logger, self._guard = logger, guard

    def __getattr__(self, name):
        return getattr(self._logger, name)

    def warning(self, message, *args, **kwargs) -> None:
        self._guard.warn(self._logger, message, args)


def _bounded_protocol(base: type, guard: SocketGuard) -> type:
    """`base` whose callbacks pass through a ConnectionBounds before (and after) uvicorn's own."""

    class Bounded(base):
        def connection_made(self, transport) -> None:
            self.logger = _QuietLogger(self.logger, guard)
            self._bounds = conn = ConnectionBounds(guard, transport)
            if conn.admit():
                super().connection_made(transport)
                conn.arm_deadline()

        def data_received(self, data: bytes) -> None:
            conn = self._bounds
            if conn.passing:
                super().data_received(data)
            elif conn.screen(data):
                super().data_received(data)
                conn.after_parse(self)

        def on_response_complete(self) -> None:
            self._bounds.responses += 1
            super().on_response_complete()
            self._bounds.response_complete()

        def connection_lost(self, exc) -> None:
            self._bounds.lost()
            if self._bounds.admitted:  # else uvicorn's protocol never saw the connection
                super().connection_lost(exc)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


# -- the hook into Gradio's server ----------------------------------------------------------------------
def guard_of(app) -> SocketGuard | None:
    """The socket guard of a Gradio app (its Blocks' edge guard carries it), if any."""
    blocks = getattr(app, "blocks", None)
    return getattr(getattr(blocks, "edge", None), "sockets", None)


def install_server_hook() -> None:
    """Make Gradio's launch() serve apps that carry a socket guard with the bounded protocol (once per process)."""
    from gradio import http_server

    if getattr(http_server.Server, "_socket_bounds_hook", False):
        return

    class Server(http_server.Server):
        _socket_bounds_hook = True

        def __init__(self, config, *args, **kwargs):
            guard = guard_of(config.app)
            if guard is not None and not config.loaded:
                config.http = guard.protocol_for(config.http)
                # Gradio speaks HTTP and SSE only; a websocket library in the environment (langsmith brings one)
                # would answer each Upgrade with a failed handshake and an ERROR line a visitor can repeat.
                config.ws = "none"
                guard.fit_descriptors()
            super().__init__(config, *args, **kwargs)

    http_server.Server = Server
