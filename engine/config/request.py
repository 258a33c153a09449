"""One image request, as every edge builds it: the Gradio handlers, the /generate API, the CLI, the benches.

An `ImageRequest` says what engine (preset, device, precision, ranks), what image (prompt, size, steps, ...)
and who asks (caller, client). It is built once at the edge and handed unchanged to
`EngineManager.generate`, where `build_request` (engine/config/validation.py) validates it into the
worker's `GenerateRequest`. Values arrive as the edge has them (the API's are text); nothing here checks
them, so one place says what is wrong with a field.

`FORM` is the one ordered list of the fields a page or an API caller sets (engine/protocol/params.py declares
each): the /generate API's parameters, the Generate page's inputs and the handlers' keyword arguments all
derive from it, and `ImageRequest` holds each one. A new field is one declaration there (plus its widget).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from engine.config.masks import MaskConvention
from engine.errors import InvalidRequest
from engine.protocol import Parallel, Size, params

MAX_PREVIEWS = 3  # partial images of one run (OpenAI's partial_images takes 0-3): each is a VAE decode
API_KEYS_ADMIN = "admin-token"  # app.py --api-keys admin-token: the admin token is the one key


class Caller(enum.StrEnum):
    HOST = "host"  # the CLI, the host's own scripts, an admin with the token
    VISITOR = "visitor"  # anyone on the web page or the public API


def load_api_keys(path: str) -> frozenset[str]:
    """The /v1 API's keys (app.py --api-keys; a key makes its caller a VISITOR, the admin token the HOST): one a
    line, '#' comments and blank lines skipped. InvalidRequest saying what is wrong, never quoting a key."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeError) as exc:
        raise InvalidRequest(f"cannot read the key file {path} ({type(exc).__name__}); give a readable text file "
                             "with one key a line, or admin-token") from None
    keys = frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise InvalidRequest(f"the key file {path} holds no key; write one key a line")
    short = sum(len(key) < MIN_KEY_CHARS for key in keys)
    if short:
        raise InvalidRequest(f"the key file {path} holds {short} key(s) shorter than {MIN_KEY_CHARS} characters, "
                             f"which can be guessed; {KEY_ADVICE}")
    return keys


MIN_KEY_CHARS = 16  # an API key or admin token: 16 random characters are about 96 bits
KEY_ADVICE = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(24))'"


def check_secret(text: str) -> str:
    """--admin-token: at least MIN_KEY_CHARS characters (it is a key of the /v1 API and of /metrics too)."""
    if len(text.strip()) < MIN_KEY_CHARS:
        raise InvalidRequest(f"a token of {len(text.strip())} characters can be guessed; give at least "
                             f"{MIN_KEY_CHARS} ({KEY_ADVICE})")
    return text


# The fields a page or an API caller sets, in the order of the /generate API, each declared once
# (engine/protocol/params.py: gradio_client callers pass them positionally, so new ones are appended).
FORM = params.FIELDS
FORM_FIELDS = tuple(f.name for f in FORM)
API_FIELDS = tuple(f.name for f in FORM if f.api)


# The declared fields as the edge has them (typed, or an API's text), with their declared defaults; the preset is
# ImageRequest's first, positional.
FormFields = params.form_class("FormFields", exclude=("preset",))


@dataclass(frozen=True)
class ImageRequest(FormFields):
    """What one image or clip needs, unvalidated: the engine, the sampling fields and who asks (see the module
    docstring). Every field of `FORM` is one (keyword-only, as engine/protocol/params.py declares it).

    `size` ("WxH" or a Size) or `width`/`height`; neither: the preset's first bucket (an edit: its source's size).
    `steps`/`guidance` None: the preset's defaults. `images`: encoded files' bytes, checked once by
    engine/config/images.py (the first is the source of img2img, inpaint and an instruction edit; all are
    references for FLUX.2)."""

    preset: str
    parallel: str | Parallel = Parallel.TENSOR
    width: int | None = None
    height: int | None = None
    snap: bool = True  # a size between buckets is snapped to the nearest (else refused)
    previews: int | str = 0  # partial images to stream while it runs (the /v1 API's partial_images)
    mask_convention: MaskConvention = MaskConvention.LUMINANCE  # what the door's mask means (config/masks.py)
    # who asks
    caller: Caller = Caller.HOST
    client: str = ""  # the visitor's address: engines take turns between clients, budgets are held per client
    # `images` and `mask` as an earlier admission decoded them (engine/config/images.py Decoded): a Compare's
    # configurations share one decode of their uploads
    decoded: object = None

    def replace(self, **changes) -> ImageRequest:
        return dataclasses.replace(self, **changes)

    def dimensions(self, buckets) -> tuple[int, int]:
        """(width, height) asked for: `size`, else `width`/`height`, else the first of the preset's `buckets`."""
        if self.size is not None:
            size = self.size if isinstance(self.size, Size) else Size.parse(self.size)
            return size.width, size.height
        if self.width is None or self.height is None:
            return buckets[0].width, buckets[0].height
        return self.width, self.height
