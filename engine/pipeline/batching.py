"""Requests that can share one denoiser call run as one pipeline call (a batch).

Which requests can share a call: the same engine (each worker batches its own queue), bucket (mode and
size), steps, guidance, presence of a negative prompt, step cache and on-cold policy — everything that
changes the graph or the noise schedule. Each member keeps its own prompt, negative prompt and seed
(`generator=[Generator.manual_seed(s) ...]`), so its image is what it gets alone, within rounding.

A first-block step cache decides per step, from the whole batch tensor, whether to skip the remaining
blocks; in a batch one request's image would change another's decisions, so such requests run alone.

Batch sizes are a small static set (1, 2, 4, ... up to the engine's `max_batch`): a compiled mode has one
graph per (bucket, batch size), compiled in the background like the buckets. A gathered group of n
requests runs at the largest *warm* size that fits; the rest go back to the front of the queue and form
the next call (with whatever arrived meanwhile). A partial group is split, never padded: padding spends
a full batch's compute on images nobody sees and makes every member wait for it, while a split's first
call finishes sooner and its remainder can still fill up. A size that is not warm yet runs as smaller
warm ones and its compile is asked for. Eager runs take any size.

`Gatherer` is the admission logic, shared by any runtime that owns a request queue (the worker process
loop, an in-process runtime): it takes the first waiting request, then every waiting request with the
same key, and waits for more while the group is not full, until no request joined for `wait_ms` (the
window slides with each joiner). A lone request waits `wait_ms`; a burst that reaches the worker one
request at a time through the web server still forms one call; the first of a group waits at most
(max_batch − 1) × `wait_ms`, and only while requests keep joining.
Requests that queued while the previous call ran are already waiting, so under load the window costs
nothing. A request cancelled while it waits leaves the queue at once (`withdraw`).

Fair between clients: the next call's first request is the oldest waiting one of the client whose last
turn is the longest ago (a client never served yet goes first), so one visitor's queued requests delay
another visitor's request by at most the call that is running, and then the calls of clients with a turn
due before theirs: round-robin by call, not first come first served. Requests of other clients with the
same key still join the call. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

from engine.protocol import GenerateRequest, StepCacheKind, params

# Step caches whose per-step decision reads the whole batch tensor: their requests run alone.
DATA_DEPENDENT_CACHES = frozenset({StepCacheKind.FIRST_BLOCK})
MAX_CLIENTS_KEPT = 1024  # clients whose last turn is remembered (bounded: a client may be any address)


def max_batch_for(max_batch: int | None, spec, tp: int = 1) -> int:
    """The engine's largest batch: the option, else the device's default; 1 (off) for a tensor-parallel
    engine, whose ranks run every request in step."""
    if tp > 1:
        return 1
    value = spec.max_batch if max_batch is None else max_batch
    return max(1, int(value))


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The static batch sizes of an engine: powers of two below `max_batch`, and `max_batch`."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max(1, max_batch))
    return tuple(sizes)


def batch_key(request: GenerateRequest) -> tuple | None:
    """What must be equal for requests to share one call; None: the request runs alone."""
    bucket = request.bucket  # mode, size, frames and an edit bucket's references: one graph
    if request.step_cache.kind in DATA_DEPENDENT_CACHES or bucket.frames:
        return None  # a clip runs alone
    # the sampling fields' own (engine/protocol/params.py): steps, guidance, one adapter at one scale, ...
    fields = tuple(field.batch(getattr(request, field.name)) for field in params.BATCH_FIELDS)
    return (bucket, fields,
            request.previews,  # partial images are decoded at the steps their count spreads over
            request.images if request.images_shared else None)  # FLUX.2's references: the call's own


def chunk(n: int, sizes) -> int:
    """How many of n gathered requests run now: the largest of `sizes` that is at most n (1 at least)."""
    fitting = [s for s in sizes if s <= n]
    return max(fitting) if fitting else 1


def wanted_size(n: int, all_sizes, warm_sizes) -> int | None:
    """The batch size a group of n would have used had it been warm (None: the one used was the best)."""
    best = chunk(n, all_sizes)
    return best if best not in warm_sizes else None


class AllSet:
    """is_set() once every one of the events is: a batch's cancel (its call stops, or steps aside, only
    when all its members left)."""

    def __init__(self, events):
        self.events = events

    def is_set(self) -> bool:
        return all(e.is_set() for e in self.events)


class Gatherer:
    """The queue side of batching: `next_batch()` returns the requests of the next pipeline call.

    source: the queue the receiver puts requests on (None = stop); arrived(request) -> perf_counter time
    it arrived; sizes_for(request) -> the batch sizes it may run at now (ascending, 1 included);
    on_split(request, size): a group was split because `size` is not warm (ask for its compile); clock: the
    time `arrived` answers in (a test passes a scripted queue and its clock, so no test waits on the machine)."""

    def __init__(self, source: queue.Queue, max_batch: int, wait_ms: float,
                 arrived: Callable[[GenerateRequest], float | None],
                 sizes_for: Callable[[GenerateRequest], tuple[int, ...]],
                 on_split: Callable[[GenerateRequest, int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.source = source
        self.clock = clock
        self.max_batch = max(1, max_batch)
        self.wait_s = max(0.0, wait_ms) / 1000
        self.arrived = arrived
        self.sizes_for = sizes_for
        self.on_split = on_split
        self.all_sizes = batch_sizes(self.max_batch)
        self._backlog: collections.deque = collections.deque()  # taken from source, not served yet
        self._lock = threading.Lock()
        self._stopped = False
        self._turn = 0
        self._last_turn: collections.OrderedDict[str, int] = collections.OrderedDict()  # client -> its last turn

    def pending(self) -> int:
        """Requests waiting (the source's and the backlog's)."""
        with self._lock:
            return len(self._backlog) + self.source.qsize()

    def withdraw(self, request_id: str) -> GenerateRequest | None:
        """Take a waiting request out of the queue (a cancel: it is answered now, not when its turn comes);
        None when it is not waiting, i.e. already taken for a call (its cancel flag stops it there)."""
        with self._lock:
            for item in self._backlog:
                if item.request_id == request_id:
                    self._backlog.remove(item)
                    return item
            with self.source.mutex:  # still in the receiver's queue: a blocked get() waits on, unharmed
                for item in self.source.queue:
                    if item is not None and item.request_id == request_id:
                        self.source.queue.remove(item)
                        return item
        return None

    def _pop(self, block: bool, timeout: float | None = None):
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
        if self._stopped:
            return None
        try:
            item = self.source.get(block=block, timeout=timeout)
        except queue.Empty:
            raise
        if item is None:
            self._stopped = True
        return item

    def next_batch(self) -> list[GenerateRequest] | None:
        """The next call's requests, in arrival order; None when the source said stop."""
        first = self._pop(block=True)
        if first is None:
            return None
        first = self._next_turn(first)
        key = batch_key(first) if self.max_batch > 1 else None
        if key is None:
            return [first]
        group = [first]
        with self._lock:  # the same key waiting in the backlog joins, the others keep their order
            keep = collections.deque()
            for item in self._backlog:
                (group if len(group) < self.max_batch and batch_key(item) == key else keep).append(item)
            self._backlog = keep
        deadline = self._arrival(first) + self.wait_s
        while len(group) < self.max_batch and not self._stopped:
            timeout = deadline - self.clock()
            try:
                item = self.source.get(block=timeout > 0, timeout=timeout if timeout > 0 else None)
            except queue.Empty:
                break
            if item is None:
                self._stopped = True
                break
            if batch_key(item) == key:
                group.append(item)
                # A burst reaches the worker one request at a time (the web server admits them in turn):
                # each joiner keeps the window open for the next.
                deadline = max(deadline, self._arrival(item) + self.wait_s)
            else:
                with self._lock:
                    self._backlog.append(item)
        sizes = self.sizes_for(first)
        size = chunk(len(group), sizes)
        if size < len(group):
            wanted = wanted_size(len(group), self.all_sizes, sizes)
            if wanted is not None and self.on_split is not None:
                self.on_split(first, wanted)
            with self._lock:
                self._backlog.extendleft(reversed(group[size:]))
        return group[:size]

    def take_waiting(self, limit: int) -> list[GenerateRequest]:
        """At most `limit` waiting requests, taken out of the queue without waiting, in turn order (a step-level
        session admits them between two steps: engine/worker/stepped.py); the source saying stop ends it."""
        taken = []
        with self._lock:
            self._drain_source()
            while self._backlog and len(taken) < limit:
                chosen = min(self._backlog, key=lambda r: self._last_turn.get(r.client, -1))
                self._backlog.remove(chosen)
                self._took_turn(chosen)
                taken.append(chosen)
        return taken

    def _drain_source(self) -> None:
        """Everything the receiver queued moved to the backlog (called holding the lock)."""
        while not self._stopped:
            try:
                item = self.source.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._stopped = True
            else:
                self._backlog.append(item)

    def _took_turn(self, chosen: GenerateRequest) -> None:
        self._turn += 1
        self._last_turn[chosen.client] = self._turn
        self._last_turn.move_to_end(chosen.client)
        while len(self._last_turn) > MAX_CLIENTS_KEPT:  # a forgotten client is served as a new one
            self._last_turn.popitem(last=False)

    def _next_turn(self, first: GenerateRequest) -> GenerateRequest:
        """Of `first` and every request waiting behind it, the oldest of the client whose turn is due."""
        with self._lock:
            self._drain_source()  # everything that arrived counts, not only what was taken so far
            waiting = [first, *self._backlog]  # in arrival order
            chosen = min(waiting, key=lambda r: self._last_turn.get(r.client, -1))  # min keeps the oldest of ties
            if chosen is not first:
                self._backlog = collections.deque(r for r in waiting if r is not chosen)
            self._took_turn(chosen)
        return chosen

    def _arrival(self, request: GenerateRequest) -> float:
        arrived = self.arrived(request)
        return arrived if arrived is not None else self.clock()
