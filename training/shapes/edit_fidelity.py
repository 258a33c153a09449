"""The checker for edits: did an edited image do what the instruction said, and nothing else?

From the pixels alone (training.shapes.fidelity.read on the source and on the result):

- the result reads as the edit's target scene: the changed attribute has its new value and the two others
  are kept (all three read and right, as for text-to-image);
- the object stayed where it was: for colour and background edits its bounding box overlaps the source's
  with IoU >= 0.8; for shape edits (a circle, a square and an upright triangle drawn in the same box share
  that box) its centre is kept within 10 % of the source's box side (at least 2 pixels) and its side
  within 20 %.

The source is read from its pixels too, so the checker needs no record of how the source was drawn and
scores an uploaded picture the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from training.shapes.edits import Edit
from training.shapes.fidelity import read

MIN_IOU = 0.8
CENTRE_TOLERANCE = 0.1  # of the source box's side
MIN_CENTRE_PIXELS = 2.0
SIDE_TOLERANCE = 0.2


@dataclass(frozen=True)
class EditFidelity:
    kind: str
    attributes_right: bool  # the result reads as the target scene (changed attribute right, others kept)
    geometry_kept: bool
    iou: float  # NaN when either object could not be found
    note: str = ""

    @property
    def correct(self) -> bool:
        return self.attributes_right and self.geometry_kept


def box_iou(a, b) -> float:
    w = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _geometry(kind: str, before, after) -> tuple[bool, str]:
    if kind != "shape":
        iou = box_iou(before, after)
        return iou >= MIN_IOU, "" if iou >= MIN_IOU else f"box IoU {iou:.2f} < {MIN_IOU}"
    side = max(before[2] - before[0], before[3] - before[1])
    new_side = max(after[2] - after[0], after[3] - after[1])
    dx = (after[0] + after[2] - before[0] - before[2]) / 2
    dy = (after[1] + after[3] - before[1] - before[3]) / 2
    moved = (dx * dx + dy * dy) ** 0.5
    if moved > max(MIN_CENTRE_PIXELS, CENTRE_TOLERANCE * side):
        return False, f"centre moved {moved:.1f} px"
    if abs(new_side - side) > SIDE_TOLERANCE * side:
        return False, f"side {new_side} px instead of {side}"
    return True, ""


def edit_fidelity(source: Image.Image, result: Image.Image, edit: Edit) -> EditFidelity:
    """Score one edited image against its source and instruction."""
    before, after = read(source), read(result)
    target = edit.target
    right = (after.colour, after.shape, after.background) == (target.colour, target.shape, target.background)
    notes = [] if right else [f"read {after.colour} {after.shape} on {after.background}: {after.note}".rstrip(": ")]
    if before.box is None or after.box is None:
        return EditFidelity(edit.kind, right, False, float("nan"), "; ".join([*notes, "no object to compare"]))
    kept, why = _geometry(edit.kind, before.box, after.box)
    if why:
        notes.append(why)
    return EditFidelity(edit.kind, right, kept, box_iou(before.box, after.box), "; ".join(notes))
