"""The web edge: what a visitor's HTTP request may cost before a handler sees it.

- Every request body is bounded (Content-Length checked before reading, streamed bytes counted);
  multipart bodies are refused but on Gradio's upload route, which takes input images (edits) within
  MAX_UPLOAD_BODY_BYTES (engine/config/images.py bounds each file and decodes it once), and on the routes
  of UPLOAD_ROUTES, which read their own multipart body bounded as it arrives (POST /v1/images/edits, and
  POST /v1/videos with its source image);
  what is uploaded is never served back by `/file=` or `/file/`, to its sender or anyone else.
- Gradio's queue is hooked at `Queue.push` (every join route goes through it): each client (its
  address, see `client_address`) may hold a bounded number of events waiting or running, and each
  concurrency group has its own queue bound, so a full generate queue never refuses /status, /cancel
  or /system. A group's waiting events take turns between clients (`in_turns`), not first come first served.
- Connections are bounded before any of this, at the socket (ui/sockets.py): open connections in total
  and per address, a deadline and a size bound for a request's headers.
- The event streams that are open (GET .../queue/data, .../call/<api>/<event_id>) are tracked per
  session, so a handler can drop an event whose client never listens before it reaches an engine.
- A request that fails by the visitor's fault (an unknown function, event or session, inputs Gradio refuses)
  gets a 4xx and at most one log line, never a traceback; every line a visitor can cause is rate-limited
  (ui/quietlog.py).
- Nothing a visitor asks for writes outside the cache folder or reads outside the app's outputs: Gradio's
  deep links (each call wrote the session's components to disk; the app offers none) are refused, and
  `/file=` serves only files in this app's own temporary folder (ui/webtemp.py), where its outputs are.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

from engine.config import strict
from engine.errors import InvalidRequest, ShowcaseError
from ui import quietlog
from ui.addresses import client_address
from ui.bodies import BodyBounds, BodyLedger, BodyReader
from ui.keyguard import KeyGuard
from ui.sockets import REASONS, SocketBounds, SocketGuard, in_networks, is_stream_path
from ui.uploads import MAX_UPLOADS_BYTES
from ui.webtemp import UploadShares

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024  # a /generate body with 2 × 4,000-character prompts is ~10 KB
MAX_UPLOAD_BODY_BYTES = MAX_UPLOADS_BYTES + 64 * 1024  # one request's input images and the multipart framing
# Routes that read a multipart body of their own, bounded as it arrives, and their body bound (the route's own).
# ui/openai_edits.py EDIT_BODY_BYTES, ui/openai_videos.py VIDEO_BODY_BYTES
UPLOAD_ROUTES = {"/v1/images/edits": 65 * 2**20, "/v1/videos": 33 * 2**20}
LISTEN_GRACE_S = 3.0  # a page or gradio_client opens its event stream right after joining
CLIENT_EVENTS = 8  # public mode: events one client may have waiting or running
RETRY_STATUSES = (429, 503)  # refusals that say when to retry (Retry-After)
RETRY_AFTER_S = 5  # a refusal at the edge: a place frees when one request ends
MCP_CALLER_HEADER = "x-showcase-mcp-caller"  # an MCP tool call's agent (EdgeGuard.mark_mcp_caller)


class ClientGone(ShowcaseError):
    """The event's client is not listening for its result: it is dropped before it runs."""


@dataclass(frozen=True)
class EdgeConfig:
    max_body_bytes: int = MAX_BODY_BYTES
    client_events: int | None = None  # None: no per-client bound (a developer's own machine)
    group_queue: int | None = 64  # events waiting per concurrency group
    trusted_proxies: tuple = field(default=())  # ip networks whose X-Forwarded-For is believed
    listen_grace_s: float = LISTEN_GRACE_S
    sockets: SocketBounds | None = field(default_factory=SocketBounds)  # None: no socket bounds
    bodies: BodyBounds | None = field(default_factory=BodyBounds)  # body deadlines and memory; None: size only


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *_retry_after(status)]})
    await send({"type": "http.response.body", "body": body})


def _retry_after(status: int, headers=()) -> list:
    """A Retry-After header for a refusal that a retry may pass (429, 503) when it carries none yet."""
    if status not in RETRY_STATUSES or any(k.lower() == b"retry-after" for k, _ in headers):
        return []
    return [(b"retry-after", str(RETRY_AFTER_S).encode())]


class Callers:
    """Who sent a request: its address (behind trusted proxies, the forwarded one), or for an MCP tool call
    the agent that made it, named in a header this edge signed."""

    def __init__(self, trusted_proxies: tuple):
        self.trusted_proxies = trusted_proxies
        self._secret = secrets.token_bytes(32)  # signs MCP caller headers (mark_mcp_caller); never leaves here

    def client_of(self, request) -> str:
        """The client of a Starlette/fastapi request (or a gr.Request's underlying one); for an MCP tool
        call (which Gradio makes over loopback) the agent that called it."""
        request = getattr(request, "request", None) or request
        headers = getattr(request, "headers", None) or {}
        caller = self.mcp_caller(headers.get(MCP_CALLER_HEADER))
        if caller is not None:
            return caller
        peer = getattr(getattr(request, "client", None), "host", None)
        return client_address(peer, headers.get("x-forwarded-for"), self.trusted_proxies)

    def mcp_caller(self, value: str | None) -> str | None:
        """The address in an MCP caller header this edge signed, else None (a forged one names nobody)."""
        address, _, signature = (value or "").rpartition(" ")
        if address and hmac.compare_digest(signature, self._sign(address)):
            return address
        return None

    def _sign(self, address: str) -> str:
        return hmac.new(self._secret, address.encode(), hashlib.sha256).hexdigest()

    def mark_mcp_caller(self, scope) -> None:
        """An MCP request: Gradio copies its headers onto the loopback API call it makes for the tool, so a
        header naming the agent's address, signed with this edge's secret, makes that call count against
        the agent's own bounds (and not all agents' against one loopback address)."""
        peer = (scope.get("client") or (None,))[0]
        address = client_address(peer, _header(scope, b"x-forwarded-for"), self.trusted_proxies)
        name = MCP_CALLER_HEADER.encode()
        headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() != name]
        headers.append((name, f"{address} {self._sign(address)}".encode("latin-1")))
        scope["headers"] = headers


class Streams:
    """The event streams open now: which sessions listen for their results, and how many streams each client
    behind a trusted proxy holds. `queue` is Gradio's queue (set when the edge is installed): it tells which
    events and sessions exist."""

    def __init__(self, trusted_proxies: tuple, listen_grace_s: float, streams_per_client: int | None):
        self.trusted_proxies, self.listen_grace_s, self.per_client = trusted_proxies, listen_grace_s, streams_per_client
        self.queue = None
        self._lock = threading.Lock()
        self._listeners: Counter[str] = Counter()  # session -> event streams open now
        self._proxied: Counter[str] = Counter()  # client behind a trusted proxy -> its held streams

    def listening(self, session: str) -> bool:
        with self._lock:
            return self._listeners[session] > 0

    @contextmanager
    def listener(self, session: str | None):
        """`session` counts as listening while the block runs (None: nothing counted): an open event stream,
        or an MCP tool call reading its result in this process (ui/mcp.py)."""
        if session is not None:
            with self._lock:
                self._listeners[session] += 1
        try:
            yield
        finally:
            if session is not None:
                with self._lock:
                    self._listeners[session] -= 1
                    if self._listeners[session] <= 0:
                        del self._listeners[session]

    def await_listener(self, session: str, timeout: float | None = None) -> bool:
        """Wait (in a handler thread) up to `timeout` for the session's event stream to be open."""
        deadline = time.monotonic() + (self.listen_grace_s if timeout is None else timeout)
        while not self.listening(session):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def session_of(self, scope) -> str | None:
        """The session whose results a GET event stream carries, else None."""
        if scope.get("method") != "GET":
            return None
        path = scope["path"].rstrip("/")
        if path.endswith("/queue/data"):
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash")
            return values[0] if values else None
        parts = path.split("/")
        if len(parts) >= 3 and "call" in parts[:-2]:  # .../call/<api>/<event_id> (simple API)
            event_id = parts[-1]
            event = getattr(self.queue, "event_ids_to_events", {}).get(event_id)
            if event is not None:
                return event.session_hash
            # As Gradio's route finds it: a finished event's id is kept until its result is read.
            pending = getattr(self.queue, "pending_event_ids_session", {})
            return next((s for s, ids in list(pending.items()) if event_id in ids), event_id)
        return None

    @contextmanager
    def proxied(self, scope):
        """A held stream that came through a trusted proxy, counted for the client it names (the socket layer
        sees only the proxy, whose connections carry many visitors); yields False when that client holds its
        share already."""
        cap = self.per_client
        peer = (scope.get("client") or (None,))[0]
        if (not cap or scope.get("method") != "GET" or not is_stream_path(scope["path"].encode("latin-1", "replace"))
                or not in_networks(str(peer), self.trusted_proxies)):
            yield True
            return
        client = client_address(peer, _header(scope, b"x-forwarded-for"), self.trusted_proxies)
        with self._lock:
            admitted = self._proxied[client] < cap
            if admitted:
                self._proxied[client] += 1
        try:
            yield admitted
        finally:
            if admitted:
                with self._lock:
                    self._proxied[client] -= 1
                    if self._proxied[client] <= 0:
                        del self._proxied[client]

    def unknown(self, session: str | None) -> bool:
        """A GET of an event stream for a session with nothing pending (never joined, or long finished): Gradio
        would answer it with an error it raises after the stream began (two tracebacks per request)."""
        pending = getattr(self.queue, "pending_messages_per_session", None)
        return session is not None and pending is not None and session not in pending


class EdgeGuard:
    """One per app: the body/upload middleware, the queue hook, who asks (`callers`) and the open event
    streams (`streams`)."""

    def __init__(self, config: EdgeConfig | None = None):
        self.config = config or EdgeConfig()
        self._lock = threading.Lock()
        self._joining: Counter[str] = Counter()  # client -> joins under way (not in the queue yet)
        self._joining_groups: Counter[str] = Counter()
        self.api_names: frozenset[str] | None = None  # the app's named endpoints (install)
        self.refused = Counter()  # reason -> count, for /system and /metrics
        bounds = self.config.sockets
        self.sockets = SocketGuard(bounds, self.config.trusted_proxies) if bounds is not None else None
        self.bodies = BodyLedger(self.config.bodies) if self.config.bodies is not None else None
        self.uploads = UploadShares()  # Gradio's upload route, per visitor (ui/webtemp.py)
        self.log = quietlog.LogBudget()
        self.keys = KeyGuard()  # failed API-key checks per address (ui/openai_api.py ApiKeys)
        self.callers = Callers(self.config.trusted_proxies)
        self.streams = Streams(self.config.trusted_proxies, self.config.listen_grace_s,
                               bounds.streams_per_client if bounds is not None else None)

    # -- the queue hook ----------------------------------------------------------------------------
    def install(self, demo) -> None:
        """Hook demo's queue (after demo.queue()): per-client and per-group bounds on joining."""
        queue = demo._queue
        self.streams.queue = queue
        self.api_names = frozenset(fn.api_name for fn in demo.fns.values() if fn.api_name)
        original = queue.push
        group_queue = self.config.group_queue
        if group_queue is None:
            group_queue = queue.max_size
        # Gradio's max_size counts every group together: the generate queue full refused /status too.
        self.config = EdgeConfig(**{**self.config.__dict__, "group_queue": group_queue})
        queue.max_size = None

        from gradio import route_utils

        async def push(body, request, username):
            client = self.callers.client_of(request)
            try:
                fn = route_utils.get_fn(demo, None, body)
            except Exception:  # an unknown function or session: the visitor's mistake, answered 400
                self.refused["unknown function"] += 1
                self.log.line(client, "join from %s refused: unknown function %.40r", client, body.fn_index)
                return False, f"Unknown function {str(body.fn_index)[:40]!r}; see /gradio_api/info", "error"
            group = fn.concurrency_id
            refusal = self._admit(group, client)
            if refusal:
                return False, refusal, "queue_full"
            request.state.joined_at = time.monotonic()  # what /cancel compares against (ui/runs.py)
            if self.callers.mcp_caller(request.headers.get(MCP_CALLER_HEADER)) is not None:
                request.state.mcp_caller = client  # its runs and /cancel: the agent's own (ui/common.py)
            try:
                joined = await original(body=body, request=request, username=username)
                if joined[0]:
                    self._take_turns(group)
                return joined
            finally:
                self._release(group, client)

        queue.push = push
        quietlog.install(self.log, demo)

    @contextmanager
    def outside_queue(self, group: str, client: str):
        """A request served beside Gradio's queue (the /v1 API, ui/openai_api.py) counts as one of the client's
        events and one waiting in `group` while the block runs, as a join does: it yields None, or the message
        that refuses it (and then holds nothing)."""
        refusal = self._admit(group, client)
        if refusal:
            yield refusal
            return
        try:
            yield None
        finally:
            self._release(group, client)

    def _release(self, group: str, client: str) -> None:
        with self._lock:
            self._joining[client] -= 1
            self._joining_groups[group] -= 1
            if self._joining[client] <= 0:
                del self._joining[client]
            if self._joining_groups[group] <= 0:
                del self._joining_groups[group]

    def _admit(self, group: str, client: str) -> str | None:
        """Reserve a place for one join, or the message that refuses it. No await inside: the event
        loop cannot interleave two joins between the count and the reservation."""
        q = self.streams.queue
        config = self.config
        with self._lock:
            waiting = q.event_queue_per_concurrency_id.get(group)
            holders = Counter(self.callers.client_of(e.request) for e in self._events()) + self._joining
            waiting = (len(waiting.queue) if waiting is not None else 0) + self._joining_groups[group]
            if config.group_queue is not None and waiting >= config.group_queue and not self._fair_turn(
                    holders, client, waiting):
                self.refused["queue full"] += 1
                return (f"The queue is full ({waiting} requests waiting for this "
                        "action); retry in a few seconds")
            if config.client_events is not None:
                mine = holders[client]
                if mine >= config.client_events:
                    self.refused["per client"] += 1
                    return (f"You already have {mine} requests waiting or running on this "
                            f"server (at most {config.client_events} per visitor); wait for "
                            "one to finish or cancel it")
            self._joining[client] += 1
            self._joining_groups[group] += 1
        return None

    def _fair_turn(self, holders: Counter, client: str, waiting: int) -> bool:
        """A full group still takes a client holding fewer events than an equal share of it (a newcomer
        among a few heavy clients), up to twice its bound: the heavy ones are refused, not everyone else."""
        bound = self.config.group_queue
        share = bound // (len(holders | Counter({client: 1})) or 1)
        return waiting < 2 * bound and holders[client] < share

    def _take_turns(self, group: str) -> None:
        """Put the group's waiting events in turns between clients (`in_turns`). No await: Gradio takes
        events from this list on the same event loop."""
        q = self.streams.queue
        event_queue = q.event_queue_per_concurrency_id.get(group)
        if event_queue is None or len(event_queue.queue) < 2:
            return
        client_of = self.callers.client_of
        running = Counter(client_of(e.request) for job in list(q.active_jobs) if job for e in job)
        event_queue.queue[:] = in_turns(event_queue.queue, lambda e: client_of(e.request), running)

    def _events(self):
        q = self.streams.queue
        for event_queue in list(q.event_queue_per_concurrency_id.values()):
            yield from list(event_queue.queue)
        for job in list(q.active_jobs):
            if job:
                yield from job

    # -- the ASGI middleware -----------------------------------------------------------------------
    def middleware(self):
        from starlette.middleware import Middleware

        # Built when the app starts, after install: api_names is known by then.
        return Middleware(_EdgeMiddleware, streams=self.streams, callers=self.callers, refused=self.refused,
                          log=self.log, max_body_bytes=self.config.max_body_bytes, api_names=self.api_names,
                          held=(self.bodies, self.uploads))

    def snapshot(self) -> dict:
        c = self.config
        return {"max_body_bytes": c.max_body_bytes, "client_events": c.client_events,
                "queue_per_action": c.group_queue, "listen_grace_s": c.listen_grace_s,
                "trusted_proxies": [str(n) for n in c.trusted_proxies], "uploads": f"input images on /gradio_api/upload, at most {MAX_UPLOAD_BODY_BYTES:,} bytes",
                "refused": dict(self.refused),
                **({"sockets": self.sockets.snapshot()} if self.sockets is not None else {}),
                **({"bodies": self.bodies.snapshot()} if self.bodies is not None else {})}


def in_turns(waiting: list, client_of, running: Counter) -> list:
    """`waiting` (oldest first) in turns between clients: a client's k-th waiting event goes in round
    (its running events + k), earlier rounds first, arrival order within a round. Gradio serves a group
    first come first served, so callers each within their bound (CLIENT_EVENTS) kept its slots full and
    queued ahead of everyone who came later; in turns, a newcomer's event is among the next to start."""
    seen: Counter = Counter()
    rounds = []
    for position, event in enumerate(waiting):
        client = client_of(event)
        rounds.append((running[client] + seen[client], position, event))
        seen[client] += 1
    return [event for _, _, event in sorted(rounds, key=lambda r: r[:2])]


def _json_post(scope) -> bool:
    """A JSON body the app's routes parse themselves (Gradio's API, MCP); /v1 reads its own strictly."""
    if scope.get("method") not in ("POST", "PUT", "PATCH") or scope["path"].startswith("/v1"):
        return False
    return (_header(scope, b"content-type") or "application/json").lower().startswith("application/json")


def _replay(data: bytes, after, gone: dict | None = None):
    """A receive that gives `data` as the whole body, then `gone` (the disconnect already read) or what the
    server's own receive, `after`, says next (a disconnect when the client goes)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return gone if gone is not None else await after()

    return receive


def _answer_kept(send):
    """(a send that also keeps the answer's body, the list it keeps it in)."""
    kept: list[bytes] = []

    async def keeping(message):
        if message["type"] == "http.response.body" and sum(map(len, kept)) < 1 << 20:
            kept.append(message.get("body", b""))
        await send(message)

    return keeping, kept


def _paths(answer: bytes) -> list[str]:
    """The paths in Gradio's upload answer (a JSON list), [] when it is anything else."""
    try:
        paths = json.loads(answer)
    except ValueError:
        return []
    return [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else []


def _file_asked(path: str) -> str | None:
    """The file a GET names on Gradio's file routes (`/file=<path>`, and its older `/file/<path>`), else None."""
    if "/file=" in path:
        return path.split("/file=", 1)[1]
    if "/gradio_api/file/" in path:
        return path.split("/gradio_api/file/", 1)[1]
    return None


def _uploaded(scope, asked: str) -> bool:
    """Whether `/file=<asked>` names a file a visitor uploaded (Gradio lists them in its upload_file_set)."""
    blocks = getattr(scope.get("app"), "blocks", None)
    uploads = getattr(blocks, "upload_file_set", None) or ()
    try:
        resolved = str(Path(asked).resolve())
    except (OSError, ValueError):
        return True
    return asked in uploads or resolved in uploads  # Gradio keeps the absolute paths it answered


def _own_output(scope, asked: str) -> bool:
    """Whether `/file=<asked>` names a file in this app's own temporary folder (Gradio's App keeps it)."""
    folder = getattr(scope.get("app"), "uploaded_file_dir", None)
    if not folder or not asked:
        return False
    try:
        return Path(asked).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, ValueError):
        return False


class _CountedBody:
    """The request as the app sees it: its body read through a BodyReader (ui/bodies.py), cut off past a bound
    (its size, its deadline, the memory bodies hold): the app then sees a client that went away, its answer is
    dropped, and the middleware answers the refusal itself."""

    def __init__(self, reader: BodyReader, send):
        self.reader, self._send = reader, send
        self.receive = reader.receive
        self.started, self.ended = False, False

    @property
    def over(self) -> bool:
        return self.reader.refusal is not None

    async def send(self, message):
        if self.over:
            return  # the app's answer to a body it never got whole
        if message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers") or ())
            if extra := _retry_after(message.get("status", 200), headers):  # Gradio's "queue_full" 503
                message = {**message, "headers": headers + extra}
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            self.ended = True
        await self._send(message)


class _EdgeMiddleware:
    def __init__(self, app, streams: Streams, callers: Callers, refused: Counter, log: quietlog.LogBudget,
                 max_body_bytes: int, api_names: frozenset[str] | None,
                 held: tuple[BodyLedger | None, UploadShares] = (None, None)):
        self.app, self.streams, self.callers, self.refused, self.log = app, streams, callers, refused, log
        self.max_body_bytes, self.api_names = max_body_bytes, api_names
        self.bodies, uploads = held  # what bodies under way and visitors' uploads hold
        self.uploads = uploads or UploadShares()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._screen(scope)
        if refusal is not None:
            reason, status, message = refusal
            if reason:
                self.refused[reason] += 1
            await _refuse(send, status, message)
            return
        body = _CountedBody(self._reader(scope, receive), send)
        try:
            await self._serve(scope, body)
        finally:
            body.reader.release()
            if self.bodies is not None:
                self.bodies.settle()
        if body.over and not body.started:
            reason, status, message = body.reader.refusal
            self.refused[reason] += 1
            if reason != "body size":
                self.log.line(self._client(scope), "%s %s refused: %s", scope.get("method"), scope["path"][:120],
                              reason)
            await _refuse(send, status, message)

    def _reader(self, scope, receive) -> BodyReader:
        """The request's body as the app reads it: bounded in size and, when one is announced, in time and in
        the memory it holds."""
        path = scope["path"].rstrip("/")
        limit = UPLOAD_ROUTES.get(path, MAX_UPLOAD_BODY_BYTES if path.endswith("/gradio_api/upload") else
                                  self.max_body_bytes)
        message = (f"Request body is over this server's limit of {limit:,} bytes (prompts are at most 4,000 "
                   "characters)")
        length = _header(scope, b"content-length")
        announced = (length is not None and length.strip() not in ("", "0")) or _header(
            scope, b"transfer-encoding") is not None
        if self.bodies is None or not announced:
            return BodyReader(receive, limit, message)
        announced = int(length) if length is not None and length.strip().isdigit() else 0
        return BodyReader(receive, limit, message, self.bodies.bounds, self.bodies, self._client(scope), announced)

    async def _serve(self, scope, body: _CountedBody) -> None:
        receive = body.receive
        if _json_post(scope):  # read whole (bounded) and checked before any parser recurses into it
            receive, refusal = await self._checked_json(scope, receive)
            if body.over:
                return
            if refusal is not None:
                self.refused[refusal[0]] += 1
                self.log.line(self._client(scope), "%s %s refused: %s", scope.get("method"), scope["path"][:120],
                              refusal[2][:160])
                await _refuse(body.send, refusal[1], refusal[2])
                return
        session = self.streams.session_of(scope)
        with self.streams.proxied(scope) as admitted, self.streams.listener(session):
            if not admitted:
                self.refused["too many streams from one address"] += 1
                await _refuse(body.send, *REASONS["too many streams from one address"])
                return
            if self.streams.unknown(session):
                self.refused["unknown event"] += 1
                self.log.line(self._client(scope), "%s %s refused: no such event or session",
                              scope.get("method"), scope["path"][:120])
                await _refuse(body.send, 404, "No such event or session: it finished, or it never joined the queue")
                return
            send = body.send
            uploaded = None
            if scope.get("method") == "POST" and scope["path"].rstrip("/").endswith("/gradio_api/upload"):
                send, uploaded = _answer_kept(body.send)
            try:
                await self.app(scope, receive, send)
                if uploaded is not None:
                    self.uploads.record(self._client(scope), _paths(b"".join(uploaded)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not body.over:
                    await self._failed(scope, body, exc)

    async def _checked_json(self, scope, receive):
        """(a receive that replays the body, None) or (None, (reason, status, message)) for a JSON body over the
        size bound, nesting deeper than strict.MAX_DEPTH or with a number of more than strict.MAX_DIGITS digits
        (Python's parser recursed past its limit, or refused to read the int: a 500 and a traceback each)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay(b"".join(chunks), receive, message), None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None, ("body size", 413, f"Request body is over this server's limit of "
                                                f"{self.max_body_bytes:,} bytes (prompts are at most 4,000 characters)")
            if not message.get("more_body"):
                break
        data = b"".join(chunks)
        try:
            strict.loads(data)
        except InvalidRequest as exc:
            if "must be JSON" not in str(exc):  # JSON the app cannot read: its own parser answers that
                return None, ("malformed JSON", 400, str(exc))
        return _replay(data, receive), None

    def _client(self, scope) -> str:
        from starlette.requests import Request

        return self.callers.client_of(Request(scope))

    async def _failed(self, scope, body: _CountedBody, exc: Exception) -> None:
        """A request the app failed: logged within the visitors' log budget (one line when it was the visitor's
        fault), answered 4xx or 500 when no answer began, else its answer ended."""
        what = f"{scope.get('method')} {scope['path'][:120]}"
        status = self.log.failure(self._client(scope), what, exc)
        if not body.started:
            message = ("This request names a function, event or input this app does not have; see /gradio_api/info"
                       if status else "The server failed on this request; it is logged")
            await _refuse(body.send, status or 500, message)
        elif not body.ended:
            await body.send({"type": "http.response.body", "body": b"", "more_body": False})

    def _screen(self, scope) -> tuple[str | None, int, str] | None:
        """(refusal reason counted, status, message) for a request refused before the app sees it."""
        path = scope["path"].rstrip("/")
        limit = UPLOAD_ROUTES.get(path, self.max_body_bytes)
        if "/gradio_api/mcp" in path:
            self.callers.mark_mcp_caller(scope)
        content_type = (_header(scope, b"content-type") or "").lower()
        if path.endswith("/gradio_api/upload") and scope.get("method") == "POST":
            limit = MAX_UPLOAD_BODY_BYTES  # input images; Gradio bounds each file (launch's max_file_size)
        elif (path.endswith("/upload") or content_type.startswith("multipart/")) and path not in UPLOAD_ROUTES:
            return "upload", 403, "This app takes uploads of input images only, on /gradio_api/upload"
        if self._unknown_api(scope, path):
            return "unknown function", 404, "This app has no such API; see /gradio_api/info"
        if path.endswith("/deep_link"):
            return "deep link", 404, "This app keeps no deep links"
        asked = _file_asked(scope["path"])
        if asked is not None and (not _own_output(scope, asked) or _uploaded(scope, asked)):
            return "file", 403, "Files are served only from this app's own outputs"
        length = _header(scope, b"content-length")
        if length is None:
            return None
        try:
            size = int(length)
        except ValueError:
            return None, 400, "Content-Length must be a number"
        if size > limit:
            return "body size", 413, (f"Request body of {size:,} bytes is over this server's limit of "
                                      f"{limit:,} bytes (prompts are at most 4,000 characters)")
        return None

    def _unknown_api(self, scope, path: str) -> bool:
        """A POST to .../call/<api> or .../call/v2/<api> for an API the app does not have."""
        names = self.api_names
        parts = path.split("/")
        if names is None or scope.get("method") != "POST" or "call" not in parts:
            return False
        rest = parts[parts.index("call") + 1:]
        if rest[:1] == ["v2"]:
            rest = rest[1:]
        return len(rest) == 1 and rest[0] not in names
