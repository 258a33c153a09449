"""What an inpaint mask means, by door: the one place its pixels are turned into repaint-or-keep.

- `MaskConvention.LUMINANCE` (the page, /generate, MCP, the CLI): white repaints, black keeps; transparent
  pixels keep (flattened onto black, with a notice).
- `MaskConvention.ALPHA` (/v1/images/edits, as OpenAI's images.edit documents it): the mask's fully
  transparent pixels (alpha 0) are edited, every other pixel is kept; its colours are not read. A mask with
  no alpha channel is refused: it says nothing in this convention.

Either way the worker gets a grayscale mask, white where it repaints, and the pipeline binarizes it at
`REPAINT_LEVEL`. A mask that keeps every pixel or repaints every pixel is served, with a notice saying what
comes back (the source itself; img2img of the whole source).
"""

from __future__ import annotations

from enum import StrEnum

from engine.errors import InvalidRequest

REPAINT_LEVEL = 128  # the FLUX inpaint pipeline's mask processor binarizes at 0.5: at and above it, a pixel is repainted
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


class MaskConvention(StrEnum):
    LUMINANCE = "luminance"  # white repaints, black keeps
    ALPHA = "alpha"  # fully transparent (alpha 0) repaints, OpenAI's images.edit

    @property
    def says(self) -> str:
        """The convention in a few words, for answers that name it."""
        if self is MaskConvention.ALPHA:
            return "this API edits where the mask is fully transparent (alpha 0), as OpenAI's images.edit does"
        return "white repaints, black keeps"


def has_alpha(image) -> bool:
    """Whether a decoded PIL image carries transparency (an alpha channel or a palette's transparent entry)."""
    return image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info)


def alpha_mask(image):
    """An OpenAI-style mask (PIL, with transparency) as the worker's grayscale mask: 255 where alpha is 0."""
    if not has_alpha(image):
        raise InvalidRequest(f"mask has no transparency (mode {image.mode}): {MaskConvention.ALPHA.says}; send a "
                             "PNG with an alpha channel, transparent where the picture is to change and opaque "
                             "where it stays")
    alpha = image.convert("RGBA").getchannel("A")
    return alpha.point(lambda a: 255 if a == 0 else 0)


def coverage_notices(mask, convention: MaskConvention, strength) -> tuple[str, ...]:
    """What a mask that keeps, or repaints, every pixel gives (the grayscale mask at the source's size)."""
    low, high = mask.getextrema()
    if high < REPAINT_LEVEL:
        where = ("no pixel of the mask is fully transparent" if convention is MaskConvention.ALPHA
                 else "no pixel of the mask is white")
        return (f"the mask keeps every pixel ({where}): the source comes back unchanged; "
                f"mark the area to repaint ({convention.says})",)
    if low >= REPAINT_LEVEL:
        shown = "the default strength" if strength in (None, "") else f"strength {strength}"
        return (f"the mask repaints every pixel: the result is img2img of the whole source at {shown}",)
    return ()
