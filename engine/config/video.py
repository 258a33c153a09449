"""A video preset's sampling fields (num_frames, fps): checked, and the frame count routed to one of the
preset's frame buckets. Only a video family takes them (`ModelPreset.frames`, a preset's declaration);
an image preset answers a frame count with a notice, as it does a negative prompt it cannot use.

Frame counts follow the family's rule (Wan: 4k + 1, its VAE compresses time 4x and keeps the first frame),
and each compiled bucket is a (size, frames) pair, so a count between the preset's buckets is snapped to the
nearest one with a notice (refused when the request asked not to snap).
"""

from __future__ import annotations

from engine.errors import InvalidRequest
from engine.protocol import BucketKey, Mode, ModelPreset, Size

MAX_FPS = 60


def check_frame_buckets(name: str, frames, step: int) -> tuple[int, ...]:
    """A preset's `frames` list from presets/models.toml: whole counts of the form step * k + 1."""
    counts = tuple(int(f) for f in frames)
    bad = [f for f in counts if f < 1 or (f - 1) % step]
    if bad or step < 1:
        raise InvalidRequest(f"preset {name}: frames {bad} are not {step}k + 1 (frame_step = {step})")
    return counts


def _whole(name: str, value) -> int:
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        raise InvalidRequest(f"{name} must be a whole number, got {text[:40]!r}") from None
    if not number.is_integer():
        raise InvalidRequest(f"{name} must be a whole number, got {text[:40]!r}")
    return int(number)


def _given(value) -> bool:
    return value is not None and str(value).strip() not in ("", "0")


def route_frames(preset: ModelPreset, frames, snap: bool = True) -> tuple[int, tuple[str, ...]]:
    """The frame bucket for a requested count (None or '': the preset's first), with the notice when it moved."""
    buckets = preset.frames
    if not _given(frames):
        return buckets[0], ()
    count = _whole("num_frames", frames)
    listed = ", ".join(map(str, sorted(buckets)))
    if not 1 <= count <= 4 * max(buckets):
        raise InvalidRequest(f"num_frames must be from 1 to {4 * max(buckets)}; {preset.name} serves {listed}")
    if count in buckets:
        return count, ()
    rule = f"{preset.frame_step}k + 1"
    if not snap:
        raise InvalidRequest(f"num_frames {count} is not a frame bucket of {preset.name} ({rule}: {listed})")
    best = min(buckets, key=lambda f: (abs(f - count), f))
    why = "is not " + rule if (count - 1) % preset.frame_step else "is not one of its buckets"
    return best, (f"num_frames {count} {why}; snapped to the nearest frame bucket {best} ({listed})",)


def check_fps(preset: ModelPreset, fps) -> int:
    if not _given(fps):
        return preset.fps
    rate = _whole("fps", fps)
    if not 1 <= rate <= MAX_FPS:
        raise InvalidRequest(f"fps must be from 1 to {MAX_FPS}, got {rate}")
    return rate


def video_fields(preset: ModelPreset, num_frames, fps, snap: bool = True) -> tuple[int, int, tuple[str, ...]]:
    """(num_frames, fps, notices) of a request: (0, 0) for an image preset, which ignores them with a notice."""
    if not preset.video:
        given = [name for name, value in (("num_frames", num_frames), ("fps", fps)) if _given(value)]
        notice = (f"{preset.name} makes images; {' and '.join(given)} ignored",) if given else ()
        return 0, 0, notice
    frames, notices = route_frames(preset, num_frames, snap)
    return frames, check_fps(preset, fps), notices


def warm_bucket(preset: ModelPreset, mode, text: str) -> BucketKey:
    """The bucket a warm names: "WxH" (a video preset: at its first frame count) or "WxHxF" (F one of its frame
    buckets)."""
    parts = str(text).lower().replace(" ", "").split("x")
    frames = preset.frames[0] if preset.video else 0
    if len(parts) == 3 and preset.video:
        frames = _whole("frames", parts[2])
        if frames not in preset.frames:
            raise InvalidRequest(f"{frames} frames is not a frame bucket of {preset.name}; pick one of "
                                 f"{', '.join(map(str, preset.frames))}")
        text = "x".join(parts[:2])
    return BucketKey(Mode.parse(mode, "mode"), Size.parse(text), frames=frames)
