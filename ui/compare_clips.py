"""Compare on a video preset: every configuration runs a clip (the same prompt, seed, size and frame count), and
its card shows the clip as a frame strip, seconds per clip and milliseconds per frame, the VAE decode's share,
and its drift against eager fp32's clip frame by frame with the temporal flicker (bench/quality.py
`clip_drift`, the bench's own code, through ui/compare_views.py `clip_quality`). Which fields a clip takes
(frames, fps) is the field declarations' (engine/protocol/params.py); the strip and the clip figures are the Video
tab's (ui/views.py `strip_of`, `clip_figures`).
"""

from __future__ import annotations

import html

from PIL import Image

from engine.protocol import params
from ui.views import clip_figures, strip_of

# The request fields only a video family takes, by their declarations (the form's names for them).
CLIP_FIELDS = tuple(f.name for f in params.FIELDS if f.needs is params.Needs.VIDEO)
CARD_FRAMES = 9  # frames a card's strip shows at most (evenly spread, the first always among them)
STRIP_PX = 96  # a strip frame's thumbnail, at most this on its longer side
CODEC_HELP = ("clips are compared as the player plays them, decoded from their MP4s; frame 1 is also kept "
              "lossless (the poster), so this line shows its drift before the codec and what the codec itself "
              "changed in it: a clip drift near the codec's loss is mostly the codec's")
FLICKER_HELP = ("flicker: how much this clip's difference to eager fp32's changes from one frame to the next, the "
                "mean |Δframe − Δframe of eager fp32| in pixel levels (0–255); 0 when the difference stays put")


def takes_clips(preset) -> bool:
    """Whether the preset's family takes every clip field (a video preset): Compare then runs clips."""
    return all(params.BY_NAME[name].taken_by(preset) for name in CLIP_FIELDS)


def clip_request_fields(preset, form) -> dict:
    """The clip fields of `form` that the preset's family takes, by name (none for an image preset, whose
    hidden fields would otherwise come back as notices)."""
    return {name: getattr(form, name) for name in CLIP_FIELDS if params.BY_NAME[name].taken_by(preset)}


def strip_pictures(clip: list) -> list[tuple[Image.Image, str]]:
    """A card's strip: (frame as a small picture, caption) of at most CARD_FRAMES frames of the clip."""
    out = []
    for frame, caption in strip_of(clip, CARD_FRAMES):
        picture = Image.fromarray(frame)
        picture.thumbnail((STRIP_PX, STRIP_PX))
        out.append((picture, caption))
    return out


def worst_frame(entry: dict) -> int:
    """The 0-based frame whose heat map a clip card shows: its worst frame, else the first."""
    return ((entry.get("clip_drift") or {}).get("worst_frame") or 1) - 1


def clip_time_text(entry: dict, per_clip_s: float | None) -> str:
    """'0.210 s / clip · 12.4 ms / frame · VAE decode 24 %' (seconds per clip: the timed median)."""
    f = clip_figures(entry)
    per = f["clip_s"] if per_clip_s is None else per_clip_s
    return (f"{per:.3f} s / clip · {1000 * per / f['frames']:.1f} ms / frame · VAE decode {f['decode_share']:.0f} % "
            f"· {f['frames']} frames at {f['fps']} fps")


def strip_html(strip: list[tuple[str, str]], config: str) -> str:
    """A card's frame strip: (data: URI, caption) pictures in a row, each titled with its frame."""
    frames = "".join(f'<img src="{uri}" alt="{html.escape(config)}, {caption}" title="{caption}">'
                     for uri, caption in strip)
    return f'<div class="c-strip">{frames}</div>'


def clip_drift_lines(entry: dict) -> list[str]:
    """A clip card's drift lines: per-frame PSNR (median, worst frame), SSIM, max diff, the flicker, then frame 1
    before the codec and the codec's own loss on it."""
    codec = [f'<div class="c-note c-codec" title="{html.escape(CODEC_HELP)}">{html.escape(entry["codec_note"])}'
             '</div>'] if entry.get("codec_note") else []
    if entry.get("reference"):
        return ['<div class="c-drift">drift: reference (every other clip is measured against this one)</div>', *codec]
    drift = entry.get("clip_drift")
    if drift is None:
        return ['<div class="c-drift">drift: — (the reference did not run)</div>', *codec]
    if not drift["max_diff"]:
        return ['<div class="c-drift">drift: identical clip, every frame</div>', *codec]
    median = "identical" if drift["median_psnr_db"] is None else f"{drift['median_psnr_db']:.1f} dB"
    return [f'<div class="c-drift">drift per frame: PSNR median {median}, worst {drift["psnr_db"]:.1f} dB '
            f'(frame {drift["worst_frame"]}/{drift["frames"]}) · SSIM {drift["ssim"]:.3f} · max diff '
            f'{drift["max_diff"]}</div>',
            f'<div class="c-flicker" title="{html.escape(FLICKER_HELP)}">flicker: {drift["flicker"]:.2f} px '
            'against eager fp32</div>' if drift["flicker"] is not None else "", *codec]
