"""An engine's configuration (plain data, sent once to a worker or the sidecar)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from engine import settings
from engine.protocol.flagfields import NEGATED, OPTIONAL_BOOL, SWITCH, Decimal, OneOf, Whole, flag
from engine.protocol.memory import MemoryLevers, memory_forms
from engine.protocol.presets import ModelPreset
from engine.protocol.vocabulary import EngineKey, Mode


@dataclass(frozen=True)
class TestingOptions:
    """Test-only hooks of an engine, read by engine/pipeline/faults.py. The UI, the CLI and the app never set
    them, and nothing in a request does: an app's engines run with them off."""

    __test__: ClassVar[bool] = False  # not a pytest test class
    inject_faults: bool = False  # accept InjectFault messages (one-shot faults armed through the client)
    fail_compiles: bool = False  # every compile and aot build fails


MAX_BATCH = 64  # each batch size is one more graph per bucket, and the measuring run allocates the largest
MAX_BATCH_WAIT_MS = 10_000.0  # a request waits at most this long for others to share its call
MEMORY_POLICIES = ("speed", "auto", "memory")  # engine/serving/fit.py POLICIES


def memory_text(text) -> str:
    """A memory lever set (engine/protocol/memory.py) as its canonical text ("" none); InvalidRequest if bad."""
    levers = MemoryLevers.parse(text)
    return str(levers) if levers.enabled else ""


@dataclass(frozen=True)
class RecipeOptions:
    """How the pipeline computes: each field is one named recipe step (engine/pipeline/recipes.py), and the
    ones with a `flag` are the engine flags of the CLI and app.py (engine/config/flags.py), in this order."""

    fuse_qkv: bool = field(default=False, metadata=flag("fuse the denoiser's QKV projections", kind=SWITCH))
    channels_last: bool = field(default=False, metadata=flag("channels_last for UNet/VAE convolutions",
                                                             kind=SWITCH))
    # enable_model_cpu_offload(); then only regional compile is possible
    cpu_offload: bool = field(default=False, metadata=flag("model CPU offload (then only regional compile)",
                                                           kind=SWITCH))
    max_autotune: bool = field(default=False, metadata=flag("torch.compile mode=max-autotune (inductor)",
                                                            kind=SWITCH))
    # dynamic=True + use_duck_shape=False (not on static-shape devices)
    dynamic: bool = field(default=False, metadata=flag("dynamic-shape compile where the device allows", kind=SWITCH))
    # torch.compile mode="reduce-overhead" (CUDA graphs) for compile; triton.cudagraphs for aot. CUDA only.
    cuda_graphs: bool = field(default=False, metadata=flag(
        "CUDA graphs: compile with mode=reduce-overhead, aot with triton.cudagraphs (CUDA only)", kind=SWITCH))
    compile_vae: bool = field(default=True, metadata=flag("compile mode leaves vae.decode eager", kind=NEGATED,
                                                          name="--no-compile-vae", dest="no_compile_vae"))
    # The preset's LoRA adapters get a slot in the denoiser (engine/pipeline/lora.py). Off by default: the slot's
    # matmuls run on every step, styled or not (docs/benchmarks.md).
    loras: bool = field(default=False, metadata=flag(
        "give the preset's LoRA styles a hot-swap slot in the denoiser (off by default: the slot's matmuls run on "
        "every step, styled or not)", kind=SWITCH))
    # flux-fast inductor flags; None = the device's default
    inductor_flags: bool | None = field(default=None, metadata=flag("flux-fast inductor flags (default: on for CUDA)",
                                                                     kind=OPTIONAL_BOOL))
    # diffusers attention backend set on the denoiser (engine/pipeline/attention.py lists each one, usable or why not)
    attention_backend: str = field(default="native", metadata=flag(
        "diffusers attention backend of the denoiser (native, _native_flash, flex, flash, _flash_3_hub, sage, ...); "
        "`python -m engine attention` lists which can run here and why not", metavar="NAME",
        check=OneOf(None, "attention backend")))
    # The memory levers an engine gets when a request names none (engine/protocol/memory.py; "" none).
    memory: str = field(default="", metadata=flag(
        f"memory levers of the engines a request names none for, comma-separated: {memory_forms()} (`python -m "
        "engine memory-levers` lists which run here)", name="--memory-lever", dest="memory_lever", check=memory_text,
        metavar="LEVERS"))
    # When a request names no levers and `memory` is "": "speed" none, "auto" the fastest set whose estimate
    # fits the device's free memory, "memory" the smallest (engine/serving/fit.py).
    memory_policy: str = field(default="speed", metadata=flag(
        "the memory levers of an engine no --memory-lever or request names: speed (none), auto (the fastest set "
        "whose estimate fits the device's free memory), memory (the smallest); README has the table",
        name="--memory", check=OneOf(lambda: MEMORY_POLICIES, "memory policy")))
    # Embeddings of recent prompts kept per engine (engine/pipeline/prompts.py): at most this many, this many
    # MiB; 0 entries: off.
    prompt_cache_entries: int = field(default=64, metadata=flag(
        "keep the embeddings of the last N prompts per engine, so a repeated prompt skips the text encoders "
        "(default {default}, at most 256 MiB)", name="--prompt-cache", dest="prompt_cache",
        check=Whole(0, 4096, zero="off"), metavar="N"))
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
    max_batch: int | None = field(default=None, metadata=flag(
        "at most N queued requests that can share a denoiser call (same bucket, steps, guidance, step cache) run as "
        f"one pipeline call; 1 turns batching off, at most {MAX_BATCH} (default per device: "
        "{per_device[max_batch]})", check=Whole(1, MAX_BATCH), metavar="N"))
    batch_wait_ms: float = field(default=15.0, metadata=flag(
        "how long a request waits after it arrives for others to share its call (default {default:g}; requests "
        "queued behind a running call join at once)", check=Decimal(0, MAX_BATCH_WAIT_MS), metavar="MS"))
    # Off by default until a long run served step by step is as fast as its whole call (docs/architecture.md).
    step_scheduling: bool = field(default=False, metadata=flag(
        "serve requests a denoising step at a time where the pipeline family has a step function: a request "
        "joins or pauses a running one at a step boundary (off: every request is one whole pipeline call)",
        kind=SWITCH))


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

