"""Pipelines over the loaded pipeline's components: the mode variants, step-cache variants, aot stand-ins.

`pipeline_over(base, transformer=...)` is diffusers' documented way to run several pipelines on one set of
weights: a pipeline of the same class built from `base.components`, with some components replaced (a
compiled denoiser, a denoiser clone with step-cache hooks, aot stand-ins, a vae whose decode is compiled).
No tensor is copied or cast. `DiffusionPipeline.from_pipe` would build the same pipeline, but it then casts
every component to one dtype in place (float32 unless told: a bf16 engine's modules, the ones it serves
with, became float32), and it leaves out a component whose class is not the pipeline's annotation (the
embedded tiny-shapes' AutoencoderTiny in a FLUX.1 pipeline: it then refuses to build). So the constructor is
called directly, with the base's init settings from its config, as from_pipe passes them.

`run_copy(pipe, scheduler)` is the one other way a pipeline object is made: per run, a shallow copy with
its own scheduler, because a pipeline keeps per-call state on itself (`_guidance_scale`, `_interrupt`,
`_current_timestep`) and a scheduler keeps per-run state; a shallow copy is far cheaper than
constructing a pipeline on every request (docs/architecture.md has the figures).
"""

from __future__ import annotations

import copy
import inspect

from engine.families import registry

# What enable_model_cpu_offload keeps on the pipeline object rather than on its modules: a variant's runs
# re-install offload hooks at their end (maybe_free_model_hooks) as the base's do.
_OFFLOAD_STATE = ("_offload_device", "_offload_gpu_id", "_all_hooks")


def pipeline_over(base, **replaced):
    """A pipeline of `base`'s class over `base`'s components, `replaced` in place of some of them."""
    components = base.components
    unknown = sorted(set(replaced) - set(components))
    if unknown:
        raise ValueError(f"{type(base).__name__} has no component {', '.join(unknown)}")
    cls = type(base)
    settings = {name: base.config[name] for name in inspect.signature(cls.__init__).parameters
                if name not in components and name in base.config}
    pipe = cls(**{**components, **replaced}, **settings)
    pipe.set_progress_bar_config(**getattr(base, "_progress_bar_config", {}))
    for name in _OFFLOAD_STATE:
        if name in base.__dict__:
            setattr(pipe, name, base.__dict__[name])
    return pipe


def pipeline_as(base, cls):
    """A pipeline of another class `cls` over `base`'s components (FLUX.1 img2img or inpainting over a FLUX.1
    text-to-image pipeline's weights, PipelineFamily.base): built like `pipeline_over`, for the reasons its docstring gives; the
    components `cls` does not take stay out."""
    params = inspect.signature(cls.__init__).parameters
    components = {name: module for name, module in base.components.items() if name in params}
    settings = {name: base.config[name] for name in params if name not in components and name in base.config}
    pipe = cls(**components, **settings)
    pipe.set_progress_bar_config(**getattr(base, "_progress_bar_config", {}))
    return pipe


def vae_decoding_with(vae, decode):
    """`vae` with its own `decode` (compiled, or an aot package): a shallow copy, so every Parameter,
    buffer and submodule stays the loaded vae's."""
    copied = copy.copy(vae)
    copied.decode = decode
    return copied


def can_decode_apart(pipe) -> bool:
    """Whether decode_apart may hand on images the pipeline has not finished: only where its family says
    nothing runs on the decoded images after the decode but the image processor (PipelineFamily
    .decode_then_postprocess), and no safety checker or watermark of its own does."""
    family = registry.find(type(pipe).__name__)
    return (family is not None and family.decode_then_postprocess and getattr(pipe, "safety_checker", None) is None
            and getattr(pipe, "watermark", None) is None
            and hasattr(getattr(pipe, "image_processor", None), "postprocess") and hasattr(pipe, "vae"))


def decodes_apart(spec, board, request, pipe) -> bool:
    """Whether a batch led by `request` (its mode after any eager fallback) decodes its images apart: the
    device says it pays (DeviceSpec.decode_batch_apart), the pipeline does nothing after its decode, and a
    compiled mode has its graph for one image warm on `board` (decoding one would compile it otherwise)."""
    if not spec.decode_batch_apart or not can_decode_apart(pipe):
        return False
    return not request.mode.compiled or board.is_warm(request.bucket.batched(1))


def decode_apart(run, on_image) -> None:
    """Make `run` (a run_copy) decode its batch's latents one at a time: `on_image(index, image)` gets each
    image (PIL) as soon as it is decoded, while the pipeline goes on with the rest. The pipeline then
    returns the whole batch as it would; a caller that took every image from on_image asks for
    output_type="pt", the cheapest."""
    import torch

    vae = run.vae
    decode = vae.decode

    def decode_each(z, *args, return_dict: bool = True, **kwargs):
        samples = []
        for index in range(z.shape[0]):
            sample = decode(z[index:index + 1], *args, return_dict=False, **kwargs)[0]
            on_image(index, run.image_processor.postprocess(sample, output_type="pil")[0])
            samples.append(sample)
        sample = torch.cat(samples)
        if not return_dict:
            return (sample,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=sample)

    object.__setattr__(run, "vae", vae_decoding_with(vae, decode_each))  # not a new component, as run_copy


def run_copy(pipe, scheduler, on_loop_start=None):
    """A private pipeline object for one run, with its own scheduler (see the module's docstring);
    `on_loop_start()` is called as its denoising loop starts."""
    run = copy.copy(pipe)
    object.__setattr__(run, "scheduler", scheduler)  # not a new component: the config stays the variant's
    if on_loop_start is not None:
        # diffusers has no callback before the first step (callback_on_step_end closes each step); every
        # pipeline opens its progress bar as its denoising loop starts, so this run's own copy marks it there.
        open_bar = run.progress_bar

        def progress_bar(*args, **kwargs):
            on_loop_start()
            return open_bar(*args, **kwargs)

        run.progress_bar = progress_bar
    return run
