"""Where a request asks its engine to run on a Ray cluster (app.py --ray, engine/fleet/): the device field
may name a chip or a node after the device, `cuda:H100`, `cpu:node:host-b`, or a node alone, `node:host-b`
(the best device that node has). Without --ray a placement is refused (engine/config/resolve.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequest

NODE = "node:"


@dataclass(frozen=True)
class Placement:
    """Where a request asks its engine to run: a chip (`@cuda:H100`: Ray's accelerator_type) or a node
    (`@node:NAME`); empty: any node with the device."""

    chip: str = ""
    node: str = ""

    @classmethod
    def parse(cls, text: str | None) -> Placement:
        """'' / 'any', 'node:NAME', or a chip name (the part after `@device:`)."""
        text = (text or "").strip()
        if text in ("", "any"):
            return cls()
        if any(c in text for c in " ,;@/+") or len(text) > 100:
            raise InvalidRequest(f"placement {text[:40]!r}: write a chip (e.g. H100) or node:NAME")
        kind, sep, value = text.partition(":")
        if sep and kind.lower() == "node":
            if not value:
                raise InvalidRequest("placement 'node:' names no node; write node:NAME (the System tab lists them)")
            return cls(node=value)
        if sep:
            raise InvalidRequest(f"placement {text[:40]!r}: write a chip (e.g. H100) or node:NAME")
        return cls(chip=text)

    def __bool__(self) -> bool:
        return bool(self.chip or self.node)

    def __str__(self) -> str:
        return f"node:{self.node}" if self.node else self.chip


ANYWHERE = Placement()  # any node with the device


def split_device(text: str) -> tuple[str, Placement]:
    """(device name, placement) of a device field: "cuda" -> ("cuda", anywhere), "cuda:H100", "cpu:node:b",
    "node:b" -> ("auto", node b)."""
    text = str(text).strip()
    if text.lower().startswith(NODE):
        return "auto", Placement.parse(text)
    device, sep, where = text.partition(":")
    if not sep:
        return text, ANYWHERE
    return device, Placement.parse(where)
