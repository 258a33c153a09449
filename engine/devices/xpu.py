"""xpu: Intel GPUs (torch's XPU build; oneDNN matmuls, oneCCL collectives as "xccl").

Everything but the probe and the bf16 check goes the generic way through torch.xpu, which mirrors
torch.cuda (synchronize, memory stats, set_device by local rank).
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

NAME = "xpu"


def probe() -> Availability:
    xpu = getattr(torch, NAME, None)
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


def precision(requested: str) -> PrecisionPlan:
    # tf32: torch.set_float32_matmul_precision("high") lets oneDNN use TF32 on Intel GPUs that
    # have it (Data Center GPU Max); elsewhere oneDNN runs fp32, so there is nothing to refuse.
    if requested == Precision.BF16 and not torch.xpu.is_bf16_supported():
        raise Refusal("this Intel GPU has no bf16 support", (Precision.FP16, Precision.FP32))
    return make_plan(requested)


# Why mode aot is not offered here (DeviceSpec.aot_refusal).
XPU_AOT_REFUSAL = (
    "AOTInductor packages are built and tested for cpu and cuda here, not yet for Intel GPUs; use mode "
    "compile (its graphs persist in the inductor cache)"
)


def spec() -> DeviceSpec:
    return DeviceSpec(
        name=NAME,
        ray_resource="showcase-xpu",
        label="Intel GPU (XPU)",
        torch_device=NAME,
        offload_streams=True,
        compile_backend="inductor",
        static_shapes=False,
        dist_backend="xccl",
        mesh_device_type=NAME,
        modes=(Mode.EAGER, Mode.COMPILE, Mode.REGIONAL),
        aot_refusal=XPU_AOT_REFUSAL,
        memory_source="torch.xpu.max_memory_allocated (tensors only)",
        cache_env=INDUCTOR_CACHE_ENV,
        probe_fn=probe,
        precision_fn=precision,
        # bind_fn None: one process per GPU, picked by LOCAL_RANK (torch.xpu.set_device)
    )
