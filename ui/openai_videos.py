"""The OpenAI videos API on the app's /v1 (ui/openai_api.py hands it every /v1/videos path): what the `openai`
SDK's `client.videos` speaks.

    POST   /v1/videos                 a job: `prompt`, `model` (a video preset), `size`, `seconds`,
                                      `input_reference` (a file: the source image of an image-to-video model, its
                                      first frame); the showcase's own fields as extra form fields (VIDEO_FIELDS:
                                      num_frames, fps, steps, ...)
    GET    /v1/videos                 the caller's jobs kept here
    GET    /v1/videos/{id}            one job: status queued | in_progress | completed | failed, progress 0-100
    GET    /v1/videos/{id}/content    its MP4 (variant=video), first frame (thumbnail, PNG) or every frame side by
                                      side (spritesheet, PNG)
    DELETE /v1/videos/{id}            stops it between steps (if it runs) and forgets it

A job is one request through the manager, as the page's Generate is: checked and priced by the gate when it is
created (a bad field or a clip over the visitor's budget is refused there, with the app's message), then run
in the background with the client's place at the edge and its one running request held until it ends. Clips
live in memory only, the last JOBS_KEPT jobs (the oldest finished one goes first).

The SDK's `videos.create(..., input_reference=open(PATH, "rb"))` sends the image as a multipart file part; the
body is read as /v1/images/edits reads its own (ui/openai_edits.py: bounded while it arrives, nothing decoded
here), and the bytes become `ImageRequest.images`, which the gate decodes and checks like every door's.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import secrets
import time
from collections import OrderedDict
from contextlib import ExitStack, aclosing
from dataclasses import dataclass, field

from engine.config.request import Caller, ImageRequest
from engine.protocol import Task, params
from engine.serving import stream
from engine.serving.stream import Run
from ui.common import HandlerBase
from ui.openai_api import PREFIX, ApiError, api_error, hold_turn
from ui.openai_edits import read_parts
from ui.uploads import MAX_UPLOAD_BYTES

JOBS_KEPT = 32
# The showcase's own fields a job takes beside OpenAI's (the SDK's extra_body; form fields on the wire).
VIDEO_FIELDS = {
    **params.field_help(None, params.v1_fields("videos")),
    # what this API adds to the declared help
    "num_frames": "frames of the clip (snapped to the model's frame buckets, 4k + 1 for Wan; default: its first); "
                  "beats `seconds`",
    "seed": "an integer >= 0 (default 0)", "mode": "eager, compile or regional",
}
# The fields a missing value takes from the page's defaults (UIDefaults) for.
PAGE_DEFAULTS = ("device", "precision", "mode", "on_cold")
OPENAI_VIDEO_FIELDS = ("prompt", "model", "size", "seconds", "input_reference")
VARIANTS = ("video", "thumbnail", "spritesheet")
SOURCE = "input_reference"  # the one file a job takes: an image-to-video model's source image
VIDEO_BODY_BYTES = MAX_UPLOAD_BYTES + 1024 * 1024  # the file and the text fields' room (ui/edge.py UPLOAD_ROUTES)
VIDEO_FORM = ("POST /v1/videos takes a JSON object or a multipart/form-data body (prompt, model, input_reference, "
              "...), as the openai SDK's videos.create sends it")
AS_A_FILE = (f"{SOURCE} must be an image file (a multipart file part), as videos.create(..., {SOURCE}=open(PATH, "
             "'rb')) sends it; references by image_url or file_id are not served here")


@dataclass
class VideoJob:
    """One clip's job as the SDK's `Video` reads it, and what it made."""

    id: str
    model: str
    prompt: str
    size: str
    client: str
    run: Run
    owner: str = ""  # its API key's digest, or without keys its client: only the owner sees or stops it
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict | None = None
    result: object = None  # the GenerateResult once completed
    seconds: str = "0"

    def body(self) -> dict:
        result = self.result
        extra = {"frames": result.num_frames, "fps": result.fps, "timings": result.as_dict()} if result else {}
        return {"id": self.id, "object": "video", "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": None, "model": self.model, "prompt": self.prompt, "progress": self.progress,
                "seconds": self.seconds, "size": self.size, "status": self.status, "error": self.error,
                "remixed_from_video_id": None, **extra}

    def step(self, progress) -> None:
        self.status = "in_progress"
        self.progress = min(99, int(100 * progress.step / max(1, progress.total)))  # 100: the clip is encoded

    def finished(self, result) -> None:
        self.result, self.status, self.progress = result, "completed", 100
        self.size, self.completed_at = str(result.bucket.size), int(time.time())
        self.seconds = f"{result.num_frames / max(1, result.fps):.2f}"

    def failed(self, exc: BaseException) -> None:
        error = api_error(exc)
        self.status, self.completed_at = "failed", int(time.time())
        self.error = {"code": error.code or "generation_failed", "message": error.message}


def _field(form, name: str) -> str | None:
    value = form.get(name)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ApiError(400, f"{name} must be text or a number", param=name)


async def read_form(request) -> dict:
    """The job's fields, from a multipart form (what the SDK sends; `input_reference` as the file's bytes) or a
    JSON object (text fields only)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeError):
            raise ApiError(400, "the body must be JSON or a multipart form") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object with a prompt")
        if body.get(SOURCE) not in (None, ""):
            raise ApiError(400, AS_A_FILE, param=SOURCE)
        return body
    if not content_type.startswith("multipart/"):
        raise ApiError(400, VIDEO_FORM, code="invalid_content_type")
    reader = await read_parts(request, VIDEO_BODY_BYTES, VIDEO_FORM, file_fields=(SOURCE,),
                              max_parts=len(OPENAI_VIDEO_FIELDS) + len(VIDEO_FIELDS) + 2)
    if any(name.startswith(SOURCE) for name in reader.texts):  # the SDK flattens {"image_url": ...} to text
        raise ApiError(400, AS_A_FILE, param=SOURCE)
    files = reader.files.get(SOURCE, [])
    if len(files) > 1:
        raise ApiError(400, f"send one {SOURCE}: the clip's first frame", param=SOURCE)
    return {**reader.texts, **({SOURCE: files[0]} if files else {})}


def check_form(form: dict) -> None:
    unknown = [name for name in form if name not in (*OPENAI_VIDEO_FIELDS, *VIDEO_FIELDS)]
    if unknown:
        raise ApiError(400, f"unknown field {str(unknown[0])[:40]!r}; /v1/videos takes "
                            f"{', '.join(OPENAI_VIDEO_FIELDS)} and {', '.join(VIDEO_FIELDS)}", param=str(unknown[0])[:40])
    if not isinstance(form.get("prompt"), str) or not form["prompt"].strip():
        raise ApiError(400, "prompt is required: the text of the clip to make", param="prompt")


_WHOLE = re.compile(r"[0-9]{1,6}")  # ASCII digits only: int() also reads other scripts' digits
_DECIMAL = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?|\.[0-9]{1,6}")


def _strict(form: dict, name: str, pattern: re.Pattern) -> str | None:
    """A number field as sent (text of ASCII digits: no sign, exponent, inf or nan), or ApiError naming it."""
    value = _field(form, name)
    if value in (None, ""):
        return None
    if not pattern.fullmatch(value.strip()):
        kind = "a whole number" if pattern is _WHOLE else "a number of seconds"
        raise ApiError(400, f"{name} must be {kind} written in digits 0-9, got {value[:40]!r}", param=name)
    return value.strip()


def frames_asked(form: dict, fps_default: int) -> str | None:
    """num_frames as sent, else `seconds` × fps + 1 (Wan's clips keep a first frame), else None (the model's);
    each field checked strictly and named in its own error."""
    frames = _strict(form, "num_frames", _WHOLE)
    fps = _strict(form, "fps", _WHOLE)
    if fps is not None and int(fps) < 1:
        raise ApiError(400, f"fps must be at least 1, got {fps}", param="fps")
    if frames is not None:
        return frames
    seconds = _strict(form, "seconds", _DECIMAL)
    if seconds is None:
        return None
    return str(round(float(seconds) * int(fps or fps_default)) + 1)


class VideoJobs:
    """The /v1/videos routes on the app's handlers (their serving interface, defaults, runs and web edge)."""

    def __init__(self, handlers: HandlerBase, kept: int = JOBS_KEPT):
        self.h, self.kept = handlers, kept
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self.tasks: set[asyncio.Task] = set()

    async def route(self, request, path: str, method: str, caller: Caller, keys_required: bool = False):
        """Answer one /v1/videos request (`path` after /v1); another owner's job is answered as one that is not
        here (`_owner`)."""
        from starlette.responses import JSONResponse

        owner = self._owner(request, keys_required)
        parts = path.split("/")[2:]  # "/videos/ID/content" -> ["ID", "content"]
        if not parts and method == "POST":
            return JSONResponse(await self.create(request, caller, owner))
        if not parts and method == "GET":
            return JSONResponse({"object": "list", "data": [j.body() for j in self.jobs.values() if j.owner == owner],
                                 "has_more": False})
        job = self._job(parts[0] if parts else "", owner)
        if len(parts) == 1 and method == "GET":
            return JSONResponse(job.body())
        if len(parts) == 1 and method == "DELETE":
            job.run.stop()
            self.jobs.pop(job.id, None)
            return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})
        if len(parts) == 2 and parts[1] == "content" and method in ("GET", "HEAD"):
            return self.content(job, request.query_params.get("variant") or "video")
        raise ApiError(404, f"no route {method} {PREFIX}{path}; the videos API serves POST/GET /v1/videos, GET and "
                            "DELETE /v1/videos/{id}, GET /v1/videos/{id}/content", code="unknown_url")

    def _owner(self, request, keys_required: bool) -> str:
        """Whom a request's jobs belong to: its API key (a digest, never the key) where keys are required, else
        its client (the edge's session or address)."""
        import hashlib

        scheme, _, sent = (request.headers.get("authorization") or "").partition(" ")
        if keys_required and scheme.lower() == "bearer" and sent.strip():
            return "key " + hashlib.sha256(sent.strip().encode()).hexdigest()[:24]
        return self._client(request)

    def _client(self, request) -> str:
        return self.h.edge.callers.client_of(request) if self.h.edge is not None else f"v1 {request.client.host}"

    def _job(self, job_id: str, owner: str) -> VideoJob:
        job = self.jobs.get(job_id)
        if job is None or job.owner != owner:  # another's job: not found, so its id tells nothing
            raise ApiError(404, f"no video {job_id[:40]!r} here (the last {self.kept} jobs are kept)",
                           param="video_id", code="not_found")
        return job

    async def create(self, request, caller: Caller, owner: str) -> dict:
        import anyio

        form = await read_form(request)
        check_form(form)
        client = self._client(request)
        name = _field(form, "model") or self._default_model(SOURCE in form)
        spec = self._spec(form, name, caller, client)
        held = ExitStack()
        try:  # the caller's turn first: nothing is decoded for a caller already running one
            hold_turn(self.h, client, held)
            admitted = await anyio.to_thread.run_sync(self._admit, spec)  # checked, priced, its source decoded
        except BaseException:
            held.close()
            raise
        job = VideoJob(id=f"video_{secrets.token_hex(12)}", model=admitted.key.preset, prompt=spec.prompt,
                       size=str(admitted.request.size), client=client, run=Run(self.h.serving.cancel), owner=owner,
                       seconds=f"{admitted.request.num_frames / max(1, admitted.request.fps):.2f}")
        self._keep(job)
        task = asyncio.create_task(self._run(job, admitted, held))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return job.body()

    def _spec(self, form: dict, name: str, caller: Caller, client: str) -> ImageRequest:
        if name not in self.h.serving.preset_names():
            raise ApiError(404, f"model {name[:60]!r} is not offered here (GET /v1/models)", param="model",
                           code="model_not_found")
        preset = self.h.serving.preset(name)
        if not preset.video:
            raise ApiError(400, f"model {name} makes images, not clips; choose a video model: "
                                f"{', '.join(self._videos()) or 'none is offered on this server'}", param="model")
        if SOURCE in form and not preset.inputs.takes_images:
            raise ApiError(400, f"model {name} makes clips from text only, so it takes no {SOURCE}; choose a model "
                                f"that starts from an image: {', '.join(self._videos(True)) or 'none is offered here'}",
                           param=SOURCE)
        d = self.h.defaults
        given = {field: _field(form, field) for field in VIDEO_FIELDS}
        given.update({field: given[field] or getattr(d, field) for field in PAGE_DEFAULTS})
        return ImageRequest(**{**given, "seed": given["seed"] if given["seed"] not in (None, "") else 0,
                               "num_frames": frames_asked(form, preset.fps),
                               "images": (form[SOURCE],) if SOURCE in form else ()},
                            preset=name, prompt=form["prompt"], size=_field(form, "size") or None, caller=caller,
                            client=client)

    def _videos(self, from_image: bool = False) -> list[str]:
        """The video models offered to visitors here (`from_image`: those that take a source image)."""
        serving = self.h.serving
        return [n for n in serving.visitor_presets() if serving.preset(n).video
                and (not from_image or serving.preset(n).inputs.takes_images)]

    def _default_model(self, from_image: bool) -> str:
        """A job naming no model: the video task's default (engine/config/defaults.py), among the models that take
        a source image when it sends one; the server's default preset where no video model is offered."""
        chosen = self.h.task_preset(Task.VIDEO, self._videos(from_image))
        return chosen.name if chosen is not None else self.h.default_preset().name

    def _admit(self, spec: ImageRequest):
        h = self.h
        key = h.key_for(spec.preset, spec.device, spec.precision, 1, caller=spec.caller)
        return h.serving.admit(spec.replace(preset=key.preset))

    def _keep(self, job: VideoJob) -> None:
        self.jobs[job.id] = job
        while len(self.jobs) > self.kept:
            done = next((j for j in self.jobs.values() if j.status in ("completed", "failed")), None)
            if done is None:
                break
            del self.jobs[done.id]

    async def _run(self, job: VideoJob, admitted, held: ExitStack) -> None:
        try:
            async with aclosing(self.h.serving.events(admitted, run=job.run)) as events:
                async for event in events:
                    if isinstance(event, stream.Step):
                        job.step(event.progress)
                    elif isinstance(event, stream.Finished):
                        job.finished(event.result)
                    elif isinstance(event, (stream.Failed, stream.Stopped)):
                        job.failed(event.error)
        except Exception as exc:  # noqa: BLE001 - the job says it failed; the server keeps serving
            job.failed(exc)
        finally:
            held.close()

    def content(self, job: VideoJob, variant: str):
        from starlette.responses import Response

        if variant not in VARIANTS:
            raise ApiError(400, f"variant must be one of {', '.join(VARIANTS)}, got {variant[:40]!r}", param="variant")
        if job.status != "completed":
            raise ApiError(409 if job.status != "failed" else 400, f"video {job.id} is {job.status}"
                           + (f" ({job.progress} %): poll GET /v1/videos/{job.id} until it is completed"
                              if job.status != "failed" else f": {job.error['message']}"), code="video_not_ready")
        result = job.result
        if variant == "video":
            return Response(result.video_mp4, media_type="video/mp4")
        png = result.image_png if variant == "thumbnail" else spritesheet(result.frames())
        return Response(png, media_type="image/png")


def spritesheet(frames: list) -> bytes:
    """Every frame of a clip side by side, as one PNG (the per-frame strip)."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.concatenate(frames, axis=1)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()
