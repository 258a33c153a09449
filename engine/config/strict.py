"""Strict reading of what a visitor sends: whole numbers by an ASCII grammar, JSON with bounded nesting and digits.

`str.isdigit()` takes "²" and "١٢" and `int()` then fails or reads them as digits; Python refuses to turn more
than 4,300 digits into an int (ValueError) and recurses once per nesting level of JSON (RecursionError); each
of those reached a door as an unexpected error (HTTP 500 and a traceback). Here each is an InvalidRequest
naming the field and what to send.
"""

from __future__ import annotations

import json
import math
import re

from engine.errors import InvalidRequest

MAX_DIGITS = 40  # digits of a number in a request: 2**128 has 39
MAX_DEPTH = 32  # nesting of arrays and objects in a request body
_WHOLE = re.compile(r"[+-]?[0-9]+")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole(value, name: str) -> int:
    """A whole number from an int (not a bool) or text of ASCII digits (an optional sign, at most MAX_DIGITS)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if len(str(abs(value))) > MAX_DIGITS:
            raise InvalidRequest(f"{name} has more than {MAX_DIGITS} digits; send a whole number in its range")
        return value
    text = value.strip() if isinstance(value, str) else None
    if text is None or not _WHOLE.fullmatch(text):
        raise InvalidRequest(f"{name} must be a whole number written with the digits 0-9, got {_shown(value)}")
    if len(text.lstrip("+-")) > MAX_DIGITS:
        raise InvalidRequest(f"{name} has more than {MAX_DIGITS} digits; send a whole number in its range")
    return int(text)


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON `text` (brackets inside strings do not count)."""
    deepest = level = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            level += 1
            deepest = max(deepest, level)
        elif char in "]}":
            level -= 1
    return deepest


def _number(text: str):
    if len(text.lstrip("-").split(".")[0].split("e")[0].split("E")[0]) > MAX_DIGITS or len(text) > 2 * MAX_DIGITS:
        raise InvalidRequest(f"a number in the body has more than {MAX_DIGITS} digits ({text[:20]}...); "
                             "send numbers in their fields' ranges")
    if _WHOLE.fullmatch(text):
        return int(text)
    number = float(text)
    if not math.isfinite(number):  # 1e999999 reads as inf
        raise InvalidRequest(f"a number in the body ({text[:20]}) is out of range; send numbers in their fields' "
                             "ranges")
    return number


def _constant(name: str):
    raise InvalidRequest(f"{name} is not a JSON number; send a finite number")


def loads(data: bytes | str, max_depth: int = MAX_DEPTH):
    """JSON of a request body; InvalidRequest when it is not UTF-8 JSON, nests deeper than `max_depth` or
    has a number of more than MAX_DIGITS digits."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else str(data)
    except UnicodeError:
        raise InvalidRequest("the body must be JSON in UTF-8 (Content-Type: application/json)") from None
    if depth(text) > max_depth:
        raise InvalidRequest(f"the body nests arrays or objects more than {max_depth} deep; send a flat JSON object")
    try:
        return json.loads(text, parse_int=_number, parse_float=_number, parse_constant=_constant)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest("the body must be JSON (Content-Type: application/json)") from None
