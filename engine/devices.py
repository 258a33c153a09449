"""Devices as data: one registry says what each accelerator can do.

Every device the showcase serves (cpu, cuda incl. ROCm, mps, xpu, neuron, tpu) is one frozen
`DeviceSpec` in `registry()`: how to probe it, why it is unavailable (text shown to users, saying what
to install or do), its torch.compile backend, whether it needs static shapes, its process-group
backend and mesh device type, how to synchronize and read peak memory, and the environment it needs.
What a device cannot do (a precision, a mode) is refused or downgraded *here*, with the reason, so no
other module needs an `if device == "mps"`.

Rules the rest of the engine relies on:

* Nothing here probes at import time. `import engine.devices` imports torch (the engine needs it
  anyway) but touches no device, imports no vendor package and initialises no driver; probes run
  when `probe()` is called, and never raise: every failure becomes `Availability(False, reason)`.
* Precision policy: a request is *downgraded* (with a visible notice) only when the substitute is
  numerically the same or more precise and costs no extra memory -- the only such case is tf32 ->
  fp32 where a device has no TF32 matmuls. Everything else a device cannot do (bf16 on a GPU
  without native bf16, fp16 on TPU) is *refused* with the reason and what to pick instead, because
  silently swapping bf16 <-> fp16 changes overflow behaviour and fp16 -> fp32 doubles memory.
* `apply_precision` and `apply_environment` change process-wide state: the engine runs one device
  per worker process, so they are applied once, in that worker, before any model is built.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import DeviceUnavailable, InvalidRequest, UnsupportedCombination
from engine.protocol import Mode, Precision

logger = logging.getLogger(__name__)

AUTO = "auto"

# Weights dtype per precision. "tf32" keeps fp32 weights and only lets matmuls/convs use TF32.
DTYPES: dict[Precision, torch.dtype] = {
    Precision.FP32: torch.float32,
    Precision.TF32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}

# Environment variables (defaults; a value the user already exported always wins).
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"
# torch_tpu reads this once, when it is loaded (i.e. at `import torch` through backend autoload),
# so it only works when set in the environment a worker process *starts* with.
TPU_DEFER_AND_FUSE_VAR = "TORCH_TPU_DEFER_AND_FUSE"

NEURON_INDEX_HINT = (
    "install TorchNeuron from AWS's Neuron package index "
    "(pip install --extra-index-url https://pip.repos.neuron.amazonaws.com 'torch-neuronx>=2.13'; "
    "Python 3.12+) on a Trainium instance"
)
TPU_INSTALL_HINT = "pip install 'torch-tpu>=0.2.0' on a Cloud TPU VM (Linux x86_64, torch 2.11-2.15)"
TORCH_BUILDS_HINT = "https://pytorch.org/get-started/locally/"


# ----------------------------------------------------------------------------------------------
# Result types
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""  # when unavailable: why, and what to install or do


@dataclass(frozen=True)
class PrecisionPlan:
    precision: str  # what will actually run (may differ from what was asked: see notices)
    dtype: torch.dtype  # weights / activations dtype
    allow_tf32: bool  # fp32 matmuls and convs may use TF32
    notices: tuple[str, ...] = ()  # shown to users (e.g. a downgrade)
    requested: str = ""  # what the user asked for

    @property
    def downgraded(self) -> bool:
        return bool(self.requested) and self.requested != self.precision


def _plan(requested: str, effective: str | None = None, *notices: str) -> PrecisionPlan:
    requested = Precision(requested)
    effective = Precision(effective or requested)
    return PrecisionPlan(
        precision=effective,
        dtype=DTYPES[effective],
        allow_tf32=effective == "tf32",
        notices=tuple(n for n in notices if n),
        requested=requested,
    )


class _Refusal(Exception):
    """Raised inside a precision rule; plan_precision turns it into UnsupportedCombination."""

    def __init__(self, reason: str, instead: tuple[str, ...]):
        super().__init__(reason)
        self.reason = reason
        self.instead = instead


# ----------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # registry key: "cpu", "cuda", "mps", "xpu", "neuron", "tpu"
    label: str  # human label
    torch_device: str  # what .to() takes
    compile_backend: str  # "inductor" | "neuron" | "tpu"
    static_shapes: bool  # compile with dynamic=False; every new size compiles once
    dist_backend: str  # process-group backend for tensor parallel ("" = none)
    mesh_device_type: str  # DeviceMesh device type ("" = none)
    modes: tuple[str, ...]  # modes it can run
    tensor_parallel: bool = True  # whether dist_backend/mesh_device_type can run a TP group
    # What peak_memory_bytes() reports (shown in describe()).
    memory_source: str = ""
    inductor_flags_default: bool = False  # flux-fast's inductor flags on unless the user says otherwise
    cuda_graphs: bool = False  # torch.compile's reduce-overhead / max-autotune replay CUDA graphs here
    # Square matmul sizes that reach this device's peak rate (the bench's roofline probe).
    matmul_probe_sizes: tuple[int, ...] = (256, 512, 1024)
    matmul_probe_iters: int = 20
    # Hooks: the few things that really differ between devices. Plain functions, so a spec
    # stays data and a test can build a spec with fakes.
    probe_fn: Callable[[], Availability] = field(
        default=lambda: Availability(True), repr=False, compare=False
    )
    precision_fn: Callable[[str], PrecisionPlan] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    sync_fn: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    reset_peak_fn: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    peak_fn: Callable[[], int | None] | None = field(default=None, repr=False, compare=False)
    memory_source_fn: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    mode_notes_fn: Callable[[str], tuple[str, ...]] | None = field(default=None, repr=False, compare=False)
    # (free, total) bytes of the device's memory, None where the device reports nothing.
    memory_info_fn: Callable[[], tuple[int, int] | None] | None = field(default=None, repr=False, compare=False)
    device_name_fn: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)

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
        fn = self.sync_fn or (lambda: _module_sync(self.name))
        fn()

    def reset_peak_memory(self) -> None:
        fn = self.reset_peak_fn or (lambda: _module_reset_peak(self.name))
        try:
            fn()
        except Exception:  # memory stats are best-effort: never fail a request over them
            logger.debug("reset_peak_memory on %s failed", self.name, exc_info=True)

    def peak_memory_bytes(self) -> int | None:
        """Peak bytes since reset_peak_memory(); None where the device reports nothing."""
        fn = self.peak_fn or (lambda: _module_peak(self.name))
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
        fn = self.memory_info_fn or (lambda: _module_mem_get_info(self.name))
        try:
            value = fn()
        except Exception:
            logger.debug("memory_info on %s failed", self.name, exc_info=True)
            return None
        return (int(value[0]), int(value[1])) if value else None

    def device_name(self) -> str | None:
        """The hardware's own name (e.g. the GPU model), None where unknown. Never raises."""
        try:
            return self.device_name_fn() if self.device_name_fn else None
        except Exception:
            return None

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device (after an out-of-memory error). Never raises."""
        mod = _device_module(self.name)
        try:
            if mod is not None and hasattr(mod, "empty_cache"):
                mod.empty_cache()
        except Exception:
            logger.debug("empty_cache on %s failed", self.name, exc_info=True)

    # -- environment ----------------------------------------------------------------------------
    def environment(self, cache_dir: Path, mode: str | None = None) -> dict[str, str]:
        """Environment variables this device needs, as defaults (the user's exports win).

        Compile caches go to the persistent cache folder: inductor's default is under /tmp and
        Neuron's NEFF cache is wiped on reboot, so every restart would recompile for minutes.
        With mode="defer-and-fuse" on tpu this includes TORCH_TPU_DEFER_AND_FUSE=1, which only
        takes effect in a process *started* with it (see mode_environment/worker_environment).
        """
        cache_dir = Path(cache_dir)
        env: dict[str, str] = {}
        if self.compile_backend == "inductor":
            env[INDUCTOR_CACHE_VAR] = str(cache_dir / "inductor")
        if self.name == "neuron":
            env[NEFF_CACHE_VAR] = str(cache_dir / "neff")
        env.update(mode_environment(self, mode) if mode else {})
        return env

    # -- report ---------------------------------------------------------------------------------
    def describe(self) -> dict:
        """JSON-able: every field, plus available/reason (this probes the device)."""
        avail = self.probe()
        try:
            from engine.settings import cache_dir

            env = self.environment(cache_dir())
        except Exception:  # a bad cache setting must not hide the device list
            env = {}
        return {
            "name": self.name,
            "label": self.label,
            "torch_device": self.torch_device,
            "compile_backend": self.compile_backend,
            "static_shapes": self.static_shapes,
            "dist_backend": self.dist_backend,
            "mesh_device_type": self.mesh_device_type,
            "tensor_parallel": self.tensor_parallel,
            "modes": list(self.modes),
            "precisions": precision_support(self) if avail.available else None,
            "memory": self.describe_memory(),
            "environment": env,
            "available": avail.available,
            "reason": avail.reason,
        }


# ----------------------------------------------------------------------------------------------
# Generic helpers (through the device module torch.<name>, then torch.accelerator)
# ----------------------------------------------------------------------------------------------


def _device_module(name: str):
    """torch.<name> if a backend registered it (torch.cuda, torch.xpu, torch.neuron, torch.tpu)."""
    return getattr(torch, name, None)


def _registered_accelerator() -> str | None:
    """The accelerator type torch knows of (e.g. "cuda", "neuron", "tpu"), without init.

    `torch.accelerator.current_accelerator()` does not poison fork and does not call the device
    module's is_available() (torch_tpu's raises on torch >= 2.11).
    """
    acc_api = getattr(torch, "accelerator", None)
    if acc_api is None or not hasattr(acc_api, "current_accelerator"):
        return None
    try:
        acc = acc_api.current_accelerator()
    except Exception:
        return None
    return acc.type if acc is not None else None


def _module_sync(name: str) -> None:
    # The device module first: torch.accelerator.synchronize() needs a C++ device guard with
    # stream support, which a Python-registered PrivateUse1 backend does not have.
    mod = _device_module(name)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()
        return
    if _registered_accelerator() == name:
        torch.accelerator.synchronize()


def _module_reset_peak(name: str) -> None:
    mod = _device_module(name)
    if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
        mod.reset_peak_memory_stats()
    elif _registered_accelerator() == name and hasattr(torch.accelerator, "reset_peak_memory_stats"):
        torch.accelerator.reset_peak_memory_stats()


def _module_mem_get_info(name: str) -> tuple[int, int] | None:
    mod = _device_module(name)
    if mod is not None and hasattr(mod, "mem_get_info"):
        return tuple(mod.mem_get_info())
    return None


def _module_peak(name: str) -> int | None:
    mod = _device_module(name)
    if mod is not None and hasattr(mod, "max_memory_allocated"):
        return int(mod.max_memory_allocated())
    if _registered_accelerator() == name and hasattr(torch.accelerator, "max_memory_allocated"):
        return int(torch.accelerator.max_memory_allocated())
    return None


# ----------------------------------------------------------------------------------------------
# cpu
# ----------------------------------------------------------------------------------------------

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+)\s+kB", _PROC_STATUS.read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _cpu_can_reset_peak() -> bool:
    return sys.platform.startswith("linux") and _PROC_STATUS.exists() and os.access(_PROC_CLEAR_REFS, os.W_OK)


def _cpu_reset_peak() -> None:
    # Linux: writing "5" to clear_refs resets the process's peak RSS (VmHWM), so the next
    # reading is the peak of this run rather than of the whole process lifetime.
    if _cpu_can_reset_peak():
        _PROC_CLEAR_REFS.write_text("5")


def _cpu_peak() -> int | None:
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except Exception:
        return None
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024  # bytes on macOS, kB elsewhere


def _cpu_memory_info() -> tuple[int, int] | None:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


def _cpu_memory_source() -> str:
    if _cpu_can_reset_peak():
        return "process peak RSS (Linux VmHWM, reset before each run); includes everything the process holds"
    return "process peak RSS since start (this OS cannot reset it); includes everything the process holds"


def _cpu_precision(precision: str) -> PrecisionPlan:
    if precision == "tf32":
        return _plan(
            "tf32", "fp32", "CPU has no TF32 matmuls: running full fp32 (same result as fp32, no speed-up)."
        )
    if precision == "fp16":
        # It runs (conv, GroupNorm, SDPA all have fp16 CPU kernels in torch >= 2.1) but most CPUs
        # have no fp16 arithmetic, so it is emulated and slow.
        return _plan(
            "fp16",
            None,
            "fp16 on CPU is emulated on most processors and usually slower than bf16 or fp32.",
        )
    return _plan(precision)


def _cpu_mode_notes(mode: str) -> tuple[str, ...]:
    if mode in ("compile", "regional") and not _find_cxx():
        return (
            "torch.compile (inductor) on CPU needs a C++ compiler and none was found on PATH: "
            "install g++ (build-essential) or set CXX, or compiling will fail.",
        )
    return ()


def _find_cxx() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return cxx
    for candidate in ("g++", "clang++", "c++"):
        if shutil.which(candidate):
            return candidate
    return None


# ----------------------------------------------------------------------------------------------
# cuda (NVIDIA CUDA and AMD ROCm: a ROCm build of torch is driven through torch.cuda)
# ----------------------------------------------------------------------------------------------


def _is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def _cuda_label() -> str:
    if _is_rocm():
        return "AMD GPU (ROCm)"
    if getattr(torch.version, "cuda", None):
        return "NVIDIA GPU (CUDA)"
    return "NVIDIA / AMD GPU (CUDA / ROCm)"


def _cuda_probe() -> Availability:
    cuda_ver, hip_ver = getattr(torch.version, "cuda", None), getattr(torch.version, "hip", None)
    if not cuda_ver and not hip_ver:
        return Availability(
            False,
            f"this PyTorch build ({torch.__version__}) has no CUDA or ROCm support: install a CUDA or "
            f"ROCm build of torch ({TORCH_BUILDS_HINT})",
        )
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return Availability(True)
    stack = f"ROCm {hip_ver}" if hip_ver else f"CUDA {cuda_ver}"
    return Availability(
        False,
        f"PyTorch is built for {stack} but no GPU is visible: check the driver "
        f"({'rocm-smi' if hip_ver else 'nvidia-smi'}) and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES",
    )


def _cuda_name() -> str:
    try:
        return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:
        return "this GPU"


def _cuda_precision(precision: str) -> PrecisionPlan:
    if precision == "tf32":
        if _is_rocm():
            # PyTorch honours TF32 on ROCm only on MI300-class GPUs (gfx94x) and newer.
            arch = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "gcnArchName", "")
            if arch.startswith(("gfx94", "gfx95")):
                return _plan("tf32")
            return _plan(
                "tf32",
                "fp32",
                f"{_cuda_name()} ({arch or 'unknown arch'}) has no TF32 in PyTorch (ROCm supports it on "
                "MI300-class gfx94x and newer): running full fp32.",
            )
        major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
        if major >= 8:
            return _plan("tf32")
        return _plan(
            "tf32",
            "fp32",
            f"TF32 needs an Ampere or newer GPU (compute capability 8.0+); {_cuda_name()} is "
            f"sm_{major}{minor}: running full fp32.",
        )
    if precision == "bf16":
        try:  # torch >= 2.3 would otherwise count slow emulation on pre-Ampere GPUs as support
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:
            native = torch.cuda.is_bf16_supported()
        if not native:
            raise _Refusal(
                f"{_cuda_name()} has no native bf16 (needs compute capability 8.0+)", ("fp16", "fp32")
            )
    return _plan(precision)


def _mps_memory_info() -> tuple[int, int] | None:
    total = int(torch.mps.recommended_max_memory())
    return max(0, total - int(torch.mps.driver_allocated_memory())), total


def _cuda_memory_source() -> str:
    return "torch.cuda.max_memory_allocated (tensors only, excludes the caching allocator's reserve)"


# ----------------------------------------------------------------------------------------------
# mps (Apple silicon)
# ----------------------------------------------------------------------------------------------


def _mps_probe() -> Availability:
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_built():
        return Availability(
            False,
            "this PyTorch build has no MPS support: MPS needs the macOS build of torch on an "
            "Apple silicon Mac (macOS 12.3+)",
        )
    if not mps.is_available():
        return Availability(
            False, "PyTorch has MPS but the GPU is not available: needs macOS 12.3+ on Apple silicon"
        )
    return Availability(True)


def _mps_bf16_ok() -> bool:
    try:
        (torch.ones(2, dtype=torch.bfloat16, device="mps") * 2).cpu()
        return True
    except Exception:
        return False


def _mps_precision(precision: str) -> PrecisionPlan:
    if precision == "tf32":
        return _plan("tf32", "fp32", "Apple GPUs have no TF32 matmuls: running full fp32.")
    if precision == "bf16" and not _mps_bf16_ok():
        raise _Refusal("bf16 on MPS needs macOS 14 (Sonoma) or newer and a recent torch", ("fp16", "fp32"))
    return _plan(precision)


def _mps_sync() -> None:
    torch.mps.synchronize()


def _mps_peak() -> int | None:
    # MPS keeps no peak counter; the memory still allocated when the run ends is what it has.
    return int(torch.mps.current_allocated_memory())


def _mps_mode_notes(mode: str) -> tuple[str, ...]:
    if mode in ("compile", "regional"):
        return ("torch.compile on MPS is a prototype in PyTorch; if it fails, use eager.",)
    return ()


# ----------------------------------------------------------------------------------------------
# xpu (Intel GPUs)
# ----------------------------------------------------------------------------------------------


def _xpu_probe() -> Availability:
    xpu = getattr(torch, "xpu", None)
    compiled = bool(xpu is not None and getattr(xpu, "_is_compiled", lambda: False)())
    if not compiled:
        return Availability(
            False,
            "this PyTorch build has no XPU support: install the XPU build of torch "
            "(pip install torch --index-url https://download.pytorch.org/whl/xpu)",
        )
    if xpu.is_available() and xpu.device_count() > 0:
        return Availability(True)
    return Availability(
        False,
        "PyTorch has XPU support but no Intel GPU is visible: check the GPU driver / Level Zero runtime",
    )


def _xpu_precision(precision: str) -> PrecisionPlan:
    # tf32: torch.set_float32_matmul_precision("high") lets oneDNN use TF32 on Intel GPUs that
    # have it (Data Center GPU Max); elsewhere oneDNN runs fp32, so there is nothing to refuse.
    if precision == "bf16" and not torch.xpu.is_bf16_supported():
        raise _Refusal("this Intel GPU has no bf16 support", ("fp16", "fp32"))
    return _plan(precision)


# ----------------------------------------------------------------------------------------------
# neuron (AWS Trainium, TorchNeuron / torch_neuronx)
# ----------------------------------------------------------------------------------------------


def _accelerator_probe(name: str) -> Availability | None:
    """If torch already has `name` as its accelerator (backend autoload, or a test's fake
    device), ask its device module; None if `name` is not registered."""
    if _registered_accelerator() != name:
        return None
    mod = _device_module(name)
    count = None
    if mod is not None and hasattr(mod, "device_count"):
        try:
            count = int(mod.device_count())
        except Exception:
            count = None  # registration alone means the backend found devices
    if count == 0:
        return Availability(False, f"the {name} backend is registered but reports no devices")
    return Availability(True)


def _neuron_probe() -> Availability:
    found = _accelerator_probe("neuron")
    if found is not None:
        return found
    # Not registered: backend autoload is off (TORCH_DEVICE_BACKEND_AUTOLOAD=0) or the package is
    # absent/broken. Import it to find out; find_spec() is not enough: PyPI's torch-neuronx is a
    # 1.4 kB placeholder that find_spec finds and whose import raises "WRONG PACKAGE".
    try:
        importlib.import_module("torch_neuronx")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_neuronx":
            return Availability(False, f"torch-neuronx is not installed: {NEURON_INDEX_HINT}")
        return Availability(False, f"importing torch_neuronx failed ({exc}); {NEURON_INDEX_HINT}")
    except (Exception, SystemExit) as exc:  # the PyPI placeholder raises on import
        text = str(exc)
        if "WRONG PACKAGE" in text.upper() or _is_placeholder_neuronx():
            return Availability(
                False,
                "the torch-neuronx on PyPI is a placeholder, not TorchNeuron (its import fails: "
                f"{text.strip()[:120] or type(exc).__name__}): pip uninstall torch-neuronx, then {NEURON_INDEX_HINT}",
            )
        return Availability(
            False, f"importing torch_neuronx failed ({type(exc).__name__}: {text}); {NEURON_INDEX_HINT}"
        )
    found = _accelerator_probe("neuron")
    if found is not None:
        return found
    return Availability(
        False,
        "torch_neuronx is installed but registered no neuron device: no NeuronCore is visible "
        "(run on a Trainium instance; check the Neuron driver with `neuron-ls`)",
    )


def _is_placeholder_neuronx() -> bool:
    try:
        from importlib.metadata import version

        return version("torch-neuronx").split(".")[0] in ("0", "1")
    except Exception:
        return False


def _neuron_precision(precision: str) -> PrecisionPlan:
    if precision == "tf32":
        # TorchNeuron exposes no TF32 switch through PyTorch's matmul-precision flags.
        return _plan("tf32", "fp32", "TorchNeuron has no TF32 switch in PyTorch: running fp32.")
    return _plan(precision)  # Trainium computes fp32, bf16 and fp16


def _static_shape_notes(mode: str) -> tuple[str, ...]:
    if mode in ("compile", "regional"):
        return ("static shapes: each new image size compiles once (dynamic=False); seen sizes are reused.",)
    return ()


# ----------------------------------------------------------------------------------------------
# tpu (Google Cloud TPU, TorchTPU / torch_tpu)
# ----------------------------------------------------------------------------------------------


def _tpu_probe() -> Availability:
    # torch_tpu autoloads with `import torch` and registers "tpu" only when it finds a chip;
    # torch.tpu.is_available() raises on torch >= 2.11, so ask torch.accelerator instead.
    found = _accelerator_probe("tpu")
    if found is not None:
        return found
    if importlib.util.find_spec("torch_tpu") is None:
        return Availability(False, f"torch_tpu is not installed: {TPU_INSTALL_HINT}")
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "0":
        # Autoload is off, so it was never loaded: load it now and look again.
        try:
            importlib.import_module("torch_tpu")
        except Exception as exc:
            return Availability(False, f"importing torch_tpu failed ({type(exc).__name__}: {exc})")
        found = _accelerator_probe("tpu")
        if found is not None:
            return found
    return Availability(
        False,
        "torch_tpu is installed but registered no tpu device: no TPU chip is visible on this "
        "machine (run on a Cloud TPU VM, e.g. v5e/v6e)",
    )


def _tpu_precision(precision: str) -> PrecisionPlan:
    if precision == "tf32":
        return _plan("tf32", "fp32", "TPUs have no TF32: running fp32.")
    if precision == "fp16":
        raise _Refusal("TPUs have no fp16 arithmetic (the matrix units work in bf16)", ("bf16", "fp32"))
    return _plan(precision)


def _tpu_mode_notes(mode: str) -> tuple[str, ...]:
    if mode == "defer-and-fuse":
        return (
            "defer-and-fuse is TorchTPU's optimized eager mode: ops are deferred and fused into graphs "
            "(first calls compile); it applies to the whole worker process.",
        )
    return _static_shape_notes(mode)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

_COMMON_MODES = (Mode.EAGER, Mode.COMPILE, Mode.REGIONAL)


def registry() -> dict[str, DeviceSpec]:
    """Every device, ordered best-first (the order `auto` tries): cuda, tpu, neuron, xpu, mps, cpu.

    Built on each call (cheap, probes nothing) so labels reflect the torch build in use.
    """
    specs = [
        DeviceSpec(
            name="cuda",
            label=_cuda_label(),
            torch_device="cuda",
            compile_backend="inductor",
            static_shapes=False,
            dist_backend="nccl",  # RCCL on ROCm, under the same name
            mesh_device_type="cuda",
            modes=_COMMON_MODES,
            memory_source=_cuda_memory_source(),
            inductor_flags_default=True,
            cuda_graphs=True,
            matmul_probe_sizes=(4096, 8192, 16384),
            probe_fn=_cuda_probe,
            precision_fn=_cuda_precision,
            device_name_fn=_cuda_name,
        ),
        DeviceSpec(
            name="tpu",
            label="Google Cloud TPU (TorchTPU)",
            torch_device="tpu",
            compile_backend="tpu",
            static_shapes=True,
            dist_backend="tpu_dist",
            mesh_device_type="tpu",
            modes=(*_COMMON_MODES, Mode.DEFER_AND_FUSE),
            memory_source="torch.tpu.max_memory_allocated where torch_tpu provides it, else not reported",
            probe_fn=_tpu_probe,
            precision_fn=_tpu_precision,
            mode_notes_fn=_tpu_mode_notes,
        ),
        DeviceSpec(
            name="neuron",
            label="AWS Trainium (TorchNeuron)",
            torch_device="neuron",
            compile_backend="neuron",
            static_shapes=True,
            dist_backend="neuron",
            mesh_device_type="neuron",
            modes=_COMMON_MODES,
            memory_source="torch.neuron.max_memory_allocated where torch_neuronx provides it, else not reported",
            probe_fn=_neuron_probe,
            precision_fn=_neuron_precision,
            mode_notes_fn=_static_shape_notes,
        ),
        DeviceSpec(
            name="xpu",
            label="Intel GPU (XPU)",
            torch_device="xpu",
            compile_backend="inductor",
            static_shapes=False,
            dist_backend="xccl",
            mesh_device_type="xpu",
            modes=_COMMON_MODES,
            memory_source="torch.xpu.max_memory_allocated (tensors only)",
            probe_fn=_xpu_probe,
            precision_fn=_xpu_precision,
        ),
        DeviceSpec(
            name="mps",
            label="Apple silicon GPU (MPS)",
            torch_device="mps",
            compile_backend="inductor",
            static_shapes=False,
            # No collective backend drives MPS tensors: tensor parallel is not offered.
            dist_backend="",
            mesh_device_type="",
            tensor_parallel=False,
            modes=_COMMON_MODES,
            memory_source="torch.mps.current_allocated_memory at the end of the run (MPS keeps no peak)",
            probe_fn=_mps_probe,
            precision_fn=_mps_precision,
            sync_fn=_mps_sync,
            reset_peak_fn=lambda: None,
            peak_fn=_mps_peak,
            mode_notes_fn=_mps_mode_notes,
            memory_info_fn=_mps_memory_info,
        ),
        DeviceSpec(
            name="cpu",
            label="CPU",
            torch_device="cpu",
            compile_backend="inductor",
            static_shapes=False,
            dist_backend="gloo",  # CPU tensor parallel is a correctness harness, not a speed-up
            mesh_device_type="cpu",
            modes=_COMMON_MODES,
            probe_fn=lambda: Availability(True),
            precision_fn=_cpu_precision,
            sync_fn=lambda: None,
            reset_peak_fn=_cpu_reset_peak,
            peak_fn=_cpu_peak,
            memory_source_fn=_cpu_memory_source,
            mode_notes_fn=_cpu_mode_notes,
            matmul_probe_iters=5,  # a CPU matmul takes milliseconds, not microseconds
            memory_info_fn=_cpu_memory_info,
            device_name_fn=_cpu_name,
        ),
    ]
    return {spec.name: spec for spec in specs}


def device_names() -> tuple[str, ...]:
    """Valid --device values, "auto" first."""
    return (AUTO, *registry())


def get_device(name: str) -> DeviceSpec:
    """The spec for `name` (no probing). Unknown -> InvalidRequest listing the valid names."""
    key = str(name).strip().lower()
    specs = registry()
    if key in specs:
        return specs[key]
    if key == AUTO:
        return resolve_device(AUTO)
    raise InvalidRequest(f"unknown device {name!r}: choose one of {', '.join(device_names())}")


def resolve_device(name: str) -> DeviceSpec:
    """`auto` -> the best available device; a named device -> its spec if available.

    Raises DeviceUnavailable (with the probe's reason) for an absent device, InvalidRequest for an
    unknown name.
    """
    key = str(name).strip().lower()
    if key == AUTO:
        for spec in registry().values():
            if spec.probe().available:
                return spec
        raise DeviceUnavailable("no device is available, not even cpu")  # unreachable: cpu always is
    spec = get_device(key)
    avail = spec.probe()
    if not avail.available:
        raise DeviceUnavailable(f"{spec.label} [{spec.name}] is not available: {avail.reason}")
    return spec


# ----------------------------------------------------------------------------------------------
# Precision and modes
# ----------------------------------------------------------------------------------------------


def plan_precision(spec: DeviceSpec, precision: str) -> PrecisionPlan:
    """What `precision` becomes on `spec`: accepted, downgraded with a notice, or refused.

    Refusal -> UnsupportedCombination naming the reason and what to pick instead.
    """
    key = Precision.parse(precision, "precision")
    rule = spec.precision_fn or _plan
    try:
        return rule(key)
    except _Refusal as refusal:
        instead = " or ".join(refusal.instead)
        raise UnsupportedCombination(
            f"{key} is not supported on {spec.label} [{spec.name}]: {refusal.reason}. Choose {instead} instead."
        ) from None


def precision_support(spec: DeviceSpec) -> dict[str, dict]:
    """For each precision: what it runs as on `spec` ("ok", "downgraded" or "refused", with the
    notice or reason). Rules may query the device, so call it for available devices only."""
    table: dict[str, dict] = {}
    for precision in Precision:
        try:
            plan = plan_precision(spec, precision)
        except UnsupportedCombination as err:
            table[precision] = {"status": "refused", "runs_as": None, "reason": str(err)}
        except Exception as err:  # a failing device query must not break the report
            table[precision] = {
                "status": "unknown",
                "runs_as": None,
                "reason": f"{type(err).__name__}: {err}",
            }
        else:
            status = "downgraded" if plan.downgraded else "ok"
            table[precision] = {"status": status, "runs_as": plan.precision, "notices": list(plan.notices)}
    return table


def check_mode(spec: DeviceSpec, mode: str) -> tuple[str, ...]:
    """Notices for running `mode` on `spec`; raises if the device cannot run it at all."""
    key = Mode.parse(mode, "mode")
    if key not in spec.modes:
        if key == "defer-and-fuse":
            reason = (
                "defer-and-fuse is TorchTPU's optimized eager mode and exists only on tpu; "
                f"on {spec.name} use compile or regional for fused graphs"
            )
        else:
            reason = f"{spec.name} runs only {', '.join(spec.modes)}"
        raise UnsupportedCombination(
            f"mode {key!r} is not supported on {spec.label} [{spec.name}]: {reason}."
        )
    return spec.mode_notes_fn(key) if spec.mode_notes_fn else ()


def apply_precision(plan: PrecisionPlan) -> None:
    """Set this process's fp32 matmul/conv math for `plan` (TF32 on or off).

    Uses torch.set_float32_matmul_precision (covers cuBLAS, oneDNN/XPU) plus the cuDNN conv flag,
    i.e. only the "legacy" API family: since torch 2.9, mixing it with the per-backend
    `fp32_precision` properties makes later reads raise ("mix of the legacy and new APIs").
    "fp32" means IEEE fp32 everywhere, including convolutions (cuDNN's default would be TF32).
    """
    torch.set_float32_matmul_precision("high" if plan.allow_tf32 else "highest")
    with contextlib.suppress(Exception):
        torch.backends.cudnn.allow_tf32 = bool(plan.allow_tf32)


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def mode_environment(spec: DeviceSpec, mode: str | None) -> dict[str, str]:
    """Variables a *worker process* must be started with for `mode` (forced, not defaults).

    Only tpu defer-and-fuse needs one: torch_tpu reads TORCH_TPU_DEFER_AND_FUSE once at start-up.
    """
    if spec.name == "tpu" and mode == "defer-and-fuse":
        return {TPU_DEFER_AND_FUSE_VAR: "1"}
    return {}


def worker_environment(
    spec: DeviceSpec, cache_dir: Path, mode: str | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The complete environment for a worker process serving `spec` in `mode`.

    `base` (default os.environ) + the device's defaults where unset + the mode's forced variables.
    A tpu worker for any other mode gets TORCH_TPU_DEFER_AND_FUSE removed, so "eager" on tpu is
    really strict eager even when the parent exported the variable.
    """
    env = dict(os.environ if base is None else base)
    for key, value in spec.environment(cache_dir).items():
        env.setdefault(key, value)
    forced = mode_environment(spec, mode)
    if spec.name == "tpu" and TPU_DEFER_AND_FUSE_VAR not in forced:
        env.pop(TPU_DEFER_AND_FUSE_VAR, None)
    env.update(forced)
    return env


def apply_environment(spec: DeviceSpec, cache_dir: Path, mode: str | None = None) -> dict[str, str]:
    """os.environ.setdefault for spec.environment(); create the cache folders; return what is in force.

    Call before the first compile (inductor and Neuron read their cache dirs lazily). A mode
    variable (TORCH_TPU_DEFER_AND_FUSE) set here only helps a process that has not loaded
    torch_tpu yet: in a running process use enter_eager_mode().
    """
    wanted = spec.environment(cache_dir, mode=mode)
    in_force: dict[str, str] = {}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
        in_force[key] = os.environ[key]
        if key.endswith("_DIR"):
            try:
                Path(in_force[key]).mkdir(parents=True, exist_ok=True)
            except OSError:
                logger.warning("could not create %s=%s", key, in_force[key])
    return in_force


# TorchTPU's set_eager_mode is a context manager; when it is the only switch, the entered manager
# is kept here so it is not garbage-collected (which would restore the previous mode).
_ACTIVE_EAGER_MODE: list = []


def enter_eager_mode(spec: DeviceSpec, mode: str) -> str | None:
    """Switch TorchTPU's eager mode for this process: DEFER_AND_FUSE for "defer-and-fuse",
    DEFER_NEVER (strict eager) for "eager". Returns the mode name set; None (no-op) on other
    devices and for compile/regional (compiled graphs do not depend on it).
    """
    if spec.name != "tpu" or mode not in ("eager", "defer-and-fuse"):
        return None
    tpu = _device_module("tpu")
    enum = getattr(tpu, "EagerMode", None)
    if enum is None:
        if mode == "eager":
            return None
        raise UnsupportedCombination(
            "this torch_tpu has no torch.tpu.EagerMode, so defer-and-fuse cannot be enabled: "
            "install torch-tpu>=0.2.0 or start the worker with TORCH_TPU_DEFER_AND_FUSE=1"
        )
    wanted_name = "DEFER_AND_FUSE" if mode == "defer-and-fuse" else "DEFER_NEVER"
    wanted = getattr(enum, wanted_name)
    if hasattr(tpu, "eager_mode"):
        tpu.eager_mode = wanted
    elif hasattr(tpu, "set_eager_mode"):
        result = tpu.set_eager_mode(wanted)
        if hasattr(result, "__enter__"):
            for old in reversed(_ACTIVE_EAGER_MODE):  # leave the previous switch first
                old.__exit__(None, None, None)
            _ACTIVE_EAGER_MODE.clear()
            result.__enter__()
            _ACTIVE_EAGER_MODE.append(result)
    else:
        raise UnsupportedCombination("this torch_tpu offers no way to set the eager mode at runtime")
    return wanted_name


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def devices_report() -> list[dict]:
    """What `python -m engine devices --json` prints: every device, best-first, with the reason
    an absent one is absent, and which one `auto` picks."""
    rows = [spec.describe() for spec in registry().values()]
    auto = next((row["name"] for row in rows if row["available"]), None)
    for row in rows:
        row["auto"] = row["name"] == auto
    return rows
