"""Validation of every user-facing input, shared by the CLI, the UI handlers and the API.

Each check raises InvalidRequest with a message that says what to change; nothing here touches a
model, so the server answers bad input at once and keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

from engine.config import images as image_inputs
from engine.config import strict
from engine.config.presets import load_presets, looks_like_model_ref, route_size
from engine.config.request import MAX_PREVIEWS, ImageRequest
from engine.config.video import video_fields
from engine.errors import InvalidRequest
from engine.protocol import GenerateRequest, Mode, ModelPreset, Precision, Size, StepCache, params, parse_lora
from engine.protocol.params import MAX_SEED, _shown, check_lora, check_prompt, check_steps, number  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build` made of a spec: the worker's request, the notices to show with its result, and the pixels
    decoded for it (0: none, or its uploads came decoded in `spec.decoded`)."""

    request: GenerateRequest
    notices: tuple[str, ...]
    decoded_pixels: int = 0


def build_request(preset: ModelPreset, spec: ImageRequest) -> tuple[GenerateRequest, tuple[str, ...]]:
    """The spec validated and routed to `preset`'s buckets: the worker's GenerateRequest plus the notices to
    show with its result. Raises InvalidRequest naming the field and what to change."""
    built = build(preset, spec)
    return built.request, built.notices


def build(preset: ModelPreset, spec: ImageRequest) -> Built:
    """`build_request`, with the pixels decoded for it (the gate prices them).

    Each sampling field is checked once, by its declaration (engine/protocol/params.py); the routed ones (size,
    frames, input images) read several fields together against the preset's buckets and inputs."""
    width, height = spec.dimensions(preset.buckets)  # a size that is not "WxH" is refused first
    if spec.decoded is not None:  # decoded once for several admissions: only the preset's count is checked here
        image_inputs.check_count(preset, tuple(spec.images or ()), spec.mask, spec.strength)
        decoded, decoded_pixels = spec.decoded, 0
    else:
        decoded = image_inputs.decode_inputs(preset, spec.images, spec.mask, spec.strength, spec.client,
                                               spec.mask_convention)
        decoded_pixels = decoded.pixels
    if decoded.source_size is not None and spec.size is None and spec.width is None and spec.height is None:
        width, height = decoded.source_size.width, decoded.source_size.height  # an edit keeps its source's shape
    checked, notices = {}, ()
    for field in params.SAMPLING:
        checked[field.name], more = field.parse(getattr(spec, field.name), preset)
        notices += more
    size, size_notices = route_size(preset, width, height, snap=spec.snap)
    num_frames, fps, video_notices = video_fields(preset, spec.num_frames, spec.fps, snap=spec.snap)
    inputs = image_inputs.fit_inputs(preset, decoded, size, spec.strength)
    request = GenerateRequest(
        **params.with_style(checked), width=size.width, height=size.height, client=spec.client,
        previews=check_previews(spec.previews), num_frames=num_frames, fps=fps, images=inputs.images,
        mask=inputs.mask, strength=inputs.strength, images_in_sequence=inputs.in_sequence, images_shared=inputs.shared,
    )
    return Built(request, notices + size_notices + video_notices + inputs.notices, decoded_pixels)


def check_previews(previews) -> int:
    """Partial images a run streams: a whole number from 0 to MAX_PREVIEWS."""
    count = number("partial_images", previews, int)
    if not 0 <= count <= MAX_PREVIEWS:
        raise InvalidRequest(f"partial_images must be from 0 to {MAX_PREVIEWS}, got {count}")
    return count


def check_precision(precision: str) -> Precision:
    return Precision.parse(precision, "precision")


# A JSON file a user names (--config-from): read only when small and shallow enough. json.loads recurses per
# level and a deeply nested file raised RecursionError.
MAX_JSON_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 32


def read_json_file(path, what: str):
    """The JSON in `path`, or InvalidRequest naming `what` and the problem (missing, too big, too deep,
    not JSON)."""
    path = Path(path)
    try:
        # A device (/dev/zero) or a FIFO has no size to check and would be read forever or wait for a writer.
        if not stat.S_ISREG(path.stat().st_mode):
            raise InvalidRequest(f"{what} is not a regular file; give the advisor's JSON file")
        with open(path, "rb") as f:  # at most the bound, even if the file grows meanwhile
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise InvalidRequest(f"{what} is over {MAX_JSON_BYTES // 2**20} MiB; give the advisor's JSON file")
        text = data.decode("utf-8")
    except OSError as exc:
        raise InvalidRequest(f"{what} cannot be read ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise InvalidRequest(f"{what} is not UTF-8 text; give the advisor's JSON file") from None
    depth = strict.depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequest(f"{what} nests {depth} levels deep; at most {MAX_JSON_DEPTH} are read")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{what} is not JSON ({exc})") from None


# The advisor's pick (python -m bench advise --out FILE): each field and what it must be.
_PICK_FIELDS = {"precision": lambda v: str(Precision.parse(v, "precision")),
                "mode": lambda v: str(Mode.parse(v, "mode")),
                "step_cache": lambda v: str(StepCache.parse(v)),
                "attention": lambda v: v.strip().lower()}
_RUN_FIELDS = {"preset": lambda v: check_preset_name(v, "preset"),
               "device": lambda v: v.strip().lower(),
               "size": lambda v: str(Size.parse(v)),
               "steps": check_steps}


def check_preset_name(name, what: str = "preset") -> str:
    """A preset of presets/models.toml, or a Hub id / local folder (checked when it loads)."""
    name = str(name).strip()
    presets = load_presets()
    if name not in presets and not looks_like_model_ref(name):
        raise InvalidRequest(f"unknown {what} {_shown(name)}; choose one of: {', '.join(presets)}")
    return name


def advice_pick(data, what: str = "the advisor file") -> dict:
    """The configuration an advisor result names, every field type-checked: its precision, mode,
    step_cache and attention, and the preset, device, size and steps it was measured for (as text)."""
    if not isinstance(data, dict):
        raise InvalidRequest(f"{what} holds a JSON {type(data).__name__}, not the advisor's object "
                             "(python -m bench advise --out FILE writes one)")
    pick = data.get("pick")
    if not pick:
        raise InvalidRequest(f"{what}: the advisor found no configuration within its bound")
    if not isinstance(pick, dict):
        raise InvalidRequest(f"{what}: 'pick' is a JSON {type(pick).__name__}, not an object")
    result = {}
    for source, fields in ((pick, _PICK_FIELDS), (data, _RUN_FIELDS)):
        for name, check in fields.items():
            value = source.get(name)
            expected = int if name == "steps" else str
            if isinstance(value, bool) or not isinstance(value, expected):
                raise InvalidRequest(f"{what}: {name} must be {'a whole number' if expected is int else 'text'}, "
                                     f"got {_shown(value)}")
            try:
                result[name] = check(value)
            except InvalidRequest as exc:
                raise InvalidRequest(f"{what}: {exc}") from None
    result["lora"] = _advised_lora(data, pick, what)
    result["lora_fused"] = pick.get("lora_fused") is True
    return result


def _advised_lora(data: dict, pick: dict, what: str) -> str:
    """The style an advisor run measured with, fused as its pick ran it ("none": a run without a style)."""
    lora, fused = data.get("lora", "none"), pick.get("lora_fused", False)
    if not isinstance(lora, str) or not isinstance(fused, bool):
        raise InvalidRequest(f"{what}: lora must be text and the pick's lora_fused true or false")
    try:
        choice = parse_lora(lora)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{what}: {exc}") from None
    return dataclasses.replace(choice, fused=fused).text() if choice.name else "none"
