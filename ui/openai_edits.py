"""POST /v1/images/edits, as OpenAI's API has it: a multipart body with `image` (one file) or `image[]` (several:
the openai SDK's `images.edit(image=[...])`), an optional `mask` (OpenAI's convention: its fully transparent
pixels are edited), and the same text fields as
/v1/images/generations (`prompt`, `model`, `n`, `size`, `response_format`, `stream`, `partial_images`, `user`,
the showcase's own extra fields), plus `strength` for img2img / inpaint presets.

The body is read here, bounded while it arrives: the whole body (EDIT_BODY_BYTES, which the web edge's
bound for this one route matches), each file (engine/config/images.py's MAX_UPLOAD_BYTES), each text field,
the number of parts and each part's headers. Files stay in memory, as bytes, for the one answer: nothing is
written to disk, nothing is decoded here. The bytes become `ImageRequest.images` / `.mask`, which the gate's
`build_request` decodes and checks once (header first: a decompression bomb costs a header read), as it does
for the page, /generate, MCP and the CLI. Everything after the body is /v1/images/generations' path
(ui/openai_api.py `OpenAIRoutes.answer`): n images sent together run as one pipeline call.
"""

from __future__ import annotations

import dataclasses

from engine.config.images import MAX_IMAGES, MAX_UPLOAD_BYTES, MAX_UPLOADS_BYTES
from engine.config.request import Caller, MaskConvention
from engine.protocol import Task
from ui.openai_api import (
    EXTRA_FIELDS,
    IGNORED_FIELDS,
    OPENAI_FIELDS,
    ApiError,
    ImagesCall,
    check_body,
    read_call,
    unnamed_notice,
)

PATH = "/v1/images/edits"
FILE_FIELDS = ("image", "image[]", "mask")
EDIT_FIELDS = {"strength": "img2img / inpaint presets: 0-1, how much of the schedule runs from the noised source "
                           "(default 0.6)"}
EDIT_IGNORED = ("input_fidelity",)  # OpenAI's fidelity knob: these pipelines have none
MAX_TEXT_BYTES = 32 * 1024  # a text field (a prompt is at most 4,000 characters: up to 16 KB of UTF-8)
MAX_HEADER_BYTES = 8 * 1024  # one part's headers
MAX_PARTS = MAX_IMAGES + 1 + len(OPENAI_FIELDS) + len(IGNORED_FIELDS) + len(EXTRA_FIELDS) + 4
EDIT_BODY_BYTES = MAX_UPLOADS_BYTES + 1024 * 1024  # every file together, and the text fields' room
CHUNK = 64 * 1024
EDIT_FORM = ("POST /v1/images/edits takes a multipart/form-data body (image, prompt, ...), as the openai SDK's "
             "images.edit sends it")


def _too_large(what: str, limit: int, param: str | None = None) -> ApiError:
    return ApiError(413, f"{what} is over this server's limit of {limit:,} bytes; send a smaller or compressed "
                         "image", param=param, code="too_large")


class _Part:
    def __init__(self):
        self.headers: dict[bytes, bytes] = {}
        self.header_bytes = 0
        self.field = b""
        self.value = b""
        self.name: str | None = None
        self.filename: str | None = None
        self.data = bytearray()


def _listed(names) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


class MultipartReader:
    """A multipart/form-data body read part by part (python-multipart's streaming parser), each part bounded as
    its bytes arrive: `files` maps a file field's name to its files' bytes, `texts` a text field to its value.
    `file_fields`: the fields that are files (any other file part is refused), at most `max_parts` parts."""

    def __init__(self, boundary: bytes, file_fields: tuple[str, ...] = FILE_FIELDS, max_parts: int = MAX_PARTS):
        from python_multipart.multipart import MultipartParser

        self.file_fields, self.max_parts = file_fields, max_parts
        self.files: dict[str, list[bytes]] = {}
        self.texts: dict[str, str] = {}
        self.parts = 0
        self.part = _Part()
        callbacks = {"on_part_begin": self._begin, "on_header_field": self._header_field,
                     "on_header_value": self._header_value, "on_header_end": self._header_end,
                     "on_headers_finished": self._headers_done, "on_part_data": self._data,
                     "on_part_end": self._end, "on_end": self._complete}
        self.complete = False
        self.parser = MultipartParser(boundary, callbacks)

    def write(self, chunk: bytes) -> None:
        from python_multipart.exceptions import MultipartParseError

        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise ApiError(400, f"the multipart body is malformed ({str(exc)[:80]}); send it as the openai SDK's "
                                "images.edit does") from None

    def finish(self) -> None:
        if not self.complete:
            raise ApiError(400, "the multipart body ends before its closing boundary; send the whole body")

    def _complete(self) -> None:
        self.complete = True

    def _begin(self) -> None:
        self.parts += 1
        if self.parts > self.max_parts:
            raise ApiError(400, f"the body has more than {self.max_parts} parts; send the file(s) "
                                f"({_listed(self.file_fields)}) and the fields this API takes, once each")
        self.part = _Part()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        self.part.field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        self.part.value += data[start:end]

    def _count(self, n: int) -> None:
        self.part.header_bytes += n
        if self.part.header_bytes > MAX_HEADER_BYTES:
            raise _too_large("a part's headers", MAX_HEADER_BYTES)

    def _header_end(self) -> None:
        part = self.part
        part.headers[part.field.strip().lower()] = part.value.strip()
        part.field, part.value = b"", b""

    def _headers_done(self) -> None:
        from python_multipart.multipart import parse_options_header

        part = self.part
        kind, options = parse_options_header(part.headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if kind != b"form-data" or name is None:
            raise ApiError(400, "every part of the body needs Content-Disposition: form-data with a name")
        part.name = name.decode("utf-8", "replace")[:60]
        filename = options.get(b"filename")
        part.filename = None if filename is None else filename.decode("utf-8", "replace")
        if part.filename is None and part.name in self.file_fields:
            raise ApiError(400, f"{part.name} must be an uploaded file (a multipart file part with a filename)",
                           param=_param(part.name))
        if part.filename is not None and part.name not in self.file_fields:
            raise ApiError(400, f"{part.name} is not a file field; this API takes files as "
                                f"{_listed(self.file_fields)}", param=part.name)

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self.part
        part.data += data[start:end]
        limit = MAX_UPLOAD_BYTES if part.filename is not None else MAX_TEXT_BYTES
        if len(part.data) > limit:
            raise _too_large(f"{part.name} ({'a file' if part.filename is not None else 'a text field'})", limit,
                             _param(part.name))

    def _end(self) -> None:
        part = self.part
        if part.filename is not None:
            self.files.setdefault(part.name, []).append(bytes(part.data))
        else:
            if part.name in self.texts:
                raise ApiError(400, f"{part.name} is sent twice; send each field once", param=part.name)
            try:
                self.texts[part.name] = part.data.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"{part.name} is not UTF-8 text", param=part.name) from None
        self.part = _Part()


def _param(name: str | None) -> str | None:
    return "image" if name == "image[]" else name


def boundary_of(content_type: str | None, expected: str = EDIT_FORM) -> bytes:
    from python_multipart.multipart import parse_options_header

    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary or len(boundary) > 200:
        raise ApiError(400, expected, code="invalid_content_type")
    return boundary


async def read_parts(request, body_bytes: int = EDIT_BODY_BYTES, expected: str = EDIT_FORM,
                     **fields) -> MultipartReader:
    """The request's multipart body, read and parsed as it arrives, bounded (413 past a bound); `expected`: what
    a body that is not multipart is told; `fields`: the MultipartReader's file fields and part bound."""
    from starlette.requests import ClientDisconnect

    reader = MultipartReader(boundary_of(request.headers.get("content-type"), expected), **fields)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > body_bytes:
        raise _too_large(f"the body ({int(length):,} bytes)", body_bytes)
    read = 0
    try:
        async for chunk in request.stream():
            read += len(chunk)
            if read > body_bytes:
                raise _too_large("the body", body_bytes)
            for at in range(0, len(chunk), CHUNK):
                reader.write(chunk[at:at + CHUNK])
    except ClientDisconnect:
        raise ApiError(400, "the body ended before it was whole; send it again") from None
    reader.finish()
    return reader


def _flag(texts: dict, name: str) -> bool | None:
    value = texts.get(name)
    if value is None:
        return None
    if value.strip().lower() not in ("true", "false", "1", "0"):
        raise ApiError(400, f"{name} must be true or false, got {value[:40]!r}", param=name)
    return value.strip().lower() in ("true", "1")


def edit_body(reader: MultipartReader) -> tuple[dict, tuple[bytes, ...], bytes | None]:
    """The text fields as /v1/images/generations' JSON body (checked the same way), the images in order, the
    mask."""
    texts = dict(reader.texts)
    known = (*OPENAI_FIELDS, *IGNORED_FIELDS, *EXTRA_FIELDS, *EDIT_FIELDS, *EDIT_IGNORED, *FILE_FIELDS)
    unknown = [name for name in texts if name not in known]
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; this API takes image or image[] and mask (files), "
                            f"{', '.join(OPENAI_FIELDS)}, strength and the showcase's own {', '.join(EXTRA_FIELDS)}",
                       param=unknown[0])
    images = (*reader.files.get("image", ()), *reader.files.get("image[]", ()))
    if not images:
        raise ApiError(400, "image is required: the picture to edit (image, or image[] for several references)",
                       param="image")
    masks = reader.files.get("mask", [])
    if len(masks) > 1:
        raise ApiError(400, "send one mask", param="mask")
    for name in ("stream",):
        if name in texts:
            texts[name] = _flag(texts, name)
    return texts, tuple(images), (masks[0] if masks else None)


def edit_preset(routes, caller: Caller, body: dict) -> str:
    """The `model` asked for, else the edit task's default among the models this caller may use."""
    return body.get("model") or routes.default_model(caller, Task.EDIT)


async def read_edit_call(routes, request, caller: Caller) -> ImagesCall:
    """A POST /v1/images/edits request as the ImagesCall /v1/images/generations runs (`routes`: OpenAIRoutes)."""
    reader = await read_parts(request)
    texts, images, mask = edit_body(reader)
    strength = texts.pop("strength", None)
    ignored = [name for name in EDIT_IGNORED if texts.pop(name, None) is not None]
    body = check_body(texts)
    h = routes.h
    client = h.edge.callers.client_of(request) if h.edge is not None else f"v1 {request.client.host}"
    preset = edit_preset(routes, caller, body)
    call = read_call(body, h.defaults, preset, caller, client)
    # OpenAI's convention: the mask's fully transparent pixels are the ones edited (engine/config/masks.py)
    spec = call.spec.replace(images=images, mask=mask, strength=strength or None, mask_convention=MaskConvention.ALPHA)
    notices = (*(() if body.get("model") else (unnamed_notice(preset),)), *call.notices,
               *(f"{name} is not used by this server" for name in ignored))
    return dataclasses.replace(call, spec=spec, notices=notices, events="image_edit")
