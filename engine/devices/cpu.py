"""cpu: always available; the reference device and the tensor-parallel correctness harness.

Its differences from an accelerator are all host-side: peak memory is the process's peak RSS (Linux
can reset it per run), compiling needs a C++ compiler, there is no TF32 and fp16 is emulated, every
rank shares the one device, and diffusers needs two adjustments to shard a model on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from engine import settings
from engine.devices.spec import INDUCTOR_CACHE_ENV, Availability, DeviceSpec, PrecisionPlan, make_plan
from engine.protocol import Mode, Precision

NAME = "cpu"

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


# -- memory -----------------------------------------------------------------------------------------


def _vm_hwm() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+)\s+kB", _PROC_STATUS.read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def can_reset_peak() -> bool:
    return sys.platform.startswith("linux") and _PROC_STATUS.exists() and os.access(_PROC_CLEAR_REFS, os.W_OK)


def reset_peak() -> None:
    # Linux: writing "5" to clear_refs resets the process's peak RSS (VmHWM), so the next
    # reading is the peak of this run rather than of the whole process lifetime.
    if can_reset_peak():
        _PROC_CLEAR_REFS.write_text("5")


def peak() -> int | None:
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except Exception:
        return None
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024  # bytes on macOS, kB elsewhere


def memory_info() -> tuple[int, int] | None:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def memory_source() -> str:
    if can_reset_peak():
        return "process peak RSS (Linux VmHWM, reset before each run); includes everything the process holds"
    return "process peak RSS since start (this OS cannot reset it); includes everything the process holds"


def device_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


# -- precision and modes ----------------------------------------------------------------------------


def precision(requested: str) -> PrecisionPlan:
    if requested == Precision.TF32:
        return make_plan(
            Precision.TF32,
            Precision.FP32,
            "CPU has no TF32 matmuls: running full fp32 (same result as fp32, no speed-up).",
        )
    if requested == Precision.FP16:
        # It runs (conv, GroupNorm, SDPA all have fp16 CPU kernels in torch >= 2.1) but most CPUs
        # have no fp16 arithmetic, so it is emulated and slow.
        plan = make_plan(
            Precision.FP16,
            None,
            "fp16 on CPU is emulated on most processors and usually slower than bf16 or fp32.",
        )
        return dataclasses.replace(plan, emulated="fp16 on CPU is emulated (diffusers warns that fp16 pipelines "
                                                  "cannot run on cpu), slower than fp32 and bf16")
    return make_plan(requested)


def find_cxx() -> str | None:
    cxx = settings.cxx()
    if cxx and shutil.which(cxx):
        return cxx
    for candidate in ("g++", "clang++", "c++"):
        if shutil.which(candidate):
            return candidate
    return None


def mode_notes(mode: str) -> tuple[str, ...]:
    if mode in (Mode.COMPILE, Mode.REGIONAL, Mode.AOT) and not find_cxx():
        return (
            "torch.compile (inductor) on CPU needs a C++ compiler and none was found on PATH: "
            "install g++ (build-essential) or set CXX, or compiling will fail."
            + (" (Loading aot packages that are already built needs none.)" if mode == Mode.AOT else ""),
        )
    return ()


def aot_target() -> str:
    """An AOTInductor package for CPU is C++ built for one instruction set: the vector ISA inductor picks
    (avx512, avx2, neon, ...) on this machine's architecture.

    Read from the CPU's flags on x86: inductor's own pick_vec_isa compiles and runs ten probe programs
    (seconds in a process whose inductor cache is empty: docs/benchmarks.md), which would make every fresh
    process pay that before it can even look a package up. Where the ISA is forced (ATEN_CPU_CAPABILITY,
    cpp.simdlen) or the CPU is not x86, inductor's answer is the one that counts."""
    import platform

    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa, supported_vec_isa_list, x86_isa_checker

    machine = platform.machine()
    if machine in ("x86_64", "AMD64") and config.cpp.simdlen is None and not settings.aten_cpu_capability():
        flags = set(x86_isa_checker())
        isa = next((str(isa) for isa in supported_vec_isa_list if set(str(isa).split()) <= flags), "")
    else:
        isa = str(pick_vec_isa())  # str(): a VecISA's truth value runs the probe build
    return f"{machine} {isa or 'no-vec'}"


# -- tensor parallel --------------------------------------------------------------------------------


def bind_local_device(local_rank: int) -> torch.device:
    return torch.device(NAME)  # every rank shares the one CPU


@contextlib.contextmanager
def tp_load_context():
    """The two adjustments diffusers 0.42.1 needs to shard on CPU (gloo).

    1. `diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES` is ("cuda", "neuron", "tpu", "xpu"):
       `apply_tensor_parallel` refuses a "cpu" mesh although torch's DTensor/gloo path works there
       (rank 0 matched one process to ~2e-6). "cpu" is added for the duration of the load.
    2. `ModelMixin._resolve_parallel_config` computes `torch.device(type, rank % torch.accelerator.
       device_count())`; with no accelerator the count is 0 and that is a ZeroDivisionError. During the
       load `torch.accelerator.device_count` reports at least 1, so the device becomes cpu:0 (all ranks
       share the one CPU).
    Both are undone when the load returns; both are only needed at load time (the mesh and the forward
    hooks are in place by then). Context parallel's `enable_parallelism` runs under it too, for the second.
    """
    import diffusers.hooks.tensor_parallel as tp_hooks

    supported = tp_hooks._SUPPORTED_TP_DEVICES
    device_count = torch.accelerator.device_count
    if NAME not in supported:
        tp_hooks._SUPPORTED_TP_DEVICES = (*supported, NAME)
    torch.accelerator.device_count = lambda: max(1, device_count())
    try:
        yield
    finally:
        tp_hooks._SUPPORTED_TP_DEVICES = supported
        torch.accelerator.device_count = device_count


def spec() -> DeviceSpec:
    return DeviceSpec(
        name=NAME,
        label="CPU",
        torch_device=NAME,
        compile_backend="inductor",
        static_shapes=False,
        dist_backend="gloo",  # CPU tensor parallel is a correctness harness, not a speed-up
        mesh_device_type=NAME,
        modes=(Mode.EAGER, Mode.COMPILE, Mode.REGIONAL, Mode.AOT),
        # SDPA's flash kernel has a CPU implementation; flex attention runs too (measured, torch 2.13).
        attention_kernels=("sdpa", "sdpa-flash", "flex"),
        # Under context parallel, diffusers calls aten::_scaled_dot_product_flash_attention itself for
        # _native_flash, and that op has no CPU kernel; only "native" SDPA runs there.
        context_parallel_kernels=("sdpa",),
        matmul_probe_iters=5,  # a CPU matmul takes milliseconds, not microseconds
        quant_base=Precision.FP32,
        quantized_precisions=(Precision.INT8_WEIGHT, Precision.INT8_DYNAMIC),
        host_memory_is_device_memory=True,
        budget_share=0.5,
        max_engines=4,
        max_batch=8,  # a burst of 8 as one call served more images/s at a lower p95 than 4 + 4 (docs/hosting.md)
        decode_batch_apart=True,  # the tiny VAE's decode of 8 took 8 times its decode of 1 (docs/hosting.md)
        process_overhead_bytes=700 * 2**20,  # a worker with torch, diffusers and a tiny model: ~0.6-0.7 GiB RSS
        cache_env=INDUCTOR_CACHE_ENV,
        probe_fn=lambda: Availability(True),
        precision_fn=precision,
        sync_fn=lambda: None,
        reset_peak_fn=reset_peak,
        peak_fn=peak,
        memory_source_fn=memory_source,
        mode_notes_fn=mode_notes,
        memory_info_fn=memory_info,
        device_name_fn=device_name,
        bind_fn=bind_local_device,
        tp_load_context_fn=tp_load_context,
        aot_target_fn=aot_target,
    )
