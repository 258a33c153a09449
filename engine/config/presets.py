"""Model and resolution presets (data in presets/*.toml) and request routing to buckets.

Routing is a pure function that mirrors the pipelines' own limits (sizes divisible by
vae_scale_factor * 2), so it is tested with parametrised cases and needs no model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from functools import cache
from pathlib import Path

from engine import settings
from engine.config.video import check_frame_buckets
from engine.errors import InvalidRequest, ModelLoadError
from engine.families import registry
from engine.protocol import ImageInputs, LoraSource, ModelPreset, Size

MAX_SIDE = 4096


# A preset's switches (cfg, negative_prompt, tp, ...): its true-or-false fields, false unless models.toml sets them
SWITCHES = tuple(f.name for f in dataclasses.fields(ModelPreset) if f.type == "bool")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@cache
def _family_buckets() -> dict[str, tuple[Size, ...]]:
    data = tomllib.loads((settings.PRESETS_DIR / "resolutions.toml").read_text())
    return {fam: tuple(Size.parse(s) for s in d["buckets"]) for fam, d in data.items()}


def family_buckets(family: str) -> tuple[Size, ...]:
    table = _family_buckets()
    return table.get(family, table["default"])


def _check_buckets(name: str, buckets: tuple[Size, ...], alignment: int) -> None:
    for b in buckets:
        if b.width % alignment or b.height % alignment:
            raise ValueError(f"preset {name}: bucket {b} is not divisible by its alignment {alignment}")


@cache
def load_presets() -> dict[str, ModelPreset]:
    data = tomllib.loads((settings.PRESETS_DIR / "models.toml").read_text())
    presets = {}
    for name, d in data.items():
        buckets = tuple(Size.parse(s) for s in d.get("buckets", ())) or family_buckets(d["family"])
        _check_buckets(name, buckets, d["alignment"])
        presets[name] = ModelPreset(
            name=name,
            pipeline=d["pipeline"],
            source=d["source"],
            family=d["family"],
            denoiser=d["denoiser"],
            steps=int(d["steps"]),
            guidance=float(d["guidance"]),
            buckets=buckets,
            alignment=int(d["alignment"]),
            **{name: bool(d.get(name, False)) for name in SWITCHES},
            min_tp=int(d.get("min_tp", 1)),
            max_sequence_length=d.get("max_sequence_length"),
            description=d.get("description", ""),
            repeated_blocks=tuple(d.get("repeated_blocks", ())),
            fidelity=d.get("fidelity"),
            examples=tuple(d.get("examples", ())),
            advice=dict(d.get("advice", {})),
            options=dict(d.get("options", {})),
            denoiser_config=d.get("denoiser_config"),
            loras=_loras(name, d.get("loras", ())),
            lora_rank=d.get("lora_rank"),
            frames=check_frame_buckets(name, d.get("frames", ()), int(d.get("frame_step", 4))),
            frame_step=int(d.get("frame_step", 4)),
            fps=int(d.get("fps", 16)),
            **_image_inputs(name, d),
            vae=d.get("vae"),
        )
    return presets


def _image_inputs(name: str, d: dict) -> dict:
    """A preset's `inputs`, `max_references` and `base_pipeline` (defaults: its pipeline family's)."""
    family = registry.find(d["pipeline"])
    if family is None:
        raise ValueError(f"preset {name}: pipeline {d['pipeline']!r} has no family; declare it in a module of "
                         f"engine/families/ (registered: {', '.join(f.pipeline for f in registry.families())})")
    inputs, most = family.inputs, family.max_images
    inputs = ImageInputs.parse(d.get("inputs", inputs), name)
    most = int(d.get("max_references", most if inputs.takes_images else 0))
    if inputs.takes_images and most < 1 or not inputs.takes_images and most:
        raise ValueError(f"preset {name}: max_references {most} does not fit inputs {inputs}")
    if inputs in (ImageInputs.EDIT, ImageInputs.IMG2IMG, ImageInputs.INPAINT, ImageInputs.FIRST_FRAME) and most != 1:
        raise ValueError(f"preset {name}: {inputs} takes one image; set max_references = 1")
    if inputs is ImageInputs.FIRST_FRAME and not d.get("frames", True):
        raise ValueError(f"preset {name}: {inputs} starts a clip; give the preset its frame buckets (frames)")
    base = d.get("base_pipeline")
    if base and base != family.base:
        raise ValueError(f"preset {name}: {family.pipeline} is built over "
                         f"{family.base or 'its own folder'}, not {base}; set base_pipeline to match")
    return {"inputs": inputs, "max_references": most, "base_pipeline": base}


def _loras(preset: str, table) -> tuple[LoraSource, ...]:
    """A preset's `[[NAME.loras]]` entries (name, source, weight_name, scale, trigger, description)."""
    fields = ", ".join(f.name for f in dataclasses.fields(LoraSource))
    loras = []
    for entry in table:
        try:
            loras.append(LoraSource(**entry))
        except TypeError as exc:
            raise InvalidRequest(f"preset {preset}: a loras entry is wrong ({exc}); its keys are {fields}") from None
    names = [lora.name for lora in loras]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"preset {preset}: two loras entries share a name ({', '.join(names)})")
    return tuple(loras)


def get_preset(name: str) -> ModelPreset:
    presets = load_presets()
    if name not in presets:
        raise InvalidRequest(f"unknown preset {name!r}; choose one of: {', '.join(presets)}")
    return presets[name]


def looks_like_model_ref(ref: str) -> bool:
    """A Hub id ('org/name') or a filesystem path rather than a preset name."""
    return "/" in ref or ref.startswith((".", "~"))


def preset_for_model(ref: str, allowed_roots: list[Path] | None = None, buckets: str | None = None) -> ModelPreset:
    """A preset for any local diffusers folder or Hub id (`--model`), buckets from its family.

    Local folders must lie under one of `allowed_roots` (the configured model roots) so a web user
    cannot point the server at arbitrary paths. Remote code is never trusted: a model_index.json that
    names a custom pipeline is refused.
    """
    ref = str(ref).strip()
    shown = ref if len(ref) <= 80 else ref[:77] + "..."

    def unreadable(exc: Exception) -> InvalidRequest:  # ~nosuchuser, a name too long for the file system
        return InvalidRequest(f"model {shown!r} is not a readable local folder ({getattr(exc, 'strerror', None) or exc}); "
                              "name a preset, a Hub id like 'org/name' or a folder under the model roots")

    try:
        path = Path(ref).expanduser()
        local = path.exists() or ref.startswith((".", "/", "~"))
    except (RuntimeError, OSError) as exc:
        raise unreadable(exc) from None
    if local:
        try:
            index = _local_model_index(path, allowed_roots)
            source = str(path.resolve())
        except OSError as exc:
            raise unreadable(exc) from None
    elif _HUB_ID.match(ref):
        index = _hub_model_index(ref)
        source = ref
    else:
        raise InvalidRequest(f"model {shown!r} is neither an existing local folder nor a Hub id like 'org/name'")
    cls = index.get("_class_name", "")
    family = None if isinstance(cls, list) or "custom_pipeline" in index else registry.find(cls)
    if family is None:
        raise ModelLoadError(
            f"model {ref!r} uses pipeline {cls!r}, which needs remote code or is not supported; supported "
            f"pipelines: {', '.join(f.pipeline for f in registry.families())} (remote code is never trusted)"
        )
    bucket_sizes = (
        tuple(Size.parse(s) for s in buckets.split(",")) if buckets else family_buckets(family.bucket_family)
    )
    _check_buckets(ref, bucket_sizes, family.alignment)
    return ModelPreset(
        name=ref,
        pipeline=cls,
        source=source,
        family=family.bucket_family,
        denoiser=family.denoiser,
        alignment=family.alignment,
        cfg=family.cfg,
        negative_prompt=family.takes_negative,
        steps=family.steps,
        guidance=family.guidance,
        buckets=bucket_sizes,
        tp=family.denoiser == "transformer",
        description=f"{cls} from {ref}",
        frames=family.frames,
        frame_step=family.frame_step,
        fps=family.fps,
        **_image_inputs(ref, {"pipeline": cls, "frames": family.frames}),
    )


def check_local_path(path: Path, allowed_roots: list[Path] | None) -> Path:
    resolved = path.expanduser().resolve()
    roots = [r.resolve() for r in (allowed_roots if allowed_roots is not None else settings.model_roots())]
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        allowed = ", ".join(str(r) for r in roots) or "(none configured)"
        raise ModelLoadError(
            f"local model path {str(path)!r} is outside the allowed model roots {allowed}; "
            "add its parent with --model-root or SHOWCASE_MODEL_ROOTS"
        )
    if not resolved.is_dir():
        raise ModelLoadError(f"local model path {str(path)!r} does not exist or is not a folder")
    return resolved


def _local_model_index(path: Path, allowed_roots: list[Path] | None) -> dict:
    folder = check_local_path(path, allowed_roots)
    index = folder / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(f"{str(path)!r} is not a diffusers pipeline folder (no model_index.json)")
    return json.loads(index.read_text())


def _hub_model_index(repo_id: str) -> dict:
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(repo_id, "model_index.json")).read_text())
    except Exception as exc:  # offline, gated, missing: all mean "can't load this here"
        hint = "it is not in the local Hugging Face cache and the Hub is offline" if settings.hf_offline() else str(exc)
        raise ModelLoadError(
            f"cannot reach Hub model {repo_id!r}: {hint}; download it first (huggingface-cli download) "
            "or pass a local folder"
        ) from None


def route_size(preset: ModelPreset, width, height, snap: bool = True) -> tuple[Size, tuple[str, ...]]:
    """Map a requested size to one of the preset's buckets.

    An exact bucket is used as is. Otherwise, with `snap`, the nearest bucket wins: closest aspect
    ratio (log scale) first, then closest pixel count; without `snap` the size is refused with the list.
    """
    sizes = ", ".join(str(b) for b in preset.buckets)
    try:
        w, h = int(width), int(height)
        if w != float(width) or h != float(height):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(f"size {width}x{height} must be whole pixels; pick one of: {sizes}") from None
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE):
        raise InvalidRequest(f"size {w}x{h} is outside 1..{MAX_SIDE} pixels a side; pick one of: {sizes}")
    requested = Size(w, h)
    if requested in preset.buckets:
        return requested, ()
    if not snap:
        raise InvalidRequest(f"size {requested} is not a bucket of {preset.name}; pick one of: {sizes}")

    def distance(b: Size) -> tuple[float, float]:
        return (abs(math.log(b.width / b.height) - math.log(w / h)), abs(math.log(b.pixels / requested.pixels)))

    best = min(preset.buckets, key=distance)
    return best, (f"size {requested} snapped to the nearest bucket {best}",)
