"""An engine's configuration (plain data, sent once to a worker or the sidecar)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from engine import settings
from engine.protocol.presets import ModelPreset
from engine.protocol.vocabulary import EngineKey, Mode


@dataclass(frozen=True)
class TestingOptions:
    """Test-only hooks of an engine, read by engine/pipeline/faults.py. The UI, the CLI and the app never set
    them, and nothing in a request does: an app's engines run with them off."""

    __test__: ClassVar[bool] = False  # not a pytest test class
    inject_faults: bool = False  # accept InjectFault messages (one-shot faults armed through the client)
    fail_compiles: bool = False  # every compile and aot build fails


@dataclass(frozen=True)
class RecipeOptions:
    """How the pipeline computes: each field is one named recipe step (engine/pipeline/recipes.py)."""

    cpu_offload: bool = False  # enable_model_cpu_offload(); then only regional compile is possible
    channels_last: bool = False  # UNet / VAE convolutions in channels_last memory format
    fuse_qkv: bool = False  # fuse_qkv_projections() on the denoiser
    inductor_flags: bool | None = None  # flux-fast inductor flags; None = the device's default
    max_autotune: bool = False  # torch.compile mode="max-autotune" (inductor devices only)
    dynamic: bool = False  # dynamic=True + use_duck_shape=False (not on static-shape devices)
    compile_vae: bool = True  # compile vae.decode too in "compile" mode
    # diffusers attention backend set on the denoiser (engine/pipeline/attention.py lists each one, usable or why not)
    attention_backend: str = "native"
    # torch.compile mode="reduce-overhead" (CUDA graphs) for compile; triton.cudagraphs for aot. CUDA only.
    cuda_graphs: bool = False
    # The preset's LoRA adapters get a slot in the denoiser (engine/pipeline/lora.py). Off by default: the slot's
    # matmuls run on every step, styled or not (docs/benchmarks.md).
    loras: bool = False
    # The memory levers an engine gets when a request names none (engine/protocol/memory.py; "" none).
    memory: str = ""
    # When a request names no levers and `memory` is "": "speed" none, "auto" the fastest set whose estimate
    # fits the device's free memory, "memory" the smallest (engine/serving/fit.py).
    memory_policy: str = "speed"
    # Embeddings of recent prompts kept per engine (engine/pipeline/prompts.py): at most this many, this many
    # MiB; 0 entries: off.
    prompt_cache_entries: int = 64
    prompt_cache_mib: int = 256


@dataclass(frozen=True)
class WarmupOptions:
    """Which buckets an engine compiles at start-up, and how long a warm-up run is."""

    modes: tuple[Mode, ...] = (Mode.COMPILE,)  # modes whose buckets warm at start-up
    sizes: tuple[str, ...] | None = None  # None: every bucket of the preset; () none
    steps: int = 2

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(Mode.parse(m, "mode") for m in self.modes))


@dataclass(frozen=True)
class BatchingOptions:
    """Queueing and batching (engine/pipeline/batching.py): at most `max_batch` queued requests that can share
    one denoiser call run as one pipeline call (None: the device's default, DeviceSpec.max_batch; 1: off),
    gathered for up to `batch_wait_ms` after the first one arrives (and while the previous call runs)."""

    max_queue: int = 16  # pending requests per engine before "busy, retry"
    max_batch: int | None = None
    batch_wait_ms: float = 15.0


# An EngineOptions field given or read by its flat name (the flags' and presets' spelling): its config, its
# name there.
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    **{f.name: ("recipe", f.name) for f in dataclasses.fields(RecipeOptions)},
    "warm_modes": ("warmup", "modes"),
    "warm_sizes": ("warmup", "sizes"),
    "warm_steps": ("warmup", "steps"),
    **{f.name: ("batching", f.name) for f in dataclasses.fields(BatchingOptions)},
}
_PARTS = {"recipe": RecipeOptions, "warmup": WarmupOptions, "batching": BatchingOptions}


class _FlatField:
    """`options.warm_sizes` reads `options.warmup.sizes`; on the class, the field's default."""

    def __init__(self, name: str):
        self.part, self.field = FLAT_FIELDS[name]

    def __get__(self, options, owner=None):
        if options is None:
            return _PARTS[self.part].__dataclass_fields__[self.field].default
        return getattr(getattr(options, self.part), self.field)


@dataclass(frozen=True, init=False)
class EngineOptions:
    """Per-engine options, one small config per concern: the compile recipe, the start-up warm-up, queueing
    and batching, and the test hooks. Built from its configs (`EngineOptions(warmup=WarmupOptions(...))`) or
    from flat field names, as flags and presets spell them (`EngineOptions(warm_sizes=(), max_batch=1)`,
    `dataclasses.replace(options, cuda_graphs=True)`): a flat name replaces that field in its config, and reads
    back the same way (FLAT_FIELDS)."""

    recipe: RecipeOptions
    warmup: WarmupOptions
    batching: BatchingOptions
    testing: TestingOptions  # tests only: off in the app and the CLI

    def __init__(self, recipe: RecipeOptions | None = None, warmup: WarmupOptions | None = None,
                 batching: BatchingOptions | None = None, testing: TestingOptions | None = None, **flat):
        parts = {"recipe": recipe or RecipeOptions(), "warmup": warmup or WarmupOptions(),
                 "batching": batching or BatchingOptions()}
        changes: dict[str, dict] = {}
        for name, value in flat.items():
            if name not in FLAT_FIELDS:
                raise TypeError(f"EngineOptions got an unexpected keyword argument {name!r}")
            part, field_name = FLAT_FIELDS[name]
            changes.setdefault(part, {})[field_name] = value
        for part, values in changes.items():
            parts[part] = dataclasses.replace(parts[part], **values)
        for part, value in parts.items():
            object.__setattr__(self, part, value)
        object.__setattr__(self, "testing", testing or TestingOptions())


for _name in FLAT_FIELDS:
    setattr(EngineOptions, _name, _FlatField(_name))


@dataclass(frozen=True)
class EngineConfig:
    """Everything a worker needs to build its runner; picklable, sent once at start."""

    key: EngineKey
    preset: ModelPreset
    options: EngineOptions = field(default_factory=EngineOptions)
    cache_dir: str = ""
    allowed_roots: tuple[str, ...] = ()

    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else settings.cache_dir()

