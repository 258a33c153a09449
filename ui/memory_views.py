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
    """"transformer 1.20 GiB, vae 80.0 MiB, ..." : the engine's weights by component as stored, largest first
    (MiB below 0.1 GiB: fp8-stored weights of a small model read "transformer 0.00 GiB" in GiB)."""
    rows = sorted((result.get("weights_bytes") or {}).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {gib(size)} GiB" if size >= GIB / 10 else f"{name} {size / 2**20:.1f} MiB"
                     for name, size in rows if size)


def size_text(value) -> str:
    """Bytes as "0.41 GiB", or "38 MiB" below a GiB (the tiny models' levers differ by MiB)."""
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / 2**20:.0f} MiB"


def lever_label(row: dict, load_s: float | None = None) -> str:
    """"layerwise:fp8 · ≈ 0.69 GiB peak, weights 12 MiB · ≈ 1.3× the time" (· unavailable), and where the set
    needs an engine not loaded yet (`load_s`: about how long a load takes here) "· loads a new engine: ≈ 18 s"."""
    parts = [row["levers"]]
    if row.get("device_bytes") is not None:
        parts.append(f"≈ {size_text(row['device_bytes'])} peak, weights {size_text(row['weights_bytes'])}")
    parts.append(f"≈ {row['time_factor']:g}× the time")
    if row.get("why_not"):
        return " · ".join(parts) + " · unavailable"
    return " · ".join(parts) + new_engine_note(load_s)


def new_engine_note(load_s: float | None) -> str:
    """" · loads a new engine: ≈ 18 s" after a choice whose engine is not loaded (`load_s`: about how long a
    load takes here), "" for one whose engine is (or None)."""
    return f" · loads a new engine: ≈ {load_s:.0f} s" if load_s is not None else ""


def host_label(host: str) -> str:
    return f"host's choice ({host or 'none'})"


def memory_choices(rows: list[dict], host: str, public: bool, loads: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """The Generate page's memory field: (label, value) per lever set the engine can take, its price beside
    it; first the host's choice ("" the value: what a request naming none gets). A public host keeps the
    choice: its visitors see only that. `loads`: the sets that need a new engine, and its load's estimate."""
    first = [(host_label(host), "")] if host or public else []
    loads = loads or {}
    return first if public else first + [(lever_label(r, loads.get(r["levers"])), r["levers"]) for r in rows]


def usable_values(rows: list[dict]) -> set[str]:
    return {"", *(r["levers"] for r in rows if not r.get("why_not"))}


def memory_info(rows: list[dict], host: str) -> str:
    """Under the field: what the figures are, and why the unavailable sets cannot run here (each reason once)."""
    size = next((r["size"] for r in rows if r.get("size")), None)
    unknown = next((r["unknown"] for r in rows if r.get("unknown")), "")
    head = (f"no memory estimate here ({unknown[:120]}); time against no lever" if unknown else
            f"estimated peak at {size} (weights as each set leaves them, activations, the process); time against "
            "no lever" if size else "no memory lever can run with these settings")
    if host:
        head += f"; the host's choice: {host}"
    unavailable = sum(1 for r in rows if r.get("why_not"))
    return head + (f". {unavailable} unavailable here: why under \"{WHY_NOT_TITLE}\"" if unavailable else "")


WHY_NOT_TITLE = "Why some choices are unavailable"  # the Generate tab's accordion under these fields


def memory_why(rows: list[dict]) -> str:
    """Why the unavailable lever sets cannot run here, each reason once (the field's info only counts them)."""
    why: dict[str, list[str]] = {}
    for r in rows:
        if r.get("why_not"):
            why.setdefault(r["why_not"], []).append(r["levers"])
    return "\n".join(f"- memory levers {', '.join(names)}: {reason}" for reason, names in why.items())
