"""Shorter requests first where engines share the host's CPU cores.

On a cpu device every engine's requests are computed by the same few cores, which the kernel shares
equally, so a short request ran beside long ones at an equal share (the figures: docs/hosting.md). Each
worker therefore runs a request on a thread niced by how long the request is expected to run: up to
`short_ms` at the worker's own priority, then two nice steps lower per doubling, at most `max_extra`
steps, and as a batch thread (no wake-up preemption). The kernel's weighted fair sharing then
approximates shortest-job-first across processes without a host-wide lock: a short request gets most of
a contended core, a long one still always moves (weights, not strict priority), equally long ones share
fairly, and the compile thread stays below every request. Not SCHED_IDLE for long requests: it can starve
them and did not shorten short ones' waits.

This only works while the workers share one scheduling group with each other and the web server: on
Linux with autogroup scheduling, sessions share the CPU equally first and niceness counts only inside a
session, so workers stay in the app's session (join_own_process_group).

Expected run time: the best (least contended) milliseconds per step seen at the same bucket in the same
variant (the compiled graph, or eager: a compiled mode's bucket that is not warm yet is served eagerly),
times the request's steps; a bucket not seen yet scales the variant's best per-pixel rate by its pixels.
An engine that has run nothing yet gives no estimate: its requests run at the worker's priority.

Inside one worker, the compile thread runs niced below its requests and steps aside while one runs
(`YieldToRequests`); loading runs on a thread as far below (`run_on_lowered_thread`).
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from engine import settings
from engine.protocol import Size


def lower_this_thread_priority(by: int | None = None) -> bool:
    """Linux: nice only the calling thread (and the compiler processes it starts, which inherit it),
    `by` steps below the process (settings.compile_niceness()), and mark it a batch thread
    (SCHED_BATCH: the kernel no longer lets it preempt others when it wakes, so the short requests and
    the web server it shares cores with get the CPU as soon as they wake)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        by = settings.compile_niceness() if by is None else by
        niceness = min(19, os.getpriority(os.PRIO_PROCESS, tid) + by)
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError:
        return False
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, niceness)  # keep the niceness across the policy change
    except (OSError, AttributeError):
        pass  # the niceness alone still holds
    return True


def run_on_lowered_thread(fn, by: int, name: str):
    """fn() on a new thread `by` nice steps below this one (Linux; elsewhere at this priority): its
    result, or its exception raised here."""
    outcome: dict = {}

    def target() -> None:
        lower_this_thread_priority(by)
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def join_own_process_group() -> None:
    """Make this process the leader of a new process group, so the app stops the worker *and* its compiler
    processes at once (killpg), in the app's session.

    Not a new session (setsid): Linux's autogroup scheduling (on by default in most desktop and VM kernels,
    /proc/sys/kernel/sched_autogroup_enabled) shares the CPU equally between sessions first and honours
    niceness only inside one. A worker in a session of its own got as much CPU as the web server and
    every other worker whatever its niceness: a long bf16 request took as much of the cores as a short
    warm one, and four busy workers left the web server a fifth."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


def fx_tracing() -> bool:
    """Whether some thread is inside a torch.fx symbolic trace (torch not imported: no)."""
    fx = sys.modules.get("torch.fx._symbolic_trace")  # its flag: is_fx_tracing() warns on every process's first call
    return bool(fx is not None and getattr(fx, "_is_fx_tracing_flag", False))


# Where a compile may be stopped: at the call of a unit of work, repeated through a compile (dynamo's
# bytecode steps, an fx node, inductor's code generation and C++ builds). Raising at an arbitrary call
# could land in a context manager's __exit__ or a finally block's call and leave a lock held or a patch
# in place; raised as one of these starts, it unwinds like that call failing.
SET_ASIDE_AT = frozenset({"step", "run_node", "codegen", "build", "compile_fx_inner", "fx_codegen_and_compile"})


class CompileSetAside(BaseException):
    """Raised in the compile thread to stop a background compile that a request is waiting behind (the
    bucket goes back to the queue). A BaseException: the compiler's and the warm-up's `except Exception`
    must not take it for a failed compile."""


class YieldToRequests:
    """Lets the compile thread step aside while a request runs in the same worker.

    Compiling holds the GIL most of the time, partly in C calls the switch interval cannot cut short
    (fake-tensor propagation, pattern matching, garbage collection). A request re-acquires the GIL after
    every torch op, so a warm request's latency multiplied while its worker compiled (docs/hosting.md).
    The compile thread installs `hook` as its profile function: at every Python function call, while a
    request runs, it waits (without the GIL) for the request to end. It waits at most `max_wait_s` per
    request: a request that needs something the compile thread holds (a lock, the import lock) then
    gets it, so this can delay a request but never deadlock it."""

    def __init__(self, max_wait_s: float = 0.5):
        self.max_wait_s = max_wait_s
        self.yields = True  # False: the hook only sets compiles aside
        self.idle = threading.Event()  # set while no request runs (between `request()` blocks)
        self.idle.set()
        self._request = 0  # the running (or last) request's number
        self._gave_up_on = -1  # the request whose wait ran out: the compile thread runs beside it
        self.compiling = None  # the bucket the compile thread works on (set by it)
        self._set_aside = None  # the bucket whose compile is to stop at the next function call

    def set_aside_unless_waited(self, waited, is_waited_for) -> None:
        """A request waits for `waited`'s compile: stop the compile running now (at the compile thread's next
        unit of work, if it is still the one running then) unless it is that one or another request waits
        for it too (`is_waited_for(bucket)`). An engine compiles one bucket at a time, so a background
        compile (the start-up warm list, a warm-up) would hold the waited one back for its whole length."""
        current = self.compiling
        if current is not None and current != waited and not is_waited_for(current):
            self._set_aside = current

    @contextmanager
    def compiling_of(self, bucket, hooked: bool):
        """The compile thread's block for one granted bucket (`hooked`: with this hook on the thread, again: a
        set-aside unsets it). Yields what says, once the block ends, whether its compile was set aside
        (CompileSetAside is taken here)."""
        run = SimpleNamespace(set_aside=False)
        self.compiling = bucket
        if hooked:
            sys.setprofile(self.hook)  # this thread only
        try:
            yield run
        except CompileSetAside:
            run.set_aside = True
        finally:
            self.compiling = None
            if self._set_aside == bucket:  # asked as it ended: not for a later compile of the bucket
                self._set_aside = None

    @contextmanager
    def request(self):
        """A request runs for the block: the compile thread waits at its next Python call until it ends."""
        self._begin()
        try:
            yield
        finally:
            self.idle.set()

    def _begin(self) -> None:
        self._request += 1
        self.idle.clear()
        # The compile thread may be inside a torch.fx symbolic trace, which patches torch.nn.Module.__call__
        # for every thread until it ends: a request run then fails ("module is not installed as a
        # submodule"). The hook lets a trace under way finish (it never pauses inside one, and pauses
        # before the next); the request starts after it.
        deadline = time.monotonic() + 10 * self.max_wait_s
        while fx_tracing() and time.monotonic() < deadline:
            time.sleep(0.001)

    def hook(self, frame, event, arg) -> None:
        if event != "call":
            return
        if self._set_aside is not None and self._set_aside == self.compiling \
                and frame.f_code.co_name in SET_ASIDE_AT and not fx_tracing():
            self._set_aside = None
            # Raised from a profile function, it propagates in the called frame, as if that function had
            # failed (and unsets the hook: the warm-up thread installs it again before its next compile).
            raise CompileSetAside(f"compile of {self.compiling} set aside for a request waiting for another")
        if not self.yields or self.idle.is_set() or self._gave_up_on == self._request or fx_tracing():
            return
        request = self._request
        if not self.idle.wait(self.max_wait_s):
            self._gave_up_on = request


class RunCost:
    def __init__(self, short_ms: float, max_extra: int):
        self.short_ms = short_ms
        self.max_extra = max(0, max_extra)
        self._lock = threading.Lock()
        self._per_step: dict[tuple[str, Size], float] = {}  # (variant, size) -> best ms per step
        self._per_pixel_step: dict[str, float] = {}  # variant -> best ms per step per pixel

    def record(self, variant: str, size: Size, steps: int, total_ms: float) -> None:
        """A finished run: its total time over its steps (encode and decode included)."""
        if steps < 1 or total_ms <= 0:
            return
        per_step = total_ms / steps
        with self._lock:
            key = (variant, size)
            self._per_step[key] = min(per_step, self._per_step.get(key, math.inf))
            rate = per_step / size.pixels
            self._per_pixel_step[variant] = min(rate, self._per_pixel_step.get(variant, math.inf))

    def expected_ms(self, variant: str, size: Size, steps: int) -> float | None:
        with self._lock:
            per_step = self._per_step.get((variant, size))
            if per_step is None and variant in self._per_pixel_step:
                per_step = self._per_pixel_step[variant] * size.pixels
        return None if per_step is None else per_step * steps

    def extra_niceness(self, variant: str, size: Size, steps: int) -> int:
        """Nice steps to add for this request: 0 up to short_ms, then 2 per doubling, at most max_extra."""
        expected = self.expected_ms(variant, size, steps)
        if self.short_ms <= 0 or expected is None or expected <= self.short_ms:
            return 0
        doublings = math.ceil(math.log2(expected / self.short_ms))
        return min(self.max_extra, 2 * doublings)


class ShortRuns:
    """Which engines on this host are running a short request right now, so that long requests elsewhere
    step aside between their steps: niceness shares a core by weight, so a short request beside a long one
    still lost part of its core, more so with the long one on the other core (shared caches, bandwidth).

    A long request waits before each of its steps while another engine runs a short one (at most
    `max_wait_s` per step, so it always moves on): the short one has the cores to itself but for the step
    already under way.

    One byte per engine in a small shared file (`SLOTS` of them): each worker writes only its own byte, so
    no lock is needed; the manager hands out the slots and clears one when its engine goes away (a worker
    killed mid-request must not leave its byte set)."""

    SLOTS = 64
    POLL_S = 0.002

    def __init__(self, path: str | Path, slot: int, max_wait_s: float = 0.5):
        if not 0 <= slot < self.SLOTS:
            raise ValueError(f"slot {slot} is outside 0..{self.SLOTS - 1}")
        self.path, self.slot, self.max_wait_s = Path(path), slot, max_wait_s
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), self.SLOTS)

    @classmethod
    def create_file(cls, folder: str | Path) -> Path:
        """A new, cleared short-run file in `folder`."""
        fd, name = tempfile.mkstemp(prefix="showcase-short-runs-", dir=folder)  # one per manager
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(cls.SLOTS))
        return Path(name)

    @classmethod
    def from_env(cls, value: str | None) -> ShortRuns | None:
        """From SHOWCASE_SHORT_RUNS ("path:slot", set by the manager for engines on the host's cores)."""
        if not value:
            return None
        path, _, slot = value.rpartition(":")
        try:
            return cls(path, int(slot))
        except (OSError, ValueError):
            return None  # no short-run slot: requests are still ordered by niceness alone

    def env_value(self) -> str:
        return f"{self.path}:{self.slot}"

    def set_running(self, running: bool) -> None:
        self._map[self.slot] = 1 if running else 0

    def clear(self, slot: int) -> None:
        self._map[slot] = 0

    def others_running(self) -> bool:
        marks = self._map[:]
        return marks.count(0) < self.SLOTS - marks[self.slot]

    def step_aside(self, cancel: threading.Event | None = None) -> float:
        """Wait while another engine runs a short request (at most max_wait_s, or until cancelled);
        returns the seconds waited."""
        if not self.others_running():
            return 0.0
        start = time.monotonic()
        deadline = start + self.max_wait_s
        while self.others_running() and time.monotonic() < deadline and not (cancel and cancel.is_set()):
            time.sleep(self.POLL_S)
        return time.monotonic() - start


class ShortRunSlots:
    """The manager's side of ShortRuns: one short-run file for the host, a slot per engine on its cores."""

    def __init__(self, folder: str | Path):
        self.path = ShortRuns.create_file(folder)
        self._file = ShortRuns(self.path, 0)
        self._lock = threading.Lock()
        self._taken: set[int] = set()

    def take(self) -> ShortRuns | None:
        """A cleared slot for a new engine, or None when all are taken (its requests use niceness alone)."""
        with self._lock:
            slot = next((s for s in range(ShortRuns.SLOTS) if s not in self._taken), None)
            if slot is None:
                return None
            self._taken.add(slot)
            self._file.clear(slot)
            return ShortRuns(self.path, slot)

    def release(self, slot: int) -> None:
        """Its engine is gone: the byte is cleared (the worker may have died with a short request running)."""
        with self._lock:
            self._taken.discard(slot)
            self._file.clear(slot)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
