"""The one contract between the app, the engines and the tensor-parallel sidecar.

Everything that crosses a process boundary is defined here as a frozen dataclass or an enum: the
vocabularies (precision, mode, on-cold policy), the records (sizes, keys, bucket states, requests,
results, timings), the engine's configuration (`EngineConfig`, `EngineOptions`, `ModelPreset`), and
the messages of the worker protocol (client <-> engine) and of the tensor-parallel operations (rank 0
-> every rank). The same objects travel unchanged to a worker process per device and to the torchrun
sidecar (they pickle), so callers only ever see these types.

Nothing here imports torch or gradio: `app.py --help` and `python -m engine presets` stay fast.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from engine import settings
from engine.errors import InvalidRequest, ShowcaseError
from engine.metrics import median


class _Choice(enum.StrEnum):
    """A closed vocabulary; `parse` turns user text into a member or names the valid choices."""

    @classmethod
    def parse(cls, value, what: str | None = None):
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise InvalidRequest(f"unknown {what or cls.__name__.lower()} {value!r}: choose one of {choices}") from None

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Precision(_Choice):
    FP32 = "fp32"
    TF32 = "tf32"  # fp32 weights; matmuls/convs may use TF32
    BF16 = "bf16"
    FP16 = "fp16"
    # Quantized: the denoiser's linear weights quantized by torchao after loading in the device's base
    # dtype (DeviceSpec.quant_base: fp32 on cpu, bf16 on GPUs); every other component stays in it.
    INT8_WEIGHT = "int8wo"  # int8 weight-only
    INT8_DYNAMIC = "int8dq"  # int8 dynamic activation + int8 weight
    FP8 = "fp8"  # float8 dynamic activation + float8 weight (CUDA, compute capability 8.9+)

    @property
    def quantized(self) -> bool:
        """An engine of its own whose denoiser weights are quantized (torchao)."""
        return self in (Precision.INT8_WEIGHT, Precision.INT8_DYNAMIC, Precision.FP8)


class Mode(_Choice):
    EAGER = "eager"
    COMPILE = "compile"  # torch.compile of the whole denoiser (+ vae.decode)
    REGIONAL = "regional"  # compile_repeated_blocks: only the repeated transformer blocks
    DEFER_AND_FUSE = "defer-and-fuse"  # TorchTPU's optimized eager mode
    AOT = "aot"  # AOTInductor package per bucket (torch.export + aoti), loaded in seconds, weights shared

    @property
    def compiled(self) -> bool:
        """Its buckets need a compile / warm-up before a request there is 'warm'."""
        return self is not Mode.EAGER


class Parallel(_Choice):
    """How a multi-rank engine splits the denoiser over its ranks (`--parallel`, with `--tp N` ranks)."""

    TENSOR = "tensor"  # weights sharded (TensorParallelConfig): each rank holds 1/N of them
    ULYSSES = "ulysses"  # sequence split, all-to-all over heads (ContextParallelConfig(ulysses_degree=N))
    RING = "ring"  # sequence split, K/V passed round a ring (ring_degree=N); needs an LSE-returning attention

    @property
    def context(self) -> bool:
        """A context-parallel layout: every rank holds the whole denoiser and a slice of the tokens."""
        return self is not Parallel.TENSOR


def ranks_choice(tp: int, parallel=Parallel.TENSOR) -> int | str:
    """The UI's ranks choice for an engine: 1, or "N · layout" (e.g. "2 · ulysses")."""
    return 1 if tp <= 1 else f"{tp} · {Parallel.parse(parallel, 'parallel')}"


def parse_ranks(value, parallel=None) -> tuple[int, Parallel]:
    """(ranks, layout) from a ranks choice: 2, "2", "2 · ulysses", "ulysses2"; `parallel` when it names none."""
    problem = InvalidRequest(f"tp must be a whole number >= 1 or 'N · layout' (layouts: {', '.join(Parallel.values())})")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str, type(None))) or len(str(value)) > 32:
        raise problem  # never echoed: the API takes any text
    text = str(1 if value in (None, "") else value).strip().lower()
    m = re.fullmatch(r"(\d+)\s*·?\s*([a-z]*)|([a-z]+)\s*(\d+)", text)
    if m is None:
        raise problem
    digits, word = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
    word = "" if word == "tp" else word
    return int(digits), Parallel.parse(word or parallel or Parallel.TENSOR, "parallel")


class OnCold(_Choice):
    """What a request at a bucket that is not warm yet does."""

    EAGER = "eager"  # serve now, eagerly, on the same weights
    WAIT = "wait"  # wait for the bucket's compile


def _coerce(record, name: str, vocabulary: type[_Choice]) -> None:
    """Frozen records take plain strings at construction (CLI, JSON, tests) and hold the enum member."""
    value = getattr(record, name)
    if not isinstance(value, vocabulary):
        object.__setattr__(record, name, vocabulary.parse(value, name))


class StepCacheKind(_Choice):
    """diffusers' step caches: reuse (or predict) denoiser work from earlier steps (engine/pipeline/stepcache.py)."""

    NONE = "none"
    FIRST_BLOCK = "first-block"  # FirstBlockCacheConfig: skip the rest when the first block's output barely moved
    TAYLORSEER = "taylorseer"  # TaylorSeerCacheConfig: predict outputs from earlier steps every few steps
    MAGCACHE = "magcache"  # MagCacheConfig: skip by calibrated residual-magnitude ratios
    FASTER_CACHE = "faster-cache"  # FasterCacheConfig: reuse attention outputs across steps
    PYRAMID = "pyramid"  # PyramidAttentionBroadcastConfig: broadcast attention outputs every few steps


# Per kind: (the parameters its text takes after the name, in order; their defaults).
STEP_CACHE_FORMS: dict[StepCacheKind, tuple[tuple[str, ...], dict]] = {
    StepCacheKind.NONE: ((), {}),
    StepCacheKind.FIRST_BLOCK: (("threshold",), {"threshold": 0.2}),
    StepCacheKind.TAYLORSEER: (("interval", "warmup"), {"interval": 3, "warmup": 2}),
    StepCacheKind.MAGCACHE: (("threshold",), {"threshold": 0.06}),
    StepCacheKind.FASTER_CACHE: (("interval",), {"interval": 2}),
    StepCacheKind.PYRAMID: (("interval",), {"interval": 2}),
}

MAX_STEPS = 200  # the most denoising steps a request may ask for (engine/config/validation.py checks it)


@dataclass(frozen=True)
class ParamRange:
    """What diffusers' hook runs with for one step-cache parameter: a whole number in low..high, or a
    number strictly between low and high."""

    low: float
    high: float
    whole: bool = True
    why: str = ""

    def holds(self, value) -> bool:
        return self.low <= value <= self.high if self.whole else self.low < value < self.high

    @property
    def span(self) -> str:
        return f"{self.low:g}..{self.high:g}" if self.whole else f"above {self.low:g} and below {self.high:g}"

    def __str__(self) -> str:
        return self.span + (f" ({self.why})" if self.why else "")


_THRESHOLD = ParamRange(0.0, 10.0, whole=False)
_INTERVAL = ParamRange(1, MAX_STEPS)  # diffusers' hooks take the step index modulo it
# Per kind: each parameter's range. TaylorSeer computes the steps before `warmup` and then predicts from
# the last computed one: with warmup 0 it predicts the very first step from nothing, and diffusers fails
# ("Cannot predict without prior initialization/update.").
STEP_CACHE_RANGES: dict[StepCacheKind, dict[str, ParamRange]] = {
    StepCacheKind.NONE: {},
    StepCacheKind.FIRST_BLOCK: {"threshold": _THRESHOLD},
    StepCacheKind.TAYLORSEER: {"interval": _INTERVAL, "warmup": ParamRange(
        1, MAX_STEPS, why="the first step must be computed before any can be predicted from it")},
    StepCacheKind.MAGCACHE: {"threshold": _THRESHOLD},
    StepCacheKind.FASTER_CACHE: {"interval": _INTERVAL},
    StepCacheKind.PYRAMID: {"interval": _INTERVAL},
}


def _param_value(value, whole: bool):
    """A step-cache parameter as a number: whole ones refuse fractions ("2.5") rather than truncate them."""
    if isinstance(value, bool):
        raise ValueError
    number = float(value)
    if not whole or number in (float("inf"), float("-inf")):
        return number  # out of every range: refused as such
    if not number.is_integer():
        raise ValueError
    return int(number)


@dataclass(frozen=True)
class StepCache:
    """A step cache and its parameters; `parse("first-block:0.2")`, `str()` gives the canonical text.

    threshold: first-block, magcache (relative change below which a step is reused);
    interval: taylorseer (full compute every `interval` steps), faster-cache / pyramid (attention
    recomputed every `interval` steps); warmup: taylorseer (steps always computed first).
    """

    kind: StepCacheKind = StepCacheKind.NONE
    threshold: float | None = None
    interval: int | None = None
    warmup: int | None = None

    def __post_init__(self):
        _coerce(self, "kind", StepCacheKind)
        names, defaults = STEP_CACHE_FORMS[self.kind]
        for name in ("threshold", "interval", "warmup"):
            value = getattr(self, name)
            if name not in names:
                if value is not None:
                    raise InvalidRequest(f"step cache {self.kind} takes no {name}; {StepCache.forms()}")
                continue
            if value is None:
                value = defaults[name]
            allowed = STEP_CACHE_RANGES[self.kind][name]
            try:
                value = _param_value(value, allowed.whole)
            except (TypeError, ValueError, OverflowError):
                kind = "whole number" if allowed.whole else "number"
                raise InvalidRequest(f"step cache {self.kind}: {name} {str(value)[:40]!r} is not a {kind} "
                                     f"(allowed {allowed}); {StepCache.forms()}") from None
            if not allowed.holds(value):
                raise InvalidRequest(f"step cache {self.kind}: {name} {value:g} is out of range: allowed {allowed}; "
                                     f"{StepCache.forms()}")
            object.__setattr__(self, name, value)

    @staticmethod
    def forms() -> str:
        """The valid texts, for error messages and help."""
        shown = []
        for kind, (names, _) in STEP_CACHE_FORMS.items():
            shown.append(kind.value + "".join(f"[:{n.upper()}]" for n in names))
        return "valid forms: " + ", ".join(shown)

    @classmethod
    def parse(cls, text) -> StepCache:
        if isinstance(text, StepCache):
            return text
        if text is None or (isinstance(text, StepCacheKind) and text is StepCacheKind.NONE):
            return cls()
        parts = [p.strip() for p in str(text).strip().lower().split(":")]
        if not parts[0]:
            return cls()
        try:
            kind = StepCacheKind(parts[0])
        except ValueError:
            raise InvalidRequest(f"unknown step cache {str(text)!r}; {cls.forms()}") from None
        names, _ = STEP_CACHE_FORMS[kind]
        values = parts[1:]
        if len(values) > len(names):
            raise InvalidRequest(f"step cache {str(text)!r} has too many parameters; {cls.forms()}")
        return cls(kind, **{n: v for n, v in zip(names, values, strict=False) if v != ""})

    @property
    def enabled(self) -> bool:
        return self.kind is not StepCacheKind.NONE

    def __str__(self) -> str:
        names, _ = STEP_CACHE_FORMS[self.kind]
        return ":".join([self.kind.value, *(f"{getattr(self, n):g}" for n in names)])


NO_STEP_CACHE = StepCache()


class BucketState(enum.StrEnum):
    COLD = "cold"
    QUEUED = "queued"
    COMPILING = "compiling"
    WARM = "warm"
    FAILED = "failed"


@dataclass(frozen=True, order=True)
class Size:
    width: int
    height: int

    @classmethod
    def parse(cls, text: str) -> Size:
        try:
            w, h = str(text).lower().replace(" ", "").split("x")
            return cls(int(w), int(h))
        except (ValueError, AttributeError):
            raise InvalidRequest(f"size {text!r} is not WIDTHxHEIGHT, e.g. '1024x1024'") from None

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def pixels(self) -> int:
        return self.width * self.height


@dataclass(frozen=True)
class EngineKey:
    """Weights are loaded once per engine key."""

    preset: str
    device: str
    precision: Precision
    tp: int = 1  # ranks
    parallel: Parallel = Parallel.TENSOR  # how the ranks split the denoiser (one rank: always tensor)

    def __post_init__(self):
        if self.precision != "?":  # "?": a client that has not heard the engine's Ready yet
            _coerce(self, "precision", Precision)
        _coerce(self, "parallel", Parallel)
        if self.tp <= 1 and self.parallel is not Parallel.TENSOR:
            object.__setattr__(self, "parallel", Parallel.TENSOR)  # one process: no layout, one key

    def __str__(self) -> str:
        tp = f" {'tp' if self.parallel is Parallel.TENSOR else self.parallel}{self.tp}" if self.tp > 1 else ""
        return f"{self.preset}@{self.device}/{self.precision}{tp}"

    def as_dict(self) -> dict:
        return {"engine": str(self), "preset": self.preset, "device": self.device,
                "precision": str(self.precision), "tp": self.tp, "parallel": str(self.parallel)}


@dataclass(frozen=True, order=True)
class BucketKey:
    """One compiled graph per (mode, size) of an engine, and per batch size where requests run batched
    (engine/pipeline/batching.py): `batch` images in one pipeline call; 1 is a request run alone."""

    mode: Mode
    size: Size
    batch: int = 1

    def __post_init__(self):
        _coerce(self, "mode", Mode)

    def __str__(self) -> str:
        return f"{self.mode}:{self.size}" + (f"/b{self.batch}" if self.batch > 1 else "")

    def solo(self) -> BucketKey:
        """The same bucket at batch size 1."""
        return dataclasses.replace(self, batch=1)

    def batched(self, batch: int) -> BucketKey:
        return dataclasses.replace(self, batch=batch)


@dataclass(frozen=True)
class BucketInfo:
    engine: EngineKey
    bucket: BucketKey
    state: BucketState
    error: str | None = None
    compile_s: float | None = None
    warmup_s: float | None = None
    requests_served: int = 0
    updated_at: float = 0.0
    cache_hits: int = 0  # inductor FX-graph cache hits while compiling (a restart warms from cache)
    cache_misses: int = 0
    # Where a warm bucket's graph came from, when that is news: aot says "loaded from package" or
    # "built now" (with what it replaced: a stale or corrupt package). None for the other modes.
    origin: str | None = None
    batches_served: int = 0  # pipeline calls that served `requests_served` (equal at batch size 1)

    def as_dict(self) -> dict:
        return {
            **self.engine.as_dict(),
            "mode": str(self.bucket.mode),
            "size": str(self.bucket.size),
            "batch": self.bucket.batch,
            "batches_served": self.batches_served,
            "state": self.state.value,
            "error": self.error,
            "compile_s": self.compile_s,
            "warmup_s": self.warmup_s,
            "requests_served": self.requests_served,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "origin": self.origin,
        }


# ------------------------------------------------------------------------------------------------
# Model presets (data; engine/config/presets.py loads them from presets/*.toml and routes sizes)
# ------------------------------------------------------------------------------------------------


DEFAULT_PRESET = settings.DEFAULT_PRESET  # part of the contract: the UI's starting preset
# For models with no example prompts (random-weight tiny pipelines, Hub models).
GENERIC_PROMPT = "a red fox in the snow, golden hour"
RANDOM_TINY_PREFIXES = ("random:", "embedded:")  # "embedded:" is the old spelling: saved presets keep loading


LORA_SCALE_RANGE = (0.0, 2.0)


@dataclass(frozen=True)
class LoraSource:
    """A LoRA adapter a preset offers (its `loras` table): a repo folder ("repo:models/..."), a local file or
    folder, or a Hub repo id with `weight_name`. Visitors pick it by `name`, never by its source."""

    name: str
    source: str
    weight_name: str | None = None  # the safetensors file inside a folder or Hub repo (None: diffusers' default)
    scale: float = 1.0  # default scale
    trigger: str = ""  # words a prompt needs for the style (added when missing), "" when none
    description: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,47}", self.name):
            raise InvalidRequest(f"LoRA name {self.name!r}: use 1-48 lower-case letters, digits, '-', '_' or '.'")
        object.__setattr__(self, "scale", check_lora_scale(self.scale))


def check_lora_scale(scale) -> float:
    """A LoRA scale as a float in [0, 2], or a clear error."""
    lo, hi = LORA_SCALE_RANGE
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise InvalidRequest(f"LoRA scale {str(scale)[:32]!r} is not a number: pick one from {lo:g} to {hi:g}") from None
    if not lo <= value <= hi:  # NaN fails too
        raise InvalidRequest(f"LoRA scale {value:g} is outside [{lo:g}, {hi:g}]: pick one from {lo:g} (off) "
                             f"to {hi:g} (twice the trained strength)")
    return value


def parse_lora(text) -> tuple[str | None, float | None]:
    """(name, scale) from "NAME[:SCALE]" (the CLI's --lora and the API's text); (None, None) for "", "none"."""
    text = "" if text is None else str(text).strip().lower()
    if len(text) > 64:
        raise InvalidRequest("LoRA choice is longer than 64 characters: give NAME or NAME:SCALE")
    if text in ("", "none"):
        return None, None
    name, _, scale = text.partition(":")
    return name.strip(), (check_lora_scale(scale) if scale.strip() else None)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    pipeline: str
    source: str
    family: str
    denoiser: str
    steps: int
    guidance: float
    buckets: tuple[Size, ...]
    alignment: int
    cfg: bool = False
    negative_prompt: bool = False
    tp: bool = False
    tp_text_encoder: bool = False
    min_tp: int = 1
    max_sequence_length: int | None = None  # T5/LLM text tokens (None: the pipeline's default)
    description: str = ""
    repeated_blocks: tuple[str, ...] = ()
    # A checker that scores images against prompts from the pixels alone ("shapes": engine/models/shapes/),
    # for a model trained on a closed grammar; None: only drift between configurations is measured.
    fidelity: str | None = None
    examples: tuple[str, ...] = ()  # prompts this model draws well (the UI offers them)
    advice: dict = field(default_factory=dict, hash=False, compare=False)
    options: dict = field(default_factory=dict, hash=False, compare=False)
    denoiser_config: dict | None = field(default=None, hash=False, compare=False)
    # LoRA adapters visitors may pick (engine/pipeline/lora.py), and the rank every one is padded to for
    # hot-swapping (None: the largest among them, read from their files).
    loras: tuple[LoraSource, ...] = ()
    lora_rank: int | None = None

    @property
    def random_tiny(self) -> str | None:
        """Name of the random-weight tiny pipeline engine/models/tiny.py builds ("random:<name>"), or None."""
        prefix = next((p for p in RANDOM_TINY_PREFIXES if self.source.startswith(p)), None)
        return self.source.removeprefix(prefix) if prefix else None

    @property
    def bundled(self) -> str | None:
        """Folder inside this repository ("repo:models/tiny-shapes": the trained embedded model), or None."""
        return self.source.removeprefix("repo:") if self.source.startswith("repo:") else None

    @property
    def example_prompt(self) -> str:
        """The prompt a form starts with: the first example (one the model draws well), else a generic one."""
        return self.examples[0] if self.examples else GENERIC_PROMPT

    def describe(self) -> dict:
        return {
            "name": self.name,
            "pipeline": self.pipeline,
            "source": self.source,
            "denoiser": self.denoiser,
            "steps": self.steps,
            "guidance": self.guidance,
            "buckets": [str(b) for b in self.buckets],
            "alignment": self.alignment,
            "negative_prompt": self.negative_prompt,
            "tp": self.tp,
            "description": self.description,
            "examples": list(self.examples),
            "advice": dict(self.advice),
            "loras": [{"name": lora.name, "scale": lora.scale, "trigger": lora.trigger, "description": lora.description}
                      for lora in self.loras],
        }


# ------------------------------------------------------------------------------------------------
# Engine configuration (plain data, sent once to a worker or the sidecar)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestingOptions:
    """Test-only hooks of an engine, read by engine/pipeline/faults.py. The UI, the CLI and the app never set
    them, and nothing in a request does: an app's engines run with them off."""

    __test__: ClassVar[bool] = False  # not a pytest test class
    inject_faults: bool = False  # accept InjectFault messages (one-shot faults armed through the client)
    fail_compiles: bool = False  # every compile and aot build fails


@dataclass(frozen=True)
class EngineOptions:
    """Per-engine options; every field is one named recipe step (engine/pipeline/recipes.py) or a setting."""

    cpu_offload: bool = False  # enable_model_cpu_offload(); then only regional compile is possible
    channels_last: bool = False  # UNet / VAE convolutions in channels_last memory format
    fuse_qkv: bool = False  # fuse_qkv_projections() on the denoiser
    inductor_flags: bool | None = None  # flux-fast inductor flags; None = the device's default
    max_autotune: bool = False  # torch.compile mode="max-autotune" (inductor devices only)
    dynamic: bool = False  # dynamic=True + use_duck_shape=False (not on static-shape devices)
    compile_vae: bool = True  # compile vae.decode too in "compile" mode
    warm_modes: tuple[Mode, ...] = (Mode.COMPILE,)  # modes whose buckets warm at start-up
    warm_sizes: tuple[str, ...] | None = None  # None: every bucket of the preset; () none
    warm_steps: int = 2
    # diffusers attention backend set on the denoiser (engine/pipeline/attention.py lists each one, usable or why not)
    attention_backend: str = "native"
    # torch.compile mode="reduce-overhead" (CUDA graphs) for compile; triton.cudagraphs for aot. CUDA only.
    cuda_graphs: bool = False
    max_queue: int = 16  # pending requests per engine before "busy, retry"
    # Batching (engine/pipeline/batching.py): at most `max_batch` queued requests that can share one denoiser call
    # run as one pipeline call (None: the device's default, DeviceSpec.max_batch; 1: off), gathered for up
    # to `batch_wait_ms` after the first one arrives (and while the previous call runs).
    max_batch: int | None = None
    batch_wait_ms: float = 15.0
    # The preset's LoRA adapters get a slot in the denoiser (engine/pipeline/lora.py). Off by default: the slot's
    # matmuls run on every step, styled or not (docs/benchmarks.md).
    loras: bool = False
    testing: TestingOptions = TestingOptions()  # tests only: off in the app and the CLI

    def __post_init__(self):
        object.__setattr__(self, "warm_modes", tuple(Mode.parse(m, "mode") for m in self.warm_modes))


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


# ------------------------------------------------------------------------------------------------
# Requests and results
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    mode: Mode = Mode.EAGER
    negative_prompt: str | None = None
    on_cold: OnCold = OnCold.EAGER
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    step_cache: StepCache = NO_STEP_CACHE  # text ("first-block:0.2") is parsed at construction
    lora: str | None = None  # one of the preset's adapters by name (None: no LoRA)
    lora_scale: float | None = None  # None: the adapter's default scale
    # Who asked (a visitor's address; "" for the host): an engine serves its waiting clients in turn.
    client: str = ""

    def __post_init__(self):
        _coerce(self, "mode", Mode)
        _coerce(self, "on_cold", OnCold)
        if self.lora is not None and str(self.lora).strip().lower() in ("", "none"):
            object.__setattr__(self, "lora", None)
        if self.lora_scale is not None:
            object.__setattr__(self, "lora_scale", check_lora_scale(self.lora_scale))
        if not isinstance(self.step_cache, StepCache):
            object.__setattr__(self, "step_cache", StepCache.parse(self.step_cache))

    @property
    def size(self) -> Size:
        return Size(self.width, self.height)

    @property
    def bucket(self) -> BucketKey:
        return BucketKey(self.mode, self.size)

    def replace(self, **changes) -> GenerateRequest:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Timings:
    step_ms: tuple[float, ...]
    encode_ms: float
    denoise_ms: float
    decode_ms: float
    total_ms: float
    queued_ms: float = 0.0  # waited in the engine's queue (earlier requests, a compile it waited for)

    @property
    def first_step_ms(self) -> float | None:
        return self.step_ms[0] if self.step_ms else None

    @property
    def median_step_ms(self) -> float | None:
        return median(self.step_ms)

    @property
    def steps_per_s(self) -> float | None:
        return 1000.0 * len(self.step_ms) / self.denoise_ms if self.denoise_ms > 0 else None


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    engine: EngineKey
    bucket: BucketKey
    image_png: bytes
    timings: Timings
    warm: bool  # the bucket's compiled graph served it
    eager_fallback: bool  # asked for a compiled mode, served eagerly because the bucket was not warm
    recompiles: int  # graphs compiled while this request ran (0 at a warm bucket)
    peak_memory_bytes: int | None
    notices: tuple[str, ...] = ()
    seed: int = 0
    steps: int = 0
    cancelled: bool = False
    step_cache: StepCache = NO_STEP_CACHE
    cached_steps: tuple[int, ...] = ()  # 1-based steps whose denoiser output came from the step cache
    batch_size: int = 1  # images in the pipeline call that made this one (engine/pipeline/batching.py)
    lora: str | None = None  # the adapter it ran with, its scale and rank (padded rank in brackets: hot-swap)
    lora_scale: float | None = None
    lora_rank: int | None = None
    lora_swap_ms: float | None = None  # the hot-swap this request waited for (None: the adapter was in place)

    @property
    def computed_steps(self) -> int:
        """Steps whose denoiser ran in full."""
        return self.steps - len(self.cached_steps)

    def image(self):
        """The image as a PIL image."""
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.image_png))

    def as_dict(self) -> dict:
        """The JSON the CLI's --json and the API's /generate return."""
        t = self.timings
        return {
            "request_id": self.request_id,
            **self.engine.as_dict(),
            "mode": str(self.bucket.mode),
            "bucket": str(self.bucket.size),
            "seed": self.seed,
            "steps": self.steps,
            "warm": self.warm,
            "eager_fallback": self.eager_fallback,
            "recompiles": self.recompiles,
            "peak_memory_bytes": self.peak_memory_bytes,
            "cancelled": self.cancelled,
            "notices": list(self.notices),
            "step_cache": str(self.step_cache),
            "cached_steps": list(self.cached_steps),
            "computed_steps": self.computed_steps,
            "batch_size": self.batch_size,
            "lora": self.lora,
            "lora_scale": self.lora_scale,
            "lora_rank": self.lora_rank,
            "lora_swap_ms": self.lora_swap_ms,
            "timings": {
                "step_ms": list(t.step_ms),
                "first_step_ms": t.first_step_ms,
                "median_step_ms": t.median_step_ms,
                "steps_per_s": t.steps_per_s,
                "encode_ms": t.encode_ms,
                "denoise_ms": t.denoise_ms,
                "decode_ms": t.decode_ms,
                "total_ms": t.total_ms,
                "queued_ms": t.queued_ms,
            },
        }


@dataclass(frozen=True)
class StepProgress:
    """Streamed while a request runs (progress bars, live plots)."""

    request_id: str
    step: int  # 1-based
    total: int
    step_ms: float
    cached: bool = False  # this step's denoiser output came from the step cache
    batch_size: int = 1  # this step was computed for this many requests at once (step_ms is the shared step's)


@dataclass(frozen=True)
class Footprint:
    """What one engine holds. `device_bytes` is what counts against its device's budget: the weights plus
    the peak of a run on an accelerator; on cpu the process's resident memory (host RAM is the device)."""

    device_bytes: int
    host_rss_bytes: int
    weights_bytes: int
    measured: bool = True  # False: an estimate made before loading

    def as_dict(self) -> dict:
        gib = 2**30
        return {"device_gib": round(self.device_bytes / gib, 3), "host_rss_gib": round(self.host_rss_bytes / gib, 3),
                "weights_gib": round(self.weights_bytes / gib, 3), "measured": self.measured}


@dataclass(frozen=True)
class EngineReady:
    """What an engine announces once its weights are loaded."""

    key: EngineKey
    pid: int
    load_s: float | None
    notices: tuple[str, ...] = ()
    modes: tuple[Mode, ...] = ()
    buckets: tuple[BucketInfo, ...] = ()
    # Tensor-parallel sidecars only: every rank (rank, host, pid, device) and the collective backend.
    tp: int = 1
    ranks: tuple[dict, ...] = ()
    backend: str = ""
    footprint: Footprint | None = None
    preset: ModelPreset | None = None  # what it serves (an app attaching to a sidecar may not know it)
    batch_sizes: tuple[int, ...] = (1,)  # batch sizes its requests may run at together (engine/pipeline/batching.py)
    # (name, folder) the worker compiles in and writes temporary files to, as the worker itself sees them
    folders: tuple[tuple[str, str], ...] = ()

    @property
    def rank_pids(self) -> tuple[int, ...]:
        return tuple(r["pid"] for r in self.ranks)


# ------------------------------------------------------------------------------------------------
# Worker protocol: messages between a client (engine/worker/client.py) and an engine (engine/worker/loop.py)
# ------------------------------------------------------------------------------------------------


class Fault(enum.StrEnum):
    """One-shot faults a test can arm in an engine started with TestingOptions(inject_faults=True)."""

    OOM = "oom"  # the next request raises the device's out-of-memory error
    CRASH = "crash"  # the worker process dies at the next request's first step


# A message's class is its kind: both ends dispatch on it (`dispatch`), and the connection pickles it.
# Client -> engine:


@dataclass(frozen=True)
class Generate:
    request: GenerateRequest


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Warm:
    bucket: BucketKey | None  # None: the engine's start-up warm list


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class InjectFault:
    """Tests only; refused unless EngineOptions.testing.inject_faults."""

    fault: Fault


@dataclass(frozen=True)
class CompileGranted:
    """The host's compile scheduler lets the engine compile a bucket."""

    bucket: BucketKey


# Engine -> client:


@dataclass(frozen=True)
class CompileWanted:
    """The engine asks the host's compile scheduler for a compile slot."""

    bucket: BucketKey
    waiting: int = 0  # requests blocked on it (on_cold=wait)
    hits: int = 0  # requests that asked for it so far
    startup_rank: int | None = None  # its place in the engine's start-up warm list


@dataclass(frozen=True)
class CompileFinished:
    """The engine gives back the compile slot it was granted."""

    bucket: BucketKey


@dataclass(frozen=True)
class FootprintChanged:
    """Its memory footprint changed (after a warm-up)."""

    footprint: Footprint


@dataclass(frozen=True)
class FoldersChanged:
    """Its compile or temporary folders moved (the cache disk filled up or turned read-only), and why."""

    folders: tuple[tuple[str, str], ...]
    notice: str = ""


@dataclass(frozen=True)
class Ready:
    ready: EngineReady


@dataclass(frozen=True)
class Fatal:
    """The engine could not start; it exits."""

    error: ShowcaseError


@dataclass(frozen=True)
class BucketChanged:
    info: BucketInfo


@dataclass(frozen=True)
class Progress:
    progress: StepProgress


@dataclass(frozen=True)
class Result:
    result: GenerateResult


@dataclass(frozen=True)
class RequestFailed:
    """One request failed; the engine keeps serving."""

    request_id: str | None  # None: a message that was not a request could not be handled
    error: ShowcaseError


def dispatch(message, handlers: dict[type, Callable], log, peer: str) -> bool:
    """Run `handlers[type(message)](message)`. An unknown message is logged and False returned, so the
    caller can answer it (never silently dropped)."""
    handler = handlers.get(type(message))
    if handler is None:
        log.error("unknown message from %s: %r", peer, type(message).__name__)
        return False
    handler(message)
    return True


# ------------------------------------------------------------------------------------------------
# Tensor-parallel operations (rank 0 broadcasts each one; every rank runs it in the same order)
# ------------------------------------------------------------------------------------------------


class TPOpKind(enum.StrEnum):
    GENERATE = "generate"
    WARM = "warm"
    PING = "ping"  # keeps the followers' control-group wait alive when idle
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class TPOp:
    kind: TPOpKind
    request: GenerateRequest | None = None
    bucket: BucketKey | None = None


class RankExit(enum.IntEnum):
    """Exit codes of a sidecar rank (and of the by-hand launcher)."""

    OK = 0
    USAGE = 2  # bad arguments
    LOAD_FAILED = 3  # the model failed to load on some rank (rank 0 told the client)
    GROUP_BROKEN = 4  # a rank died or the ranks disagreed; the in-flight request failed
    ORPHANED = 5  # torchrun or the app that launched the sidecar went away
    INJECTED_CRASH = 17  # tests: Fault.CRASH

    @property
    def consequence(self) -> str | None:
        """For exits caused by *another* rank's failure: what this rank did (None otherwise)."""
        return {
            RankExit.LOAD_FAILED: "could not load",
            RankExit.GROUP_BROKEN: "left the broken group",
            RankExit.ORPHANED: "saw torchrun or the app go away",
        }.get(self)
