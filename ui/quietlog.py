"""Log lines a visitor can cause, bounded: one line each, rate-limited per visitor and in total.

What a visitor sends wrong (an unknown event id or function, inputs Gradio cannot take, a stream for a
session that does not exist) used to reach the log as Gradio's or uvicorn's traceback, several KB per request:
one connection could write megabytes a second. Now:
- a client error is one line (its kind and the first line of its message), never a traceback;
- an unexpected error is one line and counted by kind (/metrics); its traceback goes to the debug level the
  first time its code location fails (at most SIGNATURES of them);
- each visitor (its address; "queue" for Gradio's queue, which knows no address) writes at most PER_CLIENT
  lines per WINDOW_S and all of them together at most TOTAL; what is held back is counted and said in one
  line when the next window opens.
Gradio prints its tracebacks with `traceback.print_exc()` (queueing, routes, route_utils): `install` gives
those modules a `traceback` whose print_exc goes through here. And with show_error off (app.py), Gradio
answers an input it cannot read with a bare "Error": `install` makes that answer name the input instead
(client_message), while every other error stays hidden as before.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import traceback
from collections import Counter

log = logging.getLogger("ui.visitors")

PER_CLIENT = 5  # lines per visitor per window
TOTAL = 30  # lines per window, all visitors together
WINDOW_S = 60.0
SIGNATURES = 256  # code locations whose first failure is logged in full
QUEUE = "queue"  # the key of lines Gradio's queue causes (it does not know the visitor's address)
HANDLERS = "handlers"  # ... and the handlers' unexpected failures
# Frames a client error is raised from: Gradio finding the function, checking and preprocessing the inputs.
CLIENT_FRAMES = frozenset({"get_fn", "validate_inputs", "preprocess_data", "preprocess"})


def _chain(exc: BaseException | None) -> list[BaseException]:
    found = []
    while exc is not None and exc not in found and len(found) < 8:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def client_status(exc: BaseException) -> int | None:
    """The 4xx a visitor's request earns when `exc` is the visitor's fault (an unknown function, event or
    session, inputs Gradio refuses), else None (the server's own failure)."""
    for e in _chain(exc):
        status = getattr(e, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            return status
        if type(e).__name__ == "FnIndexInferError":
            return 404
        if type(e).__name__ == "Error" and type(e).__module__ == "gradio.exceptions":  # gr.Error: says what to change
            return 400
        frames = {frame.name for frame in traceback.extract_tb(e.__traceback__)}
        if frames & CLIENT_FRAMES:
            return 404 if isinstance(e, KeyError | IndexError) else 400
    return None


def gist(exc: BaseException, limit: int = 200) -> str:
    """The exception's kind and the first line of its message, shortened."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 1] + "…"


class LogBudget:
    def __init__(self, per_client: int = PER_CLIENT, total: int = TOTAL, window_s: float = WINDOW_S):
        self.per_client, self.total, self.window_s = per_client, total, window_s
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._lines: Counter[str] = Counter()
        self._held: Counter[str] = Counter()
        self._signatures: set = set()
        self.unexpected: Counter[str] = Counter()  # the server's own failures by kind (/metrics)

    def allow(self, client: str) -> bool:
        """Whether `client` may write one more line now (counted when it may not)."""
        summary = None
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window_s:
                if self._held:
                    summary = (sum(self._held.values()), len(self._held))
                self._start, self._lines, self._held = now, Counter(), Counter()
            if self._lines[client] >= self.per_client or sum(self._lines.values()) >= self.total:
                self._held[client] += 1
                allowed = False
            else:
                self._lines[client] += 1
                allowed = True
        if summary:
            log.warning("%d more lines visitors caused were not logged in the last %.0f s (from %d visitor(s))",
                        summary[0], self.window_s, summary[1])
        return allowed

    def first_of(self, exc: BaseException) -> bool:
        """Whether `exc`'s code location fails for the first time (its traceback is worth the log)."""
        frames = traceback.extract_tb(exc.__traceback__)
        signature = (type(exc).__name__, *((frames[-1].filename, frames[-1].lineno) if frames else ()))
        with self._lock:
            if signature in self._signatures or len(self._signatures) >= SIGNATURES:
                return False
            self._signatures.add(signature)
            return True

    def failure(self, client: str, what: str, exc: BaseException) -> int | None:
        """Log a request's failure within the budget; returns the 4xx when it was the visitor's fault."""
        status = client_status(exc)
        if status is None:
            with self._lock:
                self.unexpected[type(exc).__name__[:40]] += 1
        if not self.allow(client):
            return status
        if status is not None:
            log.warning("%s from %s: %s (answered %d)", what, client, gist(exc), status)
        elif self.first_of(exc):
            log.error("%s from %s failed: %s (its traceback at debug level)", what, client, gist(exc))
            log.debug("%s from %s failed", what, client, exc_info=exc)
        else:
            log.error("%s from %s failed: %s", what, client, gist(exc))
        return status

    def line(self, client: str, message: str, *args) -> None:
        if self.allow(client):
            log.warning(message, *args)


_AT_INDEX = re.compile(r'input component at index (\d+) .*?\(named "([^"]+)"\)', re.S)


def input_names(demo) -> dict[tuple[str, int], str]:
    """(handler name, input index) -> the name a visitor knows the input by: the API parameter (the handler's
    argument) and the page's label."""
    try:
        endpoints = demo.get_api_info(all_endpoints=True)["named_endpoints"]
    except Exception:  # the page's labels still name them
        endpoints = {}
    names = {}
    for fn in demo.fns.values():
        params = iter(p.get("parameter_name") for p in endpoints.get(f"/{fn.api_name}", {}).get("parameters", ()))
        for i, block in enumerate(fn.inputs):
            param = None if getattr(block, "skip_api", False) else next(params, None)
            shown = " / ".join(f"{x!r}" for x in (param, getattr(block, "label", None)) if x)
            names[(fn.name, i)] = shown or f"input {i + 1}"
    return names


def client_message(exc: BaseException, names: dict) -> str | None:
    """What a visitor reads for an error that is theirs: the input Gradio could not read, or the first line
    of Gradio's own message; None for the server's errors (they stay a bare "Error")."""
    if client_status(exc) is None:
        return None
    if type(exc).__name__ == "ComponentProcessingError":
        match = _AT_INDEX.search(str(exc))
        what = names.get((match.group(2), int(match.group(1))), "an input") if match else "an input"
        cause = exc.__cause__
        why = f" ({gist(cause, 160)})" if cause is not None else ""
        return f"The value sent for {what} could not be read{why}; send a value of its type (see /gradio_api/info)"
    return gist(exc).split(": ", 1)[-1]


class _QuietTraceback:
    """The `traceback` module as Gradio's modules see it, with print_exc going through a LogBudget."""

    def __init__(self, budget: LogBudget):
        self._budget = budget

    def __getattr__(self, name):
        return getattr(traceback, name)

    def print_exc(self, *args, **kwargs) -> None:
        exc = sys.exc_info()[1]
        if exc is not None:
            self._budget.failure(QUEUE, "an event", exc)


_installed: LogBudget | None = None  # the latest app's (install)


def unexpected(what: str, exc: BaseException, client: str = HANDLERS) -> None:
    """An unexpected failure of a handler (`client`: who sent the request, when known): counted, one line
    within the visitors' budget (a visitor may trigger the same bug again and again), its traceback at debug
    level the first time its code location fails."""
    budget = _installed
    if budget is None:
        log.error("unexpected error in %s: %s", what, gist(exc))
        log.debug("unexpected error in %s", what, exc_info=exc)
    else:
        budget.failure(client, f"a request to {what}", exc)


def visitor_line(client: str, message: str, *args) -> None:
    """One line a visitor caused, within the latest app's budget (or logged when no app is installed)."""
    budget = _installed
    if budget is None:
        log.warning(message, *args)
    else:
        budget.line(client, message, *args)


def install(budget: LogBudget, demo) -> None:
    """Route Gradio's printed tracebacks (and the handlers' unexpected failures) through `budget`, and name the
    input in its answer to one it could not read (the latest app's, once per process)."""
    global _installed
    _installed = budget
    for name in ("gradio.queueing", "gradio.routes", "gradio.route_utils"):
        module = sys.modules.get(name)
        if module is not None:
            module.traceback = _QuietTraceback(budget)
    from gradio import queueing, utils
    from gradio.exceptions import Error

    original = getattr(utils.error_payload, "original", utils.error_payload)
    names = input_names(demo)

    def error_payload(error, show_error):
        own = error is None or show_error or isinstance(error, Error)  # a gr.Error says what it means already
        message = None if own else client_message(error, names)
        if message is None:
            return original(error, show_error)
        return {"error": message, "visible": True, "title": "Invalid input"}

    error_payload.original = original
    utils.error_payload = queueing.error_payload = error_payload
