"""Requests and results: what a client asks of an engine, and what it gets back."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from engine.metrics import median
from engine.protocol import params
from engine.protocol.presets import LoraRun, ModelPreset
from engine.protocol.stepcaches import NO_STEP_CACHE, StepCache
from engine.protocol.vocabulary import (
    BucketInfo,
    BucketKey,
    EngineKey,
    LoraInfo,
    Mode,
    Size,
)


@dataclass(frozen=True)
class PixelImage:
    """A decoded input image as the worker gets it: 8-bit pixels, row by row (`mode` "RGB", or "L" for a mask),
    already checked and resized to its bucket by engine/config/images.py. Raw pixels rather than PNG: the
    worker neither decodes nor trusts an upload, and pickling bytes costs what copying them does."""

    width: int
    height: int
    data: bytes = field(repr=False)
    mode: str = "RGB"

    def __post_init__(self):
        channels = {"RGB": 3, "L": 1}.get(self.mode)
        if channels is None or len(self.data) != self.width * self.height * channels:
            raise ValueError(f"PixelImage {self.width}x{self.height} {self.mode}: {len(self.data)} bytes do not fit")

    @property
    def size(self) -> Size:
        return Size(self.width, self.height)

    @classmethod
    def from_pil(cls, image) -> PixelImage:
        return cls(image.width, image.height, image.tobytes(), image.mode)

    def to_pil(self):
        from PIL import Image

        return Image.frombytes(self.mode, (self.width, self.height), self.data)


def denoise_steps(steps: int, strength: float | None) -> int:
    """Steps an img2img / inpaint pipeline runs of `steps` at `strength` (diffusers' get_timesteps: the schedule's
    last `steps * strength`); all of them without a strength."""
    if strength is None:
        return steps
    return steps - int(max(steps - steps * strength, 0))


# The declared fields (engine/protocol/params.py) as a checked request holds them: a new sampling field is declared
# there once, and the request carries it with no edit here.
CheckedFields = dataclasses.make_dataclass("CheckedFields", params.held_fields(), frozen=True)


@dataclass(frozen=True)
class GenerateRequest(CheckedFields):
    """One request as the gate checked it (engine/config/validation.py), carried whole to the pipeline call:
    the declared fields (prompt, steps, guidance, seed, mode, step cache, LoRA, memory levers, frames, input
    images, ...) keyword-only, plus what the gate derives from them."""

    width: int
    height: int
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Who asked (a visitor's address; "" for the host): an engine serves its waiting clients in turn.
    client: str = ""
    previews: int = 0  # partial images streamed while it runs (engine/pipeline/preview.py), at most MAX_PREVIEWS
    # Input images (engine/config/images.py): the source first (img2img, inpaint, an instruction edit), or
    # FLUX.2's references, each a PixelImage at its bucket's size. `images_in_sequence`: their tokens join the
    # denoiser's sequence (each one is part of the bucket).
    images_in_sequence: bool = False
    # FLUX.2's references are one call's, shared by its images: requests batch only with the same ones (an
    # edit's or img2img's source is each member's own)
    images_shared: bool = False

    POSITIONAL = ("prompt", "width", "height", "steps", "guidance", "seed")  # `checked`'s positional order

    @classmethod
    def checked(cls, *values, **fields) -> GenerateRequest:
        """A request from fields as a caller writes them (text modes, step caches and memory levers, "none" for no
        LoRA), made canonical: what warm-up, the benches and tests build. The gate's requests are canonical
        already (engine/config/validation.py checked each field once)."""
        fields.update(zip(cls.POSITIONAL, values, strict=False))
        return cls(**params.canonical(fields))

    @property
    def size(self) -> Size:
        return Size(self.width, self.height)

    @property
    def refs(self) -> tuple[Size, ...]:
        """The sizes of the references whose tokens join the sequence (part of the bucket)."""
        return tuple(image.size for image in self.images) if self.images_in_sequence else ()

    @property
    def denoise_steps(self) -> int:
        """Denoiser steps this request runs: its steps, or the share of them its strength leaves (img2img)."""
        return denoise_steps(self.steps, self.strength)

    @property
    def bucket(self) -> BucketKey:
        return BucketKey(self.mode, self.size, frames=self.num_frames, refs=self.refs)

    def replace(self, **changes) -> GenerateRequest:
        """A copy with `changes`, written as `checked` takes them."""
        return dataclasses.replace(self, **params.canonical({"lora": self.lora, **changes}))


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
class Pause:
    """A stepped request set aside between two steps while other requests' steps ran (engine/worker/stepped.py)."""

    after_step: int  # the steps it had done (0: before its first)
    ms: float
    for_requests: int  # the other requests that stepped meanwhile


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
    lora_run: LoraRun = LoraRun()  # the style it ran with (none by default), its rank, the swap or fuse it waited for
    # The engine's weights by component (name, bytes as stored: layerwise fp8 counts 1 byte a weight), the
    # price of its memory levers beside peak_memory_bytes.
    weights_by_component: tuple[tuple[str, int], ...] = ()
    node: str | None = None  # under --ray: the cluster node whose engine served it
    # A clip (a video preset): its MP4 (image_png is its first frame), frame count, rate and encode time.
    video_mp4: bytes = b""
    num_frames: int = 0
    fps: int = 0
    video_encode_ms: float | None = None
    # The engine ran its denoising loop a step at a time (engine/pipeline/stepping.py): the batch size of each
    # step (requests joined and left between steps) and the pauses it waited through.
    stepped: bool = False
    step_batches: tuple[int, ...] = ()
    pauses: tuple[Pause, ...] = ()

    @property
    def computed_steps(self) -> int:
        """Steps whose denoiser ran in full."""
        return self.steps - len(self.cached_steps)

    def image(self):
        """The image as a PIL image."""
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.image_png))

    def frames(self) -> list:
        """A clip's frames as its MP4 holds them (HxWx3 uint8 arrays); [] for an image."""
        return decode_mp4(self.video_mp4) if self.video_mp4 else []

    def as_dict(self) -> dict:
        """The JSON the CLI's --json and the API's /generate return."""
        t = self.timings
        return {
            "request_id": self.request_id,
            **self.engine.as_dict(),
            "mode": str(self.bucket.mode),
            "bucket": str(self.bucket.size),
            "references": [str(r) for r in self.bucket.refs],  # an edit bucket's reference sizes
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
            **self.lora_run.as_dict(),
            "weights_bytes": dict(self.weights_by_component),
            **({"node": self.node} if self.node else {}),
            **({"frames": self.num_frames, "fps": self.fps, "video_bytes": len(self.video_mp4),
                "video_encode_ms": self.video_encode_ms} if self.num_frames else {}),
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


def decode_mp4(data: bytes) -> list:
    """The frames of an MP4 (HxWx3 uint8 arrays), read by the ffmpeg binary of the imageio-ffmpeg wheel: what a
    per-frame strip shows and a client counts."""
    import tempfile
    from pathlib import Path

    import imageio_ffmpeg
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="clip-") as folder:
        path = Path(folder) / "clip.mp4"
        path.write_bytes(data)
        reader = imageio_ffmpeg.read_frames(str(path))
        width, height = next(reader)["size"]
        return [np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3).copy() for raw in reader]


@dataclass(frozen=True)
class StepProgress:
    """Streamed while a request runs (progress bars, live plots)."""

    request_id: str
    step: int  # 1-based
    total: int
    step_ms: float
    cached: bool = False  # this step's denoiser output came from the step cache
    batch_size: int = 1  # this step was computed for this many requests at once (step_ms is the shared step's)
    # At a step where the request asked for a partial image: its PNG (one per member of the call until the batch
    # hands each member its own), else empty.
    previews: tuple[bytes, ...] = ()


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
    lora: LoraInfo | None = None  # its LoRA slot (None: it serves no adapters)

    @property
    def rank_pids(self) -> tuple[int, ...]:
        return tuple(r["pid"] for r in self.ranks)


