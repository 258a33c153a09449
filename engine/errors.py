"""Errors every entry point (CLI, UI, API, sidecar) turns into a clear message.

Each error says what went wrong *and* what to change. They are plain picklable exceptions so a
worker process or the torchrun sidecar can send them back unchanged.
"""

from __future__ import annotations

import re

# A server path in a message: absolute (/a/b, C:\\a), home-relative (~, ~user/a) or a dotted relative one
# (./a, ../a). URLs (scheme://host/...) are left alone.
_PATH = re.compile(r"""(?<![\w.\-:/~])(?:~[\w.\-]*(?:/[^\s'"`,;()\[\]<>]*)?|\.{1,2}/[^\s'"`,;()\[\]<>]+|"""
                   r"""/[^\s'"`,;()\[\]<>/]+/[^\s'"`,;()\[\]<>]*|[A-Za-z]:\\[^\s'"`,;()\[\]<>]+)""")


def scrub_paths(text) -> str:
    """`text` with every file-system path replaced by <path>: what a visitor may read (the log keeps the
    original). The engine's notices and failure reasons go through it where they are made; the web edge
    passes every message through it again."""
    return _PATH.sub("<path>", str(text))


class ShowcaseError(Exception):
    """Base class: `str(err)` is the message shown to users."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # keep subclasses picklable across processes
        return (self.__class__, (self.message,))


class InvalidRequest(ShowcaseError, ValueError):
    """The request itself is wrong (size, steps, prompt, unknown name ...)."""


class DeviceUnavailable(ShowcaseError):
    """The device is absent on this machine; the message says why."""


class UnsupportedCombination(ShowcaseError):
    """The device cannot do this precision or mode."""


class ModelLoadError(ShowcaseError):
    """The model could not be loaded (missing path, offline Hub id, remote code ...)."""


class EngineBusy(ShowcaseError):
    """The queue is full; retry later. `retry_after_s`: when a retry may be served (HTTP's Retry-After)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (self.__class__, (self.message, self.retry_after_s))

    def retry_after(self) -> int:
        """Whole seconds to put in a Retry-After header (at least 1)."""
        return max(1, min(3600, round(self.retry_after_s or 5)))


class EngineCrashed(ShowcaseError):
    """The worker process (or a sidecar rank) died; the request did not finish."""


class Cancelled(ShowcaseError):
    """The run was cancelled between steps."""


class DeviceOutOfMemory(ShowcaseError):
    """The device ran out of memory; memory was released and the engine keeps serving."""


class BudgetExceeded(ShowcaseError):
    """Starting this engine would exceed the host's memory budget or engine count; nothing was unloaded
    that was in use. The message names the budget, the need and what to do instead."""


class NotAllowed(ShowcaseError):
    """The host does not let visitors do this (public mode); the message says what they may do."""
