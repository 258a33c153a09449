"""One pipeline on one device: a facade over the parts that load it, build its variants, run its calls,
warm its buckets and measure it.

A `PipelineRunner` lives inside a worker process (engine/worker/loop.py) or a tensor-parallel rank
(engine/tp/). Weights load once per (model, device, precision) (loading.py); every mode is a *variant* of
the same weights (variants.py). A bucket is (mode, size): one compiled graph of the variant's module at
that static shape, warmed by warmup.py and shown on the board (board.py). One pipeline call is calls.py's;
requests sharing one call are a batch run (batchrun.py); a result's image is encoded by png.py.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from engine import devices
from engine.errors import Cancelled, DeviceOutOfMemory, UnsupportedCombination
from engine.pipeline import batching, memory, prompts, recipes, stepcache, variants
from engine.pipeline.batchrun import BatchHooks, BatchRun
from engine.pipeline.board import BucketBoard, describe_failure
from engine.pipeline.calls import CallOutcome, PipelineCaller, pipeline_call_kwargs
from engine.pipeline.clock import compiles_in_this_thread
from engine.pipeline.clock import install_compile_counter as _install_compile_counter
from engine.pipeline.faults import Faults
from engine.pipeline.footprint import component_bytes, engine_footprint, weights_bytes
from engine.pipeline.loading import PipelineLoader, lora_refusal
from engine.pipeline.lora import SlotChange
from engine.pipeline.modes import VariantSet, clone_module_tree, compile_denoiser
from engine.pipeline.png import encode_png
from engine.pipeline.progress import progress_bar
from engine.pipeline.warmup import WarmRequests, Warmup, startup_buckets, warm_refusal
from engine.protocol import (
    BucketInfo,
    BucketKey,
    BucketState,
    EngineConfig,
    EngineReady,
    Fault,
    Footprint,
    GenerateRequest,
    GenerateResult,
    LoraChoice,
    LoraInfo,
    Mode,
    Size,
)

# What code outside this folder imports from here (the parts' own modules are the definitions).
__all__ = [
    "BucketBoard",
    "PipelineRunner",
    "_install_compile_counter",
    "clone_module_tree",
    "compile_denoiser",
    "compiles_in_this_thread",
    "describe_failure",
    "export_aot_packages",
    "pipeline_call_kwargs",
]

log = logging.getLogger(__name__)


class PipelineRunner:
    """The engine's pipeline: its modes, its load, one request or a batch at a time, its buckets' warm-up and
    what it announces. Subclasses (engine/tp/runner.py) change where it loads (`load_device`,
    `component_overrides`) and how its requests and warm-ups run."""

    def __init__(self, config: EngineConfig, listener: Callable[[BucketInfo], None] | None = None):
        self.config = config
        self.preset = config.preset
        self.options = config.options
        self.spec = devices.resolve_device(config.key.device)
        self.precision = devices.plan_precision(self.spec, config.key.precision)
        self.board = BucketBoard(config.key, listener)
        self.notices: list[str] = list(self.precision.notices)
        self.pipe = None
        self.load_s: float | None = None
        self.source: str | None = None  # what from_pretrained loaded (aot package keys name the model by it)
        self.run_lock = threading.Lock()  # one request on the device at a time (warm-up runs apart)
        self._mode_notices: dict[Mode, tuple[str, ...]] = {}
        self.faults = Faults(self.options.testing)  # the one place this process reads its test hooks
        self._weights_bytes: int | None = None
        self._peak_bytes: int | None = None
        self.measured_run: tuple[Size, float] | None = None  # the measuring run: its size and milliseconds
        self.folders_notice = ""  # why the compile folders moved (a full or read-only cache disk), once they have
        self.step_caches: stepcache.CacheVariants | None = None  # (mode, step cache) variants, once loaded
        self.loras = None  # the preset's LoRA adapters, hot-swapped into one slot (engine/pipeline/lora.py)
        self.variants = VariantSet(self.preset, self.options, self.spec, self.faults, self.notices, self._build_aot,
                                   self._variant_built)
        self.caller = PipelineCaller(self.preset, self.spec, self.options)
        # Requests that can share a denoiser call run as one call of up to max_batch images (batching.py)
        self.max_batch = self.largest_batch()
        self.batch_sizes = batching.batch_sizes(self.max_batch)
        self.warm_requests = WarmRequests(self.preset, self.options.warmup.steps)
        self.warmup = Warmup(self.board, self.variants, self.warm_requests, self.caller, self.spec, self.notices,
                             self._lora_slot_off, self._cache_moved)
        for mode in self.modes():
            for size in self.preset.buckets:
                for refs in self.preset.reference_layouts(size):  # an edit bucket is a row of its own
                    if refs and mode is Mode.AOT:
                        continue  # aot packages are exported for text-to-image buckets (warmup.check_refs)
                    self.board.add(BucketKey(mode, size, refs=refs),
                                   BucketState.COLD if mode.compiled else BucketState.WARM)

    # -- what this engine can run -----------------------------------------------------------------
    def largest_batch(self) -> int:
        """How many requests one call may serve (the --max-batch flag, else the device's default)."""
        return batching.max_batch_for(self.options.batching.max_batch, self.spec, self.config.key.tp)

    def modes(self) -> tuple[Mode, ...]:
        """Modes this engine can run: the device's, minus what its options rule out."""
        return tuple(m for m in self.spec.modes if not self._excluded(m))

    def _excluded(self, mode: Mode) -> str:
        """Why this engine's options rule `mode` out ("" when they do not)."""
        if why := recipes.excluded_mode(self.options, mode):
            return why
        if why := memory.excluded_mode(self.config.key.memory, mode):
            return why
        if mode is Mode.AOT and self.precision.precision.quantized:
            # torch.export unwraps torchao's quantized tensors into parametrizations the package then looks
            # up by name on the engine's own (still quantized) model, where they do not exist.
            return (f"{self.precision.precision} weights are torchao tensor subclasses, which an aot package cannot "
                    "take from the engine's model (export unwraps them into other tensors)")
        if mode is Mode.AOT and self.config.key.tp > 1:
            return "a tensor-parallel engine's weights are sharded DTensors, which aot packages do not take"
        return ""

    def check_mode(self, mode: Mode) -> tuple[str, ...]:
        if mode in self._mode_notices:  # checked on every request: remember the answer per mode
            return self._mode_notices[mode]
        notices = devices.check_mode(self.spec, mode)
        notices += tuple(recipes.cuda_graphs_notices(self.options, self.spec, Mode.parse(mode, "mode")))
        if mode not in self.modes():
            raise UnsupportedCombination(
                f"mode {mode!r} is not available on this engine ({self.config.key}): "
                f"{self._excluded(Mode.parse(mode, 'mode'))}, so only {', '.join(self.modes())} can run"
            )
        self._mode_notices[mode] = notices
        return notices

    def lora_refusal(self) -> str:
        """Why this engine serves no LoRA although its preset lists some ("" when it can)."""
        return lora_refusal(self.config, self.precision)

    # -- loading (hooks for subclasses: engine/tp/runner.py loads each rank's shard onto its device) -----
    def load_device(self) -> str:
        """Where the pipeline's components go (`pipe.to(...)`, offload target)."""
        return self.spec.torch_device

    def component_overrides(self, source: str) -> dict:
        """Components loaded separately and handed to the pipeline's from_pretrained (e.g. sharded ones)."""
        return {}

    def load(self) -> float:
        start = time.perf_counter()
        loader = PipelineLoader(self.config, self.spec, self.precision, self.load_device(), self.component_overrides)
        # A graph per mode x bucket x batch size, and a second batch shape per bucket with classifier-free guidance
        loaded = loader.load(graphs=len(self.modes()) * len(self.preset.buckets) * 2 * len(self.batch_sizes))
        self.source, self.loras, pipe = loaded.source, loaded.loras, loaded.pipe
        self.notices += loaded.notices
        self.pipe = pipe
        self.variants.loaded(pipe)
        self.step_caches = stepcache.CacheVariants(self.preset, self.config.cache_path(), clone_module_tree,
                                                   str(loaded.source))
        # A pristine scheduler that never runs: each request gets a copy (schedulers keep per-run state).
        self.caller.scheduler_template = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        recipe = self.options.recipe
        self.caller.prompts = prompts.PromptEncoder(
            pipe, self.config.key.memory, self.load_device(), str(self.config.key),
            prompts.PromptCache(recipe.prompt_cache_entries, recipe.prompt_cache_mib * 2**20))
        self.load_s = time.perf_counter() - start
        log.info("loaded %s in %.2fs", self.config.key, self.load_s)
        return self.load_s

    def _build_aot(self, pipe, inductor_configs: dict):
        """The aot variant's AotEngine (engine/pipeline/aot.py) on the loaded pipeline."""
        from engine.pipeline import aot

        target = aot.AotTarget(self.preset, self.options.recipe, self.spec, self.precision, self.source,
                               self.config.cache_path() / "aot")
        return aot.AotEngine(pipe, target, self.warm_requests, self.caller, self.faults, self.batch_sizes,
                             inductor_configs)

    def _variant_built(self, mode: Mode, pipe) -> None:
        """A hook for subclasses: a mode's pipeline, the first time it is handed out (engine/tp/runner.py)."""

    # -- running ----------------------------------------------------------------------------------
    def prepare(self, request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
        """What only this engine knows, checked before a request runs: the modes its options leave it (answered
        once per mode), its memory levers, its ranks, its LoRA adapters. The request, its size routed to a
        bucket, its step cache and mode checked for the device, comes from the gate (engine/serving/gate.py):
        asserted here, not checked again. Returns the request to run and the notices."""
        if request.size not in self.preset.buckets:
            raise AssertionError(f"request {request.request_id} at {request.size} is not a bucket of "
                                 f"{self.preset.name}: a bug, requests are routed to a bucket by the gate (build_request)")
        notices = list(self.check_mode(request.mode))
        memory.check_request(self.config.key.memory, request.memory, request.mode, request.step_cache.enabled,
                             request.lora is not None)
        if request.step_cache.enabled and self.config.key.tp > 1:
            # Each rank's hooks would decide alone which steps to skip; ranks that disagree hang the collectives.
            raise UnsupportedCombination(f"step cache {request.step_cache} is not available on a multi-rank engine "
                                         f"({self.config.key}, tensor or context parallel): run it on a "
                                         "single-device engine")
        if request.lora is not None:
            request, lora_notices = self._prepare_lora(request)
            notices += lora_notices
        return request, notices

    def _prepare_lora(self, request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
        """The request with its adapter checked and its scale filled in, or the error saying what to pick."""
        if self.loras is None:
            offered = self.lora_refusal() if self.preset.loras else f"preset {self.preset.name} lists no LoRA adapters"
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

    def generate(self, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None) -> GenerateResult:
        """Run one request. At a warm bucket this compiles nothing; elsewhere it runs eagerly. A request with
        on_cold=wait waits for its compile where requests queue (engine/worker/loop.py), never in here."""
        request, notices = self.prepare(request)
        run = self.run_call(request.bucket, request, notices, on_step, cancel)
        if run.cancelled_at is not None:
            raise Cancelled(f"request {request.request_id} cancelled after step {run.cancelled_at} of {request.steps}")
        self.board.served(request.bucket)
        return self.result(request, run.images, run, notices)

    def generate_batch(self, requests: list[GenerateRequest], on_step=None,
                       cancels: list[threading.Event] | None = None, on_leave=None, on_result=None) -> list:
        """Run requests that can share a denoiser call as one pipeline call (BatchRun says what each gets)."""
        hooks = BatchHooks(on_step, cancels, on_leave, on_result)
        return BatchRun(requests, hooks, self.prepare, self.generate, self.run_call, self.result, self.board).run()

    def run_call(self, bucket: BucketKey, request: GenerateRequest, notices: list[str], on_step, cancel,
                 members: list[GenerateRequest] | None = None, on_image=None) -> CallOutcome:
        """The pipeline call of a prepared request, or of a batch (`members`, led by `request`) at `bucket`:
        eagerly where `bucket` is not warm. Why it ran eagerly, and what the step cache and aot say, go into
        `notices`. A batch with `on_image` on a device that decodes a batch's images apart
        (DeviceSpec.decode_batch_apart) hands each on as it is decoded: `on_image(index, image, run so far)`."""
        info = self.board.get(bucket)
        eager_fallback = request.mode.compiled and (info is None or info.state != BucketState.WARM)
        if eager_fallback:
            state = info.state.value if info else "cold"
            reason = f": {info.error}" if info and info.error else ""
            notices.append(f"bucket {bucket} is {state}{reason}; served eagerly on the same weights")
            request = request.replace(mode=Mode.EAGER)
            members = [m.replace(mode=Mode.EAGER) for m in members] if members else members
        pipe = self.variants.get(request.mode)
        with self.run_lock:
            if self.faults.take(Fault.OOM):
                raise self._out_of_memory(torch.OutOfMemoryError("injected out-of-memory"))
            self.spec.reset_peak_memory()
            return self._call_locked(bucket, pipe, request, notices, _CallHooks(on_step, cancel, members, on_image),
                                     eager_fallback)

    def _call_locked(self, bucket, pipe, request, notices, hooks: _CallHooks, eager_fallback: bool) -> CallOutcome:
        """run_call's part under the run lock: the LoRA selected, the step cache's variant, the call measured."""
        compiles_before = compiles_in_this_thread()
        aot = self.variants.aot
        aot_before = aot.counters()[1] if aot and request.mode is Mode.AOT else None
        cached = None
        if request.lora_fused:  # built before the slot is selected, which fuses into it
            pipe = self.loras.fused_pipeline(pipe)
        slot = self.loras.select(request.lora_choice) if self.loras is not None else SlotChange()

        def outcome(images, timings, cancelled_at) -> CallOutcome:
            return CallOutcome(images, timings, cancelled_at, eager_fallback, compiles_in_this_thread() - compiles_before,
                               tuple(cached.counter.cached) if cached is not None else (),
                               self.spec.peak_memory_bytes(), slot)

        def image_ready(index, image, timings):
            hooks.on_image(index, image, outcome(None, timings, None))

        apart = hooks.on_image is not None and variants.decodes_apart(self.spec, self.board, request, pipe)
        try:
            if request.step_cache.enabled:
                cached, cache_notices = self.step_caches.get(
                    request.mode, pipe, request.step_cache, request.denoise_steps,
                    lambda p, v: self.caller.call(p, request.replace(request_id="calibrate"), cached=v),
                    fused=request.lora_fused)
                notices += cache_notices
                pipe = cached.pipe
            images, timings, cancelled_at = self.caller.call(pipe, request, hooks.on_step, hooks.cancel, cached,
                                                             members=hooks.members,
                                                             on_image=image_ready if apart else None)
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(exc) from None
        recompiles = compiles_in_this_thread() - compiles_before
        if self.loras is not None and request.mode.compiled:  # a warm graph (a cold bucket ran eager)
            self.loras.served(recompiles)
        cached_steps = cached.finish() if cached is not None else ()
        if aot_before is not None and aot.counters()[1] > aot_before:
            notices.append(f"aot: a call at {bucket} matched no package (not the exported shapes or "
                           "arguments) and ran eagerly")
        return CallOutcome(images, timings, cancelled_at, eager_fallback, recompiles, cached_steps,
                           self.spec.peak_memory_bytes(), slot)

    def result(self, request: GenerateRequest, image, run: CallOutcome, notices: list[str], batch_size: int = 1
               ) -> GenerateResult:
        return GenerateResult(
            request_id=request.request_id, engine=self.config.key, bucket=request.bucket,
            image_png=encode_png(image, request, self.config.key), timings=run.timings, warm=not run.eager_fallback,
            eager_fallback=run.eager_fallback, recompiles=run.recompiles, peak_memory_bytes=run.peak,
            notices=tuple(notices), seed=request.seed, steps=request.denoise_steps, step_cache=request.step_cache,
            cached_steps=run.cached_steps, batch_size=batch_size, lora=request.lora,
            lora_scale=request.lora_scale if request.lora else None,
            lora_rank=self.loras.rank(request.lora) if self.loras is not None else None,
            lora_swap_ms=run.lora.swap_ms, lora_fused=request.lora_fused and request.lora is not None,
            lora_fuse_ms=run.lora.fuse_ms, weights_by_component=component_bytes(self.pipe))

    def _out_of_memory(self, exc: Exception) -> DeviceOutOfMemory:
        gc.collect()
        self.spec.empty_cache()
        return DeviceOutOfMemory(
            f"{self.spec.name} ran out of memory ({exc}); memory was released. "
            "Pick a smaller size, fewer steps, bf16/fp16, or CPU offload"
        )

    # -- warm-up (warmup.py) ------------------------------------------------------------------------
    def warm_bucket(self, bucket: BucketKey) -> BucketInfo:
        """Compile and warm one bucket (Warmup): first call compiles (compile_s), second is the warm-up run.
        An eager bucket is warm as it is; one this engine cannot compile fails with the reason."""
        if not bucket.mode.compiled:
            return self.board.update(bucket, state=BucketState.WARM)
        if (refusal := warm_refusal(bucket, self.check_mode, self.preset, self.batch_sizes)) is not None:
            return self.board.update(bucket, state=BucketState.FAILED, error=str(refusal))
        return self.warmup.bucket(bucket)

    def buckets_to_warm(self) -> list[BucketKey]:
        """The configured start-up warm list, most-used size first (the preset's order)."""
        return startup_buckets(self.options.warmup, self.preset, self.modes(), self.batch_sizes)

    def _lora_slot_off(self) -> None:
        """Before an aot export: its packages hold the slot's scaling tensors as constants, captured with no
        LoRA (aot serves none)."""
        if self.loras is not None:
            with self.run_lock:
                self.loras.select(LoraChoice())

    def _cache_moved(self, notice: str) -> None:
        """Compiles moved to a temporary cache (a full or read-only cache disk): said once on the engine, and
        why the worker reports new folders."""
        if notice not in self.notices:
            self.notices.append(notice)
        self.folders_notice = notice

    # -- what the engine announces ----------------------------------------------------------------
    def ready_info(self) -> EngineReady:
        """What a worker announces once loaded (the protocol's Ready message)."""
        return EngineReady(key=self.config.key, pid=os.getpid(), load_s=self.load_s, notices=tuple(self.notices),
                           modes=self.modes(), buckets=tuple(self.board.all()), footprint=self.footprint(),
                           preset=self.preset, batch_sizes=self.batch_sizes, folders=self.folders(),
                           lora=self.lora_info())

    def lora_info(self) -> LoraInfo | None:
        """Its LoRA slot for the board (None: it serves no adapters)."""
        return self.loras.info(self.config.key) if self.loras is not None else None

    def folders(self) -> tuple[tuple[str, str], ...]:
        """Where this process compiles and writes temporary files now (reported to the app for /system)."""
        return tuple(devices.folders_in_force(self.spec).items())

    def weights_bytes(self) -> int:
        """The loaded weights, and the fused-LoRA copy reserved whether or not a fused call made it yet."""
        if self._weights_bytes is None:
            fused = (self.loras.fused_bytes if self.loras is not None and self.loras.adapters
                     and not self.precision.precision.quantized else 0)
            self._weights_bytes = weights_bytes(self.pipe) + fused
        return self._weights_bytes

    def measure_peak(self) -> None:
        """One eager step at the largest bucket and the largest batch: the activation peak a call can reach
        (budgeting); the run time a request alone would take is learnt from a batch of one."""
        largest = max(self.preset.buckets, key=lambda s: s.pixels)
        most_refs = self.preset.reference_layouts(largest)[-1]  # the most tokens a call at this size holds
        request = self.warm_requests.request(BucketKey(Mode.EAGER, largest, refs=most_refs)).replace(
            steps=1, request_id="footprint")
        self.spec.reset_peak_memory()
        with self.run_lock:
            start = time.perf_counter()
            self.caller.call(self.pipe, request)
            self.measured_run = (largest, (time.perf_counter() - start) * 1000)
            if self.max_batch > 1:
                self.caller.call(self.pipe, request, members=[request.replace(seed=i) for i in range(self.max_batch)])
        self._peak_bytes = self.spec.peak_memory_bytes()

    def footprint(self) -> Footprint:
        """What this engine holds (footprint.py): device memory and the process's resident memory."""
        return engine_footprint(self.spec, self.weights_bytes(), self._peak_bytes)


class _CallHooks:
    """What a caller of run_call hands on to the pipeline call: progress, cancel, a batch's members, and
    where each decoded image of a batch goes."""

    def __init__(self, on_step, cancel, members: list[GenerateRequest] | None, on_image):
        self.on_step, self.cancel, self.members, self.on_image = on_step, cancel, members, on_image


# --- ahead of time -------------------------------------------------------------------------------
def export_aot_packages(config, sizes: tuple[Size, ...] | None = None, rebuild: bool = False,
                        progress: bool = True) -> list[dict]:
    """`python -m engine export`: load the engine once and warm each aot bucket, which loads a valid package
    (checked) or builds it. Returns one row per bucket: state, origin, seconds, error."""
    runner = PipelineRunner(config)
    runner.check_mode(Mode.AOT)  # neuron / tpu: refused with the reason before anything loads
    sizes = tuple(sizes or config.preset.buckets)
    bar = progress_bar(len(sizes), progress, f"export {config.key}", unit="bucket")
    bar.set_postfix_str("load")
    runner.load()
    rows = []
    for size in sizes:
        bucket = BucketKey(Mode.AOT, size)
        bar.set_postfix_str(str(size))
        if rebuild:
            runner.variants.get(Mode.AOT)
            runner.variants.aot.remove_packages(size)
        start = time.perf_counter()
        info = runner.warm_bucket(bucket)
        rows.append({"bucket": str(bucket), "state": info.state.value, "origin": info.origin, "error": info.error,
                     "seconds": time.perf_counter() - start, "compile_s": info.compile_s})
        bar.update()
    bar.close()
    return rows
