"""The Buckets tab's views: every bucket of every engine as a board row, an engine's LoRA slot, and its
attention backends. Pure: no gradio, tested without a server."""

from __future__ import annotations

from ui.views import fmt_ms, fmt_s

BOARD_COLUMNS = [
    "engine", "device", "precision", "mode", "size", "state", "reason",
    "compile s", "warm-up s", "served",
]


def board_rows(status: list[dict]) -> list[list]:
    """Every bucket of every engine; an engine without buckets yet (loading / down) gets one row."""
    rows: list[list] = []
    for engine in status:
        name = engine.get("engine", "")
        preset_device = name.split("@", 1)
        device_precision = preset_device[1].split("/", 1) if len(preset_device) > 1 else ["", ""]
        on = f" on {engine['where']}" if engine.get("where") else ""  # under --ray: its node(s) and chips
        device = device_precision[0] + on
        precision = device_precision[1].split(" ", 1)[0] if len(device_precision) > 1 else ""
        if engine.get("state") != "ready" or not engine.get("buckets"):
            state = engine.get("state", "")
            reason = engine.get("error") or ("loading weights" if state == "loading" else "")
            rows.append([name, device, precision, "", "", f"engine {state}", reason or "", "", "", ""])
            if state != "ready":
                continue
        for b in engine.get("buckets", []):
            reason = b.get("error") or ""
            if b.get("state") == "warm" and b.get("cache_hits"):
                reason = reason or f"{b['cache_hits']} compile-cache hits"
            mode = b.get("mode", "")
            if b.get("origin"):  # aot: "loaded from package" / "built now"
                mode = f"{mode} · {b['origin']}"
            size, served = b.get("size", ""), b.get("requests_served", 0)
            if b.get("references"):  # an edit bucket: its references' tokens are part of the graph
                size = f"{size} + ref {' + '.join(b['references'])}"
            if b.get("batch", 1) > 1:  # a batch size's own graph: requests it served, in how many calls
                size = f"{size} · batch {b['batch']}"
                served = f"{served} in {b.get('batches_served', 0)} calls"
            rows.append([
                name, b.get("device", device_precision[0]) + on, b.get("precision", precision), mode,
                size, b.get("state", ""), reason, fmt_s(b.get("compile_s")),
                fmt_s(b.get("warmup_s")), served,
            ])
        if engine.get("lora"):
            rows.append(lora_row(name, device, precision, engine["lora"]))
    return rows


LORA_SLOT = "LoRA slot"  # the board's mode column for an engine's LoRA row (not a mode: never warmed)


def lora_row(name: str, device: str, precision: str, lora: dict) -> list:
    """An engine's LoRA slot as one board row: the adapter serving now, the hot-swaps served and their median,
    and the recompiles on warm graphs (a hot-swap must cause none)."""
    current = lora.get("current")
    state = f"{current} at {lora.get('scale', 0):g}" if current else "no LoRA"
    swaps = lora.get("swaps", 0)
    median_ms = lora.get("median_swap_ms")
    reason = (f"rank {lora.get('target_rank', 0)} · adapters {', '.join(lora.get('adapters', [])) or 'none'} · "
              f"median swap {fmt_ms(median_ms)} · {lora.get('recompiles', 0)} recompiles")
    if lora.get("fuses"):
        reason += f" · {lora['fuses']} fuses (median {fmt_ms(lora.get('median_fuse_ms'))})"
    if lora.get("refused"):
        reason += f" · refused {', '.join(lora['refused'])} (see notices)"
    return [name, device, precision, LORA_SLOT, "", state, reason, "", "", f"{swaps} swaps"]


def attention_markdown(rows: list[dict]) -> str:
    """Every attention backend for the picked engine: can it run here, and why not."""
    lines = ["| backend | runs here | why not / note |", "|---|---|---|"]
    for r in rows:
        why = (r.get("reason") or r.get("note") or r.get("summary") or "").replace("|", "\\|")
        lines.append(f"| `{r['name']}` | {'yes' if r.get('usable') else 'no'} | {why} |")
    return "\n".join(lines)
