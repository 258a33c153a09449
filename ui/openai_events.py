"""The server-sent events of /v1/images (ui/openai_api.py): OpenAI's partial_image and completed events as the
SDK reads them, and their SSE framing."""

from __future__ import annotations

import base64
import io
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.serving import stream


def partial_event(partial: stream.Partial, index: int, number: int, size: str, events: str = "image_generation") -> dict:
    """An image_generation.partial_image event (the SDK's ImageGenPartialImageEvent; image_edit.partial_image for
    an edit): image `index`'s
    `number`-th partial image, at its step."""
    return {"type": f"{events}.partial_image", "b64_json": base64.b64encode(partial.png).decode("ascii"),
            "background": "opaque", "created_at": int(time.time()), "output_format": "png", "quality": "auto",
            "size": size, "partial_image_index": number, "index": index, "step": partial.step, "steps": partial.total}


def stream_event(kind: str, answer, result, index: int) -> dict:
    """An image_generation.completed event as the SDK's ImageGenStreamEvent reads it (`answer`: the call's
    ui/openai_api.py Answer)."""
    event = {"type": f"{answer.call.events}.{kind}", "b64_json": base64.b64encode(result.image_png).decode("ascii"),
             "background": "opaque", "created_at": int(time.time()), "output_format": "png", "quality": "auto",
             "size": str(result.bucket.size), "index": index}
    if kind == "completed":
        event.update(usage={"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                            "output_tokens": 0, "total_tokens": 0},
                     seed=result.seed, timings=result.as_dict(), notices=list(result.notices))
        if answer.call.user:
            event["safety_identifier"] = answer.call.user
    return event


def preview_size(png: bytes) -> str:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return f"{image.width}x{image.height}"


def sse(event: dict, name: str | None = None) -> bytes:
    head = f"event: {name or event.get('type', 'message')}\n"
    return f"{head}data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
