"""Reading and checking safetensors weight files without loading a tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range) and the data. A corrupt length would make a naive reader allocate whatever it says (exabytes),
so the length is checked against the file's size first. Errors name the pipeline component and the file
name, never the folder it lives in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from engine.errors import ModelLoadError

# safetensors itself refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000


class CorruptWeights(ModelLoadError):
    """A weight file is missing, truncated or has an unreadable header."""


def describe(path: Path) -> str:
    """'component text_encoder (model.safetensors)': what the user can recognise, without a server path."""
    path = Path(path)
    return f"component {path.parent.name} ({path.name})"


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, with its length and byte ranges checked against the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptWeights(f"the weights of {describe(path)} are truncated ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise CorruptWeights(
                    f"the weights of {describe(path)} are corrupt: the header claims {length} bytes in a file of "
                    f"{size} bytes")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise CorruptWeights(f"the weights of {describe(path)} cannot be read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptWeights(f"the weights of {describe(path)} have an unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptWeights(f"the weights of {describe(path)} have an unreadable header (not a JSON object)")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptWeights(f"the weights of {describe(path)} have an unreadable entry {name!r}") from None
        if not 0 <= begin <= end <= data:
            raise CorruptWeights(f"the weights of {describe(path)} are truncated: {name!r} ends at byte {end} of "
                                 f"{data}")
    return header


def parameter_count(header: dict) -> int:
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in entry.get("shape", []):
            count *= int(dim)
        total += count
    return total
