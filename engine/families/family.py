"""The record of one pipeline family (`PipelineFamily`) and the declared call adapter most families use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.protocol import ImageInputs

TASKS = ("text-to-image", "edit", "video")


@dataclass(frozen=True)
class CallArguments:
    """How a family's pipeline takes the arguments the engine fills for every request (engine/pipeline/calls.py
    builds them from the request's fields): called with (preset, request, kwargs), it returns the kwargs the
    pipeline is called with."""

    max_sequence_length: bool = True  # takes the preset's max_sequence_length, when it sets one
    true_cfg: bool = False  # guidance is true CFG (`true_cfg_scale`) when the preset runs CFG (Qwen-Image)
    frame_rate: bool = False  # a clip's rate is an argument (LTX-Video scales its positions in time by it)
    # An instruction edit keeps the bucket's sizes: Kontext would resize its reference to about 1024² and its
    # output to `max_area` (1024² unless told), so the output's area bounds both.
    edit_area: bool = False

    def __call__(self, preset, request, kwargs: dict) -> dict:
        kwargs = dict(kwargs)
        if self.max_sequence_length and preset.max_sequence_length:
            kwargs["max_sequence_length"] = preset.max_sequence_length
        if self.true_cfg and preset.cfg:
            kwargs["true_cfg_scale"] = kwargs.pop("guidance_scale")
        if self.frame_rate and request.num_frames and request.fps:
            kwargs["frame_rate"] = request.fps
        if self.edit_area:
            kwargs.update(_auto_resize=False, max_area=request.width * request.height)
        return kwargs


def unpack_flux_tokens(pipe, latents, height: int, width: int):
    """FLUX.1's latents as the VAE's: its 2x2 patches are packed as tokens (the pipeline's own unpacking)."""
    return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)


@dataclass(frozen=True)
class PipelineFamily:
    """Everything the engine knows of one diffusers pipeline class (model_index.json's `_class_name`)."""

    pipeline: str  # the diffusers class name
    task: str  # one of TASKS: what a preset of this class makes from its inputs
    # Its presets' defaults (presets/models.toml may override each) and what `--model` gives a folder of it:
    bucket_family: str  # its buckets' table in presets/resolutions.toml
    denoiser: str  # the denoiser component ("transformer" or "unet")
    alignment: int  # sizes divisible by vae_scale_factor * 2 (the pipeline's own check)
    cfg: bool  # guidance > 1 doubles the denoiser batch
    takes_negative: bool  # takes a negative prompt
    steps: int
    guidance: float
    inputs: ImageInputs = ImageInputs.TEXT  # the input images it takes
    max_images: int = 0  # at most how many (the source counts as one)
    frames: tuple[int, ...] = ()  # a video family's frame-count buckets, most-used first
    frame_step: int = 4  # valid frame counts are frame_step * k + 1
    fps: int = 16
    # The class whose folder this one is built over (img2img / inpaint over a text-to-image folder's weights,
    # engine/pipeline/variants.py `pipeline_as`): a preset's `base_pipeline` must name it; None: loads its own.
    base: str | None = None
    call: Callable = CallArguments()  # (preset, request, kwargs) -> the pipeline call's kwargs
    # (pipe, latents, height, width) -> the VAE's latents, for partial images of packed latents; None: as they are
    unpack_latents: Callable | None = None
    # Its __call__ hands the decoded batch straight to image_processor.postprocess (read in diffusers' source),
    # so a batch may be decoded one image at a time (engine/pipeline/variants.py `can_decode_apart`).
    decode_then_postprocess: bool = False
    # Parameter counts of its published components other than the denoiser (engine/serving/fit.py estimates a
    # preset that is not downloaded from them and its denoiser_config).
    published: Mapping[str, int] = field(default_factory=dict, hash=False)
    # The token sequences its denoiser's context-parallel plan splits ("image", "text"; engine/tp/plan.py counts
    # them per bucket); empty: diffusers checks them at run time.
    cp_sequences: tuple[str, ...] = ()
    tiny: str | None = None  # the engine/models builder of its random-weight tiny version (preset "random:NAME")
    # The name of its step function (engine/pipeline/stepping.py STEP_FUNCTIONS), when the engine drives its
    # denoising a step at a time; None: each request is one whole pipeline call.
    step: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "published", MappingProxyType(dict(self.published)))
        video = bool(self.frames)
        task = "video" if video else "edit" if self.inputs.takes_images else "text-to-image"
        if self.task != task:
            raise ValueError(f"family {self.pipeline}: task {self.task!r} does not fit its inputs {self.inputs} "
                             f"and frames {self.frames} (they make it {task!r})")
        if self.inputs.takes_images != (self.max_images > 0):
            raise ValueError(f"family {self.pipeline}: max_images {self.max_images} does not fit inputs {self.inputs}")
        if self.inputs is ImageInputs.FIRST_FRAME and not video:
            raise ValueError(f"family {self.pipeline}: {self.inputs} starts a clip; give it its frames")

    @property
    def video(self) -> bool:
        return self.task == "video"
