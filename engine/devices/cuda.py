"""cuda: NVIDIA CUDA and AMD ROCm GPUs (a ROCm build of torch is driven through torch.cuda).

One spec for both vendors: the device string, collectives ("nccl" is RCCL on ROCm) and compile path
are the same; what differs (label, TF32 support, the driver tool to suggest) is decided from
torch.version.hip at call time.
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

NAME = "cuda"
TORCH_BUILDS_HINT = "https://pytorch.org/get-started/locally/"


def is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def label() -> str:
    if is_rocm():
        return "AMD GPU (ROCm)"
    if getattr(torch.version, "cuda", None):
        return "NVIDIA GPU (CUDA)"
    return "NVIDIA / AMD GPU (CUDA / ROCm)"


def probe() -> Availability:
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


def device_name() -> str:
    try:
        return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:
        return "this GPU"


def precision(requested: str) -> PrecisionPlan:
    if requested == Precision.TF32:
        if is_rocm():
            # PyTorch honours TF32 on ROCm only on MI300-class GPUs (gfx94x) and newer.
            arch = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "gcnArchName", "")
            if arch.startswith(("gfx94", "gfx95")):
                return make_plan(Precision.TF32)
            return make_plan(
                Precision.TF32,
                Precision.FP32,
                f"{device_name()} ({arch or 'unknown arch'}) has no TF32 in PyTorch (ROCm supports it on "
                "MI300-class gfx94x and newer): running full fp32.",
            )
        major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
        if major >= 8:
            return make_plan(Precision.TF32)
        return make_plan(
            Precision.TF32,
            Precision.FP32,
            f"TF32 needs an Ampere or newer GPU (compute capability 8.0+); {device_name()} is "
            f"sm_{major}{minor}: running full fp32.",
        )
    if requested == Precision.BF16:
        try:  # torch >= 2.3 would otherwise count slow emulation on pre-Ampere GPUs as support
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:
            native = torch.cuda.is_bf16_supported()
        if not native:
            raise Refusal(
                f"{device_name()} has no native bf16 (needs compute capability 8.0+)",
                (Precision.FP16, Precision.FP32),
            )
    return make_plan(requested)


def capability() -> tuple[int, int] | None:
    if is_rocm():
        return None  # gfx architectures are not compute capabilities; ROCm kernels check their own
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))


def aot_target() -> str:
    """A package holds kernels for one GPU architecture and links one CUDA/ROCm runtime."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if is_rocm():
        return f"{props.name} {getattr(props, 'gcnArchName', '')} rocm {torch.version.hip}"
    return f"{props.name} sm_{props.major}{props.minor} cuda {torch.version.cuda}"


def attention_kernels() -> tuple[str, ...]:
    """Which attention kernel families exist for this build's GPUs (engine/pipeline/attention.py)."""
    if is_rocm():  # no cuDNN, FA3, sage or xformers builds for ROCm; AMD's CK flash kernel from the Hub
        return ("sdpa", "sdpa-flash", "sdpa-efficient", "flex", "flash-attn", "hub-rocm")
    return ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "flash-attn", "flash-attn-3", "hub",
            "sage", "xformers")


def spec() -> DeviceSpec:
    # Built per registry() call: the label follows the torch build in use.
    return DeviceSpec(
        name=NAME,
        ray_resource="GPU",
        label=label(),
        torch_device=NAME,
        offload_streams=True,
        compile_backend="inductor",
        static_shapes=False,
        dist_backend="nccl",  # RCCL on ROCm, under the same name
        mesh_device_type=NAME,
        modes=(Mode.EAGER, Mode.COMPILE, Mode.REGIONAL, Mode.AOT),
        attention_kernels=attention_kernels(),
        memory_source="torch.cuda.max_memory_allocated (tensors only, excludes the caching allocator's reserve)",
        inductor_flags_default=True,
        cuda_graphs=True,
        matmul_probe_sizes=(4096, 8192, 16384),
        quant_base=Precision.BF16,
        quantized_precisions=(Precision.INT8_WEIGHT, Precision.INT8_DYNAMIC, Precision.FP8),
        float8_min_capability=(8, 9),
        max_batch=4,  # conservative until measured per GPU and model (scripts/bench_gpu.sh sweeps batch sizes)
        cache_env=INDUCTOR_CACHE_ENV,
        probe_fn=probe,
        precision_fn=precision,
        device_name_fn=device_name,
        aot_target_fn=aot_target,
        capability_fn=capability,
        # bind_fn None: one process per GPU, picked by LOCAL_RANK (torch.cuda.set_device)
    )
