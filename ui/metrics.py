"""GET /metrics: the manager's Prometheus metrics (engine/serving/telemetry.py) in the text format.

Served by an ASGI middleware in front of Gradio's app, so it answers before Gradio's routes and never
joins its queue. On a developer's machine anyone who reaches the app may scrape it; in public mode it
needs the admin token, sent as `Authorization: Bearer <token>` (or `?token=<token>` for scrapers that cannot
set headers), and without --admin-token it is not served at all (visitors' figures are the host's).
"""

from __future__ import annotations

import hmac
import json
from urllib.parse import parse_qs

from prometheus_client.exposition import CONTENT_TYPE_LATEST

PATH = "/metrics"


def edge_refusals(edge) -> dict:
    """Refusals by reason: of requests (ui/edge.py) and of connections before a request (ui/sockets.py)."""
    counts = dict(edge.refused)
    keys = getattr(edge, "keys", None)
    if keys is not None:  # /v1 API keys: wrong ones (401) and checks refused while an address is shut (429)
        counts.update({reason: keys.counts[kind] for kind, reason in (("failed", "failed API key"),
                                                                      ("throttled", "API key checks throttled"))})
    if edge.sockets is not None:
        for reason, n in edge.sockets.snapshot()["refused"].items():
            counts[reason] = counts.get(reason, 0) + n
    return counts


class MetricsRoute:
    def __init__(self, telemetry, public: bool, admin_token: str | None, edge=None):
        self.telemetry = telemetry
        self.public = public
        self.admin_token = admin_token
        if edge is not None:  # visitors refused at the web edge, by reason (ui/edge.py, ui/sockets.py)
            telemetry.edge_refusals = lambda: edge_refusals(edge)
            telemetry.unexpected_errors = lambda: dict(edge.log.unexpected)  # ui/quietlog.py

    def refusal(self, scope) -> tuple[int, str] | None:
        """(status, message) when this scrape may not read the metrics, else None."""
        if not self.public:
            return None
        if not self.admin_token:
            return 404, ("/metrics is off on this public server: start it with --admin-token and scrape with "
                         "Authorization: Bearer <token>")
        sent = None
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, credentials = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    sent = credentials.strip()
        if sent is None:
            sent = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [None])[0]
        if sent and hmac.compare_digest(sent.encode(), self.admin_token.encode()):
            return None
        return 401, "/metrics needs the admin token: send Authorization: Bearer <token> (or ?token=<token>)"

    def middleware(self):
        from starlette.middleware import Middleware

        return Middleware(_MetricsMiddleware, refusal=self.refusal, scrape=self.telemetry.scrape)


class _MetricsMiddleware:
    def __init__(self, app, refusal, scrape):
        # refusal(scope): MetricsRoute's (status, message) or None; scrape(): the exposition's bytes
        self.app, self.refusal, self.scrape = app, refusal, scrape

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].rstrip("/") != PATH:
            return await self.app(scope, receive, send)
        if scope.get("method") not in ("GET", "HEAD"):
            return await _answer(send, 405, b'{"detail": "GET /metrics"}', "application/json")
        refusal = self.refusal(scope)
        if refusal is not None:
            status, message = refusal
            headers = [(b"www-authenticate", b"Bearer")] if status == 401 else []
            return await _answer(send, status, json.dumps({"detail": message}).encode(), "application/json", headers)
        import anyio

        body = await anyio.to_thread.run_sync(self.scrape)  # reads the manager's status
        await _answer(send, 200, body if scope.get("method") == "GET" else b"", CONTENT_TYPE_LATEST)


async def _answer(send, status: int, body: bytes, content_type: str, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
