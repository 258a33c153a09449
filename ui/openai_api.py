"""An OpenAI-compatible images API on the app's own server and port: what every OpenAI SDK, LangChain or
LlamaIndex image tool already speaks.

    GET  /v1/models                  the presets a caller may use (data[].id is the `model` to send)
    GET  /v1/models/{model}          one of them, with its buckets, defaults and LoRA styles
    GET  /v1/loras                   every such preset's LoRA styles
    POST /v1/images/generations      `model` = preset (or an OpenAI name: choose_model), `prompt`, `n`, `size`,
                                     `response_format`, `stream`, `user`;
                                     the showcase's own fields as extra body fields (EXTRA_FIELDS)
    POST /v1/images/edits            the same, multipart, with `image` / `image[]` and `mask` (ui/openai_edits.py)
    GET  /v1/images/files/{name}     an image a `response_format: "url"` answer points at
    /v1/videos ...                   clips as jobs, as the SDK's client.videos speaks (ui/openai_videos.py)

Served by an ASGI middleware in front of Gradio's routes (as /metrics is), in the app's process, so a request
goes through the same edge (ui/edge.py: body bound, one of the client's events, one waiting in the engines'
group), the same one-running-request-per-client rule (ui/runs.py), the same visitor choices and cost budget
(the manager's gate, admission) and the same Caller identity as the page's /generate. The n images of
one call are n requests sent together, so an engine that batches runs them as one pipeline call.

A host can require API keys (`Authorization: Bearer <key>`): a file of keys, one a line, re-read when it
changes, and always the admin token, which makes the caller the host. Keys are never logged or echoed.
Errors come in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) with the app's own message,
under the status codes the SDK maps to its typed exceptions.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import random
import re
import threading
import time
from contextlib import ExitStack, aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import strict
from engine.config.request import API_KEYS_ADMIN, MAX_PREVIEWS, Caller, ImageRequest, load_api_keys
from engine.errors import (
    BudgetExceeded,
    Cancelled,
    DeviceOutOfMemory,
    DeviceUnavailable,
    EngineBusy,
    InvalidRequest,
    NotAllowed,
    ShowcaseError,
    UnsupportedCombination,
    scrub_paths,
)
from engine.protocol import RANDOM_WEIGHTS_NOTE, Task, params
from engine.serving import stream
from engine.serving.stream import Run
from ui import quietlog
from ui.common import ENGINE_QUEUE, HandlerBase
from ui.keyguard import KeyGuard, retry_after
from ui.openai_events import partial_event, preview_size, sse, stream_event
from ui.openai_store import OutputStore

if TYPE_CHECKING:
    from engine.serving.interface import Admitted

log = logging.getLogger(__name__)

PREFIX = "/v1"
OWNER = "diffusion-showcase"
USER_CHARS = 256
MAX_SEED = 2**31 - 1
# The OpenAI fields this server reads, and those it takes and leaves (they mean nothing to a diffusers pipeline).
OPENAI_FIELDS = ("model", "prompt", "n", "size", "response_format", "stream", "partial_images", "user",
                 "output_format", "background")
IGNORED_FIELDS = ("quality", "style", "moderation", "output_compression", "safety_identifier")
# The showcase's own request fields, as extra body fields (the openai SDK's `extra_body`).
EXTRA_FIELDS = {
    **params.field_help(None, params.v1_fields("images")),
    # what this API's own semantics add to the declared help
    "device": "auto, or a device name: cpu, cuda, ... (the page's System tab and the /system API list those here)",
    "seed": "an integer >= 0: image i of n gets seed + i (default: a random seed, returned with each image)",
    "lora": "none, or NAME[:SCALE][:fused], NAME one of the model's LoRA styles (GET /v1/loras)",
}
# The extra fields a missing value takes from the page's /generate defaults (UIDefaults) for.
PAGE_DEFAULTS = ("device", "precision", "mode", "on_cold", "step_cache")
RESPONSE_FORMATS = ("b64_json", "url")
DEFAULT_RETRY_AFTER_S = 5  # a 429 whose cause gives no better estimate
# OpenAI's model families and the response_format its API documents as each one's default: DALL-E answers a
# URL, gpt-image-* base64 (its only form). A client that names one (LangChain's DallEAPIWrapper sends dall-e-2
# and reads `.url`; Open WebUI sends its configured name) is served by the host's default model, and told so.
OPENAI_FAMILIES = (("dall-e-", "url"), ("gpt-image-", "b64_json"))
# This server's own model names (its presets) answer base64 unless the caller asks for a url: the image in the
# answer, as gpt-image-* does and as every client that sent no response_format here has read it.
PRESET_FORMAT = "b64_json"


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after: int | None = None  # seconds, sent as Retry-After (a 429)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# The engine's error kinds, most specific first: (class, HTTP status, OpenAI error type, code). The SDK raises
# BadRequestError for 400, PermissionDeniedError for 403, RateLimitError for 429, InternalServerError for 5xx.
STATUS_OF = (
    (InvalidRequest, 400, "invalid_request_error", "invalid_value"),
    (UnsupportedCombination, 400, "invalid_request_error", "unsupported_combination"),
    (DeviceUnavailable, 400, "invalid_request_error", "device_unavailable"),
    (NotAllowed, 403, "permission_error", "not_offered"),
    (EngineBusy, 429, "rate_limit_error", "busy"),
    (BudgetExceeded, 503, "server_error", "no_room"),
    (DeviceOutOfMemory, 503, "server_error", "out_of_memory"),
    (Cancelled, 499, "invalid_request_error", "cancelled"),
)
# The word an engine message starts with -> the /v1 parameter it is about: OpenAI's own, then the declared extras.
PARAM_OF = {"preset": "model", "size": "size", "prompt": "prompt", "step": "step_cache",
            "image": "image", "mask": "mask", "strength": "strength",  # an upload's field (/v1/images/edits)
            **{name: name for door in params.V1 for name in params.v1_fields(door)}}


def api_error(exc: BaseException, client: str = quietlog.HANDLERS) -> ApiError:
    """The engine's error as OpenAI's: its own message (server paths scrubbed), the status its kind maps to; an
    unexpected one counted and logged within the visitors' budget (ui/quietlog.py), for `client`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ShowcaseError):
        message = scrub_paths(str(exc))
        status, kind, code = next(((s, k, c) for cls, s, k, c in STATUS_OF if isinstance(exc, cls)),
                                  (500, "server_error", "generation_failed"))
        # the engine's messages name their field first ("steps must be ...", "unknown mode 'warp' ...")
        named = next((PARAM_OF[w] for w in re.findall(r"[a-z_]+", message.lower())[:3] if w in PARAM_OF), None)
        error = ApiError(status, message, kind, named if status == 400 else None, code)
        if isinstance(exc, EngineBusy):
            error.retry_after = exc.retry_after()
        return error
    quietlog.unexpected("the /v1 API", exc, client)
    return ApiError(500, f"unexpected {type(exc).__name__} on the server; it was logged and the server keeps "
                         "serving", "server_error", code="internal_error")


# -- who asks --------------------------------------------------------------------------------------------
class ApiKeys:
    """Who a /v1 request is. `spec`: None (no key required), API_KEYS_ADMIN or a key file (app.py --api-keys); the
    admin token is always a key, and the host's."""

    def __init__(self, spec: str | None, admin_token: str | None, guard: KeyGuard | None = None):
        self.spec, self.admin_token = spec, admin_token
        self.guard = guard or KeyGuard()  # failed checks per address: backoff, 429 (ui/keyguard.py)
        self._keys: frozenset[str] = frozenset()
        self._stamp = None
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return self.spec is not None

    def _file_keys(self) -> frozenset[str]:
        if self.spec in (None, API_KEYS_ADMIN):
            return frozenset()
        try:
            stat = Path(self.spec).stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            stamp = None
        with self._lock:
            if stamp != self._stamp:  # re-read when the host rotates keys; a broken file keeps the last ones
                try:
                    self._keys = load_api_keys(self.spec)
                except InvalidRequest as exc:
                    log.warning("%s; the API keys read before stay in use", exc)
                self._stamp = stamp
            return self._keys

    def caller(self, authorization: str | None, client: str = "unknown") -> Caller:
        """HOST for the admin token; VISITOR for a key of the file or, where none is required, for anyone;
        ApiError 401 otherwise, and 429 (no key compared) while `client` is shut after failed keys."""
        scheme, _, sent = (authorization or "").partition(" ")
        sent = sent.strip() if scheme.lower() == "bearer" else ""
        if sent and (shut := self.guard.shut_for(client)):
            error = ApiError(429, f"too many wrong API keys from your address: key checks pause for "
                                  f"{retry_after(shut)} s; check your key", "rate_limit_error",
                             code="too_many_failed_keys")
            error.retry_after = retry_after(shut)
            raise error
        caller = self._match(sent)
        if caller is not None:
            self.guard.succeeded(client)
            return caller
        if sent:
            failures = self.guard.failed(client)
            quietlog.visitor_line(client, "wrong /v1 API key from %s (%d in a row)", client, failures)
        raise ApiError(401, "this server's /v1 API needs an API key: send Authorization: Bearer <key> (the "
                            "openai SDK's api_key); ask the host for one" if not sent else
                       "the API key sent is not one of this server's; check it, or ask the host for one",
                       code="invalid_api_key")

    def _match(self, sent: str) -> Caller | None:
        if sent and self.admin_token and hmac.compare_digest(sent.encode(), self.admin_token.encode()):
            return Caller.HOST
        if not self.required:
            return Caller.VISITOR
        if sent and any(hmac.compare_digest(sent.encode(), key.encode()) for key in self._file_keys()):
            return Caller.VISITOR
        return None


# -- the request -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImagesCall:
    """A POST /v1/images/generations body, checked: what the images need and how the answer is sent."""

    spec: ImageRequest
    n: int = 1
    response_format: str = "b64_json"
    stream: bool = False
    user: str | None = None
    notices: tuple[str, ...] = ()
    events: str = "image_generation"  # the stream's event types: image_generation.*, or image_edit.* for an edit

    def specs(self) -> list[ImageRequest]:
        """One request per image: seed, seed + 1, ..."""
        seed = int(self.spec.seed)
        return [self.spec.replace(seed=seed + i) for i in range(self.n)]


def _whole(body: dict, name: str, default: int, low: int, high: int | None = None) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    try:
        value = strict.whole(value, name)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=name) from None
    if value < low or (high is not None and value > high):
        raise ApiError(400, f"{name} must be from {low} to {high}, got {value}" if high is not None else
                       f"{name} must be at least {low}, got {value}", param=name)
    return value


def _text(body: dict, name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ApiError(400, f"{name} must be text, got {type(value).__name__}", param=name)


def check_body(body) -> dict:
    """The body as a dict of known fields; ApiError naming an unknown one or the wrong shape."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object, e.g. {\"model\": \"tiny-shapes\", \"prompt\": \"a red "
                            "circle on a blue background\"}")
    known = (*OPENAI_FIELDS, *IGNORED_FIELDS, *EXTRA_FIELDS)
    unknown = [name for name in body if name not in known]
    if unknown:
        raise ApiError(400, f"unknown field {str(unknown[0])[:40]!r}; this API takes {', '.join(OPENAI_FIELDS)} and "
                            f"the showcase's own {', '.join(EXTRA_FIELDS)}", param=str(unknown[0])[:40])
    if not isinstance(body.get("prompt"), str) or not body["prompt"].strip():
        raise ApiError(400, "prompt is required: the text of what to draw", param="prompt")
    if body.get("response_format") not in (None, *RESPONSE_FORMATS):
        raise ApiError(400, f"response_format must be b64_json or url, got {str(body['response_format'])[:40]!r}",
                       param="response_format")
    if body.get("output_format") not in (None, "png"):
        raise ApiError(400, "output_format: this server makes PNG images only; send png or leave it out",
                       param="output_format")
    if body.get("background") not in (None, "auto", "opaque"):
        raise ApiError(400, "background: these pipelines draw opaque images only; send auto or opaque",
                       param="background")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > USER_CHARS):
        raise ApiError(400, f"user must be text of at most {USER_CHARS} characters", param="user")
    return body


def read_call(body: dict, defaults, preset: str, caller: Caller, client: str) -> ImagesCall:
    """The ImagesCall of a checked body: missing showcase fields take the page's /generate defaults
    (`defaults`: UIDefaults); no seed draws a random one; "auto" or no size is the model's first bucket."""
    size = _text(body, "size")
    seed = _text(body, "seed")
    random_seed = seed is None or not seed.strip()
    notices = tuple(f"{name} is not used by this server" for name in IGNORED_FIELDS if name in body)
    given = {name: _text(body, name, getattr(defaults, name) if name in PAGE_DEFAULTS else None)
             for name in EXTRA_FIELDS}
    spec = ImageRequest(
        **{**given, "seed": random.randint(0, MAX_SEED) if random_seed else seed,
           **{name: None for name in ("step_cache", "lora") if given[name] in (None, "", "none")}},
        preset=preset, prompt=body["prompt"], size=None if size in (None, "", "auto") else size,
        caller=caller, client=client,
        previews=_whole(body, "partial_images", 0, 0, MAX_PREVIEWS) if body.get("stream") else 0)
    if not random_seed:
        try:
            _whole(body, "seed", 0, 0)
        except ApiError:
            raise ApiError(400, f"seed must be a whole number >= 0, got {str(seed)[:40]!r}", param="seed") from None
    return ImagesCall(spec, n=_whole(body, "n", 1, 1), response_format=body.get("response_format") or "b64_json",
                      stream=bool(body.get("stream", False)), user=body.get("user"), notices=notices)


@dataclass(frozen=True)
class ModelChoice:
    """The preset a `model` name is served by, the response_format it answers when none is sent, and what the
    caller is told (an OpenAI name served by this server's default model)."""

    preset: str
    response_format: str
    notice: str | None = None


def unnamed_notice(preset: str) -> str:
    """What an answer says when its call named no model: which one served it (every door's default for a task)."""
    return f"no model named: {preset} served it, this server's default for the task"


def choose_model(name: str | None, presets, default: str, offered: list[str]) -> ModelChoice:
    """`model` as a client sends it: no name is the default preset; a preset of this server is itself (the
    serving gate then says whether this caller may use it); an OpenAI family name is the default preset with
    that family's default response_format; anything else is a 404 naming the models the caller may send."""
    if name is None or not name.strip():
        return ModelChoice(default, PRESET_FORMAT, unnamed_notice(default))
    if name in presets:
        return ModelChoice(name, PRESET_FORMAT)
    family = next((fmt for prefix, fmt in OPENAI_FAMILIES if name.lower().startswith(prefix)), None)
    if family:
        return ModelChoice(default, family, f"model {name} is served by {default}, this server's default model "
                                            f"(answered as {family}, OpenAI's default for it)")
    raise ApiError(404, f"model {name[:60]!r} is not a model of this server; send one of: {', '.join(offered)} "
                        f"(GET /v1/models), or an OpenAI name (dall-e-2, dall-e-3, gpt-image-1), which {default} "
                        "serves", param="model", code="model_not_found")


# -- the images ------------------------------------------------------------------------------------------
class ImagesRun:
    """The n images of one call: each one request's event stream (engine/serving/stream.py), started together so
    an engine that batches runs them as one pipeline call. `events()` yields (index, event) of the images' Step,
    Partial and Finished events; `stop()` cancels every image between steps. `open_events(spec, run)`: an
    image's stream; `cancel(request_id)`: what stops a sent request."""

    def __init__(self, specs: list[ImageRequest | Admitted], open_events, cancel):
        self.specs = specs
        self.runs = [Run(cancel) for _ in specs]
        self.streams = [open_events(spec, run) for spec, run in zip(specs, self.runs, strict=True)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pumps: list[asyncio.Task] = []
        self.left = len(specs)

    def start(self) -> ImagesRun:
        self.pumps = [asyncio.create_task(self._pump(index, events)) for index, events in enumerate(self.streams)]
        return self

    async def _pump(self, index: int, events) -> None:
        async with aclosing(events):
            async for event in events:
                self.queue.put_nowait((index, event))

    async def events(self):
        """Every image's steps, partials and results; raises the first image's error (after stopping the
        others). Left early, it stops the images still running."""
        try:
            while self.left:
                index, event = await self.queue.get()
                if isinstance(event, (stream.Failed, stream.Stopped)):
                    self.stop()
                    raise event.error
                if isinstance(event, stream.Finished):
                    self.left -= 1
                if isinstance(event, (stream.Step, stream.Partial, stream.Finished)):
                    yield index, event
        finally:
            for pump in self.pumps:
                pump.cancel()  # a stream closed before its image is done stops its request

    def stop(self) -> None:
        for run in self.runs:
            run.stop()


@dataclass
class Answer:
    """What one image call answers: its images in order and what the caller is told about them."""

    call: ImagesCall
    created: int = field(default_factory=lambda: int(time.time()))
    results: dict = field(default_factory=dict)  # index -> GenerateResult
    entered: float = field(default_factory=time.perf_counter)

    def image(self, result, store: OutputStore, base_url: str) -> dict:
        item = {"revised_prompt": None, "seed": result.seed, "timings": result.as_dict()}
        if self.call.response_format == "url":
            item["url"] = f"{base_url}{PREFIX}/images/files/{store.put(result.image_png)}"
        else:
            item["b64_json"] = base64.b64encode(result.image_png).decode("ascii")
        return item

    def notices(self) -> list[str]:
        seen = dict.fromkeys(self.call.notices)
        for result in self.results.values():
            seen.update(dict.fromkeys(result.notices))
        return list(seen)

    def body(self, store: OutputStore, base_url: str) -> dict:
        results = [self.results[i] for i in sorted(self.results)]
        first = results[0]
        return {
            "created": self.created, "model": first.engine.preset, "size": str(first.bucket.size),
            "output_format": "png", "background": "opaque",
            "data": [self.image(r, store, base_url) for r in results],
            "notices": self.notices(),
            "batch_sizes": [r.batch_size for r in results],
            "timings": {"handler_ms": round((time.perf_counter() - self.entered) * 1000, 1),
                        "total_ms": [r.timings.total_ms for r in results]},
            **({"safety_identifier": self.call.user} if self.call.user else {}),
        }


def public_root(request) -> str:
    """The app's address as the caller reached it, for the URLs of a "url" answer: behind a proxy its
    X-Forwarded-Host and -Proto, under a root path that path (Gradio's own rule for its file URLs)."""
    from gradio.route_utils import get_root_url

    return get_root_url(request, request.url.path, request.scope.get("root_path") or None)


# -- the routes ------------------------------------------------------------------------------------------
def error_response(error: ApiError):
    from starlette.responses import JSONResponse

    headers = {"www-authenticate": "Bearer"} if error.status == 401 else {}
    if error.status == 429:
        headers["retry-after"] = str(error.retry_after or DEFAULT_RETRY_AFTER_S)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def hold_turn(h, client: str, held: ExitStack) -> None:
    """One of the client's events at the web edge and, in public mode, its one running request, held in `held`
    (as a page's Generate holds them while it runs); `h`: the app's handlers."""
    if h.edge is not None:
        refusal = held.enter_context(h.edge.outside_queue(ENGINE_QUEUE, client))
        if refusal:
            raise ApiError(429, refusal, "rate_limit_error", code="too_many_requests")
    try:
        held.enter_context(h.runs.open(f"v1:{client}", exclusive=h.serving.public()))
    except ShowcaseError as exc:
        raise api_error(exc) from None


class OpenAIRoutes:
    """The /v1 routes on the app's handlers (ui/handlers.py): their serving interface, defaults, runs and web edge."""

    def __init__(self, handlers: HandlerBase, keys: ApiKeys, videos=None, read_edit=None):
        # read_edit: (routes, request, caller) -> ImagesCall, POST /v1/images/edits' reader (ui/openai_edits.py)
        self.h, self.keys, self.read_edit = handlers, keys, read_edit
        self.videos = videos  # the /v1/videos jobs (ui/openai_videos.py VideoJobs), or None: no videos API
        cache = getattr(handlers.serving, "cache_dir", None)  # the app's --cache-dir: its files stay in one place
        self.store = OutputStore(under=Path(cache) / "v1" if cache else None)
        self.started = int(time.time())

    def middleware(self):
        from starlette.middleware import Middleware

        return Middleware(_OpenAIMiddleware, handle=self.handle)

    async def handle(self, scope, receive, send) -> None:
        """Answer one /v1 request; what it holds (its place at the edge, its run) is let go once the answer,
        streamed or not, has been sent or the client has gone."""
        from starlette.requests import Request

        request = Request(scope, receive)
        with ExitStack() as held:
            try:
                response = await self._route(request, held)
            except Exception as exc:  # every failure answers in OpenAI's shape; the server keeps serving
                response = error_response(api_error(exc, self._client(request)))
            await response(scope, receive, send)

    async def _route(self, request, held: ExitStack):
        from starlette.responses import JSONResponse, Response

        path, method = request.url.path[len(PREFIX):].rstrip("/"), request.method
        routes = {"/models": ("GET", self.models), "/loras": ("GET", self.loras),
                  "/images/generations": ("POST", None)}
        if self.read_edit is not None:
            routes["/images/edits"] = ("POST", None)
        if path.startswith("/images/files/") and method in ("GET", "HEAD"):
            png = self.store.get(path.rsplit("/", 1)[-1])
            if png is None:
                raise ApiError(404, "no such image here (images are kept for the last "
                                    f"{self.store.kept} answers)", code="not_found")
            return Response(png, media_type="image/png", headers={"cache-control": "private, max-age=3600"})
        if self.videos is not None and (path == "/videos" or path.startswith("/videos/")):
            caller = self.keys.caller(request.headers.get("authorization"), self._client(request))
            return await self.videos.route(request, path, method, caller, self.keys.required)
        allowed, answer = routes.get(path, (None, None))
        if path.startswith("/models/"):
            allowed, answer = "GET", self.model
        if allowed is None:
            raise ApiError(404, f"no route {method} {PREFIX}{path}; this server serves GET /v1/models, GET "
                                "/v1/loras, POST /v1/images/generations and POST /v1/images/edits",
                           code="unknown_url")
        if method != allowed:
            raise ApiError(405, f"{PREFIX}{path} takes {allowed}, not {method}", code="method_not_allowed")
        caller = self.keys.caller(request.headers.get("authorization"), self._client(request))
        if answer is None and path == "/images/edits":  # multipart, read bounded
            return await self.answer(await self.read_edit(self, request, caller), request, held)
        if answer is None:
            return await self.generations(request, caller, held)
        return JSONResponse(answer(caller, path))

    # -- listings ----------------------------------------------------------------------------------------
    def _names(self, caller: Caller) -> list[str]:
        """The presets this caller may send as `model` (public mode: a visitor, the host's list)."""
        if caller is Caller.HOST:
            return self.h.serving.preset_names()
        return self.h.serving.visitor_presets()

    def default_model(self, caller: Caller, task: Task) -> str:
        """What a call naming no model runs: the task's default among the models this caller may send
        (engine/config/defaults.py), else the server's default preset."""
        chosen = self.h.task_preset(task, self._names(caller))
        return chosen.name if chosen is not None else self.h.default_preset().name

    def _defaults(self, caller: Caller) -> dict[str, str]:
        names = self._names(caller)
        return {str(task): chosen.name for task in Task if (chosen := self.h.task_preset(task, names)) is not None}

    def _entry(self, name: str, defaults: dict[str, str]) -> dict:
        preset = self.h.serving.preset(name)
        return {"id": name, "object": "model", "created": self.started, "owned_by": OWNER,
                "task": str(preset.task), "default": defaults.get(str(preset.task)) == name,
                "random_weights": preset.random_weights,
                **({"note": RANDOM_WEIGHTS_NOTE} if preset.random_weights else {}),
                "buckets": [str(s) for s in preset.buckets], "steps": preset.steps, "guidance": preset.guidance,
                "takes": params.optional_fields(preset), "example_prompt": preset.example_prompt,
                "loras": [lora["name"] for lora in self._styles(name)],
                **({"frames": list(preset.frames), "fps": preset.fps} if preset.video else {})}

    def _styles(self, name: str) -> list[dict]:
        return [{"name": lora.name, "scale": lora.scale, "trigger": lora.trigger, "description": lora.description}
                for lora in self.h.serving.preset(name).loras]

    def models(self, caller: Caller, path: str) -> dict:
        """The presets, and the extra body fields POST /v1/images/generations takes beside OpenAI's."""
        defaults = self._defaults(caller)
        return {"object": "list", "data": [self._entry(name, defaults) for name in self._names(caller)],
                "defaults": defaults, "extra_fields": EXTRA_FIELDS}

    def model(self, caller: Caller, path: str) -> dict:
        name = path.split("/", 2)[-1]
        if name not in self._names(caller):
            raise ApiError(404, f"model {name[:60]!r} is not offered here; choose one of: "
                                f"{', '.join(self._names(caller))} (GET /v1/models)", param="model",
                           code="model_not_found")
        return self._entry(name, self._defaults(caller))

    def loras(self, caller: Caller, path: str) -> dict:
        slot = bool(self.h.serving.lora_slot())
        return {"object": "list", "enabled": slot,
                "data": [{"model": name, "loras": self._styles(name)} for name in self._names(caller)],
                **({} if slot else {"note": "LoRA styles are off on this server (the host starts it with --loras)"})}

    # -- generations -------------------------------------------------------------------------------------
    async def generations(self, request, caller: Caller, held: ExitStack):
        try:
            body = check_body(strict.loads(await request.body() or b"null"))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc)) from None
        client = self._client(request)
        model = choose_model(_text(body, "model"), self.h.serving.preset_names(),
                             self.default_model(caller, Task.TEXT_TO_IMAGE), self._names(caller))
        body = {**body, "response_format": body.get("response_format") or model.response_format}
        call = read_call(body, self.h.defaults, model.preset, caller, client)
        if model.notice:
            call = replace(call, notices=(model.notice, *call.notices))
        return await self.answer(call, request, held)

    async def answer(self, call: ImagesCall, request, held: ExitStack):
        """A checked call's images (generations and edits alike): JSON, or server-sent events when it streams."""
        import anyio
        from starlette.responses import JSONResponse, StreamingResponse

        hold_turn(self.h, call.spec.client, held)  # the caller's turn first: nothing is decoded for a refused one
        admitted = await anyio.to_thread.run_sync(self._check_call, call)  # decodes, may probe devices
        answer = Answer(call)
        run = ImagesRun(admitted.images(call.n), self._events, self.h.serving.cancel)
        if call.stream:
            return StreamingResponse(self._stream(run, answer), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        await self._run(run, answer, request)
        return JSONResponse(answer.body(self.store, public_root(request)))

    def _client(self, request) -> str:
        """Who sent a /v1 request: the edge's client (its address, or an agent's), else the peer's address."""
        if self.h.edge is not None:
            return self.h.edge.callers.client_of(request)
        return f"v1 {getattr(request.client, 'host', 'unknown')}"

    def _events(self, admitted: Admitted, run: Run):
        """An image's one event stream (engine/serving/stream.py)."""
        return self.h.serving.events(admitted, run=run)

    def _check_call(self, call: ImagesCall) -> Admitted:
        """What /generate checks before an engine starts (ui/generate.py _prepare): the engine the caller may
        use, the cost of n images against the request and visitor budgets; and n against the engine's batch.
        The request admitted once (its uploads decoded once), which its n images then run."""
        h, spec = self.h, call.spec
        key = h.key_for(spec.preset, spec.device, spec.precision, 1, caller=spec.caller)
        limit = h.serving.batch_limit(key)
        if call.n > limit:
            raise ApiError(400, f"n must be from 1 to {limit} on {key} (its largest batch: the n images run as one "
                                "pipeline call; the host sets --max-batch)", param="n")
        serving = h.serving  # together the n images must fit the visitor's budget
        admitted = serving.admit(spec.replace(preset=key.preset))
        serving.check_images(admitted, call.n, serving.held(spec.client))
        return admitted


    async def _run(self, run: ImagesRun, answer: Answer, request) -> None:
        """Every image into `answer`; a client that goes away stops them between steps."""
        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)
            run.stop()

        watcher = asyncio.create_task(watch())
        try:
            async with aclosing(run.start().events()) as events:
                async for index, event in events:
                    if isinstance(event, stream.Finished):
                        answer.results[index] = event.result
        finally:
            watcher.cancel()

    async def _stream(self, run: ImagesRun, answer: Answer):
        """Server-sent events as the openai SDK's images stream reads them: the partial images each image asked
        for (partial_images) as its steps reach them, an image_generation.completed event per image as it is
        ready, an error event (OpenAI's shape) if one fails. Closed early (the client went away), it stops the
        images."""
        done, partials = False, [0] * len(run.specs)
        try:
            async with aclosing(run.start().events()) as events:
                async for index, event in events:
                    if isinstance(event, stream.Finished):
                        answer.results[index] = event.result
                        yield sse(stream_event("completed", answer, event.result, index))
                    elif isinstance(event, stream.Partial):
                        yield sse(partial_event(event, index, partials[index], preview_size(event.png),
                                                answer.call.events))
                        partials[index] += 1
            done = True
        except Exception as exc:
            yield sse(api_error(exc).body(), "error")
        finally:
            if not done:
                run.stop()


class _OpenAIMiddleware:
    def __init__(self, app, handle):
        self.app, self.handle = app, handle  # handle: OpenAIRoutes.handle, the /v1 routes' one entry

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == PREFIX or path.startswith(PREFIX + "/"):
            return await self.handle(scope, receive, send)
        return await self.app(scope, receive, send)
