"""Per-call features as steps around one pipeline call: each step says whether it applies to a request and,
if it does, wraps the call (a context manager): it may swap the variant the call runs on, and it adds what
it learnt to the call's outcome. The call itself (calls.py) knows none of them.

The steps, in the order they wrap a call: the VAE's memory levers (memory.py; every variant shares the
VAE, and a step cache's calibration call decodes under them too), the LoRA slot (lora.py), the step
cache's variant (stepcache.py) and the aot packages' match check (aot.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

from engine.pipeline import memory, stepcache
from engine.pipeline.lora import SlotChange
from engine.protocol import BucketKey, GenerateRequest, LoraChoice, Mode


@dataclass
class CallState:
    """One pipeline call as its steps see it: the request, the variant it runs on (a step may swap it), and
    what the steps add: notices, the LoRA slot's change, the step cache's counter and cached steps, and the
    recompiles the call caused (set once the call returned)."""

    bucket: BucketKey
    request: GenerateRequest
    pipe: object
    notices: list[str]
    slot: SlotChange = field(default_factory=SlotChange)
    cached: stepcache.CachedDenoiser | None = None
    cached_steps: tuple[int, ...] = ()
    recompiles: int = 0


class CallStep(Protocol):
    def applies(self, request: GenerateRequest) -> bool: ...

    def around(self, call: CallState) -> contextlib.AbstractContextManager: ...


class LoraStep:
    """The engine's LoRA slot: a fused call runs on the eager variant's fused copy (built before the slot is
    selected, which fuses into it), the slot switches to the request's adapter, and a warm graph's
    recompiles are counted against the slot."""

    def __init__(self, loras):
        self.loras = loras

    def applies(self, request: GenerateRequest) -> bool:
        return True  # the slot is off for a request without an adapter

    @contextlib.contextmanager
    def around(self, call: CallState):
        if call.request.lora_fused:
            call.pipe = self.loras.fused_pipeline(call.pipe)
        call.slot = self.loras.select(LoraChoice.of(call.request))
        yield
        if call.request.mode.compiled:  # a warm graph (a cold bucket ran eager)
            self.loras.served(call.recompiles)


class StepCacheStep:
    """A step cache: the call runs on the (mode, cache) variant, calibrated once by `call_pipeline`, whose
    hooks count the steps they served."""

    def __init__(self, step_caches: stepcache.CacheVariants, call_pipeline):
        self.step_caches = step_caches
        self.call_pipeline = call_pipeline  # (pipe, request, cached=) -> a pipeline call (calls.py)

    def applies(self, request: GenerateRequest) -> bool:
        return request.step_cache.enabled

    @contextlib.contextmanager
    def around(self, call: CallState):
        request = call.request
        calibrate = request.replace(request_id="calibrate")
        cached, notices = self.step_caches.get(request.mode, call.pipe, request.step_cache, request.denoise_steps,
                                               lambda p, v: self.call_pipeline(p, calibrate, cached=v),
                                               fused=request.lora_fused)
        call.notices += notices
        call.pipe, call.cached = cached.pipe, cached
        yield
        call.cached_steps = cached.finish()


class AotMatchStep:
    """An aot call whose arguments matched no package ran eagerly inside it: said in the notices."""

    def __init__(self, variants):
        self.variants = variants  # its AotEngine is built with the aot variant, on first use

    def applies(self, request: GenerateRequest) -> bool:
        return request.mode is Mode.AOT

    @contextlib.contextmanager
    def around(self, call: CallState):
        aot = self.variants.aot
        before = aot.counters()[1] if aot is not None else None
        yield
        if before is not None and aot.counters()[1] > before:
            call.notices.append(f"aot: a call at {call.bucket} matched no package (not the exported shapes or "
                                "arguments) and ran eagerly")


class VaeLeversStep:
    """The request's memory levers on the VAE (sliced or tiled decode) for this call only."""

    def applies(self, request: GenerateRequest) -> bool:
        return bool(request.memory)

    def around(self, call: CallState) -> contextlib.AbstractContextManager:
        return memory.vae_levers(call.pipe.vae, call.request.memory)


def call_steps(loras, step_caches, variants, call_pipeline) -> tuple[CallStep, ...]:
    """The steps of an engine's calls, once it is loaded (no LoRA step where it serves no adapters)."""
    lora = (LoraStep(loras),) if loras is not None else ()
    return (VaeLeversStep(), *lora, StepCacheStep(step_caches, call_pipeline), AotMatchStep(variants))


def enter_steps(stack: contextlib.ExitStack, steps: tuple[CallStep, ...], call: CallState) -> None:
    """Wrap the call in each step that applies to its request, in order."""
    for step in steps:
        if step.applies(call.request):
            stack.enter_context(step.around(call))
