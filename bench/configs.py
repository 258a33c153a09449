"""Explicit configurations for a comparison: parsing a list a person typed, the reason one cannot run here
(the engine's own checks), and the lists offered ready-made.

The form, one configuration per entry, entries separated by ";" or new lines:

    mode/precision[/step cache][+lora=NAME[:SCALE][:fused]][+mem=LEVERS][@device]

e.g. "eager/fp32; compile/fp32; regional/bf16; eager/fp32/first-block:0.2; compile/bf16@cuda;
compile/fp32+lora=swap; compile/fp32+lora=swap:0.5". The step cache is any form `python -m engine
step-caches` lists ("none" or left out: no cache); the device is one of the engine's device names, or the
comparison's default device when left out.

The LoRA part picks one of the preset's adapters (`[[PRESET.loras]]`) at SCALE (0-2; left out: the adapter's
own scale), fused into the weights with ":fused" (eager only), as `--lora NAME[:SCALE][:fused]` does on the
CLI; "+lora=none" is no LoRA. It is a "+" suffix, not a
fourth "/" part, because the step cache before it is optional and a position would not say which is which;
it reads as "this configuration plus a style", so listing one entry per adapter gives one card per style.

The memory part names memory levers as `python -m engine memory-levers` lists them, comma-separated:
"eager/fp32+mem=layerwise:fp8", "eager/bf16+mem=group:block:2,vae-slicing". Left out: the host's levers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import InvalidRequest
from engine.protocol import LoraChoice, MemoryLevers, Mode, Precision, StepCache, parse_lora

MAX_ENTRIES = 12  # far more than a comparison runs: a longer list is a paste gone wrong
LEVERS = "the levers one at a time"
FRONTIER = "the Advisor's frontier"
LISTS = (LEVERS, FRONTIER)


@dataclass(frozen=True)
class Configuration:
    mode: str
    precision: str
    step_cache: str = "none"
    device: str | None = None  # None: the comparison's default device
    lora: LoraChoice = LoraChoice()  # one of the preset's styles, its scale and fused flag (name None: no LoRA)
    memory: str = ""  # memory levers, canonical text ("": the host's)

    def text(self) -> str:
        """Its entry in the list's form (parse_configurations reads it back)."""
        parts = [self.mode, self.precision] + ([self.step_cache] if self.step_cache != "none" else [])
        return ("/".join(parts) + lora_suffix(self.lora) + memory_suffix(self.memory)
                + (f"@{self.device}" if self.device else ""))


LORA_PART = re.compile(r"\+\s*lora\s*=\s*([^@+;]*)", re.IGNORECASE)  # "+lora=NAME[:SCALE][:fused]", before or after @device
FORM = "mode/precision[/step cache][+lora=NAME[:SCALE][:fused]][+mem=LEVERS][@device]"
MEMORY_PART = re.compile(r"\+\s*mem\s*=\s*([^@+;]*)", re.IGNORECASE)


def memory_suffix(levers: str) -> str:
    """"+mem=LEVERS" ("" for none): how an entry and its Compare label name its memory levers."""
    return f"+mem={levers}" if levers else ""


def split_levers(entry: str) -> tuple[str, str]:
    """(the entry without its memory part, the levers' canonical text); ValueError naming the forms."""
    found = MEMORY_PART.findall(entry)
    if len(found) > 1:
        raise ValueError(f"configuration {entry!r}: one +mem= part per configuration (levers comma-separated)")
    try:
        levers = MemoryLevers.parse(found[0]) if found else MemoryLevers()
    except InvalidRequest as exc:
        raise ValueError(f"configuration {entry!r}: {exc}") from None
    return MEMORY_PART.sub("", entry).strip(), str(levers) if levers.enabled else ""


def lora_suffix(choice: LoraChoice) -> str:
    """"+lora=NAME[:SCALE][:fused]" ("" for no LoRA): how a configuration's entry and its Compare label name the
    adapter."""
    return "" if choice.name is None else f"+lora={choice.text()}"


def split_lora(entry: str) -> tuple[str, LoraChoice]:
    """(the entry without its LoRA and memory parts, its LoRA); ValueError for a second LoRA part or a bad
    scale."""
    entry = split_levers(entry)[0]
    found = LORA_PART.findall(entry)
    if len(found) > 1:
        raise ValueError(f"configuration {entry!r}: one LoRA per configuration (+lora=NAME[:SCALE]); list an entry "
                         "per adapter to compare them")
    rest = LORA_PART.sub("", entry).strip()
    if "+" in rest:
        raise ValueError(f"configuration {entry!r}: write the LoRA as +lora=NAME[:SCALE], e.g. compile/fp32+lora=swap:0.5")
    if not found:
        return rest, LoraChoice()
    if not found[0].strip():
        raise ValueError(f"configuration {entry!r}: +lora= names no adapter; write +lora=NAME[:SCALE] or leave it out")
    try:
        return rest, parse_lora(found[0])
    except InvalidRequest as exc:
        raise ValueError(f"configuration {entry!r}: {exc}") from None


def parse_configurations(text: str) -> list[Configuration]:
    """The configurations of a typed list, in order, duplicates dropped; ValueError saying which entry is
    wrong and the form to use."""
    entries = [e.strip() for chunk in str(text or "").splitlines() for e in chunk.split(";")]
    entries = [e for e in entries if e]
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"{len(entries)} configurations listed; list at most {MAX_ENTRIES}")
    out: list[Configuration] = []
    for entry in entries:
        config = parse_entry(entry)
        if config not in out:
            out.append(config)
    return out


def parse_entry(entry: str) -> Configuration:
    """One configuration of the list's form; ValueError saying what is wrong and the form to use."""
    levers = split_levers(entry)[1]
    rest, lora = split_lora(entry)
    body, _, device = rest.partition("@")
    parts = [p.strip() for p in body.split("/")]
    if len(parts) < 2 or len(parts) > 3 or not all(parts):
        raise ValueError(f"configuration {entry!r}: write {FORM}, e.g. eager/fp32, regional/bf16/first-block:0.2@cpu "
                         "or compile/fp32+lora=swap:0.5")
    mode, precision = parts[0].lower(), parts[1].lower()
    if mode not in Mode.values():
        raise ValueError(f"configuration {entry!r}: unknown mode {parts[0]!r}; modes: {', '.join(Mode.values())}")
    if precision not in Precision.values():
        raise ValueError(f"configuration {entry!r}: unknown precision {parts[1]!r}; precisions: "
                         f"{', '.join(Precision.values())}")
    try:
        cache = str(StepCache.parse(parts[2])) if len(parts) == 3 else "none"
    except Exception as exc:
        raise ValueError(f"configuration {entry!r}: {exc}") from None
    return Configuration(mode, precision, cache or "none", device.strip() or None, lora, levers)


def refusal(preset, spec, config: Configuration, loras: bool = False) -> str | None:
    """Why `config` cannot run for `preset` on the device `spec` (the checks the engine itself makes when
    asked to run it), or None when it can. `loras`: the engines here have a LoRA slot (--loras)."""
    from engine.devices import precision_support
    from engine.pipeline.stepcache import cache_status

    if config.lora.name is not None and (why := lora_refusal(preset, config, loras)):
        return why
    if Mode(config.mode) not in spec.modes:
        return f"{spec.label} does not run mode {config.mode}"
    row = precision_support(spec).get(Precision(config.precision)) or {}
    if row.get("status") in ("refused", "unknown"):
        return first_line(row.get("reason") or f"{config.precision} cannot run on {spec.label}")
    cache = StepCache.parse(config.step_cache)
    if cache.enabled:
        status = cache_status(cache.kind, preset, spec, Mode(config.mode))
        if not status["usable"]:
            return f"step cache {cache.kind} with {config.mode}: {first_line(status['why_not'])}"
    return memory_refusal(spec, config, cache.enabled)


def memory_refusal(spec, config: Configuration, step_cache: bool) -> str | None:
    """Why `config`'s memory levers cannot run (the engine's own checks, engine/pipeline/memory.py), or None."""
    from engine.errors import UnsupportedCombination
    from engine.pipeline import memory

    if not config.memory:
        return None
    try:
        memory.check_levers(config.memory, spec, quantized=Precision(config.precision).quantized)
        memory.check_request(config.memory, config.memory, Mode(config.mode), step_cache, config.lora.name is not None)
    except UnsupportedCombination as exc:
        return first_line(str(exc))
    return first_line(why) if (why := memory.excluded_mode(config.memory, Mode(config.mode))) else None


def lora_refusal(preset, config: Configuration, loras: bool) -> str | None:
    """Why `config`'s adapter cannot run (the engine's own reasons, engine/pipeline/loading.py), or None."""
    names = [source.name for source in preset.loras]
    if config.lora.name not in names:
        return (f"unknown LoRA {config.lora.name!r} for {preset.name}: choose one of {', '.join(names) or 'none'} "
                "(or none)")
    if not loras:
        return "the engines here serve no LoRA styles: the host turns them on with --loras"
    if config.mode == Mode.AOT:
        return "LoRA adapters do not run in aot mode (its packages are exported with the LoRA slot off)"
    if config.lora.fused and config.mode != Mode.EAGER:
        return (f"a fused LoRA runs in eager mode only, not {config.mode} (every fuse would recompile the graph): "
                f"use eager with :fused, or {config.mode} unfused")
    if config.lora.fused and Precision(config.precision).quantized:
        return (f"a fused LoRA is not served on {config.precision} engines (it would re-quantize at every fuse): "
                "run it unfused there, or fused on fp32, bf16 or fp16")
    return None


def first_line(text: str, limit: int = 160) -> str:
    """A reason short enough for a card: its first line, cut at `limit` characters."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def levers_one_at_a_time(preset, spec, limit: int = 6) -> list[Configuration]:
    """The reference, then each lever on its own: bf16, each compiled mode, the usable step caches (eager,
    fp32), the first `limit` of them."""
    from engine.devices import precision_support
    from engine.pipeline.stepcache import available_step_caches

    out = [Configuration("eager", "fp32")]
    support = precision_support(spec)
    for precision in ("bf16", "fp16"):
        if (support.get(Precision(precision)) or {}).get("status") == "ok":
            out.append(Configuration("eager", precision))
            break
    for mode in ("compile", "regional"):
        if Mode(mode) in spec.modes:
            out.append(Configuration(mode, "fp32"))
    for row in available_step_caches(preset, spec, Mode.EAGER):
        c = Configuration("eager", "fp32", str(StepCache.parse(row["default"] or "none")))
        if row["usable"] and c not in out:
            out.append(c)
    return out[:limit]


def saved_frontier(cache_dir, preset: str, device: str, size: str, steps: int) -> list[Configuration]:
    """advisor_frontier of the Advisor's saved result for this preset, device, size and steps; [] when none."""
    import json

    from bench.advise import result_path

    try:
        return advisor_frontier(json.loads(result_path(cache_dir, preset, device, size, steps).read_text()))
    except (OSError, ValueError):
        return []


def advisor_frontier(report: dict, limit: int = 6) -> list[Configuration]:
    """From an Advisor result (its JSON): the reference, the pick and the other configurations within its
    bound, fastest first; [] when it has none."""
    rows = [r for r in report.get("rows", []) if r.get("eligible") and not r.get("error")]
    rows.sort(key=lambda r: -(r.get("speedup") or 0))
    out = [Configuration("eager", "fp32")]
    for r in rows:
        if r.get("attention", "native") != "native":
            continue  # the Compare tab runs the engine's attention backend
        c = Configuration(r["mode"], r["precision"], r.get("step_cache") or "none")
        if c not in out:
            out.append(c)
    return out[:limit] if len(out) > 1 else []
