"""Step-level serving: the engine owns the denoising loop of the families that declare a step function.

A step function (`StepFunction`) is a family's pipeline call cut at its step boundaries, with the pipeline's
own methods: `prepare` (encode the prompt, prepare the latents, the request's own scheduler and generator),
`step` (one denoising step for several requests at once, each at its own timestep, guidance and prompt) and
`finish` (unpack, decode, postprocess). Between two steps the worker may run other requests' steps: a
request is paused (its `StepState` — latents, scheduler, timesteps — kept as it is), joined by requests at
the same bucket, or cancelled. `STEP_FUNCTIONS` says which pipeline classes have one; every other family,
and requests a step function does not cover (`StepRunner.why_whole`), run whole pipeline calls as before.

`StepRunner` is the engine's side (a PipelineRunner's `stepper`): it prepares a request the way a pipeline
call would be prepared (RequestPrep's checks, the bucket's variant or its eager fallback, a run copy with a
private scheduler, the engine's prompt cache), runs a batch's step under the engine's run lock, and makes a
request's GenerateResult. The worker's scheduling of states is engine/worker/stepped.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Protocol

from engine.families import registry
from engine.pipeline.stepstate import StepState
from engine.protocol import GenerateRequest, Mode


def _flux_steps():
    from engine.pipeline.steps_flux import FluxSteps

    return FluxSteps()


# A family's `step` name (engine/families) -> the maker of its step function (imported when such an engine loads).
STEP_FUNCTIONS = {
    "flux": _flux_steps,
}


class StepFunction(Protocol):
    """A family's denoising loop a step at a time (steps_flux.py has FLUX.1's)."""

    def prepare(self, run, request: GenerateRequest, generator, max_sequence_length: int | None) -> StepState: ...

    def batch_key(self, state: StepState) -> tuple: ...

    def step(self, states: list[StepState]) -> None: ...

    def finish(self, state: StepState): ...


def step_function_for(pipe) -> StepFunction | None:
    family = registry.find(type(pipe).__name__)
    make = STEP_FUNCTIONS.get(family.step) if family is not None and family.step else None
    return make() if make is not None else None


class StepRunner:
    """An engine's requests a step at a time (see the module's docstring). `prep`, `calls`: the runner's
    RequestPrep and CallRun (engine/pipeline/callrun.py); `function`: the family's step function."""

    def __init__(self, prep, calls, function: StepFunction, options, spec):
        self.prep, self.calls, self.function = prep, calls, function
        self.options, self.spec = options, spec

    def why_whole(self, request: GenerateRequest) -> str:
        """Why `request` runs as one whole pipeline call ("" when it is stepped)."""
        from engine.pipeline import recipes

        if request.images or request.num_frames:
            return "inputs images or frames: its family's step function is text-to-image only"
        if request.step_cache.enabled:
            return "a step cache keeps per-call state in the denoiser's hooks"
        if request.lora is not None:
            return "a LoRA adapter is the engine's one slot, switched per call"
        if request.previews:
            return "partial images are decoded inside the pipeline's own loop"
        if request.mode is Mode.AOT:
            return "aot packages match whole calls"
        if recipes.cuda_graphs_active(self.options, self.spec, request.mode):
            return "CUDA graphs replay per call"
        return ""

    def start(self, request: GenerateRequest) -> StepState:
        """The request prepared and encoded, at its step 0 (at the bucket's variant, or eagerly where the
        bucket is not warm, said in its notices)."""
        import torch

        from engine.pipeline import variants
        from engine.pipeline.clock import RunClock

        calls = self.calls
        request, notices = self.prep.prepare(request)
        info = calls.board.get(request.bucket)
        eager_fallback = request.mode.compiled and not calls.board.is_warm(request.bucket)
        if eager_fallback:
            state = info.state.value if info else "cold"
            reason = f": {info.error}" if info and info.error else ""
            notices.append(f"bucket {request.bucket} is {state}{reason}; served eagerly on the same weights")
            request = request.replace(mode=Mode.EAGER)
        clock = RunClock(self.spec)
        run = variants.run_copy(calls.variants.get(request.mode), copy.deepcopy(calls.caller.scheduler_template))
        if calls.caller.prompts is not None:
            calls.caller.prompts.bind(run)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        with calls.run_lock:
            state = self.function.prepare(run, request, generator, calls.caller.preset.max_sequence_length)
        clock.mark_loop_start()
        state.clock, state.notices, state.eager_fallback = clock, notices, eager_fallback
        state.key = (request.mode, request.bucket, self.function.batch_key(state))
        return state

    def step(self, states: list[StepState]) -> float:
        """One denoising step of `states` (one shared denoiser call); the step's milliseconds."""
        import torch

        from engine.pipeline.clock import compiles_in_this_thread

        with self.calls.run_lock:
            compiles = compiles_in_this_thread()
            started = time.perf_counter()
            try:
                self.function.step(states)
            except torch.OutOfMemoryError as exc:
                raise self.calls.out_of_memory(exc) from None
            self.spec.synchronize()
            step_ms = (time.perf_counter() - started) * 1000
            compiled = compiles_in_this_thread() - compiles
        for state in states:
            state.recompiles += compiled
            state.clock.mark_step_end()
            state.step_batches.append(len(states))
            state.step_ms.append(step_ms)
        return step_ms

    def finish(self, state: StepState):
        """The request's GenerateResult: its latents decoded the pipeline's way, under its memory levers."""
        from engine.pipeline import memory
        from engine.pipeline.calls import CallOutcome

        request = state.request
        with self.calls.run_lock, memory.vae_levers(state.run.vae, request.memory):
            image = self.function.finish(state)
        end = time.perf_counter()
        timings = dataclasses.replace(state.clock.timings(end), step_ms=tuple(state.step_ms))
        outcome = CallOutcome(image, timings, None, state.eager_fallback, state.recompiles, (),
                              self.spec.peak_memory_bytes())
        notices = list(state.notices)
        if state.pauses:
            paused = sum(p.ms for p in state.pauses) / 1000
            others = max(p.for_requests for p in state.pauses)
            notices.append(f"paused {paused:.1f} s for {others} request{'s' * (others != 1)} "
                           f"({len(state.pauses)} pause{'s' * (len(state.pauses) != 1)})")
        batch = max(state.step_batches, default=1)
        self.calls.board.served(request.bucket.batched(batch))  # on the row of the largest batch it stepped in
        result = self.calls.result(request, image, outcome, notices, batch_size=batch)
        return dataclasses.replace(result, stepped=True, pauses=tuple(state.pauses),
                                   step_batches=tuple(state.step_batches))
