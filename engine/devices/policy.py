"""What a device does with a requested precision or mode: accept, downgrade with a notice, or refuse.

Precision policy: a request is *downgraded* (with a visible notice) only when the substitute is
numerically the same or more precise and costs no extra memory -- the only such case is tf32 -> fp32
where a device has no TF32 matmuls. Everything else a device cannot do (bf16 on a GPU without native
bf16, fp16 on TPU) is *refused* with the reason and what to pick instead, because silently swapping
bf16 <-> fp16 changes overflow behaviour and fp16 -> fp32 doubles memory. Each device module's
precision rule applies this policy; `plan_precision` turns its `Refusal` into the user-facing error.

Mode policy: a device runs the modes its spec lists; asking for another is refused, with what the mode
is and where it exists when that helps (MODE_HINTS).
"""

from __future__ import annotations

import contextlib

import torch

from engine.devices.spec import DeviceSpec, PrecisionPlan, Refusal, make_plan
from engine.errors import UnsupportedCombination
from engine.protocol import Mode, Precision

# For a mode some device lacks: what the mode is, and what to run instead (said in the refusal).
MODE_HINTS: dict[Mode, tuple[str, str]] = {
    Mode.DEFER_AND_FUSE: ("TorchTPU's optimized eager mode", "compile or regional for fused graphs"),
}



def plan_precision(spec: DeviceSpec, precision: str) -> PrecisionPlan:
    """What `precision` becomes on `spec`: accepted, downgraded with a notice, or refused.

    Refusal -> UnsupportedCombination naming the reason and what to pick instead.
    """
    key = Precision.parse(precision, "precision")
    if key.quantized:
        return _plan_quantized(spec, key)
    rule = spec.precision_fn or make_plan
    try:
        return rule(key)
    except Refusal as refusal:
        instead = " or ".join(refusal.instead)
        raise UnsupportedCombination(
            f"{key} is not supported on {spec.label} [{spec.name}]: {refusal.reason}. Choose {instead} instead."
        ) from None


FLOAT8_NEED = "float8 matmuls need a CUDA GPU of compute capability 8.9+ (Ada, Hopper or newer)"


def _plan_quantized(spec: DeviceSpec, key: Precision) -> PrecisionPlan:
    """A quantized precision: the device's base precision (its own rule applies: bf16 may be refused),
    then torchao quantizes the denoiser's weights. Refused where the device has no such kernels."""
    def refuse(reason: str) -> UnsupportedCombination:
        instead = " or ".join(map(str, (*[p for p in spec.quantized_precisions if p is not key], spec.quant_base)))
        return UnsupportedCombination(
            f"{key} is not supported on {spec.label} [{spec.name}]: {reason}. Choose {instead} instead.")

    if key not in spec.quantized_precisions:
        raise refuse(FLOAT8_NEED if key is Precision.FP8 else spec.quant_refusal)
    if key is Precision.FP8:
        cap = spec.capability()
        need = spec.float8_min_capability
        if need is None or cap is None or cap < need:
            have = f"this GPU is sm_{cap[0]}{cap[1]}" if cap else "the compute capability is not known here"
            raise refuse(f"{FLOAT8_NEED}; {have}")
    base = plan_precision(spec, spec.quant_base)
    what = {Precision.INT8_WEIGHT: "int8 weight-only", Precision.INT8_DYNAMIC: "int8 dynamic activation + int8 weight",
            Precision.FP8: "float8 dynamic activation + float8 weight"}[key]
    return PrecisionPlan(precision=key, dtype=base.dtype, allow_tf32=base.allow_tf32,
                         notices=(*base.notices, f"{key}: {what} (torchao) on the denoiser, loaded in {base.precision}"),
                         requested=key, base=base.precision)


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
            table[precision] = {"status": status, "runs_as": plan.precision, "notices": list(plan.notices),
                                **({"emulated": plan.emulated} if plan.emulated else {})}
    return table


def check_mode(spec: DeviceSpec, mode: str) -> tuple[str, ...]:
    """Notices for running `mode` on `spec`; raises if the device cannot run it at all."""
    key = Mode.parse(mode, "mode")
    if key not in spec.modes:
        hint = MODE_HINTS.get(key)
        if key is Mode.AOT and spec.aot_refusal:
            reason = spec.aot_refusal
        elif hint:
            from engine.devices.registry import registry  # the registry imports every device module

            what, instead = hint
            where = ", ".join(s.name for s in registry().values() if key in s.modes) or "no device"
            reason = f"{key} is {what} and exists only on {where}; on {spec.name} use {instead}"
        else:
            reason = f"{spec.name} runs only {', '.join(spec.modes)}"
        raise UnsupportedCombination(f"mode {str(key)!r} is not supported on {spec.label} [{spec.name}]: {reason}.")
    return spec.mode_notes_fn(key) if spec.mode_notes_fn else ()


def apply_precision(plan: PrecisionPlan) -> None:
    """Set this process's fp32 matmul/conv math for `plan` (TF32 on or off).

    Uses torch.set_float32_matmul_precision (covers cuBLAS, oneDNN/XPU) plus the cuDNN conv flag,
    i.e. only the "legacy" API family: since torch 2.9, mixing it with the per-backend
    `fp32_precision` properties makes later reads raise ("mix of the legacy and new APIs").
    "fp32" means IEEE fp32 everywhere, including convolutions (cuDNN's default would be TF32).
    Process-wide: applied once, in the worker, before any model is built.
    """
    torch.set_float32_matmul_precision("high" if plan.allow_tf32 else "highest")
    with contextlib.suppress(Exception):
        torch.backends.cudnn.allow_tf32 = bool(plan.allow_tf32)
