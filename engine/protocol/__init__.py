"""The one contract between the app, the engines and the tensor-parallel sidecar.

Everything that crosses a process boundary is defined here as a frozen dataclass or an enum: the
vocabularies (precision, mode, on-cold policy), the records (sizes, keys, bucket states, requests,
results, timings), the engine's configuration (`EngineConfig`, `EngineOptions`, `ModelPreset`), and
the messages of the worker protocol (client <-> engine) and of the tensor-parallel operations (rank 0
-> every rank). The same objects travel unchanged to a worker process per device and to the torchrun
sidecar (they pickle), so callers only ever see these types.

Nothing here imports torch or gradio: `app.py --help` and `python -m engine presets` stay fast.

    vocabulary.py   closed vocabularies (precision, mode, layout, on-cold, step caches), sizes, engine and
                    bucket keys, a bucket's board row
    presets.py      model presets and their LoRA adapters
    options.py      EngineConfig and EngineOptions, composed of one small config per concern
    requests.py     requests, results, timings, progress, footprints, what a loaded engine announces
    messages.py     the worker protocol's messages and the tensor-parallel operations

Every name is re-exported here: callers import from `engine.protocol`, never from a module of it.
"""

from __future__ import annotations

from engine.metrics import median
from engine.protocol.memory import MAX_BLOCKS_PER_GROUP, MemoryLevers, memory_forms
from engine.protocol.messages import (
    BucketChanged,
    Cancel,
    CompileFinished,
    CompileGranted,
    CompileWanted,
    Fatal,
    Fault,
    FoldersChanged,
    FootprintChanged,
    Generate,
    InjectFault,
    LoraChanged,
    Progress,
    RankExit,
    Ready,
    RequestFailed,
    Result,
    Shutdown,
    TPOp,
    TPOpKind,
    Warm,
    dispatch,
)
from engine.protocol.options import (
    FLAT_FIELDS,
    BatchingOptions,
    EngineConfig,
    EngineOptions,
    RecipeOptions,
    TestingOptions,
    WarmupOptions,
)
from engine.protocol.presets import (
    DEFAULT_PRESET,
    DEFAULT_STRENGTH,
    GENERIC_PROMPT,
    LORA_SCALE_RANGE,
    RANDOM_TINY_PREFIXES,
    RANDOM_WEIGHTS_NOTE,
    ImageInputs,
    LoraChoice,
    LoraSource,
    ModelPreset,
    Task,
    lora_run_text,
    parse_lora,
)
from engine.protocol.requests import (
    EngineReady,
    Footprint,
    GenerateRequest,
    GenerateResult,
    Pause,
    PixelImage,
    StepProgress,
    Timings,
    decode_mp4,
    denoise_steps,
)
from engine.protocol.stepcaches import (
    NO_STEP_CACHE,
    STEP_CACHES,
    CacheParam,
    CacheRun,
    ParamRange,
    StepCache,
    StepCacheEntry,
    StepCacheKind,
    step_cache_forms,
)
from engine.protocol.vocabulary import (
    MAX_STEPS,
    BucketInfo,
    BucketKey,
    BucketState,
    EngineKey,
    LoraInfo,
    Mode,
    OnCold,
    Parallel,
    Precision,
    Size,
    parse_ranks,
    ranks_choice,
)

__all__ = [
    "FLAT_FIELDS",
    "BatchingOptions",
    "RecipeOptions",
    "WarmupOptions",
    "BucketChanged",
    "BucketInfo",
    "BucketKey",
    "BucketState",
    "Cancel",
    "CompileFinished",
    "CompileGranted",
    "CompileWanted",
    "DEFAULT_PRESET",
    "DEFAULT_STRENGTH",
    "ImageInputs",
    "RANDOM_WEIGHTS_NOTE",
    "Task",
    "PixelImage",
    "EngineConfig",
    "EngineKey",
    "EngineOptions",
    "EngineReady",
    "MemoryLevers",
    "MAX_BLOCKS_PER_GROUP",
    "memory_forms",
    "Fatal",
    "Fault",
    "FoldersChanged",
    "Footprint",
    "FootprintChanged",
    "GENERIC_PROMPT",
    "Generate",
    "GenerateRequest",
    "GenerateResult",
    "InjectFault",
    "LORA_SCALE_RANGE",
    "LoraChanged",
    "LoraChoice",
    "LoraInfo",
    "LoraSource",
    "MAX_STEPS",
    "Mode",
    "ModelPreset",
    "NO_STEP_CACHE",
    "OnCold",
    "Parallel",
    "ParamRange",
    "Precision",
    "Progress",
    "RANDOM_TINY_PREFIXES",
    "RankExit",
    "Ready",
    "RequestFailed",
    "Result",
    "STEP_CACHES",
    "CacheParam",
    "CacheRun",
    "StepCacheEntry",
    "step_cache_forms",
    "Shutdown",
    "Size",
    "StepCache",
    "StepCacheKind",
    "Pause",
    "StepProgress",
    "TPOp",
    "TPOpKind",
    "TestingOptions",
    "Timings",
    "decode_mp4",
    "Warm",
    "denoise_steps",
    "dispatch",
    "median",
    "lora_run_text",
    "parse_lora",
    "parse_ranks",
    "ranks_choice",
]
