"""Hostile uploads, made when asked for (the tests and `python -m bench.hostile`): nothing of them is committed.

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


def _six_at_once(work, bomb: bytes, n: int = 6) -> list[float]:
    """Seconds each of `n` threads took to answer `work(bomb)` when they all start together."""
    import threading
    import time

    seconds, start = [0.0] * n, threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        began = time.perf_counter()
        try:
            work(bomb)
        except Exception:  # noqa: BLE001, S110 - a refusal is the answer being timed
            pass
        seconds[i] = time.perf_counter() - began

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return seconds


def main() -> None:
    """Six scan bombs at once: the gate's answer (refused from the markers) beside Pillow decoding them, as the
    doors did before the bound; and a probe upload's decode time idle and while six bombs are being answered."""
    import statistics
    import threading
    import time

    from engine.config import images

    def pillow(data: bytes) -> None:
        Image.open(io.BytesIO(data)).load()

    def probe_s() -> float:
        began = time.perf_counter()
        images.decode(probe, 0)
        return time.perf_counter() - began

    bomb = scan_bomb(2048, 1000)
    buffer = io.BytesIO()
    Image.new("RGB", (512, 512), (40, 80, 220)).save(buffer, "PNG")
    probe = buffer.getvalue()
    idle = statistics.median(probe_s() for _ in range(9))
    busy: list[float] = []
    stop = threading.Event()

    def probing() -> None:
        while not stop.is_set():
            busy.append(probe_s())

    prober = threading.Thread(target=probing)
    prober.start()
    gate = _six_at_once(lambda data: images.decode(data, 0), bomb)
    stop.set()
    prober.join()
    decoded = _six_at_once(pillow, bomb)
    scans = bomb.count(b"\xff\xda")
    print(f"scan bomb: 2048x2048, {scans:,} scans, {len(bomb):,} bytes; six at once")
    print(f"  the gate (refused):  median {statistics.median(gate) * 1000:8.1f} ms, max {max(gate) * 1000:8.1f} ms")
    print(f"  Pillow decoding:     median {statistics.median(decoded) * 1000:8.1f} ms, max {max(decoded) * 1000:8.1f} ms"
          f"  ({statistics.median(decoded) / max(statistics.median(gate), 1e-9):,.0f}x the gate's)")
    print(f"  probe decode (512x512 PNG): idle median {idle * 1000:.1f} ms, during the bombs median "
          f"{statistics.median(busy or [idle]) * 1000:.1f} ms ({statistics.median(busy or [idle]) / idle:.2f}x idle)")


if __name__ == "__main__":
    main()
