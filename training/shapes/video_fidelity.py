"""Clip checker of tiny-shapes-video: reads every frame with the picture checker and the direction of motion
from the object's track, from the pixels alone (no model).

A clip is right when every frame reads as the prompt's picture (background, object colour, shape:
`fidelity.read`) and the direction reads right: the net displacement of the object's box centre from the
first frame to the last, along its dominant axis, is at least MIN_TRAVEL_PX in the prompt's direction. A
still clip, noise, or an object drifting the wrong way never reads right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.shapes import fidelity
from training.shapes.video_grammar import DIRECTIONS, VideoPrompt, as_arrays, parse_prompt

# Half the smallest travel of the grammar at 32x32 (6 px): generated motion may be a little short, a still
# object's box never moves this far by edge noise.
MIN_TRAVEL_PX = 3.0


@dataclass(frozen=True)
class ClipReading:
    frames: tuple[fidelity.Reading, ...]
    direction: str | None
    displacement: tuple[float, float] | None  # (dx, dy) of the box centre, last frame minus first


@dataclass(frozen=True)
class ClipFidelity:
    expected: VideoPrompt | None
    reading: ClipReading

    def _every_frame(self, attribute: str) -> bool:
        if self.expected is None:
            return False
        return all(getattr(r, attribute) == getattr(self.expected, attribute) for r in self.reading.frames)

    @property
    def shape_right(self) -> bool:
        return self._every_frame("shape")

    @property
    def colours_right(self) -> bool:
        return self._every_frame("colour") and self._every_frame("background")

    @property
    def direction_right(self) -> bool:
        return self.expected is not None and self.reading.direction == self.expected.direction

    @property
    def correct(self) -> bool:
        return self.shape_right and self.colours_right and self.direction_right

    @property
    def note(self) -> str:
        wrong = [f"frame {i}: {r.background}/{r.colour}/{r.shape} {r.note}".strip()
                 for i, r in enumerate(self.reading.frames)
                 if self.expected and (r.background, r.colour, r.shape) != (
                     self.expected.background, self.expected.colour, self.expected.shape)]
        return "; ".join(wrong[:3] + [f"direction {self.reading.direction} {self.reading.displacement}"])


def _centre(reading: fidelity.Reading) -> np.ndarray | None:
    if reading.box is None or reading.shape is None:
        return None
    x0, y0, x1, y1 = reading.box
    return np.array([(x0 + x1) / 2, (y0 + y1) / 2])


def read_direction(readings) -> tuple[str | None, tuple[float, float] | None]:
    """The direction of the net displacement of the object's box centre, first frame to last."""
    first, last = _centre(readings[0]), _centre(readings[-1])
    if first is None or last is None:
        return None, None
    dx, dy = (last - first).tolist()
    axis = 0 if abs(dx) >= abs(dy) else 1
    travel = (dx, dy)[axis]
    if abs(travel) < MIN_TRAVEL_PX:
        return None, (dx, dy)
    sign = 1 if travel > 0 else -1
    name = next(n for n, unit in DIRECTIONS.items() if unit[axis] == sign)
    return name, (dx, dy)


def read(frames) -> ClipReading:
    """Readings of every frame (PIL images or (h, w, 3) arrays) and the direction of motion."""
    readings = tuple(fidelity.read(a) for a in as_arrays(frames))
    direction, displacement = read_direction(readings)
    return ClipReading(readings, direction, displacement)


def check(frames, prompt: VideoPrompt | str) -> ClipFidelity:
    expected = prompt if isinstance(prompt, VideoPrompt) else parse_prompt(prompt)
    return ClipFidelity(expected, read(frames))


def rates(results: list[ClipFidelity]) -> dict[str, float]:
    """Share of clips fully right and per part (shape, colours, direction) over checked clips."""
    n = max(len(results), 1)
    return {
        "right": sum(r.correct for r in results) / n,
        "shape": sum(r.shape_right for r in results) / n,
        "colours": sum(r.colours_right for r in results) / n,
        "direction": sum(r.direction_right for r in results) / n,
    }
