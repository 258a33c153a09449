"""Validation of every user-facing input, shared by the CLI, the UI handlers and the API.

Each check raises InvalidRequest with a message that says what to change; nothing here touches a
model, so the server answers bad input at once and keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import math
import stat
from pathlib import Path

from engine.config import images as image_inputs
from engine.config import strict
from engine.config.presets import load_presets, looks_like_model_ref, route_size
from engine.config.request import MAX_PREVIEWS, ImageRequest
from engine.config.video import video_fields
from engine.errors import InvalidRequest
from engine.protocol import (
    MAX_STEPS,
    GenerateRequest,
    LoraChoice,
    MemoryLevers,
    Mode,
    ModelPreset,
    OnCold,
    Precision,
    Size,
    StepCache,
    check_lora_scale,
    parse_lora,
)

MAX_PROMPT_CHARS = 4000
LONG_PROMPT_WORDS = 60  # ~77 CLIP tokens: beyond this the CLIP encoders see only the start
MAX_GUIDANCE = 50.0
MAX_SEED = 2**63 - 1


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value) -> int:
    """A whole number from an int, a float with no fraction or text ("12", "12.0", "9223372036854775807"):
    text is read exactly (float() would round seeds above 2**53)."""
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 40 or not text.isascii():  # int() reads "١٢" as 12 (strict.py: ASCII digits only)
            raise ValueError
        try:
            return int(text)
        except ValueError:
            number = float(text)  # "12.0", "1e3"
            if not number.is_integer():
                raise ValueError from None
            return int(number)
    raise TypeError


def _number(name: str, value, kind=float):
    if isinstance(value, bool) or value is None:
        raise InvalidRequest(f"{name} must be a number, got {_shown(value)}")
    try:
        number = _whole(value) if kind is int else kind(value)
    except (TypeError, ValueError, OverflowError):
        value = _shown(value)
        raise InvalidRequest(f"{name} must be a {'whole number' if kind is int else 'number'}, got {value}") from None
    if kind is float and not math.isfinite(number):
        raise InvalidRequest(f"{name} must be finite, got {_shown(value)}")
    return number


def check_steps(steps) -> int:
    steps = _number("steps", steps, int)
    if not 1 <= steps <= MAX_STEPS:
        raise InvalidRequest(f"steps must be between 1 and {MAX_STEPS}, got {steps}")
    return steps


def check_prompt(name: str, prompt) -> tuple[str, tuple[str, ...]]:
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise InvalidRequest(f"{name} must be text, got {type(prompt).__name__}")
    if "\x00" in prompt:
        raise InvalidRequest(f"{name} contains a NUL character; remove it")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (half of a UTF-16 pair): tokenizers fail on it
        raise InvalidRequest(f"{name} contains an invalid character at position {exc.start} (a lone UTF-16 "
                             "surrogate); remove it") from None
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"{name} is {len(prompt)} characters; shorten it to at most {MAX_PROMPT_CHARS}")
    notices = []
    if name == "prompt" and not prompt.strip():
        notices.append("empty prompt: the image is unconditioned")
    if len(prompt.split()) > LONG_PROMPT_WORDS:
        notices.append(f"{name} is long ({len(prompt.split())} words): text encoders read only their token "
                       "limit (77 tokens for CLIP) and the rest is truncated")
    return prompt, tuple(notices)


def build_request(preset: ModelPreset, spec: ImageRequest) -> tuple[GenerateRequest, tuple[str, ...]]:
    """The spec validated and routed to `preset`'s buckets: the worker's GenerateRequest plus the notices to
    show with its result. Raises InvalidRequest naming the field and what to change."""
    width, height = spec.dimensions(preset.buckets)  # a size that is not "WxH" is refused first
    decoded = image_inputs.decode_inputs(preset, spec.images, spec.mask, spec.strength)
    if decoded.source_size is not None and spec.size is None and spec.width is None and spec.height is None:
        width, height = decoded.source_size.width, decoded.source_size.height  # an edit keeps its source's shape
    mode = Mode.parse(spec.mode, "mode")
    step_cache = StepCache.parse(spec.step_cache)
    on_cold = OnCold.parse(spec.on_cold, "on_cold")
    prompt, notices = check_prompt("prompt", spec.prompt)
    negative, neg_notices = check_prompt("negative_prompt", spec.negative_prompt)
    notices += neg_notices
    if negative and not preset.negative_prompt:
        notices += (f"{preset.pipeline} takes no negative prompt; it was ignored",)
        negative = ""
    steps = preset.steps if spec.steps is None else check_steps(spec.steps)
    guidance = preset.guidance if spec.guidance is None else _number("guidance", spec.guidance)
    if not 0.0 <= guidance <= MAX_GUIDANCE:
        raise InvalidRequest(f"guidance must be between 0 and {MAX_GUIDANCE}, got {guidance}")
    seed = _number("seed", spec.seed, int)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be between 0 and {MAX_SEED}, got {seed}")
    size, size_notices = route_size(preset, width, height, snap=spec.snap)
    lora = check_lora(preset, spec.lora, spec.lora_scale, spec.lora_fused)
    num_frames, fps, video_notices = video_fields(preset, spec.num_frames, spec.fps, snap=spec.snap)
    inputs = image_inputs.fit_inputs(preset, decoded, size, spec.strength)
    request = GenerateRequest(
        prompt=prompt,
        negative_prompt=negative or None,
        width=size.width,
        height=size.height,
        steps=steps,
        guidance=guidance,
        seed=seed,
        mode=mode,
        on_cold=on_cold,
        step_cache=step_cache,
        lora=lora.name,
        lora_scale=lora.scale,
        lora_fused=lora.fused,
        memory=str(MemoryLevers.parse(spec.memory).request_part()),
        client=spec.client,
        previews=check_previews(spec.previews),
        num_frames=num_frames,
        fps=fps,
        images=inputs.images,
        mask=inputs.mask,
        strength=inputs.strength,
        images_in_sequence=inputs.in_sequence,
        images_shared=inputs.shared,
    )
    return request, notices + size_notices + video_notices + inputs.notices


def check_previews(previews) -> int:
    """Partial images a run streams: a whole number from 0 to MAX_PREVIEWS."""
    count = _number("partial_images", previews, int)
    if not 0 <= count <= MAX_PREVIEWS:
        raise InvalidRequest(f"partial_images must be from 0 to {MAX_PREVIEWS}, got {count}")
    return count


def check_lora(preset: ModelPreset, lora, scale=None, fused: bool | None = None) -> LoraChoice:
    """The choice in "NAME[:SCALE][:fused]", with a separate scale and fused flag (the page's slider and
    checkbox) taking precedence; only the preset's adapters by name (a visitor can never name a file or a
    Hub repo)."""
    choice = parse_lora(lora)
    if choice.name is None:
        return choice
    names = [source.name for source in preset.loras]
    if choice.name not in names:
        offered = f"choose one of {', '.join(names)} (or none)" if names else "it lists no LoRA adapters"
        raise InvalidRequest(f"unknown LoRA {choice.name!r} for {preset.name}: {offered}")
    if scale not in (None, ""):
        choice = dataclasses.replace(choice, scale=check_lora_scale(scale))
    if fused is not None:
        choice = dataclasses.replace(choice, fused=bool(fused))
    return choice


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
