"""Memory as a price, shown where the seconds are: a result's peak and its engine's weights in GiB (Compare
cards, tables and captions; the Advisor's rows)."""

from __future__ import annotations

GIB = 2**30


def gib(value) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


def gib_text(result: dict) -> str:
    """" · 0.41 GiB peak · weights 0.05 GiB" ("" where neither is known), after a result's seconds."""
    peak = result.get("peak_memory_bytes")
    weights = sum((result.get("weights_bytes") or {}).values()) or None
    parts = ([f"{gib(peak)} GiB peak"] if peak is not None else []) + \
        ([f"weights {gib(weights)} GiB"] if weights is not None else [])
    return "".join(f" · {p}" for p in parts)


def weights_line(result: dict) -> str:
    """"transformer 0.03 GiB, vae 0.01 GiB, ..." : the engine's weights by component, largest first."""
    rows = sorted((result.get("weights_bytes") or {}).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {gib(size)} GiB" for name, size in rows if size)
