"""The request fields a person or an API caller sets, each declared once: its name, type, default, label, help,
the pipeline family capability it needs and its one parse-and-check.

Every surface derives from `FIELDS`: the request's `FORM` (engine/config/request.py), the gate's checks
(`build_request`, engine/config/validation.py), the Generate page's labels, the /generate API's parameters and
help, the /v1 and MCP schemas' help, the CLI's `generate` flags, the PNG metadata and the batching key. A field a
family does not take is noticed or refused by its declaration (`needs`), never by a handler.

Order matters: gradio_client callers pass /generate's parameters positionally, so a new field is appended.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequest
from engine.protocol.flagfields import APPEND, flag
from engine.protocol.memory import MemoryLevers, memory_forms
from engine.protocol.presets import (
    CLIP_INPUTS,
    DEFAULT_PRESET,
    ImageInputs,
    LoraChoice,
    ModelPreset,
    check_lora_scale,
    parse_lora,
)
from engine.protocol.stepcaches import NO_STEP_CACHE, StepCache, step_cache_forms
from engine.protocol.vocabulary import MAX_STEPS, Mode, OnCold, Precision

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


def number(name: str, value, kind=float):
    """`value` as a finite number (`kind` int: a whole one), or InvalidRequest naming the field."""
    if isinstance(value, bool) or value is None:
        raise InvalidRequest(f"{name} must be a number, got {_shown(value)}")
    try:
        result = _whole(value) if kind is int else kind(value)
    except (TypeError, ValueError, OverflowError):
        value = _shown(value)
        raise InvalidRequest(f"{name} must be a {'whole number' if kind is int else 'number'}, got {value}") from None
    if kind is float and not math.isfinite(result):
        raise InvalidRequest(f"{name} must be finite, got {_shown(value)}")
    return result


def check_steps(steps) -> int:
    steps = number("steps", steps, int)
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


def check_lora(preset: ModelPreset, lora, scale=None, fused: bool | None = None) -> LoraChoice:
    """The choice in "NAME[:SCALE][:fused]", with a separate scale and fused flag (the page's slider and
    checkbox) taking precedence; only the preset's adapters by name (a visitor can never name a file or a
    Hub repo)."""
    return lora_overrides(_named_lora(preset, lora), scale, fused)


def _named_lora(preset: ModelPreset, lora) -> LoraChoice:
    choice = parse_lora(lora)
    names = [source.name for source in preset.loras]
    if choice.name is not None and choice.name not in names:
        offered = f"choose one of {', '.join(names)} (or none)" if names else "it lists no LoRA adapters"
        raise InvalidRequest(f"unknown LoRA {choice.name!r} for {preset.name}: {offered}")
    return choice


def lora_overrides(choice: LoraChoice, scale=None, fused: bool | None = None) -> LoraChoice:
    """A chosen style with the page's slider scale and fused box (checked fields), which win over its text."""
    if choice.name is None:
        return choice
    if scale not in (None, ""):
        choice = dataclasses.replace(choice, scale=check_lora_scale(scale))
    if fused is not None:
        choice = dataclasses.replace(choice, fused=bool(fused))
    return choice


def with_style(checked: dict) -> dict:
    """Checked sampling fields with the page's LoRA slider and fused box folded into the chosen style (they win
    over its text), as the request holds it: the style's name, scale and fused flag."""
    checked = dict(checked)
    choice = lora_overrides(checked.pop("lora"), checked.pop("lora_scale"), checked.pop("lora_fused"))
    return {**checked, "lora": choice.name, "lora_scale": choice.scale, "lora_fused": choice.fused}


class Needs(enum.StrEnum):
    """A pipeline family's capability a field needs (a field that needs none: every family takes it)."""

    NEGATIVE_PROMPT = "negative_prompt"  # the preset declares it (CFG pipelines)
    VIDEO = "video"  # a video preset (its frame buckets)
    IMAGES = "images"  # the preset's `inputs` take images
    MASK = "mask"  # an inpaint preset
    STRENGTH = "strength"  # img2img / inpaint presets

    def taken_by(self, preset: ModelPreset) -> bool:
        if self is Needs.NEGATIVE_PROMPT:
            return preset.negative_prompt
        if self is Needs.VIDEO:
            return preset.video
        return self._taken_with(preset.inputs)

    def _taken_with(self, inputs: ImageInputs) -> bool:
        return {Needs.IMAGES: inputs.takes_images, Needs.MASK: inputs.takes_mask,
                Needs.STRENGTH: inputs.takes_strength}[self]

    @property
    def for_clips(self) -> bool:
        """Whether some video family takes it: clips start from text or a first frame (CLIP_INPUTS)."""
        if self in (Needs.NEGATIVE_PROMPT, Needs.VIDEO):
            return True
        return any(self._taken_with(inputs) for inputs in CLIP_INPUTS)


class Role(enum.StrEnum):
    """Who checks a field: the gate's loop (SAMPLING), the engine key's resolution (ENGINE), or the preset's
    routing, which reads several fields together (ROUTED: size and frames to buckets, images to the inputs)."""

    SAMPLING = "sampling"
    ENGINE = "engine"
    ROUTED = "routed"


# A check: (value as the edge has it, the preset) -> (the checked value, notices to show with the result).
Check = Callable[[object, ModelPreset], tuple[object, tuple[str, ...]]]


@dataclass(frozen=True)
class Field:
    """One request field. `help`: what it takes (text, or a function of the preset for allowed values read from
    it); `api`: a parameter of /generate (else the page's alone); `ignored`: the notice when a family that does
    not take it gets it ('' : its routing refuses it);
    `cli`: how it is a flag of the CLI's `generate` (Flag's keywords, "default" its default there; None: no
    flag); `batch`: how its value enters the batching key (requests share a pipeline call only with equal keys; None: it
    does not); `in_png`: written into the PNG's generation parameters."""

    name: str
    type: type
    default: object = None
    label: str = ""
    help: str | Callable[[ModelPreset], str] = ""
    role: Role = Role.SAMPLING
    check: Check | None = None
    needs: Needs | None = None
    api: bool = True
    ignored: str = ""
    batch: Callable[[object], object] | None = None
    in_png: bool = False
    cli: dict | None = dataclasses.field(default_factory=dict)
    choices: tuple[tuple[str, str], ...] = ()  # a page's (label, value) choices, where they are fixed
    v1: tuple[str, ...] = ()  # the /v1 doors ("images", "videos") that take it as an extra body field
    free_text: bool = False  # text a person writes (check_prompt: at most MAX_PROMPT_CHARS, no NUL)
    # The clip doors (the Video tab, /generate_video, MCP's video tool) take it where a video family can: False for
    # what only pictures offer (ranks: a clip runs on one; step caches and styles: no video preset has any).
    clips: bool = True
    # How the checked request holds it: (type, default; MISSING: required), None: the request does not hold it
    # as itself (the engine's fields make its key; size becomes width and height).
    held: tuple[object, object] | None = None
    # The preset-free canonical form for requests built outside the gate (warm-up, benches); None: as given.
    canonical: Callable[[object], object] | None = None

    def describe(self, preset: ModelPreset | None = None) -> str:
        """Its help, with the allowed values the preset declares where it has them."""
        if callable(self.help):
            return self.help(preset) if preset is not None else self.help(None)
        return self.help

    def taken_by(self, preset: ModelPreset) -> bool:
        return self.needs is None or self.needs.taken_by(preset)

    def parse(self, value, preset: ModelPreset) -> tuple[object, tuple[str, ...]]:
        """The field checked once for `preset`: a value its family does not take is dropped with the declared
        notice."""
        value, notices = self.check(value, preset)
        if value and self.ignored and not self.taken_by(preset):
            return self.default, notices + (self.ignored.format(pipeline=preset.pipeline),)
        return value, notices


def _prompt(name: str, empty=""):
    """check_prompt, with `empty` for a blank text (an optional text: None)."""
    def check(value, preset: ModelPreset):
        text, notices = check_prompt(name, value)
        return text or empty, notices

    return check


def _steps(value, preset: ModelPreset):
    return (preset.steps if value is None else check_steps(value)), ()


def _guidance(value, preset: ModelPreset):
    guidance = preset.guidance if value is None else number("guidance", value)
    if not 0.0 <= guidance <= MAX_GUIDANCE:
        raise InvalidRequest(f"guidance must be between 0 and {MAX_GUIDANCE}, got {guidance}")
    return guidance, ()


def _seed(value, preset: ModelPreset):
    seed = number("seed", value, int)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be between 0 and {MAX_SEED}, got {seed}")
    return seed, ()


def _lora(value, preset: ModelPreset):
    return _named_lora(preset, value), ()


def _lora_scale(value, preset: ModelPreset):
    return (None if value in (None, "") else check_lora_scale(value)), ()


def _same(value):
    return value


def _mode(value) -> Mode:
    return Mode.parse(value, "mode")


def _on_cold(value) -> OnCold:
    return OnCold.parse(value, "on_cold")


def _step_cache(value) -> StepCache:
    return value if isinstance(value, StepCache) else StepCache.parse(value)


def _lora_name(value) -> str | None:
    """A style's name as the request holds it ("none" or blank: no style)."""
    return None if value is None or str(value).strip().lower() in ("", "none") else value


def _memory(value) -> str:
    """The request's own levers as canonical text ('' when none is on)."""
    levers = MemoryLevers.parse(value).request_part()
    return str(levers) if levers.enabled else ""


def _plain(parse: Callable[[object], object]) -> Check:
    return lambda value, preset: (parse(value), ())


def _lora_help(preset: ModelPreset | None) -> str:
    styles = "" if preset is None else "; the default preset's: " + (", ".join(s.name for s in preset.loras) or "none")
    return ("none, or NAME[:SCALE][:fused] with NAME one of the preset's styles (`python -m engine presets` lists "
            f"them{styles}), SCALE 0-2 (default: the style's own) and :fused to fold it into the weights (eager mode "
            "only)")


V1 = ("images", "videos")  # both /v1 doors
REQUIRED = dataclasses.MISSING  # a checked request must be given it
# In the order of the /generate API (gradio_client callers pass them positionally: never reorder, append only).
FIELDS = (
    Field("prompt", str, "", "Prompt", "what to draw", check=_prompt("prompt"), in_png=True,
          cli=dict(default=None, help="default: the preset's first example prompt"), held=(str, ""), free_text=True),
    Field("negative_prompt", str, None, "Negative prompt", "what to keep out of the image (only presets that take "
          "one)", check=_prompt("negative_prompt", None), needs=Needs.NEGATIVE_PROMPT,
          ignored="{pipeline} takes no negative prompt; it was ignored", batch=bool, in_png=True, v1=V1,
          held=(str | None, None), free_text=True),
    Field("preset", str, None, "Model preset", "a preset of `python -m engine presets`, or a Hub id / local "
          "diffusers folder", role=Role.ENGINE, cli=dict(default=DEFAULT_PRESET)),
    Field("device", str, "auto", "Device", "auto, or a device name (/system says which are available here)",
          role=Role.ENGINE, v1=V1),
    Field("precision", str, "fp32", "Precision", "one of " + ", ".join(Precision.values()), role=Role.ENGINE,
          v1=V1),
    Field("mode", str, Mode.EAGER, "Mode", "one of " + ", ".join(Mode.values()) + " (compiled modes serve eagerly "
          "until their bucket is warm, see on_cold)", check=_plain(_mode), batch=_same,
          in_png=True, cli=dict(default=Mode.EAGER.value), v1=V1, held=(Mode, Mode.EAGER), canonical=_mode),
    Field("size", str, None, "Resolution bucket", "WIDTHxHEIGHT, snapped to the preset's nearest bucket (default: "
          "its first)", role=Role.ROUTED,
          cli=dict(help="WIDTHxHEIGHT (snapped to the nearest bucket unless --no-snap)")),
    Field("steps", int, None, "Steps", f"denoising steps, 1-{MAX_STEPS} (default: the preset's)",
          check=_steps, batch=_same, in_png=True, cli=dict(check=int), v1=V1, held=(int, REQUIRED)),
    Field("guidance", float, None, "Guidance", f"guidance scale, 0-{MAX_GUIDANCE:g} (default: the preset's)",
          check=_guidance, batch=float, in_png=True, cli=dict(check=float), v1=V1, held=(float, REQUIRED)),
    Field("seed", int, 0, "Seed", "an integer >= 0 (the same seed, settings and prompt draw the same image)",
          check=_seed, in_png=True, cli=dict(check=int), v1=V1, held=(int, REQUIRED)),
    Field("on_cold", str, OnCold.EAGER, "At a bucket that is not warm yet", "at a compiled mode's bucket that is not "
          "warm yet: eager (serve now, uncompiled) or wait (wait for its compile)",
          check=_plain(_on_cold), batch=_same, v1=V1, held=(OnCold, OnCold.EAGER), canonical=_on_cold,
          choices=(("serve eagerly now", OnCold.EAGER.value), ("wait for its compile", OnCold.WAIT.value)),
          cli=dict(default=OnCold.WAIT.value, choices=OnCold.values())),  # a one-shot run waits for its bucket
    Field("tp", int, 1, "Ranks", "ranks (> 1 runs on the torchrun sidecar)", role=Role.ENGINE, cli=dict(check=int),
          clips=False),
    Field("step_cache", str, None, "Step cache (reuses denoiser work across steps)",
          lambda preset: f"one of {step_cache_forms()} (`python -m engine step-caches` lists which run here)",
          check=_plain(StepCache.parse), batch=_same, in_png=True, v1=V1, held=(StepCache, NO_STEP_CACHE),
          canonical=_step_cache,
          cli=dict(default="none", name="--cache", metavar="TEXT"), clips=False),
    Field("lora", str, None, "LoRA style", _lora_help, check=_lora, batch=_same, in_png=True,
          cli=dict(metavar="NAME[:SCALE][:fused]"), v1=("images",), held=(str | None, None), canonical=_lora_name,
          clips=False),
    # the page's slider and checkbox; an API caller writes "NAME:SCALE" and "NAME[:SCALE]:fused"
    Field("lora_scale", float, None, "LoRA scale", "the style's scale, 0-2 (default: the style's own)",
          check=_lora_scale, api=False, batch=_same, in_png=True, cli=None, held=(float | None, None),
          canonical=lambda v: _lora_scale(v, None)[0]),
    Field("lora_fused", bool, None,
          "Fuse into the weights (eager only: no per-step LoRA cost, a fuse when the style changes)",
          "fold the style into the weights (eager only)",
          check=_plain(lambda v: None if v is None else bool(v)), api=False, batch=_same, cli=None,
          held=(bool, False), canonical=bool),
    # memory levers: '' the host's, "none" no lever (last of the first fields: positional callers keep working)
    Field("memory", str, None, "Memory levers", lambda preset: "the host's choice by default, or " + memory_forms()
          + " (`python -m engine memory-levers --preset P` lists which run here, with their price)",
          check=_plain(_memory), batch=_same, cli=None, held=(str, ""), canonical=_memory),  # CLI: --memory is the engine's
    Field("num_frames", int, None, "Frames (video presets)", "a video preset's clip length, snapped to its frame "
          "buckets (default: its first; image presets ignore it)", role=Role.ROUTED, needs=Needs.VIDEO,
          cli=dict(name="--frames", check=int), v1=("videos",), held=(int, 0)),  # 0: an image
    Field("fps", int, None, "fps", "a video preset's frames per second (default: its own)", role=Role.ROUTED,
          needs=Needs.VIDEO, cli=dict(check=int), v1=("videos",), held=(int, 0)),
    # Input images (engine/config/images.py), appended: positional callers of the fields above keep working.
    Field("images", tuple, (), "Images (the first is the source; all are references for FLUX.2)",
          "input images (PNG, JPEG, WebP, ...; at most 32 MiB each): the source to edit for edit / img2img / "
          "inpaint presets, references for FLUX.2, the clip's first frame for image-to-video presets; none for "
          "text to image or video", role=Role.ROUTED, needs=Needs.IMAGES,
          cli=dict(name="--image", kind=APPEND, metavar="PATH", help="an input image (repeatable): the source to "
                   "edit (img2img, inpaint, an instruction edit), FLUX.2's references, or an image-to-video "
                   "preset's first frame; the preset says which it takes"), held=(tuple, ())),
    Field("mask", bytes, None, "Mask (inpaint): white repaints, black keeps; at the source's size",
          "inpaint presets: a mask at the source's size, white where it repaints, black where it keeps (transparent "
          "pixels keep); /v1/images/edits reads OpenAI's convention instead (fully transparent pixels are edited)",
          role=Role.ROUTED,
          needs=Needs.MASK, batch=lambda mask: mask is not None, cli=dict(metavar="PATH"), held=(object, None)),
    Field("strength", float, None, "Strength (img2img / inpaint; empty: 0.6)", "img2img / inpaint presets: 0-1, how "
          "much of the schedule runs from the noised source (default: 0.6; other presets take none)",
          role=Role.ROUTED, needs=Needs.STRENGTH, batch=_same, cli=dict(check=float), held=(float | None, None)),
)
BY_NAME = {f.name: f for f in FIELDS}
FREE_TEXT = tuple(f for f in FIELDS if f.free_text)
# Text only some families take (a negative prompt): a page shows its box for those presets alone.
OPTIONAL_TEXT = tuple(f for f in FREE_TEXT if f.needs is not None)
SAMPLING = tuple(f for f in FIELDS if f.role is Role.SAMPLING)
PNG_FIELDS = tuple(f.name for f in FIELDS if f.in_png)
BATCH_FIELDS = tuple(f for f in FIELDS if f.batch is not None)


def form_fields(names: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()
                ) -> list[tuple[str, object, dataclasses.Field]]:
    """The declared fields (`names` only, in FIELDS' order) as an edge's form holds them: keyword-only, each as the
    edge has it (typed, or text from an API), with its declared default; `exclude`: the form's own."""
    return [(f.name, f.type | str | None, dataclasses.field(default=f.default, kw_only=True))
            for f in FIELDS if (names is None or f.name in names) and f.name not in exclude]


def form_class(name: str, names: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> type:
    """A frozen dataclass of those form fields: the base of a form that takes them (its own fields follow)."""
    return dataclasses.make_dataclass(name, form_fields(names, exclude), frozen=True)


def held_fields() -> list[tuple[str, object, dataclasses.Field]]:
    """The declared fields as the checked request holds them (engine/protocol/requests.py GenerateRequest):
    keyword-only, in their checked type and default."""
    return [(f.name, f.held[0], dataclasses.field(kw_only=True) if f.held[1] is REQUIRED
             else dataclasses.field(default=f.held[1], kw_only=True)) for f in FIELDS if f.held is not None]


def canonical(fields: dict) -> dict:
    """Fields a caller wrote outside the gate (text modes, step caches, "none" for no style, a LoraChoice for the
    style's three fields), in the form the checked request holds them."""
    fields = dict(fields)
    if isinstance(style := fields.get("lora"), LoraChoice):  # a style carried whole: its three fields
        fields.update(lora=style.name, lora_scale=style.scale, lora_fused=style.fused)
    for name, value in fields.items():
        if name in BY_NAME and BY_NAME[name].canonical is not None:
            fields[name] = BY_NAME[name].canonical(value)
    if "lora" in fields and fields["lora"] is None:
        fields["lora_fused"] = False  # nothing to fold in
    return fields


def cli_fields(names: tuple[str, ...] | None = None, own: dict[str, tuple[object, str]] | None = None
               ) -> list[tuple[str, object, dataclasses.Field]]:
    """A command's request flag fields, in FIELDS' order: the CLI `generate`'s (all with a `cli` form;
    engine/cli.py makes its dataclass of them), or `names` only; `own`: name -> (default, help) of the
    command's own."""
    fields = []
    for f in FIELDS:
        if f.cli is None or (names is not None and f.name not in names):
            continue
        how = dict(f.cli)
        default, text = how.pop("default", f.default), how.pop("help", f.help)
        default, text = (own or {}).get(f.name, (default, text))
        text = text if isinstance(text, str) else (lambda f=f: f.describe(None))
        spec = (dataclasses.field(default_factory=list, metadata=flag(text, **how)) if how.get("kind") == APPEND
                else dataclasses.field(default=default, metadata=flag(text or None, **how)))
        fields.append((f.name, f.type | None, spec))
    return fields


def optional_fields(preset: ModelPreset) -> list[str]:
    """The fields only some families take (negative prompt, frames, input images, ...) that `preset`'s takes."""
    return [f.name for f in FIELDS if f.needs is not None and f.taken_by(preset)]


def clip_fields() -> tuple[str, ...]:
    """The fields the clip doors take (the Video tab, /generate_video, MCP's video tool), in FIELDS' order: the API's
    that a video family can take."""
    return tuple(f.name for f in FIELDS if f.api and f.clips and (f.needs is None or f.needs.for_clips))


def v1_fields(door: str) -> tuple[str, ...]:
    """The extra body fields a /v1 door ("images", "videos") takes beside OpenAI's, in FIELDS' order."""
    return tuple(f.name for f in FIELDS if door in f.v1)


def label(name: str) -> str:
    """The field's label on a page."""
    return BY_NAME[name].label


def choices(name: str) -> list[tuple[str, str]]:
    """The field's fixed (label, value) choices on a page."""
    return list(BY_NAME[name].choices)


def field_help(preset: ModelPreset | None = None, names=None) -> dict[str, str]:
    """Each field's help (the named ones, in their order), with the allowed values `preset` declares."""
    return {name: BY_NAME[name].describe(preset) for name in (names or BY_NAME)}
