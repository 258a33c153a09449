"""Uploaded input images as a handler gets them from Gradio, turned into the bytes `ImageRequest.images` and
`ImageRequest.mask` take (engine/config/images.py decodes and checks them once, at the gate).

Gradio hands a handler a path in its upload cache (the page's gr.File, preprocessed), or the file's data as a
dict (`{"path": ...}`: /generate, whose preprocessing is off; Gradio has already moved it into its cache and
refused a path outside its upload folder), or a list of either. The file is read bounded (at most
`MAX_UPLOAD_BYTES`), never decoded here.
"""

from __future__ import annotations

from engine.config.images import MAX_IMAGES, MAX_UPLOAD_BYTES, MAX_UPLOADS_BYTES, read_image_file
from engine.errors import InvalidRequest

__all__ = ["MAX_UPLOADS_BYTES", "MAX_UPLOAD_BYTES", "upload", "uploads"]  # the edge's and launch's bounds


def _path_of(value, name: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        value = value.get("path")
    elif hasattr(value, "path") and not isinstance(value, str):  # a FileData model, a tempfile wrapper
        value = value.path
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be an uploaded file (gradio_client: handle_file(PATH))")
    return value


def upload(value, name: str = "mask") -> bytes | None:
    """One uploaded file's bytes (None: nothing uploaded)."""
    if isinstance(value, bytes):
        return value
    path = _path_of(value, name)
    return None if path is None else read_image_file(path, name)


def uploads(value) -> tuple[bytes, ...]:
    """Every uploaded image's bytes, in order (a single file counts as a list of one)."""
    if value is None or value == "":
        return ()
    items = list(value) if isinstance(value, list | tuple) else [value]
    if len(items) > MAX_IMAGES:
        raise InvalidRequest(f"{len(items)} images uploaded; at most {MAX_IMAGES} are read")
    read = (upload(item, f"image {i + 1}") for i, item in enumerate(items))
    return tuple(data for data in read if data is not None)
