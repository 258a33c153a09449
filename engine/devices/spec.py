"""The device spec: one accelerator described as data plus a few plain-function hooks.

A `DeviceSpec` holds everything the rest of the engine may ask about a device: its compile backend and
shape policy, its process-group backend and mesh device type, its modes, the environment it needs, and
hooks for the few things that really are code (probe, precision rule, synchronize, memory, binding a
rank to its device, load-time adjustments for tensor parallel, the launch environment, the eager-mode
switch). Other modules read fields and call hooks; they never branch on `spec.name`. A hook left None
falls back to the generic path through `torch.<name>` / `torch.accelerator` (engine/devices/accelerator.py).

Hooks are plain functions rather than methods of per-device subclasses so a spec stays a frozen record
that a test can build with fakes, and the per-device modules (cpu.py, cuda.py, ...) stay lists of small
functions plus one `spec()` builder.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.devices import accelerator
from engine.devices.accelerator import Availability
from engine.protocol import Mode, Precision

logger = logging.getLogger(__name__)

# Weights dtype per precision. "tf32" keeps fp32 weights and only lets matmuls/convs use TF32.
DTYPES: dict[Precision, torch.dtype] = {
    Precision.FP32: torch.float32,
    Precision.TF32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}

# inductor's default cache is under /tmp: every restart would recompile for minutes.
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_CACHE_ENV = ((INDUCTOR_CACHE_VAR, "inductor"),)


# ----------------------------------------------------------------------------------------------
# Result types
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionPlan:
    precision: str  # what will actually run (may differ from what was asked: see notices)
    dtype: torch.dtype  # weights / activations dtype
    allow_tf32: bool  # fp32 matmuls and convs may use TF32
    notices: tuple[str, ...] = ()  # shown to users (e.g. a downgrade)
    requested: str = ""  # what the user asked for
    base: str = ""  # quantized precisions: the precision the weights load in before torchao quantizes them
    # Runs, but only emulated and slower than the native precisions (why, for a user): served when asked,
    # never timed by the advisor.
    emulated: str = ""

    @property
    def downgraded(self) -> bool:
        return bool(self.requested) and self.requested != self.precision


def static_shape_notes(mode: str) -> tuple[str, ...]:
    """Mode notes of a static-shape compiler (Neuron, TPU)."""
    if mode in (Mode.COMPILE, Mode.REGIONAL, Mode.AOT):
        return ("static shapes: each new image size compiles once (dynamic=False); seen sizes are reused.",)
    return ()


def make_plan(requested: str, effective: str | None = None, *notices: str) -> PrecisionPlan:
    """The plan for `requested`, running as `effective` (default: as asked), with user-visible notices."""
    requested = Precision(requested)
    effective = Precision(effective or requested)
    return PrecisionPlan(
        precision=effective,
        dtype=DTYPES[effective],
        allow_tf32=effective == Precision.TF32,
        notices=tuple(n for n in notices if n),
        requested=requested,
    )


class Refusal(Exception):
    """Raised inside a precision rule; plan_precision turns it into UnsupportedCombination."""

    def __init__(self, reason: str, instead: tuple[str, ...]):
        super().__init__(reason)
        self.reason = reason
        self.instead = instead


# ----------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------


def _hook(default=None):
    """A hook field: not shown in repr, not compared (two specs with the same data are the same device)."""
    return field(default=default, repr=False, compare=False)


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # registry key: "cpu", "cuda", "mps", "xpu", "neuron", "tpu"
    label: str  # human label
    torch_device: str  # what .to() takes
    compile_backend: str  # "inductor" | "neuron" | "tpu"
    static_shapes: bool  # compile with dynamic=False; every new size compiles once
    dist_backend: str  # process-group backend for tensor parallel ("" = none)
    mesh_device_type: str  # DeviceMesh device type ("" = none)
    modes: tuple[Mode, ...]  # modes it can run
    tensor_parallel: bool = True  # whether dist_backend/mesh_device_type can run a TP group
    # What peak_memory_bytes() reports (shown by report.describe_device).
    memory_source: str = ""
    inductor_flags_default: bool = False  # flux-fast's inductor flags on unless the user says otherwise
    cuda_graphs: bool = False  # torch.compile's reduce-overhead / max-autotune replay CUDA graphs here
    # AOTInductor packages (mode aot): a device that can build and load them lists Mode.AOT in `modes`;
    # one that cannot says why here (its own ahead-of-time path, or an untested backend).
    aot_refusal: str = ""
    # Kernel families of diffusers' attention backends this device can run (engine/pipeline/attention.py maps each
    # backend to one): "sdpa" everywhere; fused SDPA kernels, flash-attn, sage, xformers, hub kernels on GPUs.
    attention_kernels: tuple[str, ...] = ("sdpa",)
    # The families whose op diffusers' context-parallel path (Ulysses / Ring) can call here; None: the same
    # as attention_kernels.
    context_parallel_kernels: tuple[str, ...] | None = None
    # Quantized precisions (torchao, on the denoiser's linear layers): the precision everything loads in
    # before quantizing (fp32 on cpu: bf16 matmuls are slower there), the quantized precisions this device
    # runs (the others are refused with `quant_refusal`), and the compute capability float8 needs.
    quant_base: Precision = Precision.FP32
    quantized_precisions: tuple[Precision, ...] = ()
    quant_refusal: str = "torchao's quantized kernels are not set up for this device here"
    float8_min_capability: tuple[int, int] | None = None
    # Square matmul sizes that reach this device's peak rate (the bench's roofline probe).
    matmul_probe_sizes: tuple[int, ...] = (256, 512, 1024)
    matmul_probe_iters: int = 20
    # (variable, folder under the cache dir): compile caches kept across restarts. Defaults only: a
    # value the user exported wins.
    cache_env: tuple[tuple[str, str], ...] = ()
    # (mode, variable, value): forced in a worker process started for that mode, removed from workers
    # started for any other mode (a runtime that reads it once at start-up cannot be switched later).
    mode_env: tuple[tuple[Mode, str, str], ...] = ()
    # Hosting (engine/serving/manager.py keeps each device's engines within a budget):
    # - the default budget is `budget_share` of the device's free memory at start-up (of its total
    #   where host RAM is the device: other programs come and go, the app must leave room for them);
    # - at most `max_engines` engines at once (Neuron and TPU runtimes give a core/chip to one process);
    # - before an engine has run, a process on this device is assumed to cost `process_overhead_bytes`
    #   beyond its weights (cpu: torch + diffusers in a worker's resident memory; GPUs: the context).
    host_memory_is_device_memory: bool = False
    budget_share: float = 0.9
    max_engines: int = 3
    process_overhead_bytes: int = 512 * 2**20
    # Batching (engine/pipeline/batching.py): the default --max-batch, the most requests one pipeline call serves.
    # Each batch size is one more compiled graph per bucket, and the budget counts the activations of the
    # largest: where a compile takes minutes (static-shape devices) or memory is tight, keep it small.
    max_batch: int = 4
    # A batch's images decoded one at a time, each result sent as soon as it is ready, so the web server
    # delivers the first while the rest decode. Only where a batched decode costs what separate ones do (a
    # CPU: convolutions gain nothing from the batch); a GPU decodes a batch faster than its images apart.
    decode_batch_apart: bool = False
    # Memory levers (engine/pipeline/memory.py): copy streams that let group offloading prefetch the next
    # group while one computes (diffusers' use_stream takes CUDA or XPU streams only).
    offload_streams: bool = False
    # Ray engines (engine/fleet/): the node resource an engine of this device holds one unit of. Ray's own
    # accelerator resources where Ray detects the chip (GPU, neuron_cores, TPU), else a custom resource the
    # host declares on the nodes that have the device (`ray start --resources '{"showcase-mps": 1}'`).
    ray_resource: str = "CPU"

    # Hooks: the few things that really differ between devices.
    probe_fn: Callable[[], Availability] = _hook(lambda: Availability(True))
    precision_fn: Callable[[str], PrecisionPlan] | None = _hook()
    sync_fn: Callable[[], None] | None = _hook()
    reset_peak_fn: Callable[[], None] | None = _hook()
    peak_fn: Callable[[], int | None] | None = _hook()
    memory_source_fn: Callable[[], str] | None = _hook()
    mode_notes_fn: Callable[[str], tuple[str, ...]] | None = _hook()
    # (free, total) bytes of the device's memory, None where the device reports nothing.
    memory_info_fn: Callable[[], tuple[int, int] | None] | None = _hook()
    device_name_fn: Callable[[], str | None] | None = _hook()
    # local_rank -> this rank's device (None: set_device(local_rank), as for cuda and xpu).
    bind_fn: Callable[[int], torch.device] | None = _hook()
    # () -> context manager around a tensor-parallel model load or a context-parallel enable_parallelism
    # (None: nothing to adjust).
    tp_load_context_fn: Callable[[], AbstractContextManager] | None = _hook()
    # (nnodes, nproc_per_node, set_env) -> variables a multi-process launch needs (None: none).
    launch_env_fn: Callable[[int, int, Callable | None], dict[str, str]] | None = _hook()
    # mode -> the runtime eager mode switched to in this process, None if nothing to switch (None: no switch).
    eager_mode_fn: Callable[[str], str | None] | None = _hook()
    # () -> what a compiled AOTInductor package is bound to on this device (CPU vector ISA; GPU model,
    # compute capability and CUDA/ROCm version): part of every package key (None: the device's name only).
    aot_target_fn: Callable[[], str] | None = _hook()
    # () -> (major, minor) compute capability, None where the notion does not apply (attention backends).
    capability_fn: Callable[[], tuple[int, int] | None] | None = _hook()

    # -- availability ---------------------------------------------------------------------------
    def probe(self) -> Availability:
        """Is the device usable now? Never raises; the reason says what to install or do."""
        try:
            result = self.probe_fn()
        except Exception as exc:  # a probe must never take the app down
            logger.debug("probe for %s raised", self.name, exc_info=True)
            return Availability(False, f"probing {self.name} failed: {type(exc).__name__}: {exc}")
        return result if isinstance(result, Availability) else Availability(bool(result))

    # -- runtime helpers ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for queued work (timings are only honest after this). No-op on cpu."""
        fn = self.sync_fn or (lambda: accelerator.module_sync(self.name))
        fn()

    def reset_peak_memory(self) -> None:
        fn = self.reset_peak_fn or (lambda: accelerator.module_reset_peak(self.name))
        try:
            fn()
        except Exception:  # memory stats are best-effort: never fail a request over them
            logger.debug("reset_peak_memory on %s failed", self.name, exc_info=True)

    def peak_memory_bytes(self) -> int | None:
        """Peak bytes since reset_peak_memory(); None where the device reports nothing."""
        fn = self.peak_fn or (lambda: accelerator.module_peak(self.name))
        try:
            value = fn()
        except Exception:
            logger.debug("peak_memory_bytes on %s failed", self.name, exc_info=True)
            return None
        return int(value) if value is not None else None

    def describe_memory(self) -> str:
        return self.memory_source_fn() if self.memory_source_fn else self.memory_source

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory (host RAM for cpu); None where unknown. Never raises."""
        fn = self.memory_info_fn or (lambda: accelerator.module_mem_get_info(self.name))
        try:
            value = fn()
        except Exception:
            logger.debug("memory_info on %s failed", self.name, exc_info=True)
            return None
        return (int(value[0]), int(value[1])) if value else None

    def default_memory_budget(self) -> tuple[int | None, str]:
        """(bytes, how they were chosen): the share of free memory (of total RAM on cpu); None when the
        device reports no memory (then only the engine count bounds it)."""
        info = self.memory_info()
        if info is None:
            return None, f"{self.name} reports no memory: bounded by engine count only"
        free, total = info
        base, what = (total, "RAM") if self.host_memory_is_device_memory else (free, "free memory at start-up")
        return int(base * self.budget_share), f"default: {self.budget_share:.0%} of {what}"

    def ray_actor_resources(self) -> dict:
        """The Ray actor options holding one unit of `ray_resource` (Ray names CPU and GPU by options of their
        own; an actor that names no CPU still takes one to be scheduled, so it asks for none)."""
        options: dict = {"num_cpus": 1 if self.ray_resource == "CPU" else 0}
        if self.ray_resource == "GPU":
            options["num_gpus"] = 1
        elif self.ray_resource != "CPU":
            options["resources"] = {self.ray_resource: 1}
        return options

    def device_name(self) -> str | None:
        """The hardware's own name (e.g. the GPU model), None where unknown. Never raises."""
        try:
            return self.device_name_fn() if self.device_name_fn else None
        except Exception:
            return None

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device (after an out-of-memory error). Never raises."""
        mod = accelerator.device_module(self.name)
        try:
            if mod is not None and hasattr(mod, "empty_cache"):
                mod.empty_cache()
        except Exception:
            logger.debug("empty_cache on %s failed", self.name, exc_info=True)

    def aot_target(self) -> str:
        """What an AOTInductor package built here is bound to (a different target must rebuild it)."""
        return self.aot_target_fn() if self.aot_target_fn else self.name

    def capability(self) -> tuple[int, int] | None:
        """Compute capability (major, minor) where it applies; None elsewhere or when it cannot be read."""
        try:
            return self.capability_fn() if self.capability_fn else None
        except Exception:
            return None

    # -- tensor parallel ------------------------------------------------------------------------
    def bind_local_device(self, local_rank: int) -> torch.device:
        """Make this process's device current for rank `local_rank` on its node and return it.

        One process per chip: by default the local rank picks the device (set_device); cpu shares one
        device; runtimes that give each process its own core (Neuron, TPU) ignore the local rank.
        """
        if self.bind_fn is not None:
            return self.bind_fn(local_rank)
        return accelerator.bind_by_local_rank(self.name, self.torch_device, local_rank)

    def tp_load_context(self) -> AbstractContextManager:
        """Wrap a tensor-parallel model load: adjustments a library needs on this device, undone after."""
        return self.tp_load_context_fn() if self.tp_load_context_fn else contextlib.nullcontext()

    def launch_env(self, nnodes: int, nproc_per_node: int, set_env: Callable | None = None) -> dict[str, str]:
        """Variables every rank of an `nnodes` x `nproc_per_node` launch must start with ({} for most
        devices). `set_env` replaces the vendor's function (tests). Leaves os.environ as it was."""
        if self.launch_env_fn is None:
            return {}
        return self.launch_env_fn(nnodes, nproc_per_node, set_env)

    # -- environment ----------------------------------------------------------------------------
    def environment(self, cache_dir: Path, mode: str | None = None) -> dict[str, str]:
        """Environment variables this device needs (a cache folder the user exported wins, torch's default
        does not: environment.py); with `mode`, plus the variables a worker for that mode must start with."""
        # Compile caches go to the persistent cache folder: inductor's default is under /tmp and Neuron's
        # NEFF cache is wiped on reboot, so every restart would recompile for minutes.
        env = {var: str(Path(cache_dir) / folder) for var, folder in self.cache_env}
        env.update(self.mode_environment(mode))
        return env

    def mode_environment(self, mode: str | None) -> dict[str, str]:
        """Variables a *worker process* must be started with for `mode` (forced, not defaults)."""
        return {var: value for wanted, var, value in self.mode_env if mode is not None and wanted == mode}

