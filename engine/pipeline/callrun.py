"""One pipeline call of an engine on this process's device, in two parts: `RequestPrep` checks what only
the engine knows before a request runs, `CallRun` makes the call under the engine's run lock, wrapped in
its per-call steps (callsteps.py), and makes a request's result. A request alone is `generate_here`; a
batch is a BatchRun (batchrun.py) of the same parts."""

from __future__ import annotations

import contextlib
import gc
import threading

import torch

from engine.errors import Cancelled, DeviceOutOfMemory, UnsupportedCombination
from engine.pipeline import memory, variants
from engine.pipeline.calls import CallOutcome
from engine.pipeline.callsteps import CallState, call_steps, enter_steps
from engine.pipeline.clip import Clip
from engine.pipeline.clock import compiles_in_this_thread
from engine.pipeline.footprint import component_bytes
from engine.pipeline.loading import lora_refusal
from engine.pipeline.png import encode_png
from engine.protocol import BucketKey, BucketState, Fault, GenerateRequest, GenerateResult, Mode
from engine.protocol.presets import LoraChoice, LoraRun


class RequestPrep:
    """What only this engine knows, checked before a request runs: its modes, memory levers, ranks and LoRA
    adapters (`loras`, set once loaded)."""

    def __init__(self, config, precision, rules):
        self.config, self.preset, self.precision, self.rules = config, config.preset, precision, rules
        self.loras = None

    def prepare(self, request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
        """The request to run and its notices. Its size routed to a bucket, its step cache and mode checked for
        the device, come from the gate (engine/serving/gate.py): asserted here, not checked again."""
        if request.size not in self.preset.buckets or request.num_frames not in (self.preset.frames or (0,)):
            raise AssertionError(f"request {request.request_id} at {request.size} is not a bucket of "
                                 f"{self.preset.name}: a bug, requests are routed to a bucket by the gate (build_request)")
        notices = list(self.rules.check_mode(request.mode))
        key = self.config.key
        memory.check_request(key.memory, request.memory, request.mode, request.step_cache.enabled,
                             request.lora is not None)
        if request.step_cache.enabled and key.tp > 1:
            # Each rank's hooks would decide alone which steps to skip; ranks that disagree hang the collectives.
            raise UnsupportedCombination(f"step cache {request.step_cache} is not available on a multi-rank engine "
                                         f"({key}, tensor or context parallel): run it on a single-device engine")
        if request.lora is not None:
            request, lora_notices = self._prepare_lora(request)
            notices += lora_notices
        return request, notices

    def _prepare_lora(self, request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
        """The request with its adapter checked and its scale filled in, or the error saying what to pick."""
        if self.loras is None:
            offered = lora_refusal(self.config, self.precision) if self.preset.loras else \
                f"preset {self.preset.name} lists no LoRA adapters"
            raise UnsupportedCombination(f"LoRA {request.lora!r} cannot run here: {offered}")
        if request.mode is Mode.AOT:
            raise UnsupportedCombination("LoRA adapters do not run in aot mode (its packages are exported with the "
                                         "LoRA slot off and serve requests without one): use compile or regional, "
                                         "which hot-swap on warm graphs")
        if request.lora_fused and self.precision.precision.quantized:
            raise UnsupportedCombination(
                f"a fused LoRA is not served on {self.precision.precision} engines: folding the style into "
                "quantized weights would mean re-quantizing them at every fuse. Run the LoRA unfused here "
                "(hot-swapped beside the quantized weights), or fused on an fp32, bf16 or fp16 engine")
        if request.lora_fused and request.mode is not Mode.EAGER:
            raise UnsupportedCombination(
                f"a fused LoRA runs in eager mode only, not {request.mode}: fusing changes the layers a compiled "
                "graph was traced with, so every fuse would recompile it. Use eager with the LoRA fused, or "
                f"{request.mode} with it unfused (hot-swapped on the warm graphs)")
        name, scale = self.loras.check(request.lora, request.lora_scale)
        notices = []
        trigger = self.loras.adapters[name].source.trigger
        if trigger and trigger.lower() not in request.prompt.lower():
            request = request.replace(prompt=f"{trigger}, {request.prompt}")
            notices.append(f"LoRA {name}: its trigger {trigger!r} was added to the prompt")
        return request.replace(lora=name, lora_scale=scale), notices


class CallRun:
    """One pipeline call of a prepared request, or of a batch, under the engine's run lock: on the bucket's
    variant (eager where the bucket is not warm), wrapped in the per-call steps (callsteps.py, set once
    loaded), measured; and a member's GenerateResult from its image."""

    def __init__(self, key, spec, board, variant_set, caller, faults, run_lock: threading.Lock):
        self.key, self.spec, self.board, self.variants, self.caller = key, spec, board, variant_set, caller
        self.faults, self.run_lock = faults, run_lock
        self.steps: tuple = ()
        self.loras = None
        self.pipe = None  # the loaded pipeline: its weights' bytes per component go into each result

    def loaded(self, pipe, loras, step_caches) -> None:
        """The loaded engine's parts: the steps every call goes through are built once here."""
        self.pipe, self.loras = pipe, loras
        self.steps = call_steps(loras, step_caches, self.variants, self.caller.call)

    def run_call(self, bucket: BucketKey, request: GenerateRequest, notices: list[str], on_step, cancel,
                 members: list[GenerateRequest] | None = None, on_image=None) -> CallOutcome:
        """The call at `bucket`: eagerly where it is not warm (why goes into `notices`, with what the steps
        say). A batch with `on_image` on a device that decodes a batch's images apart hands each on as it is
        decoded: `on_image(index, image, run so far)`."""
        info = self.board.get(bucket)
        eager_fallback = request.mode.compiled and (info is None or info.state != BucketState.WARM)
        if eager_fallback:
            state = info.state.value if info else "cold"
            reason = f": {info.error}" if info and info.error else ""
            notices.append(f"bucket {bucket} is {state}{reason}; served eagerly on the same weights")
            request = request.replace(mode=Mode.EAGER)
            members = [m.replace(mode=Mode.EAGER) for m in members] if members else members
        call = CallState(bucket, request, self.variants.get(request.mode), notices)
        with self.run_lock:
            if self.faults.take(Fault.OOM):
                raise self.out_of_memory(torch.OutOfMemoryError("injected out-of-memory"))
            self.spec.reset_peak_memory()
            compiles_before = compiles_in_this_thread()

            def so_far(timings) -> CallOutcome:  # a batch's image decoded apart, before the call ends
                cached = tuple(call.cached.counter.cached) if call.cached is not None else ()
                return CallOutcome(None, timings, None, eager_fallback, compiles_in_this_thread() - compiles_before,
                                   cached, self.spec.peak_memory_bytes(), call.slot)

            apart = on_image is not None and variants.decodes_apart(self.spec, self.board, request, call.pipe)
            try:
                with contextlib.ExitStack() as stack:
                    enter_steps(stack, self.steps, call)
                    images, timings, cancelled_at = self.caller.call(
                        call.pipe, request, on_step, cancel, call.cached, members=members,
                        on_image=(lambda i, image, t: on_image(i, image, so_far(t))) if apart else None)
                    call.recompiles = compiles_in_this_thread() - compiles_before
            except torch.OutOfMemoryError as exc:
                raise self.out_of_memory(exc) from None
            return CallOutcome(images, timings, cancelled_at, eager_fallback, call.recompiles, call.cached_steps,
                               self.spec.peak_memory_bytes(), call.slot)

    def result(self, request: GenerateRequest, image, run: CallOutcome, notices: list[str], batch_size: int = 1
               ) -> GenerateResult:
        clip = Clip.of(image, request)
        return GenerateResult(
            request_id=request.request_id, engine=self.key, bucket=request.bucket,
            image_png=encode_png(clip.poster, request, self.key), timings=run.timings, warm=not run.eager_fallback,
            eager_fallback=run.eager_fallback, recompiles=run.recompiles, peak_memory_bytes=run.peak,
            notices=tuple(notices), seed=request.seed, steps=request.denoise_steps, step_cache=request.step_cache,
            cached_steps=run.cached_steps, batch_size=batch_size, lora_run=LoraRun(
                LoraChoice.of(request) if request.lora else LoraChoice(),
                self.loras.rank(request.lora) if self.loras is not None else None, run.lora.swap_ms, run.lora.fuse_ms),
            weights_by_component=component_bytes(self.pipe),
            video_mp4=clip.mp4, num_frames=request.num_frames, fps=request.fps, video_encode_ms=clip.encode_ms)

    def out_of_memory(self, exc: Exception) -> DeviceOutOfMemory:
        gc.collect()
        self.spec.empty_cache()
        return DeviceOutOfMemory(
            f"{self.spec.name} ran out of memory ({exc}); memory was released. "
            "Pick a smaller size, fewer steps, bf16/fp16, or CPU offload"
        )


def generate_here(prep: RequestPrep, calls: CallRun, request: GenerateRequest, on_step=None,
                  cancel: threading.Event | None = None) -> GenerateResult:
    """One request alone on this device: prepared, called, counted, its result made. At a warm bucket this
    compiles nothing; elsewhere it runs eagerly. A request with on_cold=wait waited for its compile where
    requests queue (engine/worker/loop.py), never in here."""
    request, notices = prep.prepare(request)
    run = calls.run_call(request.bucket, request, notices, on_step, cancel)
    if run.cancelled_at is not None:
        raise Cancelled(f"request {request.request_id} cancelled after step {run.cancelled_at} of {request.steps}")
    calls.board.served(request.bucket)
    return calls.result(request, run.images, run, notices)
