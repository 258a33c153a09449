"""A result's clip as MP4 bytes: H.264 in yuv420p (what browsers and the OpenAI SDK's clients play), encoded
by the ffmpeg binary that PyPI's `imageio-ffmpeg` wheel ships (no download at run time, no system ffmpeg).

The file lives only while it is encoded (a private temporary folder, removed at once): the result carries
the bytes, and the doors keep clips in their bounded caches."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def encode_mp4(frames, fps: int) -> bytes:
    """`frames` (PIL images or HxWx3 uint8 arrays, all one size) as an MP4 at `fps` frames per second."""
    import imageio_ffmpeg

    arrays = [np.asarray(frame.convert("RGB") if hasattr(frame, "convert") else frame, dtype=np.uint8)
              for frame in frames]
    if not arrays:
        raise ValueError("a clip needs at least one frame")
    height, width = arrays[0].shape[:2]
    with tempfile.TemporaryDirectory(prefix="clip-") as folder:
        path = Path(folder) / "clip.mp4"
        writer = imageio_ffmpeg.write_frames(str(path), (width, height), fps=fps, codec="libx264", quality=8,
                                             macro_block_size=1, output_params=["-movflags", "+faststart"])
        writer.send(None)
        try:
            for array in arrays:
                writer.send(np.ascontiguousarray(array))
        finally:
            writer.close()
        return path.read_bytes()


@dataclass(frozen=True)
class Clip:
    """What a result carries of a call's output: its poster (the image, or a clip's first frame) and, for a
    clip, its MP4 and the milliseconds the encode took."""

    poster: object
    mp4: bytes = b""
    encode_ms: float | None = None

    @classmethod
    def of(cls, output, request) -> Clip:
        if not request.num_frames:
            return cls(output)
        started = time.perf_counter()
        mp4 = encode_mp4(output, request.fps)
        return cls(output[0], mp4, (time.perf_counter() - started) * 1000)
