"""Fit: the memory an engine needs with each memory lever set, estimated before anything loads, and the lever
set chosen for a device's free memory (`--memory auto|speed|memory`).

The weights come from the safetensors headers of each component (engine/models/weights.py: shapes and
dtypes, no tensor read); a preset that is not on this machine (FLUX.1-dev) gets its denoiser's shapes from
its `denoiser_config` built on torch's meta device and its encoders' and VAE's parameter counts from
its pipeline family's published sizes (`PipelineFamily.published`, engine/families/). Per component: its parameters, the share layerwise casting stores in fp8 (2-D weights outside
norms and embeddings, diffusers' skip patterns), its largest repeated block (group offload's unit) and its
largest tensor (a leaf's). Activations: `ACTIVATION_PER_TOKEN_DIM` x tokens x hidden width x dtype bytes,
calibrated on a random-weight Flux denoiser (docs/benchmarks.md says how close the estimate came). Each
lever set's price in time is its factor in `CANDIDATES` (measured here where it runs on a CPU, else a peer's
published figure).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import NotAllowed, ShowcaseError
from engine.families import registry
from engine.protocol import MemoryLevers

log = logging.getLogger(__name__)

GIB = 2**30
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8wo": 1, "int8dq": 1, "fp8": 1}
ACTIVATION_PER_TOKEN_DIM = 24.0  # activation bytes per (token x hidden width x dtype byte); docs/benchmarks.md
TEXT_TOKENS = 512  # Flux's T5 sequence: joint attention runs over image and text tokens
# diffusers' layerwise casting leaves these modules in the compute precision (DEFAULT_SKIP_MODULES_PATTERN)
# and this engine's own additions (engine/pipeline/memory.py LAYERWISE_KEEP)
_SKIP_CAST = re.compile(r"pos_embed|patch_embed|norm|^(proj_in|proj_out|x_embedder|conv_in|conv_out)\.")
_BLOCK = re.compile(r"^(.*blocks)\.(\d+)\.")
# Lever sets in the order an "auto" host tries them (fastest first), with their price in time: measured on
# this machine's CPU (layerwise casting: 1.30x) or a peer's figure (diffusers' FLUX.1-dev table: model offload
# 21.7 / 6.59 s, group offload 47.7 / 6.59 s, sequential 68.4 / 6.59 s; cache-dit's prefetching offload 24.6 /
# 23.4 s for a streamed group).
CANDIDATES = (
    ("", 1.0), ("encoders:cpu", 1.02), ("layerwise:fp8", 1.30), ("layerwise:fp8,encoders:cpu", 1.33),
    ("group:block:1:stream", 1.05), ("model-offload", 3.3), ("layerwise:fp8,group:block:1:stream", 1.37),
    ("group:block:1", 7.2), ("group:block:1:disk", 7.5), ("layerwise:fp8,group:block:1:disk", 7.8),
    ("sequential-offload", 10.4),
)
POLICIES = ("speed", "auto", "memory")
QUANTIZED = ("int8wo", "int8dq", "fp8")


@dataclass(frozen=True)
class Component:
    name: str
    params: int
    castable: int = 0  # parameters layerwise casting stores in fp8
    block: int = 0  # parameters of its largest repeated block (0: none)
    largest: int = 0  # parameters of its largest tensor


def component_from_shapes(name: str, shapes: dict[str, list[int]]) -> Component:
    params = castable = largest = 0
    blocks: dict[tuple[str, str], int] = {}
    # Layerwise casting stores the weight and bias of each linear / conv layer outside the skipped modules.
    layers = {t.rsplit(".", 1)[0] for t, s in shapes.items() if t.endswith(".weight") and len(s) >= 2}
    for tensor, shape in shapes.items():
        n = functools.reduce(lambda a, b: a * int(b), shape, 1)
        params += n
        largest = max(largest, n)
        module = tensor.rsplit(".", 1)[0]
        if module in layers and not _SKIP_CAST.search(tensor):
            castable += n
        if m := _BLOCK.match(tensor):
            blocks[m.groups()] = blocks.get(m.groups(), 0) + n
    return Component(name, params, castable, max(blocks.values(), default=0), largest)


def components_from_folder(folder: Path) -> dict[str, Component]:
    """Each component of a diffusers folder, from its safetensors headers (no tensor is read)."""
    from engine.models.weights import read_header

    out = {}
    for sub in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        shapes = {}
        for path in sorted(sub.glob("*.safetensors")):
            shapes.update({k: v.get("shape", []) for k, v in read_header(path).items() if k != "__metadata__"})
        if shapes:
            out[sub.name] = component_from_shapes(sub.name, shapes)
    return out


def components_from_config(preset) -> dict[str, Component]:
    """A preset not on this machine: its denoiser built on the meta device from denoiser_config (shapes, no
    memory), the rest from its family's published sizes; ShowcaseError where neither is known."""
    family = registry.find(preset.pipeline)
    published = family.published if family is not None else {}
    if not preset.denoiser_config or not published:
        raise ShowcaseError(f"{preset.name}: no local weights, and no denoiser_config with published component "
                            "sizes to estimate from")
    import diffusers
    import torch

    from engine.pipeline.stepcache import denoiser_class

    cls = denoiser_class(preset.pipeline, preset.denoiser) or diffusers.FluxTransformer2DModel
    with torch.device("meta"):
        model = cls.from_config(dict(preset.denoiser_config))
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    out = {name: Component(name, n, 0, 0, n // 24) for name, n in published.items()}
    out[preset.denoiser] = component_from_shapes(preset.denoiser, shapes)
    return out


def hidden_width(config: dict) -> int:
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(dim, int):
        return heads * dim
    return int(config.get("cross_attention_dim") or 1024) if not isinstance(config.get("cross_attention_dim"),
                                                                            list) else 1024


@dataclass(frozen=True)
class Estimate:
    levers: str
    device_bytes: int  # what the device holds at the peak (weights there, activations, the process)
    weights_bytes: int  # of that, weights
    activation_bytes: int
    time_factor: float  # its price in time, against no lever

    def as_dict(self) -> dict:
        return {"levers": self.levers or "none", "device_gib": round(self.device_bytes / GIB, 2),
                "weights_gib": round(self.weights_bytes / GIB, 2), "time_factor": self.time_factor}


@dataclass(frozen=True)
class Model:
    """What an estimate needs of one engine: its components, its denoiser's name and width, its precision."""

    components: dict[str, Component]
    denoiser: str
    hidden: int
    precision: str = "fp32"

    @property
    def dtype_bytes(self) -> int:
        return PRECISION_BYTES.get(str(self.precision), 4)

    def activations(self, width: int, height: int, batch: int = 1) -> int:
        tokens = (width // 16) * (height // 16) + TEXT_TOKENS
        return int(ACTIVATION_PER_TOKEN_DIM * tokens * self.hidden * self.dtype_bytes * batch)

    def estimate(self, levers, width: int, height: int, host_is_device: bool, overhead: int = 0,
                 time_factor: float = 1.0) -> Estimate:
        lv = MemoryLevers.parse(levers).engine_part()
        b, act = self.dtype_bytes, self.activations(width, height)
        sizes = {n: c.params * b for n, c in self.components.items()}
        d = self.components.get(self.denoiser, Component(self.denoiser, 0))
        if lv.layerwise:
            sizes[self.denoiser] = d.castable + (d.params - d.castable) * b
        encoders = sum(s for n, s in sizes.items() if n.startswith("text_encoder"))
        weights = sum(sizes.values())
        # Where the device's memory is the host's, moving weights to host RAM frees nothing; only disk does.
        if lv.offload == "model" and not host_is_device:
            weights = max(sizes.values(), default=0)
        elif lv.offload == "sequential" and not host_is_device:
            weights = max((c.largest * b for c in self.components.values()), default=0)
        elif lv.group and (lv.group_disk or not host_is_device):
            held = (d.block * lv.group_blocks if lv.group == "block" and d.block else d.largest) * b
            weights = weights - sizes[self.denoiser] + held * (2 if lv.group_stream else 1)
        if lv.encoders_on_host and not host_is_device:
            weights -= encoders
        return Estimate(str(lv) if lv.enabled else "", int(weights + act + overhead), int(weights), act, time_factor)


def model_for(preset, source: Path | None, precision: str) -> Model:
    """The estimate's view of an engine: from its folder's headers, else from its config (components_from_config)."""
    import json

    if source is not None and Path(source).is_dir():
        comps = components_from_folder(Path(source))
        try:
            config = json.loads((Path(source) / preset.denoiser / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
    else:
        comps, config = components_from_config(preset), dict(preset.denoiser_config or {})
    return Model(comps, preset.denoiser, hidden_width(config), str(precision))


def options(model: Model, spec, width: int, height: int, overhead: int = 0) -> list[Estimate]:
    """Every lever set of CANDIDATES this device can run, with its estimate, fastest first."""
    from engine.pipeline import memory

    out = []
    for levers, factor in CANDIDATES:
        try:
            memory.check_levers(levers, spec, quantized=model.precision in QUANTIZED)
        except ShowcaseError:
            continue
        out.append(model.estimate(levers, width, height, spec.host_memory_is_device_memory, overhead, factor))
    return out


def choose(estimates: list[Estimate], free_bytes: int | None, policy: str) -> tuple[Estimate, str]:
    """(the lever set for `policy`, why): speed: none; memory: the smallest; auto: the fastest that fits
    `free_bytes` (none when nothing is known of the device's memory; the smallest when nothing fits)."""
    none = estimates[0]
    if policy == "speed" or len(estimates) == 1:
        return none, "speed: no memory lever"
    smallest = min(estimates, key=lambda e: (e.device_bytes, e.time_factor))
    if policy == "memory":
        return smallest, f"memory: the smallest estimate ({smallest.device_bytes / GIB:.2f} GiB)"
    if free_bytes is None:
        return none, "auto: the device reports no free memory, so no lever is needed to fit"
    for e in sorted(estimates, key=lambda e: e.time_factor):
        if e.device_bytes <= free_bytes:
            return e, (f"auto: {e.levers or 'no lever'} fits {free_bytes / GIB:.2f} GiB "
                       f"(≈ {e.device_bytes / GIB:.2f} GiB at ≈ {e.time_factor:g}× the time)")
    return smallest, (f"auto: nothing fits {free_bytes / GIB:.2f} GiB; the smallest, {smallest.levers}, "
                      f"needs ≈ {smallest.device_bytes / GIB:.2f} GiB")


@functools.lru_cache(maxsize=32)
def _model_at(preset, source: str, precision: str) -> Model:
    return model_for(preset, Path(source) if Path(source).is_dir() else None, precision)


def engine_model(config) -> Model:
    """The estimate's view of an engine `config` (its weights' headers, read once per source and precision);
    ShowcaseError where they cannot be read here."""
    from engine.config.resolve import resolve_source

    return _model_at(config.preset, resolve_source(config), str(config.key.precision))


def fitted_levers(config, spec, free_bytes: int | None, policy: str) -> tuple[str, str]:
    """(levers, why) for an engine `config` whose request and host name none, by `policy` (POLICIES), sized
    for its largest bucket; ("", why) where its weights cannot be read here."""
    try:
        model = engine_model(config)
    except ShowcaseError as exc:
        return "", f"{policy}: no estimate ({exc})"
    size = max(config.preset.buckets, key=lambda s: s.pixels)
    estimates = options(model, spec, size.width, size.height, spec.process_overhead_bytes)
    chosen, why = choose(estimates, free_bytes, policy)
    return chosen.levers, why


class EngineLevers:
    """The memory levers an engine key carries: those its caller named, else the host's (--memory-lever), else
    with --memory auto|memory the set fitted to the device's free memory (chosen once per key); checked
    against the device and the engine's layout, refused with the reason."""

    def __init__(self, recipe, budgets, config_for: Callable):
        self.recipe, self.budgets, self.config_for = recipe, budgets, config_for
        self.default = MemoryLevers.parse(recipe.memory).engine_part()
        self._fitted: dict = {}  # EngineKey -> the levers fitted for it

    def wanted(self, levers: str | None, host_decides: bool) -> str:
        """The engine part of the levers asked for (None: the host's), as key text; NotAllowed where a public
        host keeps the choice."""
        wanted = self.default if levers is None else MemoryLevers.parse(levers).engine_part()
        if host_decides and wanted != self.default:
            raise NotAllowed(f"memory levers are up to the host here (this host's: {self.default})")
        return str(wanted) if wanted.enabled else ""

    def settle(self, key, named: bool):
        """`key` with the levers fitted for it where nobody named any, checked where it runs."""
        from engine import devices
        from engine.pipeline.memory import check_levers

        if not named and not key.memory and self.recipe.memory_policy != "speed" and key.tp == 1:
            key = dataclasses.replace(key, memory=self.fitted(key))
        check_levers(key.memory, devices.get_device(key.device), tp=key.tp,
                     quantized=bool(key.precision and key.precision.quantized), cpu_offload=self.recipe.cpu_offload)
        return key

    def host_choice(self) -> str:
        """What an engine gets where nobody names levers: the host's set, "--memory auto|memory" or "" (none)."""
        if self.default.enabled:
            return str(self.default)
        return "" if self.recipe.memory_policy == "speed" else f"--memory {self.recipe.memory_policy}"

    def choices(self, key, mode) -> list[dict]:
        """Each lever set of CANDIDATES that engine `key` (its own levers aside) can take on its device, fastest
        first: its estimated peak and weights at the largest bucket (None where the weights cannot be read here),
        its price in time, and why it cannot run in `mode` or with the key's ranks ("" it can). The Generate
        page's memory field."""
        from engine import devices
        from engine.pipeline.memory import check_levers, excluded_mode

        spec, config = devices.get_device(key.device), self.config_for(key)
        try:
            model, unknown = engine_model(config), ""
        except ShowcaseError as exc:
            model, unknown = None, str(exc)
        size = max(config.preset.buckets, key=lambda s: s.pixels)
        rows = []
        for levers, factor in CANDIDATES:
            try:
                check_levers(levers, spec, tp=key.tp, quantized=str(key.precision) in QUANTIZED)
            except ShowcaseError as exc:
                if key.tp > 1 and levers:  # every set is refused the same way: say it once, on each row
                    rows.append({"levers": levers, "time_factor": factor, "why_not": str(exc)})
                continue
            est = None if model is None else model.estimate(levers, size.width, size.height,
                                                            spec.host_memory_is_device_memory,
                                                            spec.process_overhead_bytes, factor)
            rows.append({"levers": levers or "none", "time_factor": factor, "why_not": excluded_mode(levers, mode),
                         "device_bytes": est and est.device_bytes, "weights_bytes": est and est.weights_bytes,
                         "size": str(size), "unknown": unknown})
        return rows

    def fitted(self, key) -> str:
        """The levers --memory auto|memory picks for `key`, for the device's budget less what this process holds."""
        from engine import devices

        if key not in self._fitted:
            budget_bytes = self.budgets.device_budget(key.device).bytes
            free = None if budget_bytes is None else budget_bytes - self.budgets.app_bytes(key.device)
            levers, why = fitted_levers(self.config_for(key), devices.get_device(key.device), free,
                                        self.recipe.memory_policy)
            log.info("memory levers for %s: %s (%s)", key, levers or "none", why)
            self._fitted[key] = levers
        return self._fitted[key]


def lever_weights(config, weights: int) -> int:
    """What an engine with memory levers holds of `weights` (its key's levers applied to its estimate)."""
    from engine import devices

    try:
        model = engine_model(config)
    except ShowcaseError:
        return weights
    host = devices.get_device(config.key.device).host_memory_is_device_memory
    return min(weights, model.estimate(config.key.memory, 64, 64, host).weights_bytes)


def advice_line(preset_name: str, precision: str, estimates: list[Estimate]) -> str:
    """"flux1-dev bf16 needs ≈ 34 GB here; layerwise:fp8 ≈ 23 GB at ≈ 1.3× the time; ...", cheapest first."""
    none, rest = estimates[0], estimates[1:]
    parts = [f"{preset_name} {precision} needs ≈ {none.device_bytes / GIB:.1f} GiB"]
    parts += [f"{e.levers} ≈ {e.device_bytes / GIB:.1f} GiB at ≈ {e.time_factor:g}× the time"
              for e in sorted(rest, key=lambda e: e.time_factor) if e.device_bytes < none.device_bytes]
    return "; ".join(parts)


# Hosts the README's table is made for: (label, usable bytes, streams, host memory is the device's). Usable:
# the budget share of the memory (0.9 on a GPU; a Mac's GPU may use about two thirds of its unified memory,
# where offloading to host RAM frees nothing: it is the same memory).
HOSTS = (
    ("24 GB GPU", int(24e9 * 0.9), True, False), ("16 GB Mac", int(16e9 * 0.66), False, True),
    ("ZeroGPU slice (70 GB)", int(70e9 * 0.9), True, False), ("80 GB H100", int(80e9 * 0.9), True, False),
    ("141 GB H200", int(141e9 * 0.9), True, False),
)


def host_table(models: list[tuple[str, Model]], spec, width: int = 1024, height: int = 1024) -> str:
    """Markdown: model x host -> the lever set auto picks, its estimate and its price in time."""
    import dataclasses

    lines = ["| model | " + " | ".join(h[0] for h in HOSTS) + " |", "|---|" + "---|" * len(HOSTS)]
    for name, model in models:
        cells = []
        for _, usable, streams, unified in HOSTS:
            host = dataclasses.replace(spec, offload_streams=streams, host_memory_is_device_memory=False)
            rows = [dataclasses.replace(e, device_bytes=model.estimate(e.levers, width, height, unified).device_bytes)
                    for e in options(model, host, width, height)]
            pick, _ = choose(rows, usable, "auto")
            fits = pick.device_bytes <= usable
            cells.append(f"{pick.levers or 'none'} ({pick.device_bytes / 1e9:.1f} GB, {pick.time_factor:g}×)"
                         if fits else f"does not fit (smallest: {pick.levers}, {pick.device_bytes / 1e9:.1f} GB)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
