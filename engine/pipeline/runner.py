"""One pipeline on one device: loading, per-bucket compiled graphs, warm-up and timed runs.

A `PipelineRunner` lives inside a worker process (engine/worker/loop.py) or a tensor-parallel rank
(engine/tp/). Weights load once per (model, device, precision); every mode is a *variant* of the
same weights:

- eager:    the loaded pipeline itself, never compiled, so it can serve while a bucket compiles;
- compile:  `torch.compile(denoiser)` (an OptimizedModule wrapping the same module) and a compiled
            `vae.decode` on a shallow VAE copy;
- regional: `compile_repeated_blocks` on a structural clone of the denoiser whose Parameters are the
            very same tensors (compile_repeated_blocks works in place, and eager must stay eager);
- defer-and-fuse: the eager variant run under torch_tpu's DEFER_AND_FUSE eager mode;
- aot:      the denoiser (and vae.decode) dispatch to one AOTInductor package per bucket and batch shape,
            loaded from the cache folder or built there, every package on the engine's own weights
            (engine/pipeline/aot.py).

A bucket is (mode, size): one compiled graph of the variant's module at that static shape.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import io
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine import devices
from engine.config import caches
from engine.config.presets import route_size
from engine.config.resolve import resolve_source
from engine.errors import (
    Cancelled,
    DeviceOutOfMemory,
    InvalidRequest,
    ModelLoadError,
    UnsupportedCombination,
    scrub_paths,
)
from engine.pipeline import attention, batching, lora, recipes, stepcache, variants
from engine.pipeline.faults import Faults, failing_backend
from engine.pipeline.progress import progress_bar, quiet_library_consoles
from engine.protocol import (
    BucketInfo,
    BucketKey,
    BucketState,
    EngineConfig,
    EngineKey,
    EngineReady,
    Fault,
    Footprint,
    GenerateRequest,
    GenerateResult,
    Mode,
    ModelPreset,
    Size,
    StepProgress,
    Timings,
)

log = logging.getLogger(__name__)

# --- compile accounting per thread --------------------------------------------------------------
# Dynamo's compile-start callback runs in the compiling thread, so counting per thread tells a
# request how many graphs *it* compiled, even while the warm-up thread compiles other buckets.
_compiles_by_thread: dict[int, int] = {}
_compile_counter_installed = False


def _install_compile_counter() -> None:
    global _compile_counter_installed
    if _compile_counter_installed:
        return
    from torch._dynamo.callback import on_compile_start

    @on_compile_start
    def _count(_args) -> None:
        tid = threading.get_ident()
        _compiles_by_thread[tid] = _compiles_by_thread.get(tid, 0) + 1

    _compile_counter_installed = True


def compiles_in_this_thread() -> int:
    return _compiles_by_thread.get(threading.get_ident(), 0)


def _cache_counters() -> tuple[int, int]:
    """Compile-cache hits and misses so far in this process (AOTAutograd + inductor FX-graph caches)."""
    from torch._dynamo.utils import counters

    aot, inductor = counters["aot_autograd"], counters["inductor"]
    hits = aot["autograd_cache_hit"] + inductor["fxgraph_cache_hit"]
    misses = aot["autograd_cache_miss"] + inductor["fxgraph_cache_miss"]
    return hits, misses


def describe_failure(exc: BaseException, limit: int = 500) -> str:
    """One line for the board: the error and, if different, its root cause (dynamo wraps errors). Visitors
    read it: a compiler's failure is told by its first error line, never its command line, and every server
    path is replaced (the log keeps the whole error)."""

    def line(e: BaseException) -> str:
        if isinstance(getattr(e, "cmd", None), list | tuple) and isinstance(getattr(e, "output", None), str):
            errors = [ln.strip() for ln in e.output.splitlines() if "error" in ln.lower()]  # a C++ compile error
            return f"{type(e).__name__}: the C++ compiler failed" + (f": {errors[0]}" if errors else "")
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".strip()

    root = exc
    while (nxt := getattr(root, "inner_exception", None) or root.__cause__) is not None and nxt is not root:
        root = nxt
    text = line(exc) if root is exc else f"{line(exc)} (cause: {line(root)})"
    return scrub_paths(text)[:limit]


def pipeline_call_kwargs(preset: ModelPreset, pipe, request: GenerateRequest, output_type: str = "pil",
                         members: list[GenerateRequest] | None = None) -> dict:
    """The pipeline call for a request — what the engine runs, and what a bare diffusers call must pass
    to be compared with it (bench, TP tests). A CPU generator makes seeds mean the same on every device.
    `members`: a batch (engine/pipeline/batching.py) sharing `request`'s size, steps and guidance: one prompt and
    one generator per member, so each image's noise is what that request alone would start from."""
    batch = members or [request]
    kwargs = dict(
        prompt=request.prompt if members is None else [r.prompt for r in batch],
        height=request.height,
        width=request.width,
        num_inference_steps=request.steps,
        guidance_scale=request.guidance,
        generator=(torch.Generator("cpu").manual_seed(request.seed) if members is None
                   else [torch.Generator("cpu").manual_seed(r.seed) for r in batch]),
        output_type=output_type,
    )
    if request.negative_prompt and preset.negative_prompt:
        kwargs["negative_prompt"] = request.negative_prompt if members is None else \
            [r.negative_prompt or "" for r in batch]
    if preset.max_sequence_length and _takes_argument(type(pipe), "max_sequence_length"):
        kwargs["max_sequence_length"] = preset.max_sequence_length
    return kwargs


@functools.cache
def _takes_argument(pipeline_cls: type, name: str) -> bool:
    return name in inspect.signature(pipeline_cls.__call__).parameters


# --- variants -----------------------------------------------------------------------------------
def clone_module_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A new module tree whose Parameters and buffers are the same tensors (no extra weight memory).

    Used for regional compile: `compile_repeated_blocks` sets `_compiled_call_impl` on each block in
    place, so it works on the clone and the eager original stays eager.
    """
    clone = copy.copy(module)
    clone._modules = OrderedDict(
        (name, clone_module_tree(child) if child is not None else None) for name, child in module._modules.items()
    )
    for hooks in ("_forward_hooks", "_forward_pre_hooks"):
        setattr(clone, hooks, OrderedDict(getattr(module, hooks)))
    return clone


def compile_denoiser(denoiser: torch.nn.Module, mode: Mode, compile_kwargs: dict) -> torch.nn.Module:
    """The denoiser of a compiled mode, over the same weights (the engine and the bench both use it).

    compile: an OptimizedModule wrapping the module; regional: `compile_repeated_blocks` on a
    structural clone, because it compiles in place and the eager original must stay eager.
    """
    if mode == Mode.COMPILE:
        return torch.compile(denoiser, **compile_kwargs)
    if mode == Mode.REGIONAL:
        clone = clone_module_tree(denoiser)
        try:
            clone.compile_repeated_blocks(**compile_kwargs)
        except ValueError as exc:
            raise UnsupportedCombination(
                f"regional compile is not possible for {type(denoiser).__name__}: {exc}; use mode 'compile'"
            ) from None
        return clone
    raise InvalidRequest(f"mode {mode!r} has no compiled denoiser")


class _RunClock:
    """Marks of one run: start, denoise loop start (the pipeline opens its progress bar), each step end
    (callback_on_step_end)."""

    def __init__(self, spec: devices.DeviceSpec):
        self.spec = spec
        self.start = time.perf_counter()
        self.loop_start: float | None = None
        self.step_ends: list[float] = []

    def mark_loop_start(self) -> None:
        if self.loop_start is not None:
            return
        self.spec.synchronize()
        self.loop_start = time.perf_counter()

    def mark_step_end(self) -> float:
        self.spec.synchronize()  # device-synchronised per-step latency
        now = time.perf_counter()
        prev = self.step_ends[-1] if self.step_ends else (self.loop_start or self.start)
        self.step_ends.append(now)
        return (now - prev) * 1000

    def timings(self, end: float) -> Timings:
        loop_start = self.loop_start or self.start
        edges = [loop_start, *self.step_ends]
        steps = tuple((b - a) * 1000 for a, b in zip(edges, edges[1:], strict=False))
        last = self.step_ends[-1] if self.step_ends else loop_start
        return Timings(
            step_ms=steps,
            encode_ms=(loop_start - self.start) * 1000,
            denoise_ms=(last - loop_start) * 1000,
            decode_ms=(end - last) * 1000,
            total_ms=(end - self.start) * 1000,
        )


@dataclass(frozen=True)
class _Run:
    """What one pipeline call gave (PipelineRunner._run): a request's image, or a batch's images in order."""

    images: object
    timings: Timings
    cancelled_at: int | None
    eager_fallback: bool
    recompiles: int
    cached_steps: tuple[int, ...]
    peak: int | None
    lora_swap_ms: float | None = None  # the LoRA hot-swap this call waited for (engine/pipeline/lora.py)


class BucketBoard:
    """Thread-safe bucket states; every change is pushed to `listener` (the worker sends it on)."""

    def __init__(self, key: EngineKey, listener: Callable[[BucketInfo], None] | None = None):
        self.key = key
        self.listener = listener
        self._lock = threading.Lock()
        self._infos: dict[BucketKey, BucketInfo] = {}
        self._warm_events: dict[BucketKey, threading.Event] = {}

    def add(self, bucket: BucketKey, state: BucketState = BucketState.COLD) -> None:
        with self._lock:
            if bucket in self._infos:
                return
        self.update(bucket, state=state)

    def get(self, bucket: BucketKey) -> BucketInfo | None:
        with self._lock:
            return self._infos.get(bucket)

    def all(self) -> list[BucketInfo]:
        with self._lock:
            return sorted(self._infos.values(), key=lambda i: (i.bucket.mode, i.bucket.size))

    def event(self, bucket: BucketKey) -> threading.Event:
        with self._lock:
            return self._warm_events.setdefault(bucket, threading.Event())

    def update(self, bucket: BucketKey, **changes) -> BucketInfo:
        with self._lock:
            info = self._infos.get(bucket) or BucketInfo(self.key, bucket, BucketState.COLD)
            info = replace(info, updated_at=time.time(), **changes)
            self._infos[bucket] = info
            event = self._warm_events.setdefault(bucket, threading.Event())
            if info.state in (BucketState.WARM, BucketState.FAILED):
                event.set()
            else:
                event.clear()
        if self.listener:
            self.listener(info)
        return info

    def served(self, bucket: BucketKey, requests: int = 1) -> None:
        """One pipeline call at `bucket` served `requests` requests (more than one in a batch). An eager
        batch size seen first here needs nothing compiled: its row starts warm."""
        info = self.get(bucket)
        state = {} if info is not None or bucket.mode.compiled else {"state": BucketState.WARM}
        self.update(bucket, requests_served=(info.requests_served if info else 0) + requests,
                    batches_served=(info.batches_served if info else 0) + 1, **state)


class PipelineRunner:
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
        self._variants: dict[Mode, object] = {}
        self._variant_lock = threading.Lock()
        self._run_lock = threading.Lock()  # one request on the device at a time (warm-up runs apart)
        self._mode_notices: dict[Mode, tuple[str, ...]] = {}
        self.faults = Faults(self.options.testing)  # the one place this process reads its test hooks
        self._weights_bytes: int | None = None
        self._peak_bytes: int | None = None
        self.measured_run: tuple[Size, float] | None = None  # the measuring run: its size and milliseconds
        self.source: str | None = None  # what from_pretrained loaded (aot package keys name the model by it)
        self._aot = None  # engine/pipeline/aot.py AotEngine, built with the aot variant
        self.folders_notice = ""  # why the compile folders moved (a full or read-only cache disk), once they have
        self._step_caches: stepcache.CacheVariants | None = None  # (mode, step cache) variants, once loaded
        self.loras: lora.LoraSlot | None = None  # the preset's LoRA adapters, hot-swapped into one slot
        # Requests that can share a denoiser call run as one call of up to max_batch images (engine/pipeline/batching.py)
        self.max_batch = self.largest_batch()
        self.batch_sizes = batching.batch_sizes(self.max_batch)
        for mode in self.modes():
            for size in self.preset.buckets:
                self.board.add(BucketKey(mode, size), BucketState.COLD if mode.compiled else BucketState.WARM)

    # -- set-up ----------------------------------------------------------------------------------
    def largest_batch(self) -> int:
        """How many requests one call may serve (the --max-batch flag, else the device's default)."""
        return batching.max_batch_for(self.options.batching.max_batch, self.spec, self.config.key.tp)

    @property
    def compute_precision(self) -> str:
        """The dtype activations run in (a quantized precision's base: what attention kernels see)."""
        return self.precision.base or self.precision.precision

    def modes(self) -> tuple[Mode, ...]:
        """Modes this engine can run: the device's, minus what its options rule out."""
        return tuple(m for m in self.spec.modes if not self._excluded(m))

    def _excluded(self, mode: Mode) -> str:
        """Why this engine's options rule `mode` out ("" when they do not)."""
        if self.options.recipe.cpu_offload and mode in (Mode.COMPILE, Mode.AOT):
            # Offload hooks cannot be traced (seed: compile only the repeated blocks), and an aot package
            # points at weights that offload moves between devices.
            return "CPU offload is on"
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

    # Hooks for subclasses (engine/tp/runner.py: each rank loads its shard onto its own device).
    def load_device(self) -> str:
        """Where the pipeline's components go (`pipe.to(...)`, offload target)."""
        return self.spec.torch_device

    def component_overrides(self, source: str) -> dict:
        """Components loaded separately and handed to the pipeline's from_pretrained (e.g. sharded ones)."""
        return {}

    def load(self) -> float:
        start = time.perf_counter()
        # An attention backend this device cannot run is refused before any weights load.
        attention.check_backend(self.options.recipe.attention_backend, self.spec, self.compute_precision)
        # Before diffusers is imported: importing it pulls in torch._dynamo, which fixes
        # TORCHINDUCTOR_CACHE_DIR to /tmp when unset, and the persistent cache would be ignored.
        env = devices.apply_environment(self.spec, self.config.cache_path())
        log.info("environment in force: %s", env)
        if not self.precision.precision.quantized:
            recipes.keep_torchao_unloaded()
        import diffusers

        quiet_library_consoles()

        devices.apply_precision(self.precision)
        _install_compile_counter()
        # A graph per mode x bucket x batch size, and a second batch shape per bucket with classifier-free guidance
        recipes.raise_recompile_limit(len(self.modes()) * len(self.preset.buckets) * 2 * len(self.batch_sizes))
        pipeline_cls = getattr(diffusers, self.preset.pipeline)
        source = self.source = resolve_source(self.config)
        try:
            pipe = pipeline_cls.from_pretrained(
                source, dtype=self.precision.dtype, trust_remote_code=False, **self.component_overrides(source)
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"could not load {self.preset.name!r} from {source!r}: {str(exc).splitlines()[0]}; "
                "check the path, or download the model first when offline"
            ) from None
        pipe.set_progress_bar_config(disable=True)
        if self.preset.repeated_blocks:
            getattr(pipe, self.preset.denoiser)._repeated_blocks = list(self.preset.repeated_blocks)
        self.notices += recipes.apply_load_steps(pipe, self.preset.denoiser, self.options)
        if self.options.recipe.cpu_offload:
            pipe.enable_model_cpu_offload(device=self.load_device())
            self.notices.append("model CPU offload: each model moves to the device only while it runs")
        else:
            pipe.to(self.load_device())
        if self.preset.loras:
            # Before any variant is compiled or cloned: every variant must share the slot's layers.
            self._prepare_loras(pipe)
        if self.precision.precision.quantized:
            self.notices.append(recipes.quantize_denoiser(pipe, self.preset.denoiser, self.precision.precision))
        self.notices += attention.apply_backend(getattr(pipe, self.preset.denoiser), self.options.recipe.attention_backend,
                                                self.spec, self.compute_precision)
        self.notices += recipes.apply_inductor_flags(self.options, self.spec)
        self.pipe = pipe
        self._variants[Mode.EAGER] = pipe
        self._step_caches = stepcache.CacheVariants(self.preset, self.config.cache_path(), clone_module_tree,
                                                    str(source))
        # A pristine scheduler that never runs: each request gets a copy (schedulers keep per-run state).
        self._scheduler_template = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        self.load_s = time.perf_counter() - start
        log.info("loaded %s in %.2fs", self.config.key, self.load_s)
        return self.load_s

    def lora_refusal(self) -> str:
        """Why this engine serves no LoRA although its preset lists some ("" when it can)."""
        if not self.options.recipe.loras:
            return ("this engine was started without LoRA styles: the host turns them on with --loras (each adds "
                    "a slot whose matmuls run on every step)")
        if self.config.key.tp > 1:
            return ("LoRA adapters are not served on multi-rank engines (every rank would have to swap in step; "
                    "not built yet): use a single-device engine")
        if self.precision.precision.quantized:
            return (f"LoRA adapters are not served on {self.precision.precision} engines (the slot's layers would "
                    "wrap torchao-quantized weights, not measured here): use fp32, bf16 or fp16")
        return ""

    def _prepare_loras(self, pipe) -> None:
        if refusal := self.lora_refusal():
            self.notices.append(refusal)
            return
        self.loras, notices = lora.LoraSlot.prepare(pipe, self.preset, self.config.allowed_roots)
        self.notices += notices

    def variant(self, mode: Mode):
        """The pipeline object for a mode (built once; compiled modules compile lazily per shape)."""
        mode = Mode.parse(mode, "mode")
        with self._variant_lock:
            if mode in self._variants:
                return self._variants[mode]
            base = self.pipe
            if mode is Mode.DEFER_AND_FUSE:
                pipe = base  # same modules; the eager mode is switched per run (devices.enter_eager_mode)
            elif mode is Mode.AOT:
                from engine.pipeline import aot

                self._aot = aot.AotEngine(self, recipes.aot_inductor_configs(self.options, self.spec))
                pipe = self._aot.pipe
            else:
                kwargs, notices = recipes.compile_kwargs(self.options, self.spec, mode=mode)
                self.notices += notices
                if self.faults.should_fail_compile():
                    kwargs["backend"] = failing_backend
                replaced = {self.preset.denoiser: compile_denoiser(getattr(base, self.preset.denoiser), mode, kwargs)}
                if mode is Mode.COMPILE and self.options.recipe.compile_vae:
                    replaced["vae"] = variants.vae_decoding_with(
                        base.vae, torch.compile(base.vae.decode, **{**kwargs, "fullgraph": False}))
                pipe = variants.pipeline_over(base, **replaced)
            self._variants[mode] = pipe
            return pipe

    # -- running ---------------------------------------------------------------------------------
    def _call(self, pipe, request: GenerateRequest, on_step=None, cancel: threading.Event | None = None,
              cached: stepcache.CachedDenoiser | None = None, members: list[GenerateRequest] | None = None,
              on_image=None):
        """One pipeline call on a private copy (own scheduler: schedulers keep per-run state). With a step
        cache variant, `cached` counts the steps its hooks served. With `members` (a batch led by `request`)
        the first value returned is the list of their images, in order; with `on_image` too, the batch is
        decoded one image at a time and `on_image(index, image, timings)` gets each as soon as it is ready
        (timings up to then)."""
        scheduler = copy.deepcopy(self._scheduler_template)  # 3-5x cheaper than from_config per request
        clock = _RunClock(self.spec)
        run = variants.run_copy(pipe, scheduler, on_loop_start=clock.mark_loop_start)
        if cached is not None:
            cached.start(run)
        cancelled_at = []
        graphs = recipes.cuda_graphs_active(self.options, self.spec, request.mode)

        def on_step_end(p, i, t, callback_kwargs):
            # With CUDA graphs the next replay overwrites this step's graph outputs: the step's tensors are
            # cloned before anything reads them, and the next denoiser call starts a new graph step.
            outputs = recipes.graph_safe_outputs(callback_kwargs) if graphs else {}
            step_ms = clock.mark_step_end()
            from_cache = cached.counter.step_end() if cached is not None else False
            if on_step:
                on_step(StepProgress(request.request_id, i + 1, request.steps, step_ms, cached=from_cache,
                                     batch_size=len(members) if members else 1))
            if cancel is not None and cancel.is_set() and not cancelled_at:
                cancelled_at.append(i + 1)
                p._interrupt = True
            return outputs

        kwargs = pipeline_call_kwargs(self.preset, run, request, members=members)
        kwargs["callback_on_step_end"] = on_step_end
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
        images = run(**kwargs).images
        end = time.perf_counter()
        images = decoded if decoded else images
        return (list(images) if members else images[0]), clock.timings(end), (cancelled_at[0] if cancelled_at else None)

    def prepare(self, request: GenerateRequest) -> tuple[GenerateRequest, list[str]]:
        """What is checked before a request runs (its mode, its step cache, its size snapped to a bucket):
        the request at its bucket and the notices; raises what it cannot run with."""
        notices = list(self.check_mode(request.mode))
        # A step cache this mode cannot hold is refused before anything runs (never served without it).
        notices += stepcache.check_step_cache(request.step_cache, self.preset, self.spec, request.mode)
        if request.step_cache.enabled and self.config.key.tp > 1:
            # Each rank's hooks would decide alone which steps to skip; ranks that disagree hang the collectives.
            raise UnsupportedCombination(f"step cache {request.step_cache} is not available on a multi-rank engine "
                                         f"({self.config.key}, tensor or context parallel): run it on a "
                                         "single-device engine")
        size, snapped = route_size(self.preset, request.width, request.height, snap=True)
        notices += snapped
        request = request.replace(width=size.width, height=size.height)
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
        run = self._run(request.bucket, request, notices, on_step, cancel)
        if run.cancelled_at is not None:
            raise Cancelled(f"request {request.request_id} cancelled after step {run.cancelled_at} of {request.steps}")
        self.board.served(request.bucket)
        return self._result(request, run.images, run, notices)

    def _run(self, bucket: BucketKey, request: GenerateRequest, notices: list[str], on_step, cancel,
             members: list[GenerateRequest] | None = None, on_image=None) -> _Run:
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
        pipe = self.variant(request.mode)
        with self._run_lock:
            if self.faults.take(Fault.OOM):
                raise self._out_of_memory(torch.OutOfMemoryError("injected out-of-memory"))
            self.spec.reset_peak_memory()
            compiles_before = compiles_in_this_thread()
            aot_before = self._aot.counters()[1] if self._aot and request.mode is Mode.AOT else None
            cached = None
            swap_ms = self.loras.select(request.lora, request.lora_scale or 0.0) if self.loras is not None else None

            def image_ready(index, image, timings):
                steps_cached = tuple(cached.counter.cached) if cached is not None else ()
                on_image(index, image, _Run(None, timings, None, eager_fallback,
                                            compiles_in_this_thread() - compiles_before, steps_cached,
                                            self.spec.peak_memory_bytes(), swap_ms))

            apart = on_image is not None and self._decodes_apart(request, pipe)
            try:
                if request.step_cache.enabled:
                    cached, cache_notices = self._step_caches.get(
                        request.mode, pipe, request.step_cache, request.steps,
                        lambda p, v: self._call(p, request.replace(request_id="calibrate"), cached=v))
                    notices += cache_notices
                    pipe = cached.pipe
                images, timings, cancelled_at = self._call(pipe, request, on_step, cancel, cached, members=members,
                                                           on_image=image_ready if apart else None)
            except torch.OutOfMemoryError as exc:
                raise self._out_of_memory(exc) from None
            recompiles = compiles_in_this_thread() - compiles_before
            cached_steps = cached.finish() if cached is not None else ()
            peak = self.spec.peak_memory_bytes()
            if aot_before is not None and self._aot.counters()[1] > aot_before:
                notices.append(f"aot: a call at {bucket} matched no package (not the exported shapes or "
                               "arguments) and ran eagerly")
        return _Run(images, timings, cancelled_at, eager_fallback, recompiles, cached_steps, peak, swap_ms)

    def _decodes_apart(self, request: GenerateRequest, pipe) -> bool:
        """Whether a batch led by `request` (its mode after any eager fallback) decodes its images apart: the
        device says it pays (DeviceSpec.decode_batch_apart), the pipeline does nothing after its decode,
        and a compiled mode has its graph for one image warm (decoding one would compile it otherwise)."""
        if not self.spec.decode_batch_apart or not variants.can_decode_apart(pipe):
            return False
        if not request.mode.compiled:
            return True
        info = self.board.get(request.bucket.batched(1))
        return info is not None and info.state == BucketState.WARM

    def _result(self, request: GenerateRequest, image, run: _Run, notices: list[str], batch_size: int = 1
                ) -> GenerateResult:
        return GenerateResult(
            request_id=request.request_id, engine=self.config.key, bucket=request.bucket,
            image_png=self._png(image, request), timings=run.timings, warm=not run.eager_fallback,
            eager_fallback=run.eager_fallback, recompiles=run.recompiles, peak_memory_bytes=run.peak,
            notices=tuple(notices), seed=request.seed, steps=request.steps, step_cache=request.step_cache,
            cached_steps=run.cached_steps, batch_size=batch_size, lora=request.lora,
            lora_scale=request.lora_scale if request.lora else None,
            lora_rank=self.loras.rank(request.lora) if self.loras is not None else None,
            lora_swap_ms=run.lora_swap_ms)

    def generate_batch(self, requests: list[GenerateRequest], on_step=None,
                       cancels: list[threading.Event] | None = None, on_leave=None, on_result=None) -> list:
        """Run requests that can share a denoiser call (engine/pipeline/batching.py's key) as one pipeline call.

        Returns, per request, its GenerateResult, the exception it failed with, or None when it already
        left through `on_leave(index, Cancelled)` or was answered through `on_result(index, result)`: a
        member whose cancel is set leaves at the next step end, at once, and the call goes on for the
        others (its image is dropped); the call stops when every member has left. Where the device decodes
        a batch's images apart, each member's result goes to `on_result` as soon as its image is decoded.
        `on_step(progress)` gets each member's StepProgress (its own request id; the step is shared:
        batch_size). A member that cannot run (mode, step cache, size) fails alone first; if the shared
        call fails, each member not answered yet runs again alone, so each gets its own outcome."""
        n = len(requests)
        cancels = cancels or [threading.Event() for _ in range(n)]
        outcomes: list = [None] * n
        answered: set[int] = set()

        def answer(index: int, result: GenerateResult) -> None:
            answered.add(index)
            on_result(index, result)
        ready: list[tuple[int, GenerateRequest, list[str]]] = []
        for i, request in enumerate(requests):
            try:
                prepared, notices = self.prepare(request)
                ready.append((i, prepared, notices))
            except Exception as exc:  # noqa: BLE001 - its own outcome
                outcomes[i] = exc
        if len(ready) < 2:
            for i, _, _ in ready:
                outcomes[i] = self._solo(requests[i], on_step, cancels[i])
            return outcomes
        try:
            results = self._run_batch(ready, on_step, cancels, on_leave, answer if on_result is not None else None)
            for (i, _, _), result in zip(ready, results, strict=True):
                outcomes[i] = result
        except Cancelled:
            pass  # every member left (each was told)
        except Exception as exc:  # noqa: BLE001 - the shared call failed: each member alone
            log.warning("a batch of %d at %s failed (%s); its requests run alone", len(ready), ready[0][1].bucket,
                        describe_failure(exc, 200))
            for i, _, _ in ready:
                if i in answered:
                    continue
                if not cancels[i].is_set():
                    outcomes[i] = self._solo(requests[i], on_step, cancels[i])
                elif outcomes[i] is None and on_leave is not None:
                    on_leave(i, Cancelled(f"request {requests[i].request_id} cancelled"))
        return outcomes

    def _solo(self, request, on_step, cancel):
        try:
            return self.generate(request, on_step=on_step, cancel=cancel)
        except Exception as exc:  # noqa: BLE001 - its own outcome
            return exc

    def _run_batch(self, ready, on_step, cancels, on_leave, on_result=None) -> list:
        members = [request for _, request, _ in ready]
        indexes = [i for i, _, _ in ready]
        lead, k = members[0], len(members)
        bucket = lead.bucket.batched(k)
        left = [False] * k

        def member_left(j: int, step: int) -> bool:
            """Whether member j has left; one whose cancel is set leaves now (told through on_leave)."""
            if not left[j] and cancels[indexes[j]].is_set():
                left[j] = True
                if on_leave is not None:
                    on_leave(indexes[j], Cancelled(
                        f"request {members[j].request_id} cancelled after step {step} of {members[j].steps} "
                        f"(the batch of {k} it shared went on without it)"))
            return left[j]

        def member_steps(progress: StepProgress) -> None:
            for j, member in enumerate(members):
                if not member_left(j, progress.step) and on_step is not None:
                    on_step(replace(progress, request_id=member.request_id))

        answered = [False] * k

        def image_ready(j: int, image, run_so_far: _Run) -> None:
            # Its own result at once: the web server delivers it while the others decode.
            if not member_left(j, lead.steps):
                on_result(indexes[j], self._result(members[j], image, run_so_far, ready[j][2] + notices, batch_size=k))
                answered[j] = True

        notices: list[str] = []
        run = self._run(bucket, lead, notices, member_steps, batching.AllSet([cancels[i] for i in indexes]),
                        members=members, on_image=image_ready if on_result is not None else None)
        if run.cancelled_at is not None:
            raise Cancelled(f"every request of a batch of {k} cancelled after step {run.cancelled_at}")
        results = [None if left[j] or answered[j] else
                   self._result(member, image, run, ready[j][2] + notices, batch_size=k)
                   for j, (member, image) in enumerate(zip(members, run.images, strict=True))]
        # Counted where it ran: an eager batch (eager mode, or a batch size not warm yet) on the eager row
        ran = bucket if not run.eager_fallback else BucketKey(Mode.EAGER, bucket.size, k)
        self.board.served(ran, requests=sum(r is not None for r in results) + sum(answered))
        return results

    def _png(self, image, request: GenerateRequest) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG", compress_level=1,  # lossless; level 6 costs ~0.25 s at 1024²
                   pnginfo=self._png_info(request))
        return buf.getvalue()

    def _png_info(self, request: GenerateRequest):
        """Generation parameters in the PNG (tEXt), request id included: every file is unique, so two
        identical images never share one cached file in a web server (Gradio names files by content)."""
        import json

        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        info.add_text("diffusion-showcase", json.dumps({
            "request_id": request.request_id, "engine": str(self.config.key), "mode": request.mode,
            "size": str(request.size), "seed": request.seed, "steps": request.steps, "guidance": request.guidance,
            "prompt": request.prompt, "negative_prompt": request.negative_prompt,
            "step_cache": str(request.step_cache), "lora": request.lora, "lora_scale": request.lora_scale,
        }))
        return info

    def _out_of_memory(self, exc: Exception) -> DeviceOutOfMemory:
        gc.collect()
        self.spec.empty_cache()
        return DeviceOutOfMemory(
            f"{self.spec.name} ran out of memory ({exc}); memory was released. "
            "Pick a smaller size, fewer steps, bf16/fp16, or CPU offload"
        )

    # -- warm-up ---------------------------------------------------------------------------------
    def warm_request(self, bucket: BucketKey, guidance: float | None = None) -> GenerateRequest:
        return GenerateRequest(
            prompt="warm-up",
            width=bucket.size.width,
            height=bucket.size.height,
            steps=self.options.warmup.steps,
            guidance=self.preset.guidance if guidance is None else guidance,
            seed=0,
            mode=bucket.mode,
            request_id=f"warm-{bucket}",
        )

    def warm_members(self, bucket: BucketKey, guidance: float | None = None) -> list[GenerateRequest] | None:
        """A batched bucket's warm-up call: `bucket.batch` requests (None at batch size 1)."""
        if bucket.batch <= 1:
            return None
        request = self.warm_request(bucket, guidance)
        return [request.replace(seed=i, request_id=f"{request.request_id}-{i}") for i in range(bucket.batch)]

    def _warm_call(self, pipe, bucket: BucketKey, guidance: float | None = None):
        return self._call(pipe, self.warm_request(bucket, guidance), members=self.warm_members(bucket, guidance))

    def warm_guidances(self) -> tuple[float, ...]:
        # With classifier-free guidance, guidance <= 1 halves the denoiser batch: a second shape.
        # Warm both so changing guidance never recompiles.
        g = self.preset.guidance
        return (g, 1.0) if self.preset.cfg and g > 1.0 else (g,)

    def warm_bucket(self, bucket: BucketKey) -> BucketInfo:
        """Compile and warm one bucket: first call compiles (compile_s), second is the warm-up run."""
        if not bucket.mode.compiled:
            return self.board.update(bucket, state=BucketState.WARM)
        try:
            self.check_mode(bucket.mode)
            if bucket.size not in self.preset.buckets:
                raise InvalidRequest(f"{bucket.size} is not a bucket of {self.preset.name}")
            if bucket.batch not in self.batch_sizes:
                raise InvalidRequest(f"batch size {bucket.batch} is not one of this engine's "
                                     f"({', '.join(map(str, self.batch_sizes))}; --max-batch)")
        except Exception as exc:
            return self.board.update(bucket, state=BucketState.FAILED, error=str(exc))
        self.board.update(bucket, state=BucketState.COMPILING, error=None, origin=None)
        try:
            pipe = self.variant(bucket.mode)
            hits_before, misses_before = _cache_counters()
            start = time.perf_counter()
            origin = self._compile_bucket(pipe, bucket)
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            aot_misses = self._aot.counters()[1] if bucket.mode is Mode.AOT else 0
            self._warm_call(pipe, bucket)
            warmup_s = time.perf_counter() - start
            if bucket.mode is Mode.AOT and self._aot.counters()[1] > aot_misses:
                raise RuntimeError("the warm-up run matched no aot package (the pipeline calls the denoiser or "
                                   "decoder with other arguments than were exported)")
        except Exception as exc:  # a failed compile must leave eager serving
            log.warning("bucket %s failed to compile: %s", bucket, exc)
            return self.board.update(bucket, state=BucketState.FAILED, error=describe_failure(exc))
        hits, misses = _cache_counters()
        return self.board.update(bucket, state=BucketState.WARM, compile_s=compile_s, warmup_s=warmup_s,
                                 cache_hits=hits - hits_before, cache_misses=misses - misses_before, origin=origin)

    def _compile_bucket(self, pipe, bucket: BucketKey) -> str | None:
        """First calls at the bucket's shapes compile. A cache that cannot be written (read-only, full: told by
        the error or by the disk's free space, whichever tool failed) moves compiles to a temporary cache; a
        corrupt one has its broken files removed and the compile runs again without the on-disk caches.
        Returns what the board says about where the graph came from. aot: load the bucket's packages,
        building what is missing (in the temporary cache too when the package folder cannot be written)."""
        try:
            if bucket.mode is Mode.AOT:
                return self._warm_aot(bucket)
            for guidance in self.warm_guidances():
                self._warm_call(pipe, bucket, guidance)
            return None
        except Exception as exc:
            unwritable = caches.unwritable_cause(exc, self._compile_folders())
            if unwritable is not None:
                origin = self._move_cache(bucket, unwritable)
            elif bucket.mode is Mode.AOT:
                raise
            else:
                removed = caches.remove_corrupt_artifacts(exc)
                if not caches.compile_caches_enabled() and not removed:
                    raise
                notice = (f"compiling {bucket} failed with the on-disk compile cache ({describe_failure(exc, 200)}); "
                          f"retrying without the cache"
                          f"{f' (removed {len(removed)} corrupt file(s))' if removed else ''}")
                log.warning(notice)
                self.notices.append(notice)
                caches.disable_compile_caches()
                origin = None
        if bucket.mode is Mode.AOT:
            return f"{self._warm_aot(bucket)}; {origin}"
        for guidance in self.warm_guidances():
            self._warm_call(pipe, bucket, guidance)
        return origin

    def _warm_aot(self, bucket: BucketKey) -> str:
        if self.loras is not None:
            # An export holds the slot's scaling tensors as constants: captured with no LoRA (aot serves none).
            with self._run_lock:
                self.loras.select(None, 0.0)
        origin, notices = self._aot.warm(bucket, report=lambda text: self.board.update(bucket, origin=text))
        self.notices += notices
        return origin

    def _compile_folders(self) -> tuple[str, ...]:
        """The folders a compile writes to: inductor's cache, the compilers' temporary files, aot packages."""
        folders = [folder for _, folder in self.folders()]
        if self._aot is not None:
            folders.append(str(self._aot.store.root))
        return tuple(folders)

    def _move_cache(self, bucket: BucketKey, unwritable: caches.Unwritable) -> str:
        """Compiles (and aot packages) go to a temporary cache from now on; the notice goes on the engine and the
        bucket, and the worker reports its new folders (engine/worker/loop.py)."""
        folder, notice = caches.switch_to_temporary_compile_cache(unwritable)
        if self._aot is not None:
            from engine.pipeline import aot

            self._aot.store = aot.PackageStore(folder / "aot")
        if notice not in self.notices:
            self.notices.append(notice)
        self.folders_notice = notice
        origin = f"compiled in a temporary cache ({unwritable.what})"
        self.board.update(bucket, origin=origin)
        return origin

    def ready_info(self) -> EngineReady:
        """What a worker announces once loaded (the protocol's Ready message)."""
        return EngineReady(key=self.config.key, pid=os.getpid(), load_s=self.load_s, notices=tuple(self.notices),
                           modes=self.modes(), buckets=tuple(self.board.all()), footprint=self.footprint(),
                           preset=self.preset, batch_sizes=self.batch_sizes, folders=self.folders())

    def folders(self) -> tuple[tuple[str, str], ...]:
        """Where this process compiles and writes temporary files now (reported to the app for /system)."""
        return tuple(devices.folders_in_force(self.spec).items())

    def weights_bytes(self) -> int:
        if self._weights_bytes is None:
            seen, total = set(), 0
            for component in self.pipe.components.values():
                if isinstance(component, torch.nn.Module):
                    for tensor in (*component.parameters(), *component.buffers()):
                        if id(tensor) not in seen:
                            seen.add(id(tensor))
                            total += tensor.numel() * tensor.element_size()
            self._weights_bytes = total
        return self._weights_bytes

    def measure_peak(self) -> None:
        """One eager step at the largest bucket and the largest batch: the activation peak a call can reach
        (budgeting); the run time a request alone would take is learnt from a batch of one."""
        largest = max(self.preset.buckets, key=lambda s: s.pixels)
        request = self.warm_request(BucketKey(Mode.EAGER, largest)).replace(steps=1, request_id="footprint")
        self.spec.reset_peak_memory()
        with self._run_lock:
            start = time.perf_counter()
            self._call(self.pipe, request)
            self.measured_run = (largest, (time.perf_counter() - start) * 1000)
            if self.max_batch > 1:
                self._call(self.pipe, request, members=[request.replace(seed=i) for i in range(self.max_batch)])
        self._peak_bytes = self.spec.peak_memory_bytes()

    def footprint(self) -> Footprint:
        """What this engine holds: device memory (weights + the measured run peak; the resident memory
        where host RAM is the device) and the process's resident memory."""
        import psutil

        rss = psutil.Process().memory_info().rss
        weights = self.weights_bytes()
        if self.spec.host_memory_is_device_memory:
            device = max(rss, self._peak_bytes or 0)
        else:
            device = max(weights, self._peak_bytes or 0) + self.spec.process_overhead_bytes
        return Footprint(device_bytes=int(device), host_rss_bytes=int(rss), weights_bytes=int(weights))

    def buckets_to_warm(self) -> list[BucketKey]:
        """The configured start-up warm list, most-used size first (the preset's order)."""
        sizes = self.preset.buckets
        if self.options.warmup.sizes is not None:
            sizes = tuple(Size.parse(s) for s in self.options.warmup.sizes)
        solo = [BucketKey(m, s) for s in sizes for m in self.options.warmup.modes if m in self.modes()]
        # Then the batch sizes of the first size (the default bucket), the largest first: it serves a burst
        # in the fewest calls, and a group the largest cannot fill runs as the smaller warm ones meanwhile.
        batched = [BucketKey(m, sizes[0], b) for b in reversed(self.batch_sizes[1:])
                   for m in self.options.warmup.modes if m in self.modes() and m.compiled] if sizes else []
        return solo + batched


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
            runner.variant(Mode.AOT)
            runner._aot.remove_packages(size)
        start = time.perf_counter()
        info = runner.warm_bucket(bucket)
        rows.append({"bucket": str(bucket), "state": info.state.value, "origin": info.origin, "error": info.error,
                     "seconds": time.perf_counter() - start, "compile_s": info.compile_s})
        bar.update()
    bar.close()
    return rows


