"""diffusers attention backends: which one can run here, and why not, before anyone picks it.

diffusers dispatches every attention call of a model to one backend (`model.set_attention_backend(name)`):
torch's SDPA (`native`, or one of its kernels forced: `_native_flash`, `_native_cudnn`, ...), flex
attention, flash-attn 2/3, SageAttention, xformers, or a kernel downloaded from the Hub. Whether a
choice runs depends on five things, checked here in this order so the first reason is the one to fix:

1. the device: each backend belongs to a kernel family (`BACKENDS[name].kernel`) and each device lists
   the families it can run (`DeviceSpec.attention_kernels`); cuDNN or FA3 on a CPU is refused;
2. the dtype: flash, cuDNN, sage and FA3 kernels take bf16/fp16 only (diffusers declares this as a
   constraint but checks it only with DIFFUSERS_ATTN_CHECKS=1; a wrong dtype would fail mid-request);
3. the compute capability (FA3: Hopper, sm_90 only; flash-attn 2, cuDNN attention, sage: sm_80+);
4. the package (flash_attn, flash_attn_interface for FA3, sageattention, xformers, kernels) — diffusers'
   own requirement check says what to install;
5. Hub kernels: the `kernels` package downloads the kernel from the Hub on first use, which an offline
   machine (HF_HUB_OFFLINE=1) can do only if it is already in the Hub cache.

`attention_table` returns every backend with `usable` and `reason`; `check_backend` refuses an unusable
choice with UnsupportedCombination, and `apply_backend` sets it on the denoiser at load time.

Importing this module imports no torch (engine/cli.py builds the `attention` sub-command's parser).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine import settings
from engine.errors import UnsupportedCombination

DEFAULT = "native"
HALF = ("bf16", "fp16")


@dataclass(frozen=True)
class Backend:
    name: str
    kernel: str  # family, matched against DeviceSpec.attention_kernels
    summary: str
    dtypes: tuple[str, ...] | None = None  # precisions it takes (None: any)
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None  # FA3 kernels exist for Hopper only
    hub: bool = False  # a kernel the `kernels` package downloads from the Hub (repo: diffusers' registry)
    # Context parallel: diffusers registers the backend with supports_context_parallel (Ulysses runs on it),
    # and its op returns the log-sum-exp (`return_lse=True`), which Ring attention merges partial results by.
    context_parallel: bool = False
    lse: bool = False


def _b(name, kernel, summary, **kw) -> tuple[str, Backend]:
    return name, Backend(name, kernel, summary, **kw)


HOPPER = {"min_capability": (9, 0), "max_capability": (9, 0)}
AMPERE = {"min_capability": (8, 0)}
CP = {"context_parallel": True}
CP_LSE = {"context_parallel": True, "lse": True}

# Every backend diffusers 0.42 registers, as data. A backend diffusers adds later is listed as "not
# described here" until it gets a row (never offered blindly).
BACKENDS: dict[str, Backend] = dict([
    _b("native", "sdpa", "torch SDPA; torch picks the kernel (default)", **CP),
    _b("_native_math", "sdpa", "torch SDPA, math kernel forced (reference, slowest)"),
    _b("_native_flash", "sdpa-flash", "torch SDPA, flash kernel forced", dtypes=HALF, **CP_LSE),
    _b("_native_efficient", "sdpa-efficient", "torch SDPA, memory-efficient kernel forced"),
    _b("_native_cudnn", "sdpa-cudnn", "torch SDPA, cuDNN attention forced", dtypes=HALF, **AMPERE, **CP_LSE),
    _b("_native_npu", "npu", "Ascend NPU attention (torch_npu)", dtypes=HALF, **CP),
    _b("_native_xla", "xla", "torch_xla flash attention (XLA devices, not TorchTPU)"),
    _b("flex", "flex", "torch flex attention (compiled kernel)"),
    _b("flash", "flash-attn", "flash-attn 2", dtypes=HALF, **AMPERE, **CP_LSE),
    _b("flash_varlen", "flash-attn", "flash-attn 2, variable length", dtypes=HALF, **AMPERE),
    _b("_flash_3", "flash-attn-3", "flash-attn 3 (FA3 beta built from source)", dtypes=HALF, **HOPPER),
    _b("_flash_varlen_3", "flash-attn-3", "flash-attn 3, variable length", dtypes=HALF, **HOPPER),
    _b("flash_hub", "hub", "flash-attn 2 from the Hub (kernels)", dtypes=HALF, hub=True,
       **AMPERE, **CP_LSE),
    _b("flash_varlen_hub", "hub", "flash-attn 2 varlen from the Hub (kernels)", dtypes=HALF,
       hub=True, **AMPERE, **CP_LSE),
    _b("_flash_3_hub", "hub", "flash-attn 3 from the Hub (kernels)", dtypes=HALF,
       hub=True, **HOPPER, **CP_LSE),
    _b("_flash_3_varlen_hub", "hub", "flash-attn 3 varlen from the Hub (kernels)", dtypes=HALF,
       hub=True, **HOPPER, **CP_LSE),
    _b("flash_4_hub", "hub", "flash-attn 4 (CuTe) from the Hub (kernels)", dtypes=HALF,
       hub=True, min_capability=(9, 0)),
    _b("aiter_fa2_hub", "hub-rocm", "AMD aiter CK flash-attn 2 from the Hub (kernels)", dtypes=("bf16",),
       hub=True),
    _b("sage", "sage", "SageAttention 2 (int8 QK)", dtypes=HALF, **AMPERE, **CP_LSE),
    _b("sage_varlen", "sage", "SageAttention 2, variable length", dtypes=HALF, **AMPERE),
    _b("sage_hub", "hub", "SageAttention from the Hub (kernels)", dtypes=HALF, hub=True,
       **AMPERE, **CP_LSE),
    _b("sage_blackwell_hub", "hub", "SageAttention 3 for Blackwell from the Hub (kernels)", dtypes=HALF,
       hub=True, min_capability=(12, 0)),
    _b("_sage_qk_int8_pv_fp8_cuda", "sage", "SageAttention int8 QK / fp8 PV (CUDA)", min_capability=(9, 0)),
    _b("_sage_qk_int8_pv_fp8_cuda_sm90", "sage", "SageAttention int8 QK / fp8 PV (sm_90)", min_capability=(9, 0)),
    _b("_sage_qk_int8_pv_fp16_cuda", "sage", "SageAttention int8 QK / fp16 PV (CUDA)", **AMPERE),
    _b("_sage_qk_int8_pv_fp16_triton", "sage", "SageAttention int8 QK / fp16 PV (Triton)", **AMPERE),
    _b("xformers", "xformers", "xformers memory-efficient attention"),
])


def _diffusers_names() -> list[str]:
    """Every backend the installed diffusers knows, in its order (ours for the ones it lacks)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [m.value for m in AttentionBackendName]
    return names + [n for n in BACKENDS if n not in names]


def _package_problem(name: str) -> str | None:
    """diffusers' own requirement check (package installed, version recent enough), as text."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
    )

    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ValueError, ImportError) as exc:
        return str(exc).strip().splitlines()[0]
    return None


def _hub_repo(name: str) -> str | None:
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    config = _HUB_KERNELS_REGISTRY.get(AttentionBackendName(name))
    return config.repo_id if config else None


def _hub_cached(repo: str) -> bool:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    return os.path.isdir(os.path.join(HF_HUB_CACHE, "models--" + repo.replace("/", "--")))


def _offline() -> bool:
    return settings.hf_offline()


def _cap(c: tuple[int, int]) -> str:
    return f"sm_{c[0]}{c[1]}"


def backend_status(name: str, spec, precision: str | None) -> dict:
    """One row of the table: can `name` run on `spec` at `precision` (effective precision), and why not."""
    b = BACKENDS.get(name)
    row = {"name": name, "kernel": b.kernel if b else None, "summary": b.summary if b else "", "usable": False,
           "reason": "", "note": ""}
    if b is None:
        row["reason"] = "not described here (a backend newer than this table): not offered"
        return row
    if b.kernel not in spec.attention_kernels:
        row["reason"] = f"{spec.label} [{spec.name}] has no {b.kernel} kernels"
        return row
    if b.dtypes and precision is not None and str(precision) not in b.dtypes:
        row["reason"] = f"{name} takes {' or '.join(b.dtypes)} only, not {precision}"
        return row
    if b.min_capability or b.max_capability:
        cap = spec.capability()
        if cap is None:
            row["note"] = "compute capability not known here (device not available): not checked"
        elif b.min_capability and cap < b.min_capability:
            row["reason"] = f"needs compute capability {_cap(b.min_capability)}+; this GPU is {_cap(cap)}"
            return row
        elif b.max_capability and cap > b.max_capability:
            row["reason"] = (f"kernels exist for {_cap(b.min_capability or b.max_capability)} (Hopper) only; "
                             f"this GPU is {_cap(cap)}")
            return row
    if name in _diffusers_names():
        problem = _package_problem(name)
        if problem:
            row["reason"] = problem
            return row
    else:
        row["reason"] = "the installed diffusers does not have this backend"
        return row
    repo = _hub_repo(name) if b.hub else None
    if repo and not _hub_cached(repo):
        if _offline():
            row["reason"] = (f"downloads {repo} from the Hub on first use, and this machine is offline "
                             "(HF_HUB_OFFLINE=1) without a cached copy")
            return row
        row["note"] = f"downloads {repo} from the Hub on first use"
    row["usable"] = True
    return row


def attention_table(spec, precision: str | None = None) -> list[dict]:
    """Every attention backend with whether it can run on `spec` at `precision`, and why not."""
    return [backend_status(name, spec, precision) for name in _diffusers_names()]


def check_backend(name: str, spec, precision: str | None) -> list[str]:
    """Notices for using `name`; UnsupportedCombination (with the reason) when it cannot run here."""
    name = str(name or DEFAULT).strip().lower()
    if name == DEFAULT:
        return []
    if name not in BACKENDS and name not in _diffusers_names():
        raise UnsupportedCombination(
            f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)} "
            "(`python -m engine attention` says which can run here)")
    row = backend_status(name, spec, precision)
    if not row["usable"]:
        raise UnsupportedCombination(
            f"attention backend {name!r} cannot run on {spec.label} [{spec.name}] in {precision}: {row['reason']}. "
            "`python -m engine attention` lists the ones that can")
    return [f"attention backend {name}: {row['summary']}" + (f" ({row['note']})" if row["note"] else "")]


def check_context_parallel(name: str, layout: str, spec) -> None:
    """Refuse (UnsupportedCombination, naming the backend and what to pick) an attention backend that cannot
    run `layout` ("ulysses" or "ring") on `spec`: diffusers' context-parallel support, the log-sum-exp Ring
    needs, and the kernels the device runs in diffusers' context-parallel path."""
    name = str(name or DEFAULT).strip().lower()
    b = BACKENDS.get(name)
    kernels = spec.context_parallel_kernels if spec.context_parallel_kernels is not None else spec.attention_kernels
    usable = [n for n, r in BACKENDS.items() if r.context_parallel and r.kernel in kernels]
    if layout == "ring":
        usable = [n for n in usable if BACKENDS[n].lse]
    pick = (f"use an attention backend that can: {', '.join(usable)}" if usable
            else f"{spec.label} [{spec.name}] has none; use --parallel ulysses or tensor")
    if b is None or not b.context_parallel:
        raise UnsupportedCombination(
            f"attention backend {name!r} does not support context parallel ({layout}) in diffusers; {pick}")
    if layout == "ring" and not b.lse:
        raise UnsupportedCombination(
            f"ring attention needs the attention's log-sum-exp to merge partial results, and {name!r} does not "
            f"return it (diffusers: '{name} attention does not support return_lse=True'); {pick}")
    if b.kernel not in kernels:
        raise UnsupportedCombination(
            f"attention backend {name!r} has no {b.kernel} kernel in diffusers' context-parallel path on "
            f"{spec.label} [{spec.name}]; {pick}")


def apply_backend(denoiser, name: str, spec, precision: str | None) -> list[str]:
    """Set the backend on the denoiser (after its weights are on the device); notices of what was set."""
    notices = check_backend(name, spec, precision)
    if notices:
        if not hasattr(denoiser, "set_attention_backend"):
            raise UnsupportedCombination(
                f"{type(denoiser).__name__} has no set_attention_backend(): only diffusers models take an "
                "attention backend; use 'native'")
        denoiser.set_attention_backend(str(name).strip().lower())
    return notices


def format_table(rows: list[dict]) -> str:
    """The table as aligned text (`python -m engine attention`)."""
    width = max(len(r["name"]) for r in rows)
    lines = []
    for r in rows:
        state = "usable" if r["usable"] else "no"
        why = r["reason"] or r["note"] or r["summary"]
        lines.append(f"{r['name']:{width}s}  {state:6s}  {why}")
    return "\n".join(lines)


def activate(name: str) -> None:
    """Make `name` diffusers' process-wide attention backend. A model whose backend was left at `native` follows
    that process-wide one, which set_attention_backend changes for every model in the process, and compiled
    graphs guard on it: a process holding models with different backends (the advisor's runners) activates a
    model's own before it runs, so a native model runs native and its graphs do not recompile."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(AttentionBackendName(str(name).strip().lower() or DEFAULT))
