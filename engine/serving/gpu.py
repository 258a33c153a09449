"""GPU calls of the in-process runtime: device work inside a function ZeroGPU can schedule.

On a ZeroGPU Space the app's process has no CUDA; a function decorated with `spaces.GPU(duration=...)`
runs in a process forked for the call, its arguments and what it returns (or yields) pickled across,
and everything it changed in memory lost afterwards. A shorter `duration` gets the call queued sooner.
So each request (and each aot build) is one *GPU call*: a generator that takes picklable arguments and
yields picklable events (progress, board changes, the result), never relying on state it leaves behind.

Executors:
- `DirectGpu`: the call runs on the calling thread. What `spaces.GPU` amounts to outside ZeroGPU (the
  decorator returns the function itself), on a CPU host or a dedicated GPU.
- `SpacesGpu`: the function wrapped by `spaces.GPU` (optional dependency, extra `zerogpu`), imported only
  when `SPACES_ZERO_GPU` is set (importing `spaces` imports gradio, which engine/ never does).
- `ForkingGpu`: every call in a child made with os.fork, arguments and events pickled through a pipe:
  what ZeroGPU does, without a GPU. Tests use it to prove a request loses nothing across the fork; a host
  may use it (`SHOWCASE_GPU_CALLS=fork`) to keep aot builds off the web server's interpreter lock.

Cancel crosses the fork as a flag file (`CancelFlag`): a threading.Event set in the app after the fork
is invisible to the child.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from engine import settings

log = logging.getLogger(__name__)

# What a call's duration is made of besides its denoising steps: text encoding, decoding, moving weights
# onto the GPU slice in a fresh fork (ZeroGPU packs them once, then maps them).
CALL_OVERHEAD_S = 3.0
DURATION_MARGIN = 1.5  # measured step time x steps x this: a slower step (a busier slice) still fits
MIN_DURATION_S = 5


class Durations:
    """The `duration` a GPU call asks for: per (variant, size), the best milliseconds per step seen so far
    x steps x DURATION_MARGIN + CALL_OVERHEAD_S, rounded up; with no measurement yet, the documented
    default (`SHOWCASE_GPU_DURATION`, 60 s, ZeroGPU's own default). Never above `SHOWCASE_GPU_MAX_DURATION`."""

    def __init__(self, default_s: float | None = None, max_s: float | None = None):
        self.default_s = settings.gpu_default_duration_s() if default_s is None else default_s
        self.max_s = settings.gpu_max_duration_s() if max_s is None else max_s
        self._ms_per_step: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def record(self, variant: str, size, steps: int, step_ms: tuple[float, ...]) -> None:
        if not step_ms or steps <= 0:
            return
        ms = sorted(step_ms)[len(step_ms) // 2]
        with self._lock:
            key = (variant, str(size))
            self._ms_per_step[key] = min(ms, self._ms_per_step.get(key, math.inf))

    def measured(self, variant: str, size) -> float | None:
        with self._lock:
            return self._ms_per_step.get((variant, str(size)))

    def for_request(self, variant: str, size, steps: int) -> int:
        ms = self.measured(variant, size)
        if ms is None:
            return int(min(self.default_s, self.max_s))
        seconds = ms * steps * DURATION_MARGIN / 1000 + CALL_OVERHEAD_S
        return int(min(self.max_s, max(MIN_DURATION_S, math.ceil(seconds))))


class CancelFlag:
    """A request's cancel, readable on both sides of a fork: the app's Event in the process that made it,
    a file elsewhere (the app writes it when the Event is set, see `GpuCalls.watch_cancel`)."""

    def __init__(self, path: str, event: threading.Event | None = None):
        self.path = path
        self._event = event
        self._owner = os.getpid()

    def is_set(self) -> bool:
        if os.getpid() == self._owner and self._event is not None:
            return self._event.is_set()
        return os.path.exists(self.path)

    def __getstate__(self):  # the Event stays behind: the file is what the other side reads
        return {"path": self.path, "_event": None, "_owner": -1}


class GpuCalls:
    """Runs a generator function as one GPU call; `forks` says whether its memory changes are lost."""

    name = "direct"
    forks = False

    def __init__(self):
        self.flags_dir = Path(tempfile.mkdtemp(prefix="showcase-gpu-calls-"))
        self.calls: list[tuple[str, int]] = []  # (what, duration asked for), for the board and tests

    def wrap(self, fn: Callable[..., Iterator]) -> Callable[..., Iterator]:
        """fn(duration_s, *args) -> a generator; the returned callable takes the same arguments."""
        return fn

    def call(self, wrapped: Callable[..., Iterator], what: str, duration_s: int, *args) -> Iterator:
        self.calls.append((what, duration_s))
        del self.calls[:-256]
        return wrapped(duration_s, *args)

    def cancel_flag(self, request_id: str, event: threading.Event) -> CancelFlag:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)[:120]
        return CancelFlag(str(self.flags_dir / f"{safe}.cancel"), event)

    def watch_cancel(self, flag: CancelFlag, event: threading.Event, done: threading.Event) -> None:
        """Where the call runs in another process: write the flag file when the request is cancelled."""
        if not self.forks:
            return

        def watch():
            while not done.is_set():
                if event.wait(0.05):
                    Path(flag.path).touch()
                    return

        threading.Thread(target=watch, name="gpu-cancel-watch", daemon=True).start()

    def clear(self, flag: CancelFlag) -> None:
        try:
            os.unlink(flag.path)
        except OSError:
            pass

    def close(self) -> None:
        shutil.rmtree(self.flags_dir, ignore_errors=True)


DirectGpu = GpuCalls


class SpacesGpu(GpuCalls):
    """ZeroGPU: `spaces.GPU(duration=<the call's first argument>)`. A generator function streams its
    yields back to the app, so progress arrives per step."""

    name = "spaces"
    forks = True

    def __init__(self, size: str | None = None):
        super().__init__()
        try:
            import spaces  # noqa: F401 - the optional dependency (pip install ".[zerogpu]")
        except ImportError as exc:
            raise RuntimeError("SPACES_ZERO_GPU is set but the `spaces` package is not installed: add it to the "
                               "Space's requirements (pip install '.[zerogpu]')") from exc
        self._size = size

    def wrap(self, fn):
        import spaces

        kwargs = {"size": self._size} if self._size else {}
        return spaces.GPU(duration=lambda duration_s, *args: duration_s, **kwargs)(fn)


_FRAME = struct.Struct("!Q")


class ForkingGpu(GpuCalls):
    """Each call in a child made with os.fork, its arguments and every event it yields pickled through a
    pipe, the child discarded afterwards: ZeroGPU's process model on any host. libgomp's thread pool does
    not survive a fork (the child's first parallel op hangs), so the child computes on one thread."""

    name = "fork"
    forks = True

    def __init__(self, child_threads: int = 1):
        super().__init__()
        self.child_threads = child_threads

    def call(self, wrapped, what: str, duration_s: int, *args) -> Iterator:
        self.calls.append((what, duration_s))
        del self.calls[:-256]
        payload = pickle.dumps((duration_s, args))  # what ZeroGPU sends its worker: must pickle
        return self._run(wrapped, payload)

    def _run(self, fn, payload: bytes) -> Iterator:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read_fd)
            code = 0
            try:
                import torch

                torch.set_num_threads(self.child_threads)
                duration_s, args = pickle.loads(payload)
                with os.fdopen(write_fd, "wb") as out:
                    for event in fn(duration_s, *args):
                        data = pickle.dumps(event)
                        out.write(_FRAME.pack(len(data)) + data)
                        out.flush()
            except BaseException:  # noqa: BLE001 - the child reports by its exit code; the app says what failed
                log.exception("GPU call failed in the forked child")
                code = 1
            os._exit(code)
        os.close(write_fd)
        try:
            with os.fdopen(read_fd, "rb") as source:
                while True:
                    head = source.read(_FRAME.size)
                    if len(head) < _FRAME.size:
                        break
                    (n,) = _FRAME.unpack(head)
                    yield pickle.loads(source.read(n))
        finally:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"the GPU call's process exited with code {code}")


def make_gpu_calls(kind: str | None = None) -> GpuCalls:
    """The executor for this host: spaces on ZeroGPU, else `SHOWCASE_GPU_CALLS` (direct or fork)."""
    kind = kind or settings.gpu_calls()
    if kind == "spaces":
        return SpacesGpu(settings.zero_gpu_size())
    if kind == "fork":
        return ForkingGpu()
    if kind == "direct":
        return DirectGpu()
    raise ValueError(f"SHOWCASE_GPU_CALLS={kind!r}: use direct, fork or spaces")
