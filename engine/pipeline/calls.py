"""One pipeline call: the diffusers arguments of a request (or of a batch's members), run on a private copy
of a variant with its own scheduler, timed step by step, cancellable between steps."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass

import torch

from engine import devices
from engine.families import registry
from engine.pipeline import paste, preview, recipes, stepcache, variants
from engine.pipeline.clock import RunClock
from engine.pipeline.lora import SlotChange
from engine.protocol import EngineOptions, GenerateRequest, ImageInputs, ModelPreset, StepProgress, Timings
from engine.protocol.params import Needs


def pipeline_call_kwargs(preset: ModelPreset, pipe, request: GenerateRequest, output_type: str = "pil",
                         members: list[GenerateRequest] | None = None) -> dict:
    """The pipeline call for a request — what the engine runs, and what a bare diffusers call must pass
    to be compared with it (bench, TP tests). A CPU generator makes seeds mean the same on every device.
    `members`: a batch (engine/pipeline/batching.py) sharing `request`'s size, steps and guidance: one prompt and
    one generator per member, so each image's noise is what that request alone would start from. Each field
    adapter below adds the arguments of the fields its capability takes (engine/protocol/params.py `Needs`);
    the preset's pipeline family (engine/families/) then names them as its pipeline takes them. `pipe` is the
    pipeline object the call runs on: a class with no registered family gets the arguments as they are."""
    kwargs = dict(output_type=output_type)
    for needs, adapter in FIELD_ADAPTERS.items():
        if needs is None or needs.taken_by(preset):
            kwargs.update(adapter(preset, request, members))
    family = registry.find(preset.pipeline) or registry.find(type(pipe).__name__)
    return family.call(preset, request, kwargs) if family else kwargs


def _every_family(preset: ModelPreset, request: GenerateRequest, members) -> dict:
    batch = members or [request]
    return dict(
        prompt=request.prompt if members is None else [r.prompt for r in batch],
        height=request.height,
        width=request.width,
        num_inference_steps=request.steps,
        guidance_scale=request.guidance,
        generator=(torch.Generator("cpu").manual_seed(request.seed) if members is None
                   else [torch.Generator("cpu").manual_seed(r.seed) for r in batch]),
    )


def _negative_prompt(preset: ModelPreset, request: GenerateRequest, members) -> dict:
    if not request.negative_prompt:
        return {}
    return {"negative_prompt": request.negative_prompt if members is None else
            [r.negative_prompt or "" for r in members]}


def _video(preset: ModelPreset, request: GenerateRequest, members) -> dict:
    # the rate reaches the pipeline where its family takes it as an argument (CallArguments.frame_rate)
    return {"num_frames": request.num_frames} if request.num_frames else {}


def image_kwargs(preset: ModelPreset, request: GenerateRequest, members: list[GenerateRequest] | None = None) -> dict:
    """The input images' arguments of a pipeline call, by the preset's `inputs` (engine/config/images.py checked
    and resized them to the bucket): a batch passes one source per member, in order."""
    inputs = preset.inputs
    if not request.images:
        return {}
    batch = members or [request]
    if inputs is ImageInputs.REFERENCES:  # FLUX.2 / Qwen-Image-Edit-Plus: a list of references, one call's
        return {"image": [image.to_pil() for image in request.images]}
    sources = [r.images[0].to_pil() for r in batch]
    kwargs = {"image": sources[0] if members is None else sources}
    if inputs.takes_strength:
        kwargs["strength"] = request.strength
    if inputs.takes_mask:
        masks = [r.mask.to_pil() for r in batch]
        kwargs["mask_image"] = masks[0] if members is None else masks
    return kwargs


# A request field's capability (None: every family) -> the call arguments of the fields it takes: a new field
# is taught to the families that take it here, once.
FIELD_ADAPTERS = {
    None: _every_family,
    Needs.NEGATIVE_PROMPT: _negative_prompt,
    Needs.VIDEO: _video,
    Needs.IMAGES: image_kwargs,
}


@dataclass(frozen=True)
class CallOutcome:
    """What one pipeline call gave (CallRun.run_call, callrun.py): a request's image, or a batch's images in order."""

    images: object
    timings: Timings
    cancelled_at: int | None
    eager_fallback: bool
    recompiles: int
    cached_steps: tuple[int, ...]
    peak: int | None
    lora: SlotChange = SlotChange()  # the LoRA hot-swap or fuse this call waited for (engine/pipeline/lora.py)


class _StepEnds:
    """diffusers' callback_on_step_end for one call: marks the clock, counts cached steps, reports progress,
    and interrupts the pipeline at the first step end after `cancel` is set."""

    def __init__(self, clock: RunClock, request: GenerateRequest, batch_size: int, graphs: bool, on_step,
                 cancel: threading.Event | None, cached: stepcache.CachedDenoiser | None):
        self.clock, self.request, self.batch_size, self.graphs = clock, request, batch_size, graphs
        self.on_step, self.cancel, self.cached = on_step, cancel, cached
        self.cancelled_at: int | None = None
        self.preview_at = preview.preview_steps(request.denoise_steps, request.previews) if on_step else frozenset()
        self.vae = None  # the run's own VAE, for partial images (a batch decoded apart wraps the run's)

    def __call__(self, pipe, i, t, callback_kwargs) -> dict:
        # With CUDA graphs the next replay overwrites this step's graph outputs: the step's tensors are
        # cloned before anything reads them, and the next denoiser call starts a new graph step.
        outputs = recipes.graph_safe_outputs(callback_kwargs) if self.graphs else {}
        step_ms = self.clock.mark_step_end()
        from_cache = self.cached.counter.step_end() if self.cached is not None else False
        if self.on_step:
            self.on_step(StepProgress(self.request.request_id, i + 1, self.request.denoise_steps, step_ms, cached=from_cache,
                                      batch_size=self.batch_size, previews=self._previews(pipe, i + 1, callback_kwargs)))
        if self.cancel is not None and self.cancel.is_set() and self.cancelled_at is None:
            self.cancelled_at = i + 1
            pipe._interrupt = True
        return outputs


    def _previews(self, pipe, step: int, callback_kwargs) -> tuple[bytes, ...]:
        """The call's partial images at this step, if it is one of the request's preview steps; the decode's time
        is kept out of the next step's."""
        if step not in self.preview_at or "latents" not in callback_kwargs:
            return ()
        started = time.perf_counter()
        images = preview.decode(pipe, self.vae or pipe.vae, callback_kwargs["latents"], self.request.height,
                                self.request.width)
        pngs = tuple(preview.to_png(image) for image in images) if images else ()
        if not images:
            self.preview_at = frozenset()  # this pipeline makes none: no second try
        self.clock.exclude(time.perf_counter() - started)
        return pngs


class PipelineCaller:
    """Runs one pipeline call of a variant on a private copy: its own scheduler (schedulers keep per-run
    state), copied from `scheduler_template`, a pristine scheduler set once the pipeline is loaded."""

    def __init__(self, preset: ModelPreset, spec: devices.DeviceSpec, options: EngineOptions):
        self.preset = preset
        self.spec = spec
        self.options = options
        self.scheduler_template = None
        self.prompts = None  # the engine's PromptEncoder (prompts.py), once loaded

    def call(self, pipe, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None,
             cached: stepcache.CachedDenoiser | None = None, members: list[GenerateRequest] | None = None,
             on_image=None):
        """One pipeline call. With a step cache variant, `cached` counts the steps its hooks served. With
        `members` (a batch led by `request`) the first value returned is the list of their images, in order;
        with `on_image` too, the batch is decoded one image at a time and `on_image(index, image, timings)`
        gets each as soon as it is ready (timings up to then). Per-call features (LoRA, step cache variant,
        memory levers) wrap the call as steps (callsteps.py). Returns (images, timings, cancelled_at)."""
        scheduler = copy.deepcopy(self.scheduler_template)  # far cheaper than from_config (docs/benchmarks.md)
        clock = RunClock(self.spec)
        run = variants.run_copy(pipe, scheduler, on_loop_start=clock.mark_loop_start)
        if cached is not None:
            cached.start(run)
        graphs = recipes.cuda_graphs_active(self.options, self.spec, request.mode)
        step_ends = _StepEnds(clock, request, len(members) if members else 1, graphs, on_step, cancel, cached)
        step_ends.vae = getattr(run, "vae", None)  # no VAE (a test's stand-in): no previews
        kwargs = pipeline_call_kwargs(self.preset, run, request, members=members)
        kwargs["callback_on_step_end"] = step_ends
        decoded = []
        if members and on_image is not None:
            def ready(index, image):
                decoded.append(image)
                on_image(index, image, clock.timings(time.perf_counter()))

            variants.decode_apart(run, ready)
            kwargs["output_type"] = "pt"  # every image came through ready(): the pipeline's own are not used
        devices.enter_eager_mode(self.spec, request.mode)  # TPU: strict eager or defer-and-fuse; no-op elsewhere
        # The pipelines run under no_grad already; inference_mode is avoided on purpose: out-of-tree
        # backends (and the fake PrivateUse1 device in tests) cannot version inference tensors.
        if self.prompts is not None:
            self.prompts.bind(run)
        output = run(**kwargs)
        images = output.frames if request.num_frames else output.images  # a clip: one list of frames each
        end = time.perf_counter()
        images = decoded if decoded else images
        if self.preset.inputs.takes_mask and request.mask is not None:
            images = [_paste_kept(r, image) for r, image in zip(members or [request], images, strict=True)]
        return (list(images) if members else images[0]), clock.timings(end), step_ends.cancelled_at


def _paste_kept(request: GenerateRequest, image):
    """An inpaint's result with its source's kept pixels pasted back (engine/pipeline/paste.py)."""
    return paste.paste_kept(request.images[0].to_pil(), image, request.mask.to_pil())
