"""The edit grammar of tiny-shapes-edit: instructions over the shapes grammar, which sources each applies to,
the held-out (instruction, source) combinations, and the target scene an edit asks for.

Three kinds of instruction, each naming one attribute of the scene and its new value:

    colour      "make the {shape} {colour}"            the object's colour (the named shape is the one shown)
    background  "make the background {colour}"         the background colour
    shape       "turn the {shape} into a {shape}"      the object's shape; its position and size are kept

An edit is consistent when the named shape is the one in the picture, the new value differs from the old
one, and the object and background colours still differ afterwards. Over the 168 source prompts that is
168 x (6 + 6 + 2) = 2,352 (instruction, source prompt) combinations, 38 instruction texts.

Held out (`HELD_OUT_EDITS`, never trained on): the combinations whose index sum
`colour + 2 * background + 3 * shape + 5 * value + kind` is 0 modulo 7 (indices into COLOUR_NAMES, SHAPES,
the value's own list and KINDS). The rule spreads them over every instruction text and every source: each
instruction keeps training sources, and each held-out combination's instruction and source are trained
with other partners (tests/test_embedded_edit.py pins the counts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache

from training.shapes.grammar import COLOUR_NAMES, SHAPES, Prompt, all_prompts

KINDS: tuple[str, ...] = ("colour", "background", "shape")
HELD_OUT_MODULUS = 7


@dataclass(frozen=True, order=True)
class Edit:
    """One instruction applied to one source scene (given by its prompt)."""

    kind: str
    source: Prompt
    value: str  # the new colour name or shape name

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown edit kind {self.kind!r}; known: {', '.join(KINDS)}")
        values = SHAPES if self.kind == "shape" else COLOUR_NAMES
        if self.value not in values:
            raise ValueError(f"{self.value!r} is not a {self.kind} of the grammar")
        if self.value == getattr(self.source, _FIELD[self.kind]):
            raise ValueError(f"the {self.kind} is already {self.value}: nothing to edit")
        self.target  # noqa: B018 - validates fg != bg after the edit

    @property
    def instruction(self) -> str:
        if self.kind == "colour":
            return f"make the {self.source.shape} {self.value}"
        if self.kind == "background":
            return f"make the background {self.value}"
        return f"turn the {self.source.shape} into a {self.value}"

    @property
    def target(self) -> Prompt:
        """The scene after the edit (raises ValueError when the edit would give fg == bg)."""
        return replace(self.source, **{_FIELD[self.kind]: self.value})

    @property
    def value_index(self) -> int:
        return (SHAPES if self.kind == "shape" else COLOUR_NAMES).index(self.value)


_FIELD = {"colour": "colour", "background": "background", "shape": "shape"}


def _consistent(kind: str, source: Prompt, value: str) -> bool:
    try:
        Edit(kind, source, value)
    except ValueError:
        return False
    return True


@cache
def all_edits() -> tuple[Edit, ...]:
    """Every consistent (instruction, source prompt) combination, in a fixed order."""
    return tuple(
        Edit(kind, source, value)
        for source in all_prompts()
        for kind in KINDS
        for value in (SHAPES if kind == "shape" else COLOUR_NAMES)
        if _consistent(kind, source, value)
    )


def is_held_out(edit: Edit) -> bool:
    s = edit.source
    total = (COLOUR_NAMES.index(s.colour) + 2 * COLOUR_NAMES.index(s.background) + 3 * SHAPES.index(s.shape)
             + 5 * edit.value_index + KINDS.index(edit.kind))
    return total % HELD_OUT_MODULUS == 0


@cache
def held_out_edits() -> tuple[Edit, ...]:
    return tuple(e for e in all_edits() if is_held_out(e))


@cache
def training_edits() -> tuple[Edit, ...]:
    return tuple(e for e in all_edits() if not is_held_out(e))


@cache
def instructions() -> tuple[str, ...]:
    """The 38 instruction texts, in a fixed order (their index is the text-embedding row)."""
    return tuple(dict.fromkeys(e.instruction for e in all_edits()))


_PATTERNS = (
    ("colour", re.compile(r"make the (\w+) (\w+)")),
    ("background", re.compile(r"make the background (\w+)")),
    ("shape", re.compile(r"turn the (\w+) into an? (\w+)")),
)


def parse_edit(instruction: str, source: Prompt) -> Edit | None:
    """The Edit an instruction means for a source scene, or None when it is outside the edit grammar or
    inconsistent with the source (another shape named, nothing to change, fg == bg afterwards). Case, extra
    spaces and a final full stop are forgiven."""
    text = " ".join(str(instruction).lower().split()).rstrip(".").strip()
    for kind, pattern in reversed(_PATTERNS):  # "make the background X" before "make the {shape} X"
        match = pattern.fullmatch(text)
        if match is None:
            continue
        *named, value = match.groups()
        if named and named[0] != source.shape:
            return None
        try:
            return Edit(kind, source, value)
        except ValueError:
            return None
    return None
