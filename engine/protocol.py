"""Typed, frozen messages shared by every engine implementation.

The same objects travel unchanged to an in-process runner, a worker process per device and the
torchrun tensor-parallel sidecar (they are plain dataclasses, so they pickle). Callers only ever see
these types; nothing here imports torch or gradio.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
MODES = ("eager", "compile", "regional", "defer-and-fuse")


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
        from engine.errors import InvalidRequest

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
    precision: str
    tp: int = 1

    def __str__(self) -> str:
        tp = f" tp{self.tp}" if self.tp > 1 else ""
        return f"{self.preset}@{self.device}/{self.precision}{tp}"

    def as_dict(self) -> dict:
        return {"engine": str(self), "preset": self.preset, "device": self.device, "precision": self.precision,
                "tp": self.tp}


@dataclass(frozen=True, order=True)
class BucketKey:
    """One compiled graph per (mode, size) of an engine."""

    mode: str
    size: Size

    def __str__(self) -> str:
        return f"{self.mode}:{self.size}"


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

    def as_dict(self) -> dict:
        return {
            **self.engine.as_dict(),
            "mode": self.bucket.mode,
            "size": str(self.bucket.size),
            "state": self.state.value,
            "error": self.error,
            "compile_s": self.compile_s,
            "warmup_s": self.warmup_s,
            "requests_served": self.requests_served,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
        }


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    mode: str = "eager"
    negative_prompt: str | None = None
    # At a cold/compiling bucket: "eager" serves now on the same weights, "wait" waits for the graph.
    on_cold: str = "eager"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

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

    @property
    def first_step_ms(self) -> float | None:
        return self.step_ms[0] if self.step_ms else None

    @property
    def median_step_ms(self) -> float | None:
        if not self.step_ms:
            return None
        s = sorted(self.step_ms)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2

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
            "mode": self.bucket.mode,
            "bucket": str(self.bucket.size),
            "seed": self.seed,
            "steps": self.steps,
            "warm": self.warm,
            "eager_fallback": self.eager_fallback,
            "recompiles": self.recompiles,
            "peak_memory_bytes": self.peak_memory_bytes,
            "cancelled": self.cancelled,
            "notices": list(self.notices),
            "timings": {
                "step_ms": list(t.step_ms),
                "first_step_ms": t.first_step_ms,
                "median_step_ms": t.median_step_ms,
                "steps_per_s": t.steps_per_s,
                "encode_ms": t.encode_ms,
                "denoise_ms": t.denoise_ms,
                "decode_ms": t.decode_ms,
                "total_ms": t.total_ms,
            },
        }


@dataclass(frozen=True)
class StepProgress:
    """Streamed while a request runs (progress bars, live plots)."""

    request_id: str
    step: int  # 1-based
    total: int
    step_ms: float
