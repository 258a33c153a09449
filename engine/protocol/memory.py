"""Memory levers as text: what a host, a request or a Compare entry names to make an engine fit.

A lever set is comma-separated lever texts, e.g. "layerwise:fp8,group:block:2:disk" or "vae-tiling":

    group:block[:N][:stream][:disk]   diffusers group offloading, N blocks per group (default 1)
    group:leaf[:stream][:disk]        ... one leaf module at a time
    layerwise:fp8 | layerwise:fp8-e5m2  denoiser weights stored in fp8, computed in the engine's precision
    model-offload                     each model on the device only while it runs
    sequential-offload                each submodule on the device only while it runs
    encoders:cpu | encoders:offload   text encoders run on the CPU, or are moved off after encoding
    vae-tiling | vae-slicing          the VAE decodes in tiles / one image at a time (per request)

Levers that change where weights live or how the graph runs are part of the engine key (`engine_part`);
the VAE's are set per request (`request_part`). Which device and mode each can run with is in
engine/pipeline/memory.py. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.errors import InvalidRequest

MAX_BLOCKS_PER_GROUP = 64
LAYERWISE_STORAGE = ("fp8", "fp8-e5m2")
ENCODER_PLACES = ("cpu", "offload")
OFFLOADS = ("model", "sequential")
FORMS = ("group:block[:N][:stream][:disk]", "group:leaf[:stream][:disk]", "layerwise:fp8|fp8-e5m2",
         "model-offload", "sequential-offload", "encoders:cpu|offload", "vae-tiling", "vae-slicing")
MAX_TEXT = 200  # a lever set is a few dozen characters; longer text is refused unread


def forms() -> str:
    return "memory levers (comma-separated): " + ", ".join(FORMS) + ", or none"


memory_forms = forms


@dataclass(frozen=True)
class MemoryLevers:
    """A set of memory levers (the module docstring has the text forms); `MemoryLevers()` is none."""

    group: str | None = None  # "block" | "leaf"
    group_blocks: int = 1  # blocks per group (block level)
    group_stream: bool = False  # CUDA/XPU streams with prefetch
    group_disk: bool = False  # offload to files on disk rather than host RAM
    layerwise: str | None = None  # storage dtype: "fp8" (e4m3fn) | "fp8-e5m2"
    offload: str | None = None  # "model" | "sequential" (enable_model/sequential_cpu_offload)
    encoders: str | None = None  # "cpu" | "offload"
    vae_tiling: bool = False
    vae_slicing: bool = False

    def __post_init__(self):
        if self.group is not None and self.offload is not None:
            raise InvalidRequest(f"group offload and {self.offload}-offload both move the denoiser's weights: "
                                 "pick one")
        if self.encoders is not None and self.offload is not None:
            raise InvalidRequest(f"{self.offload}-offload already moves the text encoders off the device: leave "
                                 f"encoders:{self.encoders} out")

    @classmethod
    def parse(cls, text) -> MemoryLevers:
        if isinstance(text, MemoryLevers):
            return text
        raw = "" if text is None else str(text)
        if len(raw) > MAX_TEXT:
            raise InvalidRequest(f"memory levers: text too long (at most {MAX_TEXT} characters); {forms()}")
        fields: dict = {}
        for token in (t.strip().lower() for t in raw.split(",")):
            if token in ("", "none"):
                continue
            for name, value in _parse_token(token).items():
                if name in fields and name not in ("group_blocks",):
                    raise InvalidRequest(f"memory levers {raw!r}: {token!r} repeats a lever; name each once")
                fields[name] = value
        return cls(**fields)

    @property
    def enabled(self) -> bool:
        return self != MemoryLevers()

    @property
    def encoders_on_host(self) -> bool:
        """encoders:cpu: the text encoders stay in host memory and run there."""
        return self.encoders == ENCODER_PLACES[0]

    def engine_part(self) -> MemoryLevers:
        """The levers that are part of the engine key (everything but the VAE's)."""
        return dataclasses.replace(self, vae_tiling=False, vae_slicing=False)

    def request_part(self) -> MemoryLevers:
        return MemoryLevers(vae_tiling=self.vae_tiling, vae_slicing=self.vae_slicing)

    def names(self) -> tuple[str, ...]:
        """The registry names of the levers in this set (engine/pipeline/memory.py's rows)."""
        out = []
        if self.group:
            out.append(f"group:{self.group}")
        if self.layerwise:
            out.append("layerwise")
        if self.offload:
            out.append(f"{self.offload}-offload")
        if self.encoders:
            out.append(f"encoders:{self.encoders}")
        out += [n for n, on in (("vae-tiling", self.vae_tiling), ("vae-slicing", self.vae_slicing)) if on]
        return tuple(out)

    def __str__(self) -> str:
        parts = []
        if self.layerwise:
            parts.append(f"layerwise:{self.layerwise}")
        if self.group:
            group = f"group:{self.group}" + (f":{self.group_blocks}" if self.group == "block" else "")
            parts.append(group + (":stream" if self.group_stream else "") + (":disk" if self.group_disk else ""))
        if self.offload:
            parts.append(f"{self.offload}-offload")
        if self.encoders:
            parts.append(f"encoders:{self.encoders}")
        parts += [n for n, on in (("vae-tiling", self.vae_tiling), ("vae-slicing", self.vae_slicing)) if on]
        return ",".join(parts) or "none"


def _parse_token(token: str) -> dict:
    head, *rest = token.split(":")
    if head == "group":
        return _parse_group(token, rest)
    if head == "layerwise":
        storage = rest[0] if rest else "fp8"
        if len(rest) > 1 or storage not in LAYERWISE_STORAGE:
            raise InvalidRequest(f"memory lever {token!r}: layerwise stores weights in "
                                 f"{' or '.join(LAYERWISE_STORAGE)}; {forms()}")
        return {"layerwise": storage}
    if head.endswith("-offload") and head.removesuffix("-offload") in OFFLOADS and not rest:
        return {"offload": head.removesuffix("-offload")}
    if head == "encoders":
        if len(rest) != 1 or rest[0] not in ENCODER_PLACES:
            raise InvalidRequest(f"memory lever {token!r}: the text encoders go to {' or '.join(ENCODER_PLACES)}; "
                                 f"{forms()}")
        return {"encoders": rest[0]}
    if head in ("vae-tiling", "vae-slicing") and not rest:
        return {head.replace("-", "_"): True}
    raise InvalidRequest(f"unknown memory lever {token[:40]!r}; {forms()}")


def _parse_group(token: str, rest: list[str]) -> dict:
    if not rest or rest[0] not in ("block", "leaf"):
        raise InvalidRequest(f"memory lever {token!r}: write group:block[:N] or group:leaf; {forms()}")
    fields: dict = {"group": rest[0]}
    for word in rest[1:]:
        if word in ("stream", "disk"):
            fields[f"group_{word}"] = True
        elif rest[0] == "block" and word.isascii() and word.isdigit() and len(word) <= 9 and "group_blocks" not in fields:
            blocks = int(word)
            if not 1 <= blocks <= MAX_BLOCKS_PER_GROUP:
                raise InvalidRequest(f"memory lever {token!r}: blocks per group {blocks} is out of range: allowed "
                                     f"1..{MAX_BLOCKS_PER_GROUP}")
            fields["group_blocks"] = blocks
        else:
            raise InvalidRequest(f"memory lever {token!r}: {word[:20]!r} is not a group option; {forms()}")
    return fields
