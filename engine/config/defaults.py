"""Each task's default model among the presets a door serves: the one every door (the page's tabs, gradio_client,
/v1 with no `model`, the CLI with no `--preset`) starts from, so a newcomer's first picture, edit or clip is one
that draws its prompt.

The order: the host's own choice (app.py --preset) where it makes that task and draws, then an embedded model a
checker scores (`fidelity`: tiny-shapes, tiny-shapes-edit, tiny-shapes-video), then any model with real weights,
and a random-weight preset (noise) only where nothing else serves the task. Ties keep the served order.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.protocol import ModelPreset, Task


def _rank(preset: ModelPreset, preferred: str | None) -> int:
    if preset.random_weights:
        return 3
    if preset.name == preferred:
        return 0
    return 1 if preset.draws else 2


def task_default(presets: Iterable[ModelPreset], task: Task | str, preferred: str | None = None) -> ModelPreset | None:
    """The default model for `task` among `presets` (in the served order), or None where none makes it."""
    task = Task(task)
    takers = [p for p in presets if p.task is task]
    return min(takers, key=lambda p: _rank(p, preferred)) if takers else None


def task_of_request(*, frames: bool = False, images: bool = False) -> Task:
    """The task a request with no model asks for: a clip where it names frames or fps, an edit where it sends
    images, else a picture from text."""
    if frames:
        return Task.VIDEO
    return Task.EDIT if images else Task.TEXT_TO_IMAGE
