"""Inpaint masks: what a mask means at each door (engine/config/masks.py: white repaints on the page, the CLI,
/generate and MCP; fully transparent pixels at /v1/images/edits, as OpenAI's images.edit), the answers a
keep-everything or repaint-everything mask gets, and the kept pixels pasted back after decode with a feathered
edge (engine/pipeline/paste.py). No model loads here."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from engine.config.masks import MaskConvention
from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest
from engine.pipeline import paste

INPAINT = "tiny-shapes-inpaint"


def encoded(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def source() -> bytes:
    return encoded(Image.new("RGB", (64, 64), (30, 30, 200)))


def built(mask: bytes, convention=MaskConvention.LUMINANCE, **fields):
    return build_request(get_preset(INPAINT), ImageRequest(preset=INPAINT, prompt="a red circle on a blue background",
                                                           images=(source(),), mask=mask,
                                                           mask_convention=convention, **fields))


def alpha_mask(edit=(0, 0, 32, 64), size=(64, 64), colour=(255, 255, 255)) -> bytes:
    """Opaque (in `colour`) but for a fully transparent `edit` box: OpenAI's "edit here"."""
    mask = Image.new("RGBA", size, (*colour, 255))
    mask.paste((0, 0, 0, 0), edit)
    return encoded(mask)


def mask_pixels(request) -> np.ndarray:
    return np.asarray(request.mask.to_pil())


def test_the_page_reads_white_as_repaint_and_black_or_transparent_as_keep():
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    request, notices = built(encoded(mask))
    pixels = mask_pixels(request)
    assert (pixels[:, :32] == 255).all() and (pixels[:, 32:] == 0).all() and not notices
    clear = Image.new("RGBA", (64, 64), (255, 255, 255, 255))
    clear.paste((0, 0, 0, 0), (32, 0, 64, 64))  # transparent right half: kept on the page
    request, notices = built(encoded(clear))
    assert (mask_pixels(request)[:, 32:] == 0).all() and (mask_pixels(request)[:, :32] == 255).all()
    assert any("flattened onto black" in n for n in notices), notices


def test_v1_edits_the_fully_transparent_pixels_whatever_their_colours():
    # opaque white (the page's "repaint") is kept here; only alpha 0 is edited, half-transparent is kept too
    mask = Image.new("RGBA", (64, 64), (255, 255, 255, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 16, 64))
    mask.paste((0, 0, 0, 128), (16, 0, 32, 64))
    request, notices = built(encoded(mask), MaskConvention.ALPHA)
    pixels = mask_pixels(request)
    assert (pixels[:, :16] == 255).all() and (pixels[:, 16:] == 0).all() and not notices
    palette = Image.new("P", (64, 64), 1)  # a palette PNG whose transparent entry is index 0
    palette.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    palette.paste(0, (0, 0, 32, 64))
    buffer = io.BytesIO()
    palette.save(buffer, "PNG", transparency=0)
    request, _ = built(buffer.getvalue(), MaskConvention.ALPHA)
    assert (mask_pixels(request)[:, :32] == 255).all() and (mask_pixels(request)[:, 32:] == 0).all()


@pytest.mark.parametrize("mode", ["L", "RGB", "1"])
def test_v1_refuses_a_mask_without_transparency_naming_the_convention(mode):
    with pytest.raises(InvalidRequest, match=r"mask has no transparency .*fully transparent \(alpha 0\)"):
        built(encoded(Image.new(mode, (64, 64), 255 if mode != "RGB" else (255, 255, 255))), MaskConvention.ALPHA)


def test_a_mask_of_another_size_is_refused_at_every_door():
    for mask, convention in ((encoded(Image.new("L", (32, 32), 255)), MaskConvention.LUMINANCE),
                             (alpha_mask(size=(32, 32)), MaskConvention.ALPHA)):
        with pytest.raises(InvalidRequest, match=r"mask is 32x32 but image 1 is 64x64; draw the mask at the source"):
            built(mask, convention)


def test_a_keep_all_and_a_repaint_all_mask_say_what_comes_back():
    _, notices = built(encoded(Image.new("L", (64, 64), 0)))
    assert any("keeps every pixel (no pixel of the mask is white): the source comes back unchanged" in n
               for n in notices), notices
    _, notices = built(alpha_mask(edit=(0, 0, 0, 0)), MaskConvention.ALPHA)
    assert any("keeps every pixel (no pixel of the mask is fully transparent)" in n for n in notices), notices
    _, notices = built(encoded(Image.new("L", (64, 64), 255)), strength=0.8)
    assert any("repaints every pixel: the result is img2img of the whole source at strength 0.8" in n
               for n in notices), notices
    _, notices = built(alpha_mask(edit=(0, 0, 64, 64)), MaskConvention.ALPHA)
    assert any("repaints every pixel" in n and "default strength" in n for n in notices), notices


def test_paste_keeps_every_pixel_outside_the_feathered_edge_and_repaints_inside():
    rng = np.random.default_rng(0)
    src = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    new = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    keep_all = paste.paste_kept(src, new, Image.new("L", (64, 64), 0))
    assert keep_all.tobytes() == src.tobytes()
    assert paste.paste_kept(src, new, Image.new("L", (64, 64), 255)).tobytes() == new.tobytes()
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    out, s, n = (np.asarray(i, dtype=np.int16) for i in (paste.paste_kept(src, new, mask), src, new))
    edge = 3 * paste.feather_radius(64, 64)  # the Gaussian's reach
    assert (out[:16 - edge] == s[:16 - edge]).all() and (out[:, 48 + edge:] == s[:, 48 + edge:]).all()
    assert (out[16 + edge:48 - edge, 16 + edge:48 - edge] == n[16 + edge:48 - edge, 16 + edge:48 - edge]).all()
    band = out[16 - 1:16 + 1, 20:44]  # on the edge: a blend of both, not either
    assert (band != s[16 - 1:16 + 1, 20:44]).any() and (band != n[16 - 1:16 + 1, 20:44]).any()
