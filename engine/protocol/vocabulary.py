"""The closed vocabularies and the keys of an engine and a bucket: precision, mode, parallel layout,
on-cold policy, sizes, `EngineKey`, `BucketKey`, a bucket's board row (`BucketInfo`) and a LoRA slot's (`LoraInfo`)."""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import ClassVar

from engine.errors import InvalidRequest
from engine.protocol.memory import MemoryLevers


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


MAX_STEPS = 200  # the most denoising steps a request may ask for (engine/config/validation.py checks it)


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
    precision: Precision | None  # None: not known yet (EngineKey.unknown)
    tp: int = 1  # ranks
    parallel: Parallel = Parallel.TENSOR  # how the ranks split the denoiser (one rank: always tensor)
    # Memory levers that change where the weights live or how the graph runs (engine/protocol/memory.py), as
    # canonical text; "" none. The VAE's per-request levers never enter the key.
    memory: str = ""
    place: str = ""  # on a Ray cluster: a chip ("H100") or "node:NAME" it must run on ("": any node with the device)

    UNKNOWN: ClassVar[str] = "?"  # how an unknown part is shown

    def __post_init__(self):
        if self.precision is not None:
            _coerce(self, "precision", Precision)
        _coerce(self, "parallel", Parallel)
        if self.tp <= 1 and self.parallel is not Parallel.TENSOR:
            object.__setattr__(self, "parallel", Parallel.TENSOR)  # one process: no layout, one key
        levers = MemoryLevers.parse(self.memory).engine_part()
        object.__setattr__(self, "memory", str(levers) if levers.enabled else "")

    @classmethod
    def unknown(cls) -> EngineKey:
        """The key of a client that has not heard its engine's Ready yet (an attached sidecar)."""
        return cls(cls.UNKNOWN, cls.UNKNOWN, None, 0)

    @property
    def precision_label(self) -> str:
        return self.UNKNOWN if self.precision is None else str(self.precision)

    def __str__(self) -> str:
        tp = f" {'tp' if self.parallel is Parallel.TENSOR else self.parallel}{self.tp}" if self.tp > 1 else ""
        place = f":{self.place}" if self.place else ""
        memory = f"+{self.memory}" if self.memory else ""
        return f"{self.preset}@{self.device}{place}/{self.precision_label}{tp}{memory}"

    @property
    def levers(self) -> MemoryLevers:
        return MemoryLevers.parse(self.memory)

    @property
    def device_text(self) -> str:
        """The device as a request names it: with its placement ("cpu:node:host-b")."""
        return f"{self.device}:{self.place}" if self.place else self.device

    def as_dict(self) -> dict:
        row = {"engine": str(self), "preset": self.preset, "device": self.device,
               "precision": self.precision_label, "tp": self.tp, "parallel": str(self.parallel),
               "memory": self.memory or "none"}
        return {**row, "place": self.place} if self.place else row


@dataclass(frozen=True, order=True)
class BucketKey:
    """One compiled graph per (mode, size) of an engine, and per batch size where requests run batched
    (engine/pipeline/batching.py): `batch` images in one pipeline call; 1 is a request run alone. `refs`: the
    sizes of the reference images whose latent tokens join the denoiser's sequence (an instruction edit, FLUX.2's
    references), each another graph; () for text to image, img2img and inpaint (their source is the start
    latent, of the output's shape)."""

    mode: Mode
    size: Size
    batch: int = 1
    refs: tuple[Size, ...] = ()

    def __post_init__(self):
        _coerce(self, "mode", Mode)

    def __str__(self) -> str:
        return (f"{self.mode}:{self.size}" + "".join(f"+ref{r}" for r in self.refs)
                + (f"/b{self.batch}" if self.batch > 1 else ""))

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
            "references": [str(r) for r in self.bucket.refs],  # an edit bucket's reference sizes ([]: none)
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


@dataclass(frozen=True)
class LoraInfo:
    """An engine's LoRA slot as the board shows it (engine/pipeline/lora.py): the adapter serving now (None: no
    LoRA, the slot at scale 0), the hot-swaps served and their median milliseconds, and the compiles during
    requests on warm compiled buckets since the engine loaded, which a hot-swap must leave at 0."""

    engine: EngineKey
    adapters: tuple[str, ...] = ()  # the ones it can swap in; `refused` were refused at load
    refused: tuple[str, ...] = ()
    target_rank: int = 0
    current: str | None = None
    scale: float = 0.0
    swaps: int = 0
    median_swap_ms: float | None = None
    recompiles: int = 0
    fuses: int = 0  # refreshes of the fused copy (fused LoRA, eager)
    median_fuse_ms: float | None = None
    fused_bytes: int = 0  # the fused copy's weights (the targeted layers), what fused mode holds beyond the engine

    def as_dict(self) -> dict:
        return {"adapters": list(self.adapters), "refused": list(self.refused), "target_rank": self.target_rank,
                "current": self.current, "scale": self.scale, "swaps": self.swaps,
                "median_swap_ms": self.median_swap_ms, "recompiles": self.recompiles, "fuses": self.fuses,
                "median_fuse_ms": self.median_fuse_ms, "fused_bytes": self.fused_bytes}
