"""A result's image as PNG bytes, its generation parameters inside."""

from __future__ import annotations

import io
import json

from engine.protocol import EngineKey, GenerateRequest, params


def encode_png(image, request: GenerateRequest, engine: EngineKey) -> bytes:
    """Lossless at the fastest level: a higher level costs the request far more time than it saves bytes
    (docs/benchmarks.md)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1, pnginfo=png_info(request, engine))
    return buf.getvalue()


def png_info(request: GenerateRequest, engine: EngineKey):
    """Generation parameters in the PNG (tEXt), request id included: every file is unique, so two
    identical images never share one cached file in a web server (Gradio names files by content)."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    fields = {name: getattr(request, name) for name in params.PNG_FIELDS}
    info.add_text("diffusion-showcase", json.dumps({
        "request_id": request.request_id, "engine": str(engine), "size": str(request.size), **fields,
    }, default=str))  # a step cache as its text
    return info
