"""Memory levers: which can run here and why not, and how each is applied through diffusers' own APIs.

Each lever is one row of `LEVERS` (as the attention backends and step caches are): its text form, its
parameters and their ranges, whether it is part of the engine key (it changes where weights live or how the
graph runs) or set per request, the modes it runs with and why not the others, the device it needs, and
whether it combines with a step cache, a LoRA slot and tensor parallel. `lever_table(spec)` lists them
(`python -m engine memory-levers`); `check_levers` refuses an impossible set before any weights load;
`apply_engine_levers` applies them once the weights are loaded; `vae_levers` sets the VAE's per request.

What was measured on a CPU (diffusers 0.42.1, torch 2.13, models/tiny-shapes) is in docs/benchmarks.md:
layerwise fp8 storage runs eagerly and fails under a fullgraph compile, whole or regional ("Attempted to use
`torch.nn.Parameter()` constructor with Dynamo"); group offload runs (to disk too) with the image equal and
fails under both compiles ("Skip inlining `torch.compiler.disable()`d function");
AutoencoderTiny's tiling fails at small sizes (tile blend size mismatch); model and sequential CPU offload
raise without an accelerator; group offload's streams need CUDA or XPU.

Importing this module imports no torch (the CLI lists the table and the manager checks a key with it).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import UnsupportedCombination
from engine.protocol import MAX_BLOCKS_PER_GROUP, MemoryLevers, Mode

ENGINE = "engine"  # part of the engine key: an engine of its own
REQUEST = "request"  # set per request on the engine's own VAE


def _accelerator(spec) -> str:
    if spec.host_memory_is_device_memory:
        return (f"{spec.label} [{spec.name}] keeps its weights in host RAM already: there is nowhere to offload "
                "to (diffusers raises without an accelerator)")
    return ""


def _anywhere(spec) -> str:
    return ""


def _separate_memory(spec) -> str:
    if spec.host_memory_is_device_memory:
        return f"{spec.label} [{spec.name}] computes in host RAM: the text encoders are on the CPU already"
    return ""


_OFFLOAD_MOVES = "the clone a step cache runs on would lose the offload hooks that bring each weight in"
_NO_FULLGRAPH = ("its hooks cast each weight as a layer runs, which a fullgraph torch.compile (whole or "
                 "regional) cannot trace (\"Attempted to use torch.nn.Parameter() constructor with Dynamo\")")
_MOVING_WEIGHTS = ("its hooks move weights between memories while the denoiser runs: a fullgraph compile (whole "
                   "or regional) fails on them (\"Skip inlining torch.compiler.disable()d function\") and an aot "
                   "package points at weights that must stay put")
_VAE_COMPILED = ("compile and aot decode through a graph of the VAE traced at the bucket's shape; tiling or "
                 "slicing would change it. Use eager or regional (the VAE stays eager there)")


@dataclass(frozen=True)
class Lever:
    name: str
    form: str
    summary: str
    scope: str  # ENGINE or REQUEST
    modes: tuple[Mode, ...]  # the modes it runs with
    mode_reason: str  # why not the others
    needs: Callable[[object], str] = _anywhere  # spec -> why this device cannot ("" it can)
    params: dict[str, str] = field(default_factory=dict)  # parameter -> its range
    step_caches: str = ""  # why a step cache cannot run beside it ("" it can)
    loras: str = ""  # why a LoRA slot cannot run beside it ("" it can)
    peer: str = ""  # the price a peer measured (docs/benchmarks.md has ours)


_EAGER = (Mode.EAGER, Mode.DEFER_AND_FUSE)
_ALL = tuple(Mode)

LEVERS: dict[str, Lever] = {lever.name: lever for lever in (
    Lever("group:block", "group:block[:N][:stream][:disk]",
          "denoiser blocks on the device N at a time, the rest in host RAM (or files on disk with :disk)",
          ENGINE, _EAGER, _MOVING_WEIGHTS, params={"N": f"1..{MAX_BLOCKS_PER_GROUP} blocks per group",
                                                   "stream": "CUDA/XPU only: prefetch the next group"},
          step_caches=_OFFLOAD_MOVES, peer="FLUX.1-dev H100: 11.7 GB at 47.7 s vs 33.9 GB at 6.59 s"),
    Lever("group:leaf", "group:leaf[:stream][:disk]", "each leaf module on the device only while it runs",
          ENGINE, _EAGER, _MOVING_WEIGHTS, params={"stream": "CUDA/XPU only: prefetch the next layer"},
          step_caches=_OFFLOAD_MOVES),
    Lever("layerwise", "layerwise:fp8|fp8-e5m2",
          "denoiser weights stored in fp8, each layer cast to the engine's precision as it runs "
          "(norms and embeddings keep theirs)", ENGINE, _EAGER, _NO_FULLGRAPH,
          params={"storage": "fp8 (e4m3fn) or fp8-e5m2"},
          step_caches="the clone a step cache runs on would lose the casting hooks and meet fp8 weights",
          loras="a LoRA slot's layers would meet fp8 weights its hot-swap does not cast (not measured here)"),
    Lever("model-offload", "model-offload", "each model on the device only while it runs (enable_model_cpu_offload)",
          ENGINE, (Mode.EAGER, Mode.REGIONAL, Mode.DEFER_AND_FUSE),
          "offload hooks cannot be traced by a whole-denoiser compile, and an aot package points at weights "
          "offload moves", needs=_accelerator, step_caches=_OFFLOAD_MOVES,
          peer="FLUX.1-dev H100: 22.6 GB at 21.7 s"),
    Lever("sequential-offload", "sequential-offload",
          "each submodule on the device only while it runs (enable_sequential_cpu_offload): least memory, slowest",
          ENGINE, _EAGER, _MOVING_WEIGHTS, needs=_accelerator, step_caches=_OFFLOAD_MOVES,
          peer="FLUX.1-dev H100: 2.4 GB at 68.4 s"),
    Lever("encoders:cpu", "encoders:cpu", "text encoders run on the CPU; only their embeddings reach the device",
          ENGINE, _ALL, "", needs=_separate_memory),
    Lever("encoders:offload", "encoders:offload",
          "text encoders moved to the device to encode and back to host RAM after", ENGINE, _ALL, "",
          needs=_separate_memory),
    Lever("vae-tiling", "vae-tiling", "the VAE decodes in overlapping tiles (large sizes)", REQUEST,
          (Mode.EAGER, Mode.REGIONAL, Mode.DEFER_AND_FUSE), _VAE_COMPILED),
    Lever("vae-slicing", "vae-slicing", "the VAE decodes a batch one image at a time", REQUEST,
          (Mode.EAGER, Mode.REGIONAL, Mode.DEFER_AND_FUSE), _VAE_COMPILED),
)}


def lever_status(lever: Lever, spec, mode: Mode | None = None) -> dict:
    """One row: can `lever` run on `spec` (in `mode`, when given), and why not."""
    why = lever.needs(spec)
    if not why and mode is not None and Mode.parse(mode, "mode") not in lever.modes:
        why = f"not with mode {mode}: {lever.mode_reason}"
    return {"name": lever.name, "form": lever.form, "scope": lever.scope, "usable": not why, "why_not": why,
            "summary": lever.summary, "params": dict(lever.params), "modes": [str(m) for m in lever.modes],
            "not_with_modes": lever.mode_reason, "step_caches": lever.step_caches or "yes",
            "loras": lever.loras or "yes", "tp": "no: single-device engines only", "peer": lever.peer}


def lever_table(spec, mode: Mode | None = None) -> list[dict]:
    return [lever_status(lever, spec, mode) for lever in LEVERS.values()]


def format_table(rows: list[dict]) -> str:
    """The table as aligned text (`python -m engine memory-levers`)."""
    width = max(len(r["form"]) for r in rows)
    lines = []
    for r in rows:
        state = "usable" if r["usable"] else "no"
        lines.append(f"{r['form']:{width}s}  {r['scope']:7s} {state:6s}  {r['why_not'] or r['summary']}")
        if r["usable"]:
            lines.append(f"{'':{width}s}  modes: {', '.join(r['modes'])}; step caches: {r['step_caches']}; "
                         f"LoRA: {r['loras']}")
    return "\n".join(lines)


def check_levers(levers, spec, *, tp: int = 1, quantized: bool = False, cpu_offload: bool = False) -> list[str]:
    """Notices for an engine with `levers`; UnsupportedCombination naming the lever and what to pick when it
    cannot run on `spec` (a device, tensor parallel, a quantized precision, --cpu-offload)."""
    levers = MemoryLevers.parse(levers)
    if not levers.enabled:
        return []
    for name in levers.names():
        if why := LEVERS[name].needs(spec):
            raise UnsupportedCombination(f"memory lever {name} cannot run here: {why}. "
                                         "`python -m engine memory-levers` lists the ones that can")
    if levers.group_stream and not spec.offload_streams:
        raise UnsupportedCombination(f"group offload with :stream needs CUDA or XPU streams; {spec.label} "
                                     f"[{spec.name}] has none: leave :stream out")
    engine_levers = levers.engine_part()
    if engine_levers.enabled and tp > 1:
        raise UnsupportedCombination(f"memory levers ({engine_levers}) run on single-device engines only: every "
                                     "rank of a multi-rank engine would move its shard on its own (not built)")
    if levers.layerwise and quantized:
        raise UnsupportedCombination("layerwise casting stores plain weights in fp8, and a quantized precision's "
                                     "weights are torchao tensors already: pick one")
    if cpu_offload and (levers.group or levers.offload or levers.encoders):
        raise UnsupportedCombination("--cpu-offload is model offload already: drop it, or use the memory lever "
                                     "model-offload")
    return [f"memory lever {name}: {LEVERS[name].summary}" for name in levers.names()]


def excluded_mode(levers, mode: Mode) -> str:
    """Why an engine with `levers` cannot run `mode` ("" when it can)."""
    for name in MemoryLevers.parse(levers).engine_part().names():
        lever = LEVERS[name]
        if mode not in lever.modes:
            return f"memory lever {name}: {lever.mode_reason}"
    return ""


def check_request(levers, request_levers, mode: Mode, step_cache: bool, lora: bool) -> None:
    """Refuse a request an engine with `levers` cannot serve: its VAE levers in this mode, a step cache or
    a LoRA beside a lever that cannot take one."""
    for name in MemoryLevers.parse(request_levers).request_part().names():
        if mode not in LEVERS[name].modes:
            raise UnsupportedCombination(f"memory lever {name} not in mode {mode}: {LEVERS[name].mode_reason}")
    for name in MemoryLevers.parse(levers).names():
        lever = LEVERS[name]
        if step_cache and lever.step_caches:
            raise UnsupportedCombination(f"a step cache cannot run on this engine (memory lever {name}): "
                                         f"{lever.step_caches}; drop the step cache or use an engine without it")
        if lora and lever.loras:
            raise UnsupportedCombination(f"a LoRA cannot run on this engine (memory lever {name}): {lever.loras}")


def lora_refusal(levers) -> str:
    """Why an engine with `levers` gets no LoRA slot ("" when it can)."""
    for name in MemoryLevers.parse(levers).names():
        if LEVERS[name].loras:
            return f"this engine serves no LoRA styles (memory lever {name}): {LEVERS[name].loras}"
    return ""


# -- applying them (torch from here on) ------------------------------------------------------------
# Beside diffusers' own skips (norms, embeddings, a top-level proj_in / proj_out), layerwise casting keeps the
# denoiser's first and last layers under their other names in the compute precision: in fp8, Flux's input
# projection (x_embedder) alone cost most of the embedded model's fidelity to fp32 (docs/benchmarks.md).
LAYERWISE_KEEP = ("^x_embedder$", "^conv_in$", "^conv_out$")


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 2**20  # weights above it get pages of their own; small tensors stay in the heap


def prepare_process(levers) -> str:
    """Before the weights load: with group offload to disk, every allocation above 1 MiB gets pages of
    its own from the kernel (glibc's mmap threshold fixed rather than raised as large blocks are freed), so a
    group written to disk gives its pages back and the empty placeholders diffusers leaves in its place take
    none. Otherwise freed weights stay in the heap, are handed to the placeholders and the process's resident
    memory does not drop (docs/benchmarks.md). A notice ("" when nothing was done or it is not glibc)."""
    if not MemoryLevers.parse(levers).group_disk:
        return ""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        done = bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        done = False
    return "group offload to disk: large allocations mapped apart, so offloaded groups leave host RAM" if done else ""


def _offload_folder(cache_path: Path) -> str:
    """A folder of this process's own for group offload's files, removed when the process exits."""
    root = Path(cache_path) / "offload"
    root.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="engine-", dir=root)
    atexit.register(shutil.rmtree, folder, True)
    return folder


WEIGHT_ALIGNMENT = 64  # bytes: the widest vector a CPU's matmul kernels align their loads to


def weight_phases(module) -> dict:
    """Each parameter and buffer of `module` -> its address modulo WEIGHT_ALIGNMENT, as loaded."""
    return {t: t.data_ptr() % WEIGHT_ALIGNMENT for t in (*module.parameters(), *module.buffers())}


def _disk_onloads_in_phase(denoiser, phases: dict) -> int:
    """Each disk-offloaded group's tensors, once read back, at the address (modulo 64 bytes) they had when the
    engine loaded them. The CPU's matmul kernels split a row differently by its alignment, which changes the
    summation order: read back from the group files (another layout than the model's own files) the weights
    moved a large model's image by 1/255 (docs/benchmarks.md). A tensor out of phase is copied once per
    onload. Returns the groups wrapped."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    groups = {}
    for module in denoiser.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is not None and getattr(hook.group, "offload_to_disk_path", None):
            groups[id(hook.group)] = hook.group
    for group in groups.values():
        group._onload_from_disk = _in_phase(group, group._onload_from_disk, phases)
    return len(groups)


def _in_phase(group, onload: Callable, phases: dict) -> Callable:
    def onload_in_phase():
        onload()
        for tensor in group.key_to_tensor.values():
            phase = phases.get(tensor, 0)
            if tensor.data.data_ptr() % WEIGHT_ALIGNMENT != phase:
                tensor.data = at_phase(tensor.data, phase)
    return onload_in_phase


def at_phase(tensor, phase: int):
    """A copy of `tensor` whose address is `phase` modulo WEIGHT_ALIGNMENT (a plain clone where the phase is not
    a whole number of its elements)."""
    import torch

    size = tensor.element_size()
    if phase % size:
        return tensor.clone()
    buffer = torch.empty(tensor.numel() + WEIGHT_ALIGNMENT // size, dtype=tensor.dtype, device=tensor.device)
    shift = ((phase - buffer.data_ptr()) % WEIGHT_ALIGNMENT) // size
    out = buffer[shift:shift + tensor.numel()].view(tensor.shape)
    out.copy_(tensor)
    return out


def _group_offload(denoiser, levers: MemoryLevers, device: str, cache_path: Path) -> str:
    import torch

    kwargs = {"onload_device": torch.device(device), "offload_device": torch.device("cpu"),
              "offload_type": f"{levers.group}_level", "use_stream": levers.group_stream}
    if levers.group == "block":
        kwargs["num_blocks_per_group"] = levers.group_blocks
    if levers.group_disk:
        kwargs["offload_to_disk_path"] = _offload_folder(cache_path)
    from engine import devices

    # where host memory is the device, onloaded weights are used where they land; elsewhere a copy follows
    on_cpu = levers.group_disk and devices.get_device(device).host_memory_is_device_memory
    phases = weight_phases(denoiser) if on_cpu else {}
    denoiser.enable_group_offload(**kwargs)
    if on_cpu:
        _disk_onloads_in_phase(denoiser, phases)
    return f" (files in {kwargs['offload_to_disk_path']})" if levers.group_disk else ""


def apply_engine_levers(pipe, denoiser_name: str, levers, device: str, compute_dtype, cache_path: Path) -> list[str]:
    """Apply an engine's levers to a loaded pipeline still in host memory, and put every component where it
    runs (`device`, or where its lever keeps it). Returns notices; does `pipe.to(device)` when no lever
    moves weights."""
    import torch

    levers = MemoryLevers.parse(levers).engine_part()
    denoiser = getattr(pipe, denoiser_name)
    notices = []
    if levers.layerwise:
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

        storage = torch.float8_e5m2 if levers.layerwise == "fp8-e5m2" else torch.float8_e4m3fn
        denoiser.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute_dtype,
                                          skip_modules_pattern=(*DEFAULT_SKIP_MODULES_PATTERN, *LAYERWISE_KEEP))
        notices.append(f"layerwise casting: denoiser weights stored in {storage}, computed in {compute_dtype} "
                       "(input and output projections, norms and embeddings keep theirs)")
    if levers.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
        return [*notices, "model offload: each model moves to the device only while it runs"]
    if levers.offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
        return [*notices, "sequential offload: each submodule moves to the device only while it runs"]
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        if name == denoiser_name and levers.group:
            where = _group_offload(component, levers, device, cache_path)
            notices.append(f"group offload: {levers.group} level, blocks moved in as they run{where}")
        elif not (levers.encoders and name.startswith("text_encoder")):
            component.to(device)
    return notices


@contextmanager
def vae_levers(vae, levers):
    """The VAE decoding in tiles / slices for one call (the engine's runs are one at a time); refused with
    the reason where this VAE cannot."""
    levers = MemoryLevers.parse(levers).request_part()
    if not levers.enabled:
        yield
        return
    check_vae(vae, levers)
    if levers.vae_tiling:
        vae.enable_tiling()
    if levers.vae_slicing:
        vae.enable_slicing()
    try:
        yield
    finally:
        if levers.vae_tiling:
            vae.disable_tiling()
        if levers.vae_slicing:
            vae.disable_slicing()


def check_vae(vae, levers) -> None:
    levers = MemoryLevers.parse(levers)
    name = type(vae).__name__
    for lever, method in (("vae-tiling", "enable_tiling"), ("vae-slicing", "enable_slicing")):
        if lever in levers.names() and not hasattr(vae, method):
            raise UnsupportedCombination(f"{lever}: this pipeline's VAE ({name}) has no {method}()")
    if levers.vae_tiling and name in TILING_FAILS:
        raise UnsupportedCombination(f"vae-tiling: {TILING_FAILS[name]}; use vae-slicing or no VAE lever")


# VAEs whose tiling was measured to fail (docs/benchmarks.md): offered nowhere, with the reason.
TILING_FAILS = {
    "AutoencoderTiny": "AutoencoderTiny's tiled decode fails at this showcase's sizes (tile blend size mismatch "
                       "at 64x64)",
}
