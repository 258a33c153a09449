"""The prompt encoders of one engine: where they run (the `encoders:cpu|offload` memory levers) and a cache of
their embeddings keyed by the prompt and the encoder, so a repeated prompt skips the encoders.

Every pipeline call goes through `PromptEncoder.bind(run)`, which puts a wrapper in place of the run copy's
`encode_prompt` (diffusers' pipelines call `self.encode_prompt(...)` once per call). The wrapper answers a
repeated call from the cache (the same tensors the first call made, so the image is equal) and otherwise
runs the encoders where the lever puts them and moves their output to the device. The cache is bounded in
entries and in bytes (least recently used goes first); a call that hands in its own embeddings is not cached.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict

from engine.protocol import MemoryLevers


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _moved(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    return value


def _key_part(value):
    """A hashable stand-in for an argument; None for a tensor (such a call is not cached)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        parts = tuple(_key_part(v) for v in value)
        return None if any(p is None and v is not None for p, v in zip(parts, value, strict=True)) else parts
    if hasattr(value, "type") and hasattr(value, "index") and not hasattr(value, "shape"):
        return str(value)  # a torch.device
    return None


class PromptCache:
    """Embeddings by key, least recently used first out, at most `entries` and `max_bytes`."""

    def __init__(self, entries: int, max_bytes: int):
        self.entries = entries
        self.max_bytes = max_bytes
        self._items: OrderedDict = OrderedDict()
        self._sizes: dict = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._items:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key]

    def put(self, key, value) -> None:
        size = sum(t.numel() * t.element_size() for t in _tensors(value))
        if self.entries <= 0 or size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key], self._sizes[key] = value, size
            self.bytes += size
            while len(self._items) > self.entries or self.bytes > self.max_bytes:
                old, _ = self._items.popitem(last=False)
                self.bytes -= self._sizes.pop(old)

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict:
        return {"entries": len(self._items), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                "max_entries": self.entries, "max_bytes": self.max_bytes}


class PromptEncoder:
    """One engine's prompt encoding: `bind(run)` before each call. `identity` names the encoders (the engine
    key and their classes): part of every cache key."""

    def __init__(self, pipe, levers, device: str, identity: str, cache: PromptCache):
        self.levers = MemoryLevers.parse(levers)
        self.device = device
        self.cache = cache
        self.encoders = [m for n, m in pipe.components.items() if n.startswith("text_encoder") and m is not None]
        self.identity = (identity, *(type(m).__name__ for m in self.encoders))
        self._place_lock = threading.Lock()
        method = getattr(type(pipe), "encode_prompt", None)
        self.signature = inspect.signature(method) if method is not None else None

    def bind(self, run) -> None:
        """Route the run copy's encode_prompt through the cache and the encoders' placement."""
        if self.signature is None:
            return
        run.encode_prompt = functools.partial(self._encode, run.__class__.encode_prompt.__get__(run))

    def _key(self, args, kwargs):
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError:
            return None
        parts = []
        for name, value in sorted(bound.arguments.items())[: len(bound.arguments)]:
            if name == "self":
                continue
            part = _key_part(value)
            if part is None and value is not None:
                return None  # embeddings handed in, or an argument we cannot key on
            parts.append((name, part))
        return (self.identity, tuple(parts))

    def _encode(self, original, *args, **kwargs):
        key = self._key(args, kwargs)
        if key is not None and (hit := self.cache.get(key)) is not None:
            return hit
        value = self._run_encoders(original, args, kwargs)
        if key is not None:
            self.cache.put(key, value)
        return value

    def _run_encoders(self, original, args, kwargs):
        where = self.levers.encoders
        if where is None:
            return original(*args, **kwargs)
        kwargs = dict(kwargs)
        if self.levers.encoders_on_host:
            kwargs["device"] = "cpu"
            return _moved(original(*args, **kwargs), self.device)
        with self._place_lock:  # encoders:offload: on the device to encode, back to host RAM after
            for module in self.encoders:
                module.to(self.device)
            try:
                return original(*args, **kwargs)
            finally:
                for module in self.encoders:
                    module.to("cpu")
