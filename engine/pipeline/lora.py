"""LoRA adapters on a warm engine: each allowed adapter checked once, one slot hot-swapped in place.

An engine whose preset lists adapters (`ModelPreset.loras`) gets one LoRA slot in its denoiser before any
variant is built: `enable_lora_hotswap(target_rank=R)` (R: the preset's `lora_rank`, else the largest rank
among its adapters, read from their files), then the adapter targeting the most layers is loaded into the
slot. Every variant shares the slot: compile wraps the same module, regional and the step caches clone the
module tree and share its Parameters and scaling tensors, so a hot-swap (`load_lora_weights(...,
hotswap=True)`: weights copied into the slot's zero-padded tensors) reaches them all with no recompile.
A request's scale is written into the slot's scaling tensors (no recompile either); "no LoRA" is scale 0,
which adds an exact zero.

Fused (`LoraChoice.fused`, eager only): the adapter folded into the weights, so a step costs what it costs
with no LoRA. The fused denoiser is a structural clone whose LoRA layers are plain linears with weights of
their own (base + the slot's delta, refreshed when the adapter or scale changes: the "fuse"); every other
tensor is shared. It is a clone, not peft's in-place `merge`, because merging flips a flag on modules the
compiled graphs share and guard on (measured: the next compiled call recompiled) while a bucket may be
compiling on the warm-up thread, and because un-merging in bf16 does not give the base weights back
exactly. Its price is memory: a copy of the targeted layers (`fused_bytes`, reserved in the footprint).

What does not hot-swap, refused with the reason when the engine loads (the engine serves its other adapters):
an adapter with text-encoder layers (diffusers hot-swaps only the denoiser), one targeting layers outside the
first adapter's set (a compiled graph has no LoRA branch there), one of a rank above R (the slot's tensors
are R wide), one whose layers this denoiser lacks (made for another pipeline class), a file that cannot be
read. A swap that fails puts the previous adapter back.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import settings
from engine.errors import InvalidRequest, ModelLoadError, UnsupportedCombination
from engine.metrics import median
from engine.models import weights
from engine.protocol import EngineKey, LoraChoice, LoraInfo, LoraSource, ModelPreset

log = logging.getLogger(__name__)

SLOT = "style"  # the one adapter name every hot-swap fills
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def locate(source: LoraSource, allowed_roots: tuple[str, ...] = ()) -> Path:
    """The safetensors file of an adapter: a repo folder ("repo:..."), a local file or folder (inside the
    allowed model roots when any are set), or a Hub repo id (`weight_name` in it; offline: the local cache)."""
    text = source.source
    name = source.weight_name or DEFAULT_WEIGHT_NAME
    if text.startswith("repo:"):
        path = settings.data_path(text.removeprefix("repo:"))
    elif text.startswith(("/", ".", "~")):
        path = Path(text).expanduser().resolve()
        roots = [Path(r).resolve() for r in allowed_roots]
        if roots and not any(path == r or path.is_relative_to(r) for r in roots):
            raise ModelLoadError(f"LoRA {source.name!r}: its file is outside the allowed model roots; add its "
                                 "folder with --model-root")
    elif _HUB_ID.fullmatch(text):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return Path(hf_hub_download(text, name))
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
            raise ModelLoadError(f"LoRA {source.name!r}: {name} of Hub repo {text!r} could not be fetched "
                                 f"({type(exc).__name__}); download it first when offline") from None
    else:
        raise ModelLoadError(f"LoRA {source.name!r}: source {text!r} is neither 'repo:FOLDER', a path nor a Hub "
                             "repo id 'org/name'")
    path = path / name if path.is_dir() else path
    if not path.is_file():
        raise ModelLoadError(f"LoRA {source.name!r}: no file {path.name} at its source {text!r}")
    return path


@dataclass(frozen=True)
class Adapter:
    """One adapter as read from its file (tensors are read again at each swap: the page cache keeps them)."""

    source: LoraSource
    path: Path
    rank: int
    layers: frozenset[str]  # the denoiser's modules it targets


def inspect(source: LoraSource, path: Path, pipe, denoiser_name: str) -> Adapter:
    """Read an adapter's file and check it fits this pipeline's denoiser; raises what to change."""
    try:
        header = weights.read_header(path)  # a truncated or corrupt file is named before torch reads it
    except weights.CorruptWeights as exc:
        raise ModelLoadError(f"LoRA {source.name!r}: {exc}; replace the file (download or train it again)") from None
    try:
        state = type(pipe).lora_state_dict(str(path.parent), weight_name=path.name)
    except Exception as exc:  # noqa: BLE001 - diffusers raises many kinds for a file it cannot convert
        raise ModelLoadError(f"LoRA {source.name!r} cannot be read as a {type(pipe).__name__} LoRA "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
                             f"use an adapter trained for this model") from None
    if isinstance(state, tuple):
        state = state[0]
    keys = [k for k in state if "lora" in k]
    if not keys:
        raise ModelLoadError(f"LoRA {source.name!r}: {path.name} holds no LoRA weights ({len(header) - 1} tensors, "
                             "none named lora_*)")
    encoder_keys = [k for k in keys if k.startswith(("text_encoder", "te_", "lora_te"))]
    if encoder_keys:
        raise UnsupportedCombination(
            f"LoRA {source.name!r} also adapts the text encoder ({encoder_keys[0]}): diffusers hot-swaps only the "
            f"{denoiser_name}, so it cannot be switched on warm graphs; use a {denoiser_name}-only adapter")
    denoiser = getattr(pipe, denoiser_name)
    modules = {name for name, _ in denoiser.named_modules()}
    layers, foreign = set(), []
    for key in keys:
        inner = key.removeprefix(f"{denoiser_name}.")
        layer = inner.split(".lora_")[0]
        if inner == key or layer not in modules:
            foreign.append(key)
        else:
            layers.add(layer)
    if foreign:
        raise InvalidRequest(
            f"LoRA {source.name!r} was made for another pipeline: {len(foreign)} of its weights name layers this "
            f"{type(pipe).__name__}'s {denoiser_name} lacks (e.g. {foreign[0]}); use an adapter trained for "
            f"{type(pipe).__name__}")
    ranks = [int(state[k].shape[0]) for k in keys if ".lora_A." in k]
    return Adapter(source, path, max(ranks, default=0), frozenset(layers))


@dataclass
class SlotState:
    adapter: str | None = None  # what the slot holds (its weights), even at scale 0
    scale: float = 0.0
    swaps: int = 0
    swap_ms: list[float] = field(default_factory=list)
    recompiles: int = 0  # compiles during requests on warm compiled buckets (the runner's count per call)
    fused: tuple[str, float] | None = None  # (adapter, scale) the fused copy holds
    fuses: int = 0
    fuse_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SlotChange:
    """What a call waited for before its first step: a hot-swap, a fuse (None: nothing to do)."""

    swap_ms: float | None = None
    fuse_ms: float | None = None


class LoraSlot:
    """The adapters of one engine and the slot they are hot-swapped into. `select` runs under the engine's
    run lock (one request on the device at a time)."""

    def __init__(self, pipe, preset: ModelPreset, adapters: dict[str, Adapter], refused: dict[str, str],
                 target_rank: int):
        self.pipe = pipe
        self.preset = preset
        self.adapters = adapters
        self.refused = refused
        self.target_rank = target_rank
        self.state = SlotState()
        self._base_scaling: dict[int, float] = {}
        self._lock = threading.Lock()
        self._fused_pipe = None
        self._fused_layers: list[tuple[object, torch.nn.Linear]] = []  # (slot layer, its fused linear)

    @classmethod
    def prepare(cls, pipe, preset: ModelPreset, allowed_roots: tuple[str, ...] = ()) -> tuple[LoraSlot, list[str]]:
        """Check every adapter of the preset and load the widest into the slot, at scale 0 (no LoRA yet).
        Must run before any variant is compiled or cloned."""
        adapters, refused, notices = {}, {}, []
        for source in preset.loras:
            try:
                adapters[source.name] = inspect(source, locate(source, allowed_roots), pipe, preset.denoiser)
            except (ModelLoadError, InvalidRequest, UnsupportedCombination) as exc:
                refused[source.name] = str(exc)
        target = preset.lora_rank or max((a.rank for a in adapters.values()), default=0)
        for name, adapter in list(adapters.items()):
            if adapter.rank > target:
                refused[name] = (f"LoRA {name!r} has rank {adapter.rank}, above this engine's hot-swap rank {target}: "
                                 f"raise lora_rank to {adapter.rank} in preset {preset.name!r} (every adapter is "
                                 f"padded to it), or use an adapter of rank <= {target}")
                del adapters[name]
        first = max(adapters.values(), key=lambda a: (len(a.layers), a.rank), default=None)
        for name, adapter in list(adapters.items()):
            outside = adapter.layers - first.layers
            if outside:
                refused[name] = (f"LoRA {name!r} targets {len(outside)} layer(s) the widest adapter "
                                 f"{first.source.name!r} does not (e.g. {sorted(outside)[0]}); a hot-swap can only "
                                 "fill the first adapter's layers: train it on the same layers or a subset, or "
                                 "serve it from a preset of its own")
                del adapters[name]
        notices += [f"LoRA refused: {reason}" for reason in refused.values()]
        slot = cls(pipe, preset, adapters, refused, target)
        if first is not None:
            pipe.enable_lora_hotswap(target_rank=target)
            start = time.perf_counter()
            slot._load(first.source.name, hotswap=False)
            slot.set_scale(0.0)
            notices.append(f"LoRA: {len(adapters)} adapter(s) hot-swappable at rank {target} "
                           f"({', '.join(adapters)}); slot loaded in {1000 * (time.perf_counter() - start):.0f} ms")
        return slot, notices

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.preset.loras)

    def check(self, name: str | None, scale: float | None) -> tuple[str | None, float]:
        """(adapter, scale) a request runs with, or the error naming what to pick instead."""
        if name is None:
            return None, 0.0
        if name in self.refused:
            raise UnsupportedCombination(self.refused[name])
        if name not in self.adapters:
            offered = ", ".join(self.adapters) or "none"
            raise InvalidRequest(f"unknown LoRA {name!r} for {self.preset.name}: choose one of {offered} "
                                 "(or none)")
        return name, self.adapters[name].source.scale if scale is None else scale

    def _layers(self):
        from peft.tuners.lora import LoraLayer

        return [m for m in getattr(self.pipe, self.preset.denoiser).modules()
                if isinstance(m, LoraLayer) and SLOT in m.scaling]

    def _load(self, name: str, hotswap: bool) -> None:
        adapter = self.adapters[name]
        self.pipe.load_lora_weights(str(adapter.path.parent), weight_name=adapter.path.name, adapter_name=SLOT,
                                    hotswap=hotswap)
        # The scaling each layer got from the adapter's alpha / rank: a request's scale multiplies it.
        self._base_scaling = {id(m): float(m.scaling[SLOT]) for m in self._layers()}
        self.state.adapter = name

    def set_scale(self, scale: float) -> None:
        for module in self._layers():
            module.scaling[SLOT].fill_(self._base_scaling.get(id(module), 0.0) * scale)
        self.state.scale = scale

    def select(self, choice: LoraChoice) -> SlotChange:
        """Put `choice`'s adapter at its scale in the slot (no adapter: scale 0) and, when it is fused, into
        the fused copy. A failed swap restores the previous adapter and raises."""
        with self._lock:
            swap_ms = None
            name = choice.name
            scale = 0.0 if name is None else choice.scale if choice.scale is not None else self.adapters[name].source.scale
            if name is not None and name != self.state.adapter:
                swap_ms = self._swap(name)
            if scale != self.state.scale or swap_ms is not None:
                self.set_scale(scale)
            fuse_ms = self._fuse(name, scale) if choice.fused else None
            return SlotChange(swap_ms, fuse_ms)

    def _swap(self, name: str) -> float:
        previous = self.state.adapter
        start = time.perf_counter()
        try:
            self._load(name, hotswap=True)
        except Exception as exc:
            log.warning("LoRA swap to %s failed (%s); restoring %s", name, exc, previous)
            if previous is not None:
                self._load(previous, hotswap=True)
            self.set_scale(self.state.scale)
            raise UnsupportedCombination(f"LoRA {name!r} could not be swapped in ({type(exc).__name__}: "
                                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); the engine "
                                         f"keeps serving with {previous or 'no LoRA'}") from None
        swap_ms = 1000 * (time.perf_counter() - start)
        self.state.swaps += 1
        self.state.swap_ms.append(swap_ms)
        return swap_ms

    # -- fused ------------------------------------------------------------------------------------
    @property
    def fused_bytes(self) -> int:
        """The fused copy's weights: what fused mode holds beyond the engine's own (reserved up front)."""
        return sum(layer.base_layer.weight.numel() * layer.base_layer.weight.element_size()
                   for layer in self._layers())

    def fused_pipeline(self, eager_pipe):
        """The eager pipeline over the fused denoiser (built once, on the first fused call)."""
        if self._fused_pipe is None:
            from engine.pipeline.modes import clone_module_tree
            from engine.pipeline.variants import pipeline_over

            denoiser = clone_module_tree(getattr(eager_pipe, self.preset.denoiser))
            self._fused_layers = _fused_linears(denoiser)
            self._fused_pipe = pipeline_over(eager_pipe, **{self.preset.denoiser: denoiser})
        return self._fused_pipe

    def _fuse(self, name: str | None, scale: float) -> float | None:
        """Fold the slot (now holding `name` at `scale`) into the fused copy; None when it already holds it."""
        if self.state.fused == (name, scale):
            return None
        if self._fused_pipe is None:
            raise RuntimeError("fused LoRA: fused_pipeline() builds the fused copy before a fused select()")
        start = time.perf_counter()
        with torch.no_grad():
            for layer, fused in self._fused_layers:
                base = layer.base_layer.weight
                if name is None or scale == 0:
                    fused.weight.copy_(base)
                else:
                    fused.weight.copy_(base + layer.get_delta_weight(SLOT).to(base.dtype))
        fuse_ms = 1000 * (time.perf_counter() - start)
        self.state.fused = (name, scale)
        self.state.fuses += 1
        self.state.fuse_ms.append(fuse_ms)
        return fuse_ms

    def rank(self, name: str | None) -> int | None:
        return self.adapters[name].rank if name in self.adapters else None

    def served(self, recompiles: int) -> None:
        """A call on a warm compiled bucket ran with the slot, compiling `recompiles` graphs (0 after a hot-swap)."""
        self.state.recompiles += recompiles

    def info(self, engine: EngineKey) -> LoraInfo:
        """The slot as the board shows it (sent to the app after each call that changed it)."""

        return LoraInfo(engine, adapters=tuple(self.adapters), refused=tuple(self.refused),
                        target_rank=self.target_rank, current=self.state.adapter if self.state.scale > 0 else None,
                        scale=self.state.scale, swaps=self.state.swaps, median_swap_ms=median(self.state.swap_ms),
                        recompiles=self.state.recompiles, fuses=self.state.fuses,
                        median_fuse_ms=median(self.state.fuse_ms), fused_bytes=self.fused_bytes)


def _fused_linears(denoiser: torch.nn.Module) -> list[tuple[object, torch.nn.Linear]]:
    """Replace each slot layer of a cloned denoiser by a plain linear with a weight of its own (its bias and
    every other tensor stay shared); returns (slot layer, fused linear) pairs."""
    from peft.tuners.lora import LoraLayer

    pairs = []
    for parent in list(denoiser.modules()):
        for child_name, child in list(parent._modules.items()):
            if not (isinstance(child, LoraLayer) and SLOT in child.scaling):
                continue
            base = child.base_layer
            if not isinstance(base, torch.nn.Linear) or child.use_dora.get(SLOT):
                raise UnsupportedCombination(f"a fused LoRA needs plain linear layers; {child_name} is a "
                                             f"{type(base).__name__}{' with DoRA' if child.use_dora.get(SLOT) else ''}"
                                             ": run the LoRA unfused")
            fused = torch.nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            fused.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
            fused.bias = base.bias  # shared: a LoRA does not change it
            parent._modules[child_name] = fused
            pairs.append((child, fused))
    return pairs
