"""One pipeline on one device: a facade over the parts that load it, build its variants, run its calls,
warm its buckets and measure it.

A `PipelineRunner` lives inside a worker process (engine/worker/loop.py) or a tensor-parallel rank
(engine/tp/). Weights load once per (model, device, precision) (loading.py); every mode is a *variant* of
the same weights (variants.py). A bucket is (mode, size): one compiled graph of the variant's module at
that static shape, warmed by warmup.py and shown on the board (board.py). One pipeline call is calls.py's;
requests sharing one call are a batch run (batchrun.py); a result's image is encoded by png.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from engine import devices
from engine.pipeline import batching, prompts, stepcache, stepping
from engine.pipeline.batchrun import BatchHooks, BatchRun
from engine.pipeline.board import BucketBoard, describe_failure
from engine.pipeline.callrun import CallRun, RequestPrep, generate_here
from engine.pipeline.calls import PipelineCaller, pipeline_call_kwargs
from engine.pipeline.clock import compiles_in_this_thread
from engine.pipeline.clock import install_compile_counter as _install_compile_counter
from engine.pipeline.executor import ModeRules
from engine.pipeline.faults import Faults
from engine.pipeline.footprint import engine_footprint, weights_bytes
from engine.pipeline.loading import PipelineLoader, lora_refusal
from engine.pipeline.modes import VariantSet, clone_module_tree, compile_denoiser
from engine.pipeline.progress import progress_bar
from engine.pipeline.stepping import StepRunner
from engine.pipeline.warmup import WarmRequests, Warmup, preset_buckets, startup_buckets, warm_refusal
from engine.protocol import (
    BucketInfo,
    BucketKey,
    BucketState,
    EngineConfig,
    EngineReady,
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
    what it announces. It is the executor that runs them on this process's device (executor.py's protocol);
    the in-process and tensor-parallel executors are given one. What its runtime refuses (`refused`: mode ->
    why), its largest batch (`max_batch`) and whether it lives in the app's process come from who builds it. A subclass (engine/tp/runner.py)
    changes where it loads (`load_device`, `component_overrides`)."""

    def __init__(self, config: EngineConfig, listener: Callable[[BucketInfo], None] | None = None,
                 refused: Callable[[Mode], str] | None = None, max_batch: int | None = None,
                 in_app_process: bool = False):
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
        self.vae_source: str | None = None  # the VAE's own folder (a preset's `vae`), None: the source's
        self.in_app_process = in_app_process  # its footprint leaves out the app's resident memory
        self.run_lock = threading.Lock()  # one request on the device at a time (warm-up runs apart)
        self.rules = ModeRules(config, self.spec, self.precision, refused)
        self.modes, self.check_mode = self.rules.modes, self.rules.check_mode  # what the runner is asked most
        self.faults = Faults(self.options.testing)  # the one place this process reads its test hooks
        self._weights_bytes: int | None = None
        self._peak_bytes: int | None = None
        self.measured_run: tuple[Size, float] | None = None  # the measuring run: its size and milliseconds
        self.folders_notice = ""  # why the compile folders moved (a full or read-only cache disk), once they have
        self.step_caches: stepcache.CacheVariants | None = None  # (mode, step cache) variants, once loaded
        self.loras = None  # the preset's LoRA adapters, hot-swapped into one slot (engine/pipeline/lora.py)
        self.stepper: StepRunner | None = None  # its requests a step at a time, where its family has a step function
        self.variants = VariantSet(self.preset, self.options, self.spec, self.faults, self.notices, self._build_aot,
                                   self._variant_built)
        self.caller = PipelineCaller(self.preset, self.spec, self.options)
        self.prep = RequestPrep(config, self.precision, self.rules)
        self.calls = CallRun(config.key, self.spec, self.board, self.variants, self.caller, self.faults, self.run_lock)
        # Requests that can share a denoiser call run as one call of up to max_batch images (batching.py)
        self.max_batch = self.largest_batch() if max_batch is None else max_batch
        self.batch_sizes = batching.batch_sizes(self.max_batch)
        self.warm_requests = WarmRequests(self.preset, self.options.warmup.steps)
        self.warmup = Warmup(self.board, self.variants, self.warm_requests, self.caller, self.spec, self.notices,
                             self._lora_slot_off, self._cache_moved)
        for mode in self.modes():
            for bucket in preset_buckets(self.preset, mode):  # an edit's or a clip's bucket is a row of its own
                self.board.add(bucket, BucketState.COLD if mode.compiled else BucketState.WARM)

    # -- what this engine can run -----------------------------------------------------------------
    def largest_batch(self) -> int:
        """How many requests one call may serve (the --max-batch flag, else the device's default); clips run alone."""
        return 1 if self.preset.video else batching.max_batch_for(self.options.batching.max_batch, self.spec, self.config.key.tp)

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
        graphs = len(self.modes()) * len(preset_buckets(self.preset, Mode.EAGER)) * 2 * len(self.batch_sizes)
        loaded = loader.load(graphs=graphs)
        self.source, self.vae_source, self.loras, pipe = loaded.source, loaded.vae_source, loaded.loras, loaded.pipe
        self.notices += loaded.notices
        self.pipe = pipe
        self.variants.loaded(pipe)
        self.step_caches = stepcache.CacheVariants(self.preset, self.config.cache_path(), clone_module_tree,
                                                   str(loaded.source))
        # A pristine scheduler that never runs: each request gets a copy (schedulers keep per-run state).
        self.caller.scheduler_template = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        recipe = self.options.recipe
        self.prep.loras = loaded.loras
        self.calls.loaded(pipe, loaded.loras, self.step_caches)
        self.caller.prompts = prompts.PromptEncoder(
            pipe, self.config.key.memory, self.load_device(), str(self.config.key),
            prompts.PromptCache(recipe.prompt_cache_entries, recipe.prompt_cache_mib * 2**20))
        self.stepper = self.make_stepper(pipe)
        self.load_s = time.perf_counter() - start
        log.info("loaded %s in %.2fs", self.config.key, self.load_s)
        return self.load_s

    def make_stepper(self, pipe) -> StepRunner | None:
        """The engine's step-level runner (stepping.py): None where the host turned it off or the family has no
        step function (its requests run whole calls). A subclass whose calls are more than this process's
        (engine/tp/runner.py) has none."""
        if not self.options.batching.step_scheduling:
            self.notices.append("step-level scheduling is off (--step-scheduling turns it on): each request is one "
                                "whole pipeline call")
            return None
        function = stepping.step_function_for(pipe)
        if function is None:
            self.notices.append(f"{type(pipe).__name__} has no step function: each request is one whole pipeline "
                                "call (none joins or pauses it between steps)")
            return None
        return StepRunner(self.prep, self.calls, function, self.options, self.spec)

    def _build_aot(self, pipe, inductor_configs: dict):
        """The aot variant's AotEngine (engine/pipeline/aot.py) on the loaded pipeline."""
        from engine.pipeline import aot

        target = aot.AotTarget(self.preset, self.options.recipe, self.spec, self.precision, self.source,
                               self.config.cache_path() / "aot", vae_source=self.vae_source)
        return aot.AotEngine(pipe, target, self.warm_requests, self.caller, self.faults, self.batch_sizes,
                             inductor_configs)

    def _variant_built(self, mode: Mode, pipe) -> None:
        """A hook for subclasses: a mode's pipeline, the first time it is handed out (engine/tp/runner.py)."""

    # -- running ----------------------------------------------------------------------------------
    def generate(self, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None) -> GenerateResult:
        """Run one request here (callrun.py's generate_here)."""
        return generate_here(self.prep, self.calls, request, on_step=on_step, cancel=cancel)

    def generate_batch(self, requests: list[GenerateRequest], on_step=None,
                       cancels: list[threading.Event] | None = None, on_leave=None, on_result=None) -> list:
        """Run requests that can share a denoiser call as one pipeline call (BatchRun says what each gets)."""
        hooks = BatchHooks(on_step, cancels, on_leave, on_result)
        return BatchRun(requests, hooks, self.prep, self.calls).run()

    # -- warm-up (warmup.py) ------------------------------------------------------------------------
    def warm_bucket(self, bucket: BucketKey) -> BucketInfo:
        """Compile and warm one bucket (Warmup): first call compiles (compile_s), second is the warm-up run.
        An eager bucket is warm as it is; one this engine cannot compile fails with the reason."""
        if not bucket.mode.compiled:
            return self.board.update(bucket, state=BucketState.WARM)
        if (refusal := warm_refusal(bucket, self.rules.check_mode, self.preset, self.batch_sizes)) is not None:
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
        frames = max(self.preset.frames, default=0)
        most_refs = self.preset.reference_layouts(largest)[-1]  # the most tokens a call at this size holds
        request = self.warm_requests.request(BucketKey(Mode.EAGER, largest, frames=frames, refs=most_refs)).replace(
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
        """What this engine holds (footprint.py): device memory and the process's resident memory. In the app's
        process that memory is not the engine's: weights + the measured peak, on every device."""
        base = engine_footprint(self.spec, self.weights_bytes(), self._peak_bytes)
        if not (self.in_app_process and self.spec.host_memory_is_device_memory):
            return base
        device = self.weights_bytes() + (self._peak_bytes or 0)
        return Footprint(device_bytes=int(device), host_rss_bytes=0, weights_bytes=base.weights_bytes)


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
