"""mps: Apple silicon GPUs through Metal Performance Shaders.

MPS keeps no peak-memory counter and no collective backend drives MPS tensors, so memory is what is
still allocated when a run ends and tensor parallel is not offered. bf16 depends on the macOS version,
so it is tried with a two-element tensor when asked for.
"""

from __future__ import annotations

import torch

from engine.devices.spec import (
    INDUCTOR_CACHE_ENV,
    Availability,
    DeviceSpec,
    PrecisionPlan,
    Refusal,
    make_plan,
)
from engine.protocol import Mode, Precision

NAME = "mps"


def probe() -> Availability:
    mps = getattr(torch.backends, NAME, None)
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


def bf16_ok() -> bool:
    try:
        (torch.ones(2, dtype=torch.bfloat16, device=NAME) * 2).cpu()
        return True
    except Exception:
        return False


def precision(requested: str) -> PrecisionPlan:
    if requested == Precision.TF32:
        return make_plan(Precision.TF32, Precision.FP32, "Apple GPUs have no TF32 matmuls: running full fp32.")
    if requested == Precision.BF16 and not bf16_ok():
        raise Refusal(
            "bf16 on MPS needs macOS 14 (Sonoma) or newer and a recent torch", (Precision.FP16, Precision.FP32)
        )
    return make_plan(requested)


def synchronize() -> None:
    torch.mps.synchronize()


def peak() -> int | None:
    # MPS keeps no peak counter; the memory still allocated when the run ends is what it has.
    return int(torch.mps.current_allocated_memory())


def memory_info() -> tuple[int, int] | None:
    total = int(torch.mps.recommended_max_memory())
    return max(0, total - int(torch.mps.driver_allocated_memory())), total


def mode_notes(mode: str) -> tuple[str, ...]:
    if mode in (Mode.COMPILE, Mode.REGIONAL):
        return ("torch.compile on MPS is a prototype in PyTorch; if it fails, use eager.",)
    return ()


# Why mode aot is not offered here (DeviceSpec.aot_refusal).
MPS_AOT_REFUSAL = (
    "AOTInductor packages for Apple GPUs (MPS) are experimental in PyTorch and not built here; use mode "
    "compile (its graphs persist in the inductor cache)"
)


def spec() -> DeviceSpec:
    return DeviceSpec(
        name=NAME,
        ray_resource="showcase-mps",
        label="Apple silicon GPU (MPS)",
        torch_device=NAME,
        compile_backend="inductor",
        static_shapes=False,
        # No collective backend drives MPS tensors: tensor parallel is not offered.
        dist_backend="",
        mesh_device_type="",
        tensor_parallel=False,
        modes=(Mode.EAGER, Mode.COMPILE, Mode.REGIONAL),
        max_engines=2,
        max_batch=2,  # unified memory shared with the desktop: small activation headroom
        aot_refusal=MPS_AOT_REFUSAL,  # unified memory is shared with everything else on the Mac
        memory_source="torch.mps.current_allocated_memory at the end of the run (MPS keeps no peak)",
        cache_env=INDUCTOR_CACHE_ENV,
        probe_fn=probe,
        precision_fn=precision,
        sync_fn=synchronize,
        reset_peak_fn=lambda: None,
        peak_fn=peak,
        mode_notes_fn=mode_notes,
        memory_info_fn=memory_info,
    )
