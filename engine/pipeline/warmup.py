"""Warm-up: compile one bucket (its first calls compile, the next is the warm-up run), where a compile
cache that cannot be written or is corrupt moves or drops the cache, and which buckets warm at start-up."""

from __future__ import annotations

import logging
import time

from engine.config import caches
from engine.errors import InvalidRequest
from engine.pipeline.board import describe_failure
from engine.pipeline.clock import cache_counters
from engine.protocol import BucketInfo, BucketKey, BucketState, GenerateRequest, LoraChoice, Mode, Size

log = logging.getLogger(__name__)


class Warmup:
    """The warm-up of one runner's buckets (engine/pipeline/runner.py): its board, variants and options."""

    def __init__(self, runner):
        self.runner = runner

    # -- the warm-up requests ---------------------------------------------------------------------
    def request(self, bucket: BucketKey, guidance: float | None = None) -> GenerateRequest:
        r = self.runner
        return GenerateRequest(
            prompt="warm-up",
            width=bucket.size.width,
            height=bucket.size.height,
            steps=r.options.warmup.steps,
            guidance=r.preset.guidance if guidance is None else guidance,
            seed=0,
            mode=bucket.mode,
            request_id=f"warm-{bucket}",
        )

    def members(self, bucket: BucketKey, guidance: float | None = None) -> list[GenerateRequest] | None:
        """A batched bucket's warm-up call: `bucket.batch` requests (None at batch size 1)."""
        if bucket.batch <= 1:
            return None
        request = self.request(bucket, guidance)
        return [request.replace(seed=i, request_id=f"{request.request_id}-{i}") for i in range(bucket.batch)]

    def call(self, pipe, bucket: BucketKey, guidance: float | None = None):
        return self.runner.caller.call(pipe, self.request(bucket, guidance), members=self.members(bucket, guidance))

    def guidances(self) -> tuple[float, ...]:
        # With classifier-free guidance, guidance <= 1 halves the denoiser batch: a second shape.
        # Warm both so changing guidance never recompiles.
        preset = self.runner.preset
        g = preset.guidance
        return (g, 1.0) if preset.cfg and g > 1.0 else (g,)

    # -- one bucket -------------------------------------------------------------------------------
    def _refusal(self, bucket: BucketKey) -> Exception | None:
        """Why `bucket` cannot be compiled on this engine (None when it can)."""
        r = self.runner
        try:
            r.check_mode(bucket.mode)
            if bucket.size not in r.preset.buckets:
                raise InvalidRequest(f"{bucket.size} is not a bucket of {r.preset.name}")
            if bucket.batch not in r.batch_sizes:
                raise InvalidRequest(f"batch size {bucket.batch} is not one of this engine's "
                                     f"({', '.join(map(str, r.batch_sizes))}; --max-batch)")
        except Exception as exc:  # noqa: BLE001 - the board shows it
            return exc
        return None

    def bucket(self, bucket: BucketKey) -> BucketInfo:
        """Compile and warm one bucket: first call compiles (compile_s), second is the warm-up run."""
        board = self.runner.board
        if not bucket.mode.compiled:
            return board.update(bucket, state=BucketState.WARM)
        if (refusal := self._refusal(bucket)) is not None:
            return board.update(bucket, state=BucketState.FAILED, error=str(refusal))
        board.update(bucket, state=BucketState.COMPILING, error=None, origin=None)
        try:
            pipe = self.runner.variant(bucket.mode)
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
        aot = self.runner.aot if bucket.mode is Mode.AOT else None
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
        for guidance in self.guidances():
            self.call(pipe, bucket, guidance)
        return None

    def _recover(self, bucket: BucketKey, exc: Exception) -> str | None:
        """After a failed first compile: move to a temporary cache, or drop the on-disk caches (raises `exc`
        again when neither can help). Returns the bucket's origin."""
        r = self.runner
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
        r.notices.append(notice)
        caches.disable_compile_caches()
        return None

    def _load_or_build_aot(self, bucket: BucketKey) -> str:
        r = self.runner
        if r.loras is not None:
            # An export holds the slot's scaling tensors as constants: captured with no LoRA (aot serves none).
            with r.run_lock:
                r.loras.select(LoraChoice())
        origin, notices = r.aot.warm(bucket, report=lambda text: r.board.update(bucket, origin=text))
        r.notices += notices
        return origin

    # -- the compile folders ----------------------------------------------------------------------
    def compile_folders(self) -> tuple[str, ...]:
        """The folders a compile writes to: inductor's cache, the compilers' temporary files, aot packages."""
        folders = [folder for _, folder in self.runner.folders()]
        if self.runner.aot is not None:
            folders.append(str(self.runner.aot.store.root))
        return tuple(folders)

    def _move_cache(self, bucket: BucketKey, unwritable: caches.Unwritable) -> str:
        """Compiles (and aot packages) go to a temporary cache from now on; the notice goes on the engine and the
        bucket, and the worker reports its new folders (engine/worker/loop.py)."""
        r = self.runner
        folder, notice = caches.switch_to_temporary_compile_cache(unwritable)
        if r.aot is not None:
            from engine.pipeline import aot

            r.aot.store = aot.PackageStore(folder / "aot")
        if notice not in r.notices:
            r.notices.append(notice)
        r.folders_notice = notice
        origin = f"compiled in a temporary cache ({unwritable.what})"
        r.board.update(bucket, origin=origin)
        return origin

    # -- the start-up list ------------------------------------------------------------------------
    def startup_buckets(self) -> list[BucketKey]:
        """The configured start-up warm list, most-used size first (the preset's order)."""
        r, warmup = self.runner, self.runner.options.warmup
        sizes = r.preset.buckets
        if warmup.sizes is not None:
            sizes = tuple(Size.parse(s) for s in warmup.sizes)
        modes = r.modes()
        solo = [BucketKey(m, s) for s in sizes for m in warmup.modes if m in modes]
        # Then the batch sizes of the first size (the default bucket), the largest first: it serves a burst
        # in the fewest calls, and a group the largest cannot fill runs as the smaller warm ones meanwhile.
        batched = [BucketKey(m, sizes[0], b) for b in reversed(r.batch_sizes[1:])
                   for m in warmup.modes if m in modes and m.compiled] if sizes else []
        return solo + batched
