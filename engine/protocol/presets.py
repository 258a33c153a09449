"""Model presets (plain data): what a preset names, its LoRA adapters and its defaults."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from engine import settings
from engine.errors import InvalidRequest
from engine.protocol.vocabulary import Size

DEFAULT_PRESET = settings.DEFAULT_PRESET  # part of the contract: the UI's starting preset
# For models with no example prompts (random-weight tiny pipelines, Hub models).
GENERIC_PROMPT = "a red fox in the snow, golden hour"
RANDOM_TINY_PREFIXES = ("random:", "embedded:")  # "embedded:" is the old spelling: saved presets keep loading


LORA_SCALE_RANGE = (0.0, 2.0)


@dataclass(frozen=True)
class LoraSource:
    """A LoRA adapter a preset offers (its `loras` table): a repo folder ("repo:models/..."), a local file or
    folder, or a Hub repo id with `weight_name`. Visitors pick it by `name`, never by its source."""

    name: str
    source: str
    weight_name: str | None = None  # the safetensors file inside a folder or Hub repo (None: diffusers' default)
    scale: float = 1.0  # default scale
    trigger: str = ""  # words a prompt needs for the style (added when missing), "" when none
    description: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,47}", self.name):
            raise InvalidRequest(f"LoRA name {self.name!r}: use 1-48 lower-case letters, digits, '-', '_' or '.'")
        object.__setattr__(self, "scale", check_lora_scale(self.scale))


def check_lora_scale(scale) -> float:
    """A LoRA scale as a float in [0, 2], or a clear error."""
    lo, hi = LORA_SCALE_RANGE
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise InvalidRequest(f"LoRA scale {str(scale)[:32]!r} is not a number: pick one from {lo:g} to {hi:g}") from None
    if not lo <= value <= hi:  # NaN fails too
        raise InvalidRequest(f"LoRA scale {value:g} is outside [{lo:g}, {hi:g}]: pick one from {lo:g} (off) "
                             f"to {hi:g} (twice the trained strength)")
    return value


@dataclass(frozen=True)
class LoraChoice:
    """A request's LoRA: one of the preset's adapters by name (None: no LoRA), its scale (None: the
    adapter's own) and whether it runs fused into the weights (eager only) or unfused (hot-swapped)."""

    name: str | None = None
    scale: float | None = None
    fused: bool = False

    def text(self) -> str:
        """"NAME[:SCALE][:fused]" ("none" for no LoRA): what parse_lora reads back."""
        if self.name is None:
            return "none"
        return self.name + (f":{self.scale:g}" if self.scale is not None else "") + (":fused" if self.fused else "")

    def caption(self) -> str:
        """"NAME at SCALE[ fused]": a result's style under its picture (the scale it ran at; 1 if not said)."""
        return f"{self.name} at {1 if self.scale is None else self.scale:g}" + (" fused" if self.fused else "")

    @classmethod
    def of(cls, fields) -> LoraChoice:
        """The style a request (or a result's JSON, GenerateResult.as_dict) names with its three fields."""
        get = fields.get if isinstance(fields, dict) else lambda name: getattr(fields, name)
        return cls(get("lora"), get("lora_scale"), bool(get("lora_fused")))


@dataclass(frozen=True)
class LoraRun:
    """The LoRA a request ran with (GenerateResult.lora_run): the style, the adapter's rank (padded: hot-swap) and
    the hot-swap or fuse the request waited for (None: the adapter was already in place)."""

    choice: LoraChoice = LoraChoice()
    rank: int | None = None
    swap_ms: float | None = None
    fuse_ms: float | None = None

    def as_dict(self) -> dict:
        """The result JSON's LoRA keys, read back by LoraChoice.of and lora_run_text."""
        c = self.choice
        return {"lora": c.name, "lora_scale": c.scale, "lora_rank": self.rank, "lora_swap_ms": self.swap_ms,
                "lora_fused": c.fused, "lora_fuse_ms": self.fuse_ms}


def lora_run_text(result: dict) -> str:
    """The style a run (GenerateResult.as_dict) used, its scale and rank, and the hot-swap or fuse it waited for."""
    if not result.get("lora"):
        return "none"
    swap, fuse = result.get("lora_swap_ms"), result.get("lora_fuse_ms")
    text = (f"{result['lora']} at scale {result.get('lora_scale', 1):g}, rank {result.get('lora_rank')}; "
            + (f"hot-swapped in {swap:.0f} ms (no recompile)" if swap is not None else "already in place"))
    if result.get("lora_fused"):
        text += (f"; fused into the weights in {fuse:.0f} ms" if fuse is not None
                 else "; fused into the weights (already)")
    return text


FUSED = "fused"


def parse_lora(text) -> LoraChoice:
    """The choice in "NAME[:SCALE][:fused]" (the CLI's --lora and the API's text); no LoRA for "", "none"."""
    text = "" if text is None else str(text).strip().lower()
    if len(text) > 64:
        raise InvalidRequest("LoRA choice is longer than 64 characters: give NAME, NAME:SCALE or NAME:SCALE:fused")
    if text in ("", "none"):
        return LoraChoice()
    name, *rest = (part.strip() for part in text.split(":"))
    fused = FUSED in rest
    numbers = [part for part in rest if part not in (FUSED, "")]
    if len(numbers) > 1 or len(rest) > 2:
        raise InvalidRequest(f"LoRA choice {text!r}: write NAME, NAME:SCALE, NAME:fused or NAME:SCALE:fused")
    return LoraChoice(name, check_lora_scale(numbers[0]) if numbers else None, fused)


class ImageInputs(enum.StrEnum):
    """Which input images a preset's pipeline takes (its `inputs` in presets/models.toml): a request field the
    family does not take is refused by this declaration (engine/config/images.py), not by a handler."""

    TEXT = "text"  # text to image: no input image
    IMG2IMG = "img2img"  # one source image, noised to `strength` (FLUX.1 img2img, ...)
    INPAINT = "inpaint"  # a source, a mask (white: repaint) and `strength` (FLUX.1 inpainting, ...)
    EDIT = "edit"  # an instruction edit of one reference whose tokens join the sequence (FLUX.1 Kontext)
    REFERENCES = "references"  # 0..max_references references joining the sequence (FLUX.2, Qwen-Image-Edit-Plus)
    # A clip's first frame (Wan / LTX image to video): one source, encoded into the first latent frame, no strength
    FIRST_FRAME = "first-frame"

    @classmethod
    def parse(cls, value, preset: str = "") -> ImageInputs:
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise InvalidRequest(f"preset {preset}: inputs {value!r} is not one of "
                                 f"{', '.join(m.value for m in cls)}") from None

    @property
    def takes_images(self) -> bool:
        return self is not ImageInputs.TEXT

    @property
    def needs_source(self) -> bool:
        """At least one image is required (else the pipeline has nothing to edit)."""
        return self in (ImageInputs.IMG2IMG, ImageInputs.INPAINT, ImageInputs.EDIT, ImageInputs.FIRST_FRAME)

    @property
    def source_role(self) -> str:
        """What the first image is to the pipeline (a form's label, the error asking for it)."""
        return "the image the clip starts from" if self is ImageInputs.FIRST_FRAME else "the image to edit"

    @property
    def takes_strength(self) -> bool:
        return self in (ImageInputs.IMG2IMG, ImageInputs.INPAINT)

    @property
    def takes_mask(self) -> bool:
        return self is ImageInputs.INPAINT

    @property
    def in_sequence(self) -> bool:
        """The references' latent tokens join the denoiser's sequence: each one is part of the bucket."""
        return self in (ImageInputs.EDIT, ImageInputs.REFERENCES)

    def describe(self, video: bool = False) -> str:
        """What it takes, in words (`video`: the preset makes clips, so text alone is text to video)."""
        return {ImageInputs.TEXT: f"text to {'video' if video else 'image'} only",
                ImageInputs.IMG2IMG: "one source image and a strength",
                ImageInputs.INPAINT: "one source image, a mask and a strength",
                ImageInputs.EDIT: "one image to edit by instruction",
                ImageInputs.REFERENCES: "reference images",
                ImageInputs.FIRST_FRAME: "one source image, the clip's first frame"}[self]


# The inputs a video family takes: text alone, or a source image as the clip's first frame.
CLIP_INPUTS = (ImageInputs.TEXT, ImageInputs.FIRST_FRAME)
DEFAULT_STRENGTH = 0.6  # diffusers' img2img/inpaint default: 60 % of the schedule runs from the noised source


class Task(enum.StrEnum):
    """What a preset makes, derived from its declaration (ModelPreset.task): each task has its own default model
    on every door (engine/config/defaults.py)."""

    TEXT_TO_IMAGE = "text-to-image"  # a picture from text (FLUX.2's references are optional: still this task)
    EDIT = "edit"  # a picture from a required source: instruction edit, img2img, inpaint
    VIDEO = "video"  # a clip (text to video, or from a first frame)


# What a listing says of a random-weight preset: it loads and runs, but draws noise.
RANDOM_WEIGHTS_NOTE = "random weights: draws noise"


@dataclass(frozen=True)
class ModelPreset:
    name: str
    pipeline: str
    source: str
    family: str
    denoiser: str
    steps: int
    guidance: float
    buckets: tuple[Size, ...]
    alignment: int
    cfg: bool = False
    negative_prompt: bool = False
    tp: bool = False
    tp_text_encoder: bool = False
    min_tp: int = 1
    max_sequence_length: int | None = None  # T5/LLM text tokens (None: the pipeline's default)
    description: str = ""
    repeated_blocks: tuple[str, ...] = ()
    # A checker that scores images against prompts from the pixels alone ("shapes": training/shapes/),
    # for a model trained on a closed grammar; None: only drift between configurations is measured.
    fidelity: str | None = None
    examples: tuple[str, ...] = ()  # prompts this model draws well (the UI offers them)
    advice: dict = field(default_factory=dict, hash=False, compare=False)
    options: dict = field(default_factory=dict, hash=False, compare=False)
    denoiser_config: dict | None = field(default=None, hash=False, compare=False)
    # LoRA adapters visitors may pick (engine/pipeline/lora.py), and the rank every one is padded to for
    # hot-swapping (None: the largest among them, read from their files).
    loras: tuple[LoraSource, ...] = ()
    lora_rank: int | None = None
    # A video family: its frame-count buckets, most-used first (empty: the preset makes images), the step
    # between valid frame counts (Wan: 4k + 1, its VAE's temporal compression) and the default fps.
    frames: tuple[int, ...] = ()
    frame_step: int = 4
    fps: int = 16

    @property
    def video(self) -> bool:
        """Whether it makes clips (num_frames and fps are its sampling fields)."""
        return bool(self.frames)
    # Which input images it takes, and at most how many (the source counts as one); `base_pipeline`: the class
    # the weights load as when `pipeline` is built over its components (img2img / inpaint over a text-to-image
    # folder, engine/pipeline/variants.py `pipeline_as`); None: `pipeline` loads them.
    inputs: ImageInputs = ImageInputs.TEXT
    max_references: int = 0
    base_pipeline: str | None = None
    # A model folder ("repo:models/...", a checked local folder or a Hub id) whose `vae/` is loaded in place of
    # the source's: a trained encoder for a source's latent space whose own encoder reads pictures poorly.
    vae: str | None = None

    @property
    def random_tiny(self) -> str | None:
        """Name of the random-weight tiny pipeline engine/models/tiny.py builds ("random:<name>"), or None."""
        prefix = next((p for p in RANDOM_TINY_PREFIXES if self.source.startswith(p)), None)
        return self.source.removeprefix(prefix) if prefix else None

    @property
    def random_weights(self) -> bool:
        """Built with random weights (a pipeline check, not a model): it draws noise, so it is never a default."""
        return self.random_tiny is not None

    @property
    def task(self) -> Task:
        """Video for a clip maker, edit where the pipeline needs a source image, else text to image."""
        if self.video:
            return Task.VIDEO
        return Task.EDIT if self.inputs.needs_source else Task.TEXT_TO_IMAGE

    @property
    def draws(self) -> bool:
        """An embedded model whose pictures a checker scores (its `fidelity`), trained rather than random."""
        return self.fidelity is not None and not self.random_weights

    @property
    def bundled(self) -> str | None:
        """Folder inside this repository ("repo:models/tiny-shapes": the trained embedded model), or None."""
        return self.source.removeprefix("repo:") if self.source.startswith("repo:") else None

    def reference_layouts(self, size: Size) -> tuple[tuple[Size, ...], ...]:
        """The reference sizes of this preset's buckets at output `size`, the default first (what warms at
        start-up): none for text, img2img and inpaint (their source is the start latent); one reference at the
        output's size for an instruction edit; none or one for FLUX.2 (more are their own buckets, on demand)."""
        if self.inputs is ImageInputs.EDIT:
            return ((size,),)
        if self.inputs is ImageInputs.REFERENCES:
            return ((), (size,))
        return ((),)

    @property
    def example_prompt(self) -> str:
        """The prompt a form starts with: the first example (one the model draws well), else a generic one."""
        return self.examples[0] if self.examples else GENERIC_PROMPT

    def describe(self) -> dict:
        return {
            "name": self.name,
            "pipeline": self.pipeline,
            "source": self.source,
            "denoiser": self.denoiser,
            "steps": self.steps,
            "guidance": self.guidance,
            "buckets": [str(b) for b in self.buckets],
            "alignment": self.alignment,
            "negative_prompt": self.negative_prompt,
            "tp": self.tp,
            "description": self.description,
            "examples": list(self.examples),
            "advice": dict(self.advice),
            "inputs": str(self.inputs),
            "max_references": self.max_references,
            "task": str(self.task),
            "random_weights": self.random_weights,
            "loras": [{"name": lora.name, "scale": lora.scale, "trigger": lora.trigger, "description": lora.description}
                      for lora in self.loras],
            **({"frames": list(self.frames), "fps": self.fps} if self.video else {}),
        }


