"""The console of the app's processes (the web server and every engine worker): what they log and how.

- Third-party messages known to be harmless here are dropped at the logger that emits them, each matched
  by its words (`HARMLESS`), never a logger or a level silenced as a whole: anything else they say still
  shows.
- Text lines (`LEVEL logger [request id]: message`) or, for hosts that ship logs, one JSON object per line
  (`--log-format json`, SHOWCASE_LOG_FORMAT=json).
- A line logged while a request runs carries its id (the request_id of its GenerateRequest,
  engine/protocol/requests.py): `request_context` sets it for the thread that serves the request (the
  manager's in the web process, the worker loop's in a worker).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
import warnings
from contextlib import contextmanager

from engine import settings

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("showcase_request_id", default=None)

# (logger, words its message contains): harmless here, and nothing a user could act on.
HARMLESS = (
    # torchao ships two extensions built against CUDA libraries; a CPU build of torch cannot load them
    # and torchao runs without them (the int8 precisions use its CPU kernels).
    ("torchao", ("Failed to load", "_C_mxfp8")),
    ("torchao", ("Failed to load", "_C_cutlass_90a")),
    ("torchao.kernel.intmm", ("Detected no triton",)),  # Triton is GPU-only: its kernels are not used on CPU
    # torchao 0.18 registers its enums with pytree as torch 2.13 deprecates it; a torchao release fixes it.
    ("torch.utils._pytree", ("is an Enum subclass", "register_constant")),
    # diffusers' torchao quantizer reads checkpoints saved by torchao, which no engine loads.
    ("diffusers.quantizers.torchao.torchao_quantizer", ("Unable to import `torchao` Tensor objects",)),
    # The PIL image processors are what the pipelines' (unused) image encoders get without torchvision.
    ("transformers.utils.import_utils", ("requires torchvision (not installed); falling back to",)),
    # The embedded model's small VAE (AutoencoderTiny) is not the type FLUX.1's pipeline annotates; it works.
    ("diffusers.pipelines.pipeline_utils", ("Expected types for vae", "AutoencoderTiny")),
    # tiny-wan's text encoder is the project's tiny T5, not the UMT5 Wan's pipeline annotates; it works.
    ("diffusers.pipelines.pipeline_utils", ("Expected types for text_encoder", "UMT5EncoderModel", "T5EncoderModel")),
    # Served adapters are denoiser-only (a text-encoder LoRA cannot be hot-swapped and is refused), so every
    # load and swap finds no text-encoder keys, as it should.
    ("diffusers.loaders.lora_base", ("No LoRA keys associated to", "prefix='text_encoder")),
    # A visitor's faster-cache request: diffusers warns on every one (two lines per request, a log any
    # visitor could flood); the app offers it knowingly, with diffusers' default weight.
    ("diffusers.hooks.faster_cache", ("FasterCache is a purely experimental feature",)),
    ("diffusers.hooks.faster_cache", ("No `attention_weight_callback` provided when enabling FasterCache",)),
)


# (category, the start of its message): library warnings of the same kind, printed by `warnings` itself.
HARMLESS_WARNINGS = (
    # torch 2.13 deprecates pytree's LeafSpec, which torchao 0.18 and diffusers still build: two lines at the
    # first compile, nothing a user could act on.
    (FutureWarning, r".*LeafSpec"),
)


class _Harmless(logging.Filter):
    def __init__(self, words: list[tuple[str, ...]]):
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is shown as logging shows it
            return True
        return not any(all(w in message for w in words) for words in self.words)


_quieted = False


def quiet_third_party() -> None:
    """Attach the HARMLESS filters to their loggers (once per process; before or after the libraries are
    imported: logging hands the library the same logger object)."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    by_logger: dict[str, list[tuple[str, ...]]] = {}
    for name, words in HARMLESS:
        by_logger.setdefault(name, []).append(words)
    for name, words in by_logger.items():
        logging.getLogger(name).addFilter(_Harmless(words))
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def thread_locks_for_progress_bars() -> None:
    """tqdm's progress bars (diffusers' loading and step bars) lock with a multiprocessing semaphore by
    default. A worker leaves with os._exit, so that semaphore is never released and the app's resource
    tracker warned at shutdown ("There appear to be 1 leaked semaphore objects"). A worker's bars are
    written by its own threads only: a thread lock serves them."""
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


@contextmanager
def request_context(request_id: str | None):
    """Lines logged by this thread inside the block carry `request_id`."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request_id = request_id
        record.request_tag = f" [{request_id}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, process, request_id, message."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "process": self.process,
            "request_id": getattr(record, "request_id", None), "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def log_format(value: str | None = None) -> str:
    """'text' or 'json' (`value`, else SHOWCASE_LOG_FORMAT); anything else is refused with the choices."""
    value = (value or settings.log_format()).strip().lower()
    if value not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {value!r}")
    return value


def configure(level: int | str, process: str, fmt: str | None = None, prefix: str = "") -> None:
    """The process's one console handler (stderr): the chosen format, request ids, the harmless
    third-party messages dropped. `prefix` starts every text line (a worker names its engine)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestId())
    if log_format(fmt) == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s%(request_tag)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    quiet_third_party()
