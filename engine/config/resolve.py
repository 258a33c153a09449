"""Presets, engine keys and configs resolved from user input: shared by the manager and the sidecar.

`Catalog` knows the presets (the shipped ones, plus any Hub id or local folder a user may name) and
turns (preset, device, precision, tp) into a validated `EngineKey` and an `EngineConfig`. It starts
nothing, so the tensor-parallel sidecar resolves its own config with it without an EngineManager.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

from engine import settings
from engine.config.placement import ANYWHERE, Placement, split_device
from engine.config.presets import (
    check_local_path,
    get_preset,
    load_presets,
    looks_like_model_ref,
    preset_for_model,
)
from engine.config.validation import check_precision
from engine.errors import DeviceUnavailable, InvalidRequest, ModelLoadError
from engine.protocol import EngineConfig, EngineKey, EngineOptions, ModelPreset, Parallel


class Catalog:
    def __init__(self, allowed_roots: list[Path] | None = None, extra_presets: dict[str, ModelPreset] | None = None):
        self.allowed_roots = [Path(r) for r in (allowed_roots if allowed_roots is not None else settings.model_roots())]
        self.presets: dict[str, ModelPreset] = {**load_presets(), **(extra_presets or {})}
        self._lock = threading.Lock()
        # Engines on a Ray cluster (engine/fleet/): (device, placement) -> why no node has it (None: one has).
        # Set, it replaces this machine's probe: a device lives where the fleet's nodes are, not here.
        self.fleet_lacks: Callable[[str, Placement], str | None] | None = None

    def preset(self, name: str) -> ModelPreset:
        """A preset by name, or any Hub id / local diffusers folder under the allowed model roots."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest(f"preset must be a name; choose one of: {', '.join(self.presets)}")
        if name in self.presets:
            return self.presets[name]
        if not looks_like_model_ref(name):
            return get_preset(name)  # raises InvalidRequest listing the presets
        preset = preset_for_model(name, self.allowed_roots)  # ModelLoadError says why not
        with self._lock:
            self.presets.setdefault(preset.name, preset)
        return self.presets[preset.name]

    def make_key(self, preset: str, device: str, precision: str, tp: int = 1, parallel: str = "tensor",
                 memory: str = "") -> EngineKey:
        """Validate and resolve an engine key ("auto" -> the best available device). `parallel` is how tp > 1
        ranks split the denoiser; whether the model allows it is checked before anything loads
        (engine/tp/plan.py)."""
        from engine import devices  # imports torch: only when a key is really made

        p = self.preset(preset)
        precision = check_precision(precision)
        name, placement = split_device(device)
        spec = self.device(name, placement)  # InvalidRequest / DeviceUnavailable with the reason
        if spec.probe().available:  # a device only a node has plans its precision there, as it loads
            devices.plan_precision(spec, precision)  # UnsupportedCombination with the reason
        place = str(placement)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InvalidRequest(f"tp must be a whole number >= 1, got {tp!r}")
        parallel = Parallel.parse(parallel, "parallel")
        if tp > 1 and parallel.context:
            if p.min_tp > 1:
                raise InvalidRequest(f"preset {p.name} needs its weights sharded over at least {p.min_tp} ranks, and "
                                     f"{parallel} (context parallel) keeps the whole denoiser on every rank; use "
                                     "--parallel tensor")
            return EngineKey(p.name, spec.name, precision, tp, parallel, memory=memory, place=place)
        if tp > 1 and not p.tp:
            raise InvalidRequest(f"preset {p.name} has no tensor-parallel plan; use tp=1")
        if tp < p.min_tp:
            raise InvalidRequest(f"preset {p.name} needs tensor parallel over at least {p.min_tp} ranks (--tp {p.min_tp})")
        return EngineKey(p.name, spec.name, precision, tp, memory=memory, place=place)

    def device(self, name: str, placement: Placement = ANYWHERE):
        """The spec of `name` ("auto": the best available), here or, under a fleet, on a node at `placement`;
        DeviceUnavailable saying why not (a placement without a fleet included)."""
        from engine import devices

        if self.fleet_lacks is None:
            if placement:
                raise InvalidRequest(f"device placement {placement} needs a Ray cluster (start the app with --ray); "
                                     "name the device alone")
            return devices.resolve_device(name)
        if str(name).strip().lower() == "auto":
            for spec in devices.registry().values():
                if self.fleet_lacks(spec.name, placement) is None:
                    return spec
            where = f" at {placement}" if placement else ""
            raise DeviceUnavailable(f"no node of the Ray cluster{where} has a device the showcase runs on")
        spec = devices.get_device(str(name).strip().lower())
        if (why := self.fleet_lacks(spec.name, placement)) is not None:
            raise DeviceUnavailable(f"{spec.label} [{spec.name}] is not available: {why}")
        return spec

    def options_for(self, key: EngineKey, base: EngineOptions) -> EngineOptions:
        """`base`, then the preset's per-device options (e.g. CPU offload on one v6e)."""
        preset_options = self.preset(key.preset).options.get(key.device, {})
        return dataclasses.replace(base, **preset_options) if preset_options else base

    def config(self, key: EngineKey, options: EngineOptions, cache_dir: Path) -> EngineConfig:
        return EngineConfig(key=key, preset=self.preset(key.preset), options=options, cache_dir=str(cache_dir),
                            allowed_roots=tuple(str(r) for r in self.allowed_roots))


def resolve_source(config: EngineConfig) -> str:
    """What from_pretrained loads: a random-weight tiny pipeline (built here once), a model committed in this
    repository, a checked local folder, or a Hub id."""
    preset = config.preset
    if preset.random_tiny:
        from engine.models.tiny import ensure_tiny_pipeline

        return str(ensure_tiny_pipeline(preset.random_tiny, settings.models_dir(config.cache_path())))
    return _resolve_folder(config, preset.source)


def resolve_vae_source(config: EngineConfig) -> str | None:
    """The folder (or Hub id) whose `vae/` the preset loads in place of its source's (its `vae` row), or None."""
    return _resolve_folder(config, config.preset.vae) if config.preset.vae else None


def _resolve_folder(config: EngineConfig, ref: str) -> str:
    """A "repo:" folder of this repository (it must be complete), a checked absolute folder, or a Hub id."""
    preset = config.preset
    if ref.startswith("repo:"):
        folder = settings.data_path(ref.removeprefix("repo:"))
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(f"preset {preset.name}: its model folder {folder} is missing or incomplete; "
                                 "restore it from the repository (git checkout -- models) or rebuild it with "
                                 "`python -m training.train_embedded`")
        return str(folder)
    if Path(ref).is_absolute():
        roots = [Path(r) for r in config.allowed_roots] or None
        return str(check_local_path(Path(ref), roots))
    return ref
