"""What a request that has not started its steps yet waits for, in words a visitor can act on: its engine
loading (seconds so far and about how long a load takes here), the compile of its bucket (which bucket,
seconds so far, about how long, and which compiles run ahead of it) or earlier requests on its engine.
Pure functions of the host's compile scheduler snapshot and the engine's board, so they are tested alone.
"""

from __future__ import annotations

from ui.views import median  # engine.metrics' median: the one the bench and timings use

DEFAULT_LOAD_S = 20.0  # before any engine loaded here: about the embedded model's load on a 2-core CPU
DEFAULT_COMPILE_S = 30.0  # before any bucket of the mode compiled here


def load_estimate_s(load_times: list[float]) -> float:
    """About how long loading an engine takes here: the median of the loads measured so far."""
    times = [t for t in load_times if t]
    return median(times) if times else DEFAULT_LOAD_S


def loading_text(key, waited_s: float, load_times: list[float]) -> tuple[str, float]:
    """(what it waits for, the share of an estimated load done: below 1 until the engine is ready)."""
    estimate = load_estimate_s(load_times)
    share = min(0.95, waited_s / estimate) if estimate else 0.0
    return (f"loading engine {key} (a new model, device or precision): {waited_s:.0f} s so far, "
            f"a load takes about {estimate:.0f} s here…"), share


def compile_estimate_s(buckets, mode: str) -> float | None:
    """About how long a compile of `mode` takes on this engine: the median of its buckets compiled so far
    (any mode where none of this one has)."""
    same = [b.compile_s for b in buckets if b.compile_s and str(b.bucket.mode) == mode]
    every = [b.compile_s for b in buckets if b.compile_s]
    return median(same or every) if (same or every) else None


def _ahead_text(running: list[dict]) -> str:
    return "; ".join(f"{r['bucket']} on {r['engine']} ({r['running_s']:.0f} s so far)" for r in running)


def compile_bucket(mode, size, on_cold) -> str | None:
    """The bucket ("mode:WxH") a request waits for the compile of before its first step: a compiled mode
    with on_cold=wait; None where a cold bucket is served eagerly."""
    if str(mode) == "eager" or str(on_cold) != "wait":
        return None
    return f"{mode}:{size}"


def _waits_on(entry: dict, engine: str, bucket: str | None) -> bool:
    """A scheduler entry is the compile this request waits for: its engine's, of its bucket (where the request
    names it: the entry's `waiting` counts only requests that waited before the compile was granted)."""
    if entry["engine"] != engine:
        return False
    return entry["bucket"] == bucket if bucket else bool(entry.get("waiting"))


def compile_wait_text(key, snapshot: dict, buckets, waited_s: float,
                      bucket: str | None = None) -> tuple[str, float | None] | None:
    """(text, share of the compile done) when a request on engine `key` waits for a bucket's compile: the
    scheduler's running or queued compile of `bucket` ("mode:WxH"; without it, one a request waits for), else
    the engine's board showing that bucket compiling or queued; None when it waits for no compile."""
    engine = str(key)
    for r in snapshot.get("running", []):
        if _waits_on(r, engine, bucket):
            mode = r["bucket"].split(":")[0]
            estimate = compile_estimate_s(buckets, mode) or DEFAULT_COMPILE_S
            others = [o for o in snapshot.get("running", []) if o is not r]
            beside = f"; beside it: {_ahead_text(others)}" if others else ""
            return (f"compiling {r['bucket']} on {engine}: {r['running_s']:.0f} s so far, about {estimate:.0f} s "
                    f"in all (a compile of this mode here); waited {waited_s:.0f} s{beside}…",
                    min(0.95, r["running_s"] / estimate))
    queued = snapshot.get("queued", [])
    for position, q in enumerate(queued, start=1):
        if _waits_on(q, engine, bucket):
            running = snapshot.get("running", [])
            ahead = (f"behind {len(running)} running compile{'s' if len(running) != 1 else ''}: "
                     f"{_ahead_text(running)}") if running else "starting"
            line = "next in line" if position == 1 else f"{position} in line"
            return (f"compile of {q['bucket']} on {engine} queued ({line}), {ahead}; waited {waited_s:.0f} s…",
                    None)
    return _board_compile_text(engine, buckets, bucket, waited_s)


def _board_compile_text(engine: str, buckets, bucket: str | None, waited_s: float) -> tuple[str, float] | None:
    """The engine's own word where the scheduler has none (no host scheduler, or the grant not seen yet)."""
    info = next((b for b in buckets if bucket and str(b.bucket) == bucket), None)
    if info is None or str(info.state) not in ("compiling", "queued"):
        return None
    estimate = compile_estimate_s(buckets, str(info.bucket.mode)) or DEFAULT_COMPILE_S
    return (f"compiling {bucket} on {engine} ({info.state}): waited {waited_s:.0f} s, a compile of this mode "
            f"takes about {estimate:.0f} s here…", min(0.95, waited_s / estimate))


def queued_text(key, pending: int, waited_s: float) -> str:
    """A request submitted to its engine that neither loads nor waits for a compile: earlier requests run."""
    ahead = max(0, pending - 1)
    return (f"queued on {key}: {ahead} earlier request{'s' if ahead != 1 else ''} ahead; "
            f"waited {waited_s:.0f} s…")
