"""Warm-up: compile one bucket (its first calls compile, the next is the warm-up run), where a compile
cache that cannot be written or is corrupt moves or drops the cache, and which buckets warm at start-up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine import devices
from engine.config import caches
from engine.config.images import synthetic_inputs
from engine.errors import InvalidRequest
from engine.pipeline.board import describe_failure
from engine.pipeline.clock import cache_counters
from engine.protocol import (
    BucketInfo,
    BucketKey,
    BucketState,
    GenerateRequest,
    Mode,
    Size,
)

log = logging.getLogger(__name__)


class WarmRequests:
    """The warm-up's requests at a bucket (a compile's first calls, the warm-up run, the aot capture and the
    measuring run): the preset's guidance, `steps` steps."""

    def __init__(self, preset, steps: int):
        self.preset, self.steps = preset, steps

    def request(self, bucket: BucketKey, guidance: float | None = None) -> GenerateRequest:
        return GenerateRequest.checked(
            prompt="warm-up",
            width=bucket.size.width,
            height=bucket.size.height,
            steps=self.steps,
            guidance=self.preset.guidance if guidance is None else guidance,
            seed=0,
            mode=bucket.mode,
            request_id=f"warm-{bucket}",
            num_frames=bucket.frames,
            fps=self.preset.fps if bucket.frames else 0,
            **synthetic_inputs(self.preset, bucket),
        )

    def members(self, bucket: BucketKey, guidance: float | None = None) -> list[GenerateRequest] | None:
        """A batched bucket's warm-up call: `bucket.batch` requests (None at batch size 1)."""
        if bucket.batch <= 1:
            return None
        request = self.request(bucket, guidance)
        return [request.replace(seed=i, request_id=f"{request.request_id}-{i}") for i in range(bucket.batch)]

    def guidances(self) -> tuple[float, ...]:
        # With classifier-free guidance, guidance <= 1 halves the denoiser batch: a second shape.
        # Warm both so changing guidance never recompiles.
        g = self.preset.guidance
        return (g, 1.0) if self.preset.cfg and g > 1.0 else (g,)


class Warmup:
    """The compile and warm-up of one engine's compiled buckets: its board, its variants (engine/pipeline/
    modes.py), the warm-up requests, the caller that runs them, the device (its compile folders) and the
    engine's notices. `lora_off()` runs before an aot export (its packages hold no LoRA slot);
    `cache_moved(notice)` is told when compiles moved to a temporary cache."""

    def __init__(self, board, variants, requests: WarmRequests, caller, spec, notices: list[str],
                 lora_off: Callable[[], None], cache_moved: Callable[[str], None]):
        self.board, self.variants, self.requests, self.caller = board, variants, requests, caller
        self.spec, self.notices = spec, notices
        self.lora_off, self.cache_moved = lora_off, cache_moved

    def call(self, pipe, bucket: BucketKey, guidance: float | None = None):
        return self.caller.call(pipe, self.requests.request(bucket, guidance),
                                members=self.requests.members(bucket, guidance))

    # -- one bucket -------------------------------------------------------------------------------
    def bucket(self, bucket: BucketKey) -> BucketInfo:
        """Compile and warm one compiled bucket this engine can run (engine/pipeline/runner.py checks that):
        first call compiles (compile_s), second is the warm-up run."""
        board = self.board
        board.update(bucket, state=BucketState.COMPILING, error=None, origin=None)
        try:
            pipe = self.variants.get(bucket.mode)
            hits_before, misses_before = cache_counters()
            start = time.perf_counter()
            origin = self._compile(pipe, bucket)
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            self._warm_run(pipe, bucket)
            warmup_s = time.perf_counter() - start
        except Exception as exc:  # a failed compile must leave eager serving
            log.warning("bucket %s failed to compile: %s", bucket, exc)
            return board.update(bucket, state=BucketState.FAILED, error=describe_failure(exc))
        hits, misses = cache_counters()
        return board.update(bucket, state=BucketState.WARM, compile_s=compile_s, warmup_s=warmup_s,
                            cache_hits=hits - hits_before, cache_misses=misses - misses_before, origin=origin)

    def _warm_run(self, pipe, bucket: BucketKey) -> None:
        """The warm-up run after the compile; at an aot bucket it must have run the packages."""
        aot = self.variants.aot if bucket.mode is Mode.AOT else None
        aot_misses = aot.counters()[1] if aot is not None else 0
        self.call(pipe, bucket)
        if aot is not None and aot.counters()[1] > aot_misses:
            raise RuntimeError("the warm-up run matched no aot package (the pipeline calls the denoiser or "
                               "decoder with other arguments than were exported)")

    def _compile(self, pipe, bucket: BucketKey) -> str | None:
        """First calls at the bucket's shapes compile. A cache that cannot be written (read-only, full: told by
        the error or by the disk's free space, whichever tool failed) moves compiles to a temporary cache; a
        corrupt one has its broken files removed and the compile runs again without the on-disk caches.
        Returns what the board says about where the graph came from. aot: load the bucket's packages,
        building what is missing (in the temporary cache too when the package folder cannot be written)."""
        try:
            return self._first_calls(pipe, bucket)
        except Exception as exc:
            origin = self._recover(bucket, exc)
        if bucket.mode is Mode.AOT:
            return f"{self._first_calls(pipe, bucket)}; {origin}"
        self._first_calls(pipe, bucket)
        return origin

    def _first_calls(self, pipe, bucket: BucketKey) -> str | None:
        if bucket.mode is Mode.AOT:
            return self._load_or_build_aot(bucket)
        for guidance in self.requests.guidances():
            self.call(pipe, bucket, guidance)
        return None

    def _recover(self, bucket: BucketKey, exc: Exception) -> str | None:
        """After a failed first compile: move to a temporary cache, or drop the on-disk caches (raises `exc`
        again when neither can help). Returns the bucket's origin."""
        unwritable = caches.unwritable_cause(exc, self.compile_folders())
        if unwritable is not None:
            return self._move_cache(bucket, unwritable)
        if bucket.mode is Mode.AOT:
            raise exc
        removed = caches.remove_corrupt_artifacts(exc)
        if not caches.compile_caches_enabled() and not removed:
            raise exc
        notice = (f"compiling {bucket} failed with the on-disk compile cache ({describe_failure(exc, 200)}); "
                  f"retrying without the cache"
                  f"{f' (removed {len(removed)} corrupt file(s))' if removed else ''}")
        log.warning(notice)
        self.notices.append(notice)
        caches.disable_compile_caches()
        return None

    def _load_or_build_aot(self, bucket: BucketKey) -> str:
        self.lora_off()
        origin, notices = self.variants.aot.warm(bucket, report=lambda text: self.board.update(bucket, origin=text))
        self.notices += notices
        return origin

    # -- the compile folders ----------------------------------------------------------------------
    def compile_folders(self) -> tuple[str, ...]:
        """The folders a compile writes to: inductor's cache, the compilers' temporary files, aot packages."""
        folders = list(devices.folders_in_force(self.spec).values())
        if self.variants.aot is not None:
            folders.append(str(self.variants.aot.store.root))
        return tuple(folders)

    def _move_cache(self, bucket: BucketKey, unwritable: caches.Unwritable) -> str:
        """Compiles (and aot packages) go to a temporary cache from now on; the notice goes on the engine and the
        bucket, and the worker reports its new folders (engine/worker/loop.py)."""
        folder, notice = caches.switch_to_temporary_compile_cache(unwritable)
        if self.variants.aot is not None:
            from engine.pipeline import aot

            self.variants.aot.store = aot.PackageStore(folder / "aot")
        self.cache_moved(notice)
        origin = f"compiled in a temporary cache ({unwritable.what})"
        self.board.update(bucket, origin=origin)
        return origin



# -- refusals and the start-up list ---------------------------------------------------------------------
def warm_refusal(bucket: BucketKey, check_mode: Callable, preset, batch_sizes: tuple[int, ...]) -> Exception | None:
    """Why `bucket` cannot be compiled on an engine (None when it can): its mode (`check_mode`), a size not
    among the preset's buckets, a batch size not among the engine's."""
    try:
        check_mode(bucket.mode)
        if bucket.size not in preset.buckets:
            raise InvalidRequest(f"{bucket.size} is not a bucket of {preset.name}")
        if bucket.frames not in (preset.frames or (0,)):
            frames = ", ".join(map(str, preset.frames)) or "none: it makes images"
            raise InvalidRequest(f"{bucket.frames} frames is not a frame bucket of {preset.name} ({frames})")
        check_refs(bucket, preset)
        if bucket.batch not in batch_sizes:
            raise InvalidRequest(f"batch size {bucket.batch} is not one of this engine's "
                                 f"({', '.join(map(str, batch_sizes))}; --max-batch)")
    except Exception as exc:  # noqa: BLE001 - the board shows it
        return exc
    return None


def preset_buckets(preset, mode: Mode) -> list[BucketKey]:
    """Every bucket of a preset in one mode: its sizes, each with its reference layouts (an edit's) and, for a
    video preset, at each frame count. aot packages are exported for text-to-image buckets only."""
    return [BucketKey(mode, size, frames=frames, refs=refs) for size in preset.buckets
            for refs in preset.reference_layouts(size) if not (refs and mode is Mode.AOT)
            for frames in (preset.frames or (0,))]


def check_refs(bucket: BucketKey, preset) -> None:
    """An edit bucket's references: as many as the preset takes, each at the output size (engine/config/
    images.py resizes every upload to it), and none where the preset's images do not join the sequence."""
    if not bucket.refs:
        return
    if not preset.inputs.in_sequence:
        raise InvalidRequest(f"{preset.name} takes {preset.inputs.describe()}: its buckets have no references")
    if len(bucket.refs) > preset.max_references or any(r != bucket.size for r in bucket.refs):
        raise InvalidRequest(f"{bucket} is not a bucket of {preset.name}: at most {preset.max_references} "
                             f"reference(s), each at the output size {bucket.size}")
    if bucket.mode is Mode.AOT:
        raise InvalidRequest("aot packages are exported for text-to-image buckets only; an edit bucket compiles "
                             "(compile or regional)")


def startup_buckets(warmup, preset, modes: tuple[Mode, ...], batch_sizes: tuple[int, ...]) -> list[BucketKey]:
    """The configured start-up warm list (`warmup`: WarmupOptions), most-used size first (the `preset`'s
    order of buckets, each with its default references), in the engine's `modes`."""
    sizes = preset.buckets
    if warmup.sizes is not None:
        sizes = tuple(Size.parse(s) for s in warmup.sizes)
    frames = preset.frames[0] if preset.frames else 0  # a video preset's sizes at its most-used frame count
    solo = [BucketKey(m, s, frames=frames, refs=preset.reference_layouts(s)[0])
            for s in sizes for m in warmup.modes if m in modes]
    solo = [b for b in solo if not (b.refs and b.mode is Mode.AOT)]
    # Then the batch sizes of the first size (the default bucket), the largest first: it serves a burst
    # in the fewest calls, and a group the largest cannot fill runs as the smaller warm ones meanwhile.
    batched = [BucketKey(m, sizes[0], b, frames=frames, refs=preset.reference_layouts(sizes[0])[0])
               for b in reversed(batch_sizes[1:])
               for m in warmup.modes if m in modes and m.compiled] if sizes else []
    return solo + batched
