"""Hostile uploads made in the test (import as `from hostile import ...`): nothing of them is committed.

- `scan_bomb(side, scans)`: a progressive grayscale JPEG whose one AC scan (with its Huffman table) is repeated
  `scans` times; Pillow decodes every scan, each a pass over all the blocks.
- `wide_png(width, height)`: a PNG whose header declares 16-bit RGBA pixels (8 B/px) with one compressed row.
- `crafted_exif_jpeg()`: a small JPEG with Orientation 6 and an ImageWidth stored as ASCII, which makes Pillow's
  `ImageOps.exif_transpose` raise struct.error when it writes the EXIF back.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def _segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each JPEG marker segment; a scan's end includes its entropy-coded data."""
    out, at = [], 2
    while at < len(data):
        marker = data[at + 1]
        if marker == 0xD9:
            out.append((marker, at, at + 2))
            break
        end = at + 2 + int.from_bytes(data[at + 2:at + 4], "big")
        if marker == 0xDA:  # entropy data runs to the next marker that is not a stuffed 0xFF00 or a restart
            while not (data[end] == 0xFF and data[end + 1] not in (0x00, *range(0xD0, 0xD8))):
                end += 1
        out.append((marker, at, end))
        at = end
    return out


def scan_bomb(side: int, scans: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((side, side), 128, np.uint8), "L").save(buffer, "JPEG", progressive=True, quality=90)
    data = buffer.getvalue()
    segments = _segments(data)
    sos = [i for i, segment in enumerate(segments) if segment[0] == 0xDA]
    head = data[:segments[sos[0]][2]]  # the frame and its DC scan
    ac = data[segments[sos[0] + 1][1]:segments[sos[1]][2]]  # the first AC scan and the table before it
    return head + ac * scans + b"\xff\xd9"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def wide_png(width: int, height: int) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(1 + width * 8)))
            + _chunk(b"IEND", b""))


def crafted_exif_jpeg(colour=(200, 30, 30)) -> bytes:
    entries = [struct.pack("<HHII", 0x0100, 2, 8, 38),  # ImageWidth as 8 ASCII bytes, stored after the IFD
               struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0)]  # Orientation 6: rotate to stand upright
    ifd = struct.pack("<H", len(entries)) + b"".join(entries) + struct.pack("<I", 0)
    tiff = b"II*\x00" + struct.pack("<I", 8) + ifd + b"abcdefg\x00"
    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), colour).save(buffer, "JPEG", exif=b"Exif\x00\x00" + tiff)
    return buffer.getvalue()
