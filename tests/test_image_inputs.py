"""Input images (engine/config/images.py): every upload decoded and checked once, at build_request; what can
be converted is, with a notice; what cannot is an InvalidRequest naming the field. No model loads here."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from engine.config import images as image_inputs
from engine.config.presets import get_preset, load_presets
from engine.config.request import API_FIELDS, FORM_FIELDS, ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest
from engine.protocol import BucketKey, GenerateRequest, ImageInputs, Mode, PixelImage, Size


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def rgb(size=(64, 64), colour=(200, 30, 30)) -> bytes:
    return encoded(Image.new("RGB", size, colour))


def png_bomb(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height 1-bit pixels, with one compressed row: a few hundred bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def edit(**fields) -> ImageRequest:
    return ImageRequest(preset="tiny-shapes-edit", prompt="make the circle green", **fields)


# -- the contract ---------------------------------------------------------------------------------------
def test_image_fields_are_appended_to_the_form_so_positional_callers_keep_working():
    assert FORM_FIELDS[-3:] == ("images", "mask", "strength")
    assert API_FIELDS[-3:] == ("images", "mask", "strength")
    assert FORM_FIELDS.index("memory") == len(FORM_FIELDS) - 4


def test_presets_declare_the_inputs_their_family_takes():
    presets = load_presets()
    assert presets["tiny-shapes"].inputs is ImageInputs.TEXT
    assert presets["tiny-shapes-edit"].inputs is ImageInputs.EDIT and presets["tiny-shapes-edit"].max_references == 1
    assert presets["tiny-shapes-img2img"].inputs is ImageInputs.IMG2IMG
    assert presets["tiny-flux-inpaint"].inputs is ImageInputs.INPAINT
    assert presets["tiny-flux2-klein"].inputs is ImageInputs.REFERENCES
    assert presets["flux2-dev"].max_references == 10 and presets["qwen-image-edit-plus"].max_references == 3
    assert presets["flux1-kontext-dev"].pipeline == "FluxKontextPipeline"
    assert presets["tiny-shapes-img2img"].base_pipeline == "FluxPipeline"


def test_an_edit_is_built_into_pixels_at_its_bucket_with_its_reference_in_the_bucket():
    request, notices = build_request(get_preset("tiny-shapes-edit"), edit(images=(rgb(),), size="64x64"))
    assert isinstance(request, GenerateRequest) and request.images_in_sequence
    assert request.images[0] == PixelImage(64, 64, Image.new("RGB", (64, 64), (200, 30, 30)).tobytes())
    assert request.bucket == BucketKey(Mode.EAGER, Size(64, 64), refs=(Size(64, 64),))
    assert str(request.bucket) == "eager:64x64+ref64x64"
    assert notices == ()


def test_a_source_of_another_size_is_resized_to_the_bucket_with_a_notice_and_sets_the_output_shape():
    request, notices = build_request(get_preset("tiny-shapes-edit"), edit(images=(rgb((130, 60)),)))
    assert request.size == Size(128, 64)  # no size asked: the source's, snapped to a bucket
    assert request.images[0].size == Size(128, 64)
    assert any("image 1 (130x60) resized to 128x64" in n and "Lanczos" in n for n in notices), notices


def test_img2img_takes_a_strength_and_runs_its_share_of_the_steps():
    preset = get_preset("tiny-shapes-img2img")
    request, _ = build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),), strength="0.5", steps=8))
    assert request.strength == 0.5 and request.denoise_steps == 4 and request.bucket.refs == ()
    default, _ = build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),)))
    assert default.strength == 0.6
    for strength, words in (("2", "at most 1"), ("0", "above 0"), ("x", "number"), ("nan", "at most 1")):
        with pytest.raises(InvalidRequest, match=words):
            build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),), strength=strength))
    tiny, _ = build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),), strength=0.05, steps=4))
    assert tiny.denoise_steps == 1  # diffusers' get_timesteps keeps at least one step


def test_inpaint_needs_a_mask_at_the_sources_size():
    preset = get_preset("tiny-shapes-inpaint")
    mask = encoded(Image.new("L", (64, 64), 255))
    request, _ = build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),), mask=mask))
    assert request.mask.mode == "L" and request.mask.size == Size(64, 64)
    with pytest.raises(InvalidRequest, match="upload a mask"):
        build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),)))
    with pytest.raises(InvalidRequest, match=r"mask is 32x32 but image 1 is 64x64"):
        build_request(preset, ImageRequest(preset=preset.name, images=(rgb(),),
                                           mask=encoded(Image.new("L", (32, 32), 255))))


@pytest.mark.parametrize(("preset", "fields", "words"), [
    ("tiny-shapes", dict(images=(rgb(),)), "takes text to image only: remove the input image"),
    ("tiny-shapes-edit", dict(), "upload the image to edit"),
    ("tiny-shapes-edit", dict(images=(rgb(), rgb())), "at most 1 input image"),
    ("tiny-shapes-edit", dict(images=(rgb(),), strength="0.5"), "no strength"),
    ("tiny-shapes-edit", dict(images=(rgb(),), mask=rgb()), "no mask"),
    ("tiny-flux2-klein", dict(images=(rgb(),) * 5), "at most 4 input images"),
    ("tiny-shapes", dict(strength="0.3"), "no strength"),
])
def test_a_field_the_family_does_not_take_is_refused_by_its_declaration(preset, fields, words):
    with pytest.raises(InvalidRequest, match=words):
        build_request(get_preset(preset), ImageRequest(preset=preset, **fields))


def test_flux2_takes_several_references_each_in_the_bucket():
    preset = get_preset("tiny-flux2-klein")
    request, _ = build_request(preset, ImageRequest(preset=preset.name, images=(rgb(), rgb((128, 128))), size="64x64"))
    assert request.bucket.refs == (Size(64, 64), Size(64, 64))
    text, _ = build_request(preset, ImageRequest(preset=preset.name, size="64x64"))
    assert text.bucket.refs == () and not text.images_in_sequence


# -- hosting-grade decoding ---------------------------------------------------------------------------------
def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = png_bomb(40_000, 32_500)  # 1.3 gigapixels declared in 100 bytes
    assert len(bomb) < 200
    with pytest.raises(InvalidRequest, match=r"image 1 (is 40000x32500 pixels|declares more pixels)"):
        image_inputs.decode(bomb, 0)


def test_a_file_over_the_byte_bound_is_refused_before_decoding():
    with pytest.raises(InvalidRequest, match="bytes; upload at most 32 MiB"):
        image_inputs.decode(b"\x89PNG" + bytes(image_inputs.MAX_UPLOAD_BYTES), 0)


@pytest.mark.parametrize(("data", "words"), [
    (b"", "image 1 is empty"),
    (b"hello, not an image", "not an image this server reads"),
    ("a path as text", "must be an uploaded image file"),
    (rgb()[: len(rgb()) // 2], "truncated or damaged"),
    (encoded(Image.new("F", (8, 8)), "TIFF"), "pixel mode F"),
    (encoded(Image.new("RGB", (8, 8)), "PNG")[:30], "image 1 (is truncated|has a damaged header|is not an image)"),
])
def test_a_damaged_or_foreign_upload_is_a_clear_error_naming_the_field(data, words):
    with pytest.raises(InvalidRequest, match=words):
        image_inputs.decode(data, 0)


def test_cmyk_sixteen_bit_and_transparency_are_converted_with_a_notice():
    cmyk, said = image_inputs.decode(encoded(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"), 0)
    assert cmyk.mode == "RGB" and any("CMYK; converted to RGB" in n for n in said)
    deep = Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16))
    sixteen, said = image_inputs.decode(encoded(deep), 1)
    assert sixteen.getpixel((0, 0)) == (255, 255, 255) and said == ("image 2 has 16-bit pixels; reduced to 8 bits",)
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([255, 0, 0] * 256)
    flat, said = image_inputs.decode(encoded(palette, transparency=0), 0)
    assert flat.getpixel((0, 0)) == (255, 255, 255) and "flattened onto white" in said[0]
    half = Image.new("RGBA", (8, 8), (0, 0, 255, 0))
    assert image_inputs.decode(encoded(half), 0)[0].getpixel((0, 0)) == (255, 255, 255)


def test_exif_rotation_is_applied_and_said():
    tall = Image.new("RGB", (8, 16), (0, 200, 0))
    exif = tall.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to view
    upright, said = image_inputs.decode(encoded(tall, "JPEG", exif=exif), 0)
    assert upright.size == (16, 8) and "EXIF orientation (6)" in said[0]


def test_an_animation_serves_its_first_frame_and_says_so():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    first, said = image_inputs.decode(buffer.getvalue(), 0)
    assert first.getpixel((0, 0))[0] > 200 and "animated (GIF); its first frame was used" in said[0]


def test_a_mask_with_transparency_reads_transparent_as_keep():
    mask = Image.new("RGBA", (8, 8), (255, 255, 255, 0))
    read, said = image_inputs.decode(encoded(mask), None)
    assert read.mode == "L" and read.getpixel((0, 0)) == 0 and "mask has transparency" in said[0]


def test_the_cli_reads_a_file_bounded(tmp_path):
    path = tmp_path / "source.png"
    path.write_bytes(rgb())
    assert image_inputs.read_image_file(path) == rgb()
    with pytest.raises(InvalidRequest, match="cannot be read"):
        image_inputs.read_image_file(tmp_path / "missing.png", "--image 1")
    with pytest.raises(InvalidRequest, match="not a regular file"):
        image_inputs.read_image_file(tmp_path, "--image 1")


def test_an_edit_costs_its_references_tokens_in_a_visitors_budget():
    from engine.errors import NotAllowed
    from engine.serving import cost

    preset, size = get_preset("tiny-shapes-edit"), Size(64, 64)
    assert cost.tokens_per_image_step(preset, size, refs=(size,)) == 2 * cost.tokens_per_image_step(preset, size)
    assert cost.price(preset, size, 8, refs=(size, size)) == 3 * cost.price(preset, size, 8)
    text_fits = cost.check_generate(cost.CostBudget(request=8 * 64), preset, size, 8)
    assert text_fits == 8 * 64
    with pytest.raises(NotAllowed, match="1 reference included"):
        cost.check_generate(cost.CostBudget(request=8 * 64), preset, size, 8, refs=(size,))


def test_twenty_malformed_uploads_each_get_a_clear_error_naming_what_to_change():
    from bench.edit import bad_uploads

    table = bad_uploads()
    assert len(table) == 20
    answers = []
    for _what, fields in table:
        preset = fields.pop("preset", "tiny-shapes-edit")
        with pytest.raises(InvalidRequest) as refused:
            build_request(get_preset(preset), ImageRequest(preset=preset, prompt="make it green", **fields))
        answers.append(str(refused.value))
    assert all(("image" in a or "mask" in a or "strength" in a) and len(a) < 300 for a in answers), answers
    assert len(set(answers)) >= 15  # each says what is wrong with its own upload


def test_edits_batch_by_bucket_and_flux2_only_with_the_same_references():
    from engine.pipeline.batching import batch_key

    def built(preset, **fields):
        return build_request(get_preset(preset), ImageRequest(preset=preset, size="64x64", **fields))[0]

    red, blue = rgb(colour=(255, 0, 0)), rgb(colour=(0, 0, 255))
    assert batch_key(built("tiny-shapes-edit", images=(red,))) == batch_key(built("tiny-shapes-edit", images=(blue,)))
    assert batch_key(built("tiny-flux2-klein", images=(red,))) != batch_key(built("tiny-flux2-klein", images=(blue,)))
    assert batch_key(built("tiny-flux2-klein", images=(red,))) == batch_key(built("tiny-flux2-klein", images=(red,),
                                                                                  seed=3))
    assert batch_key(built("tiny-flux2-klein")) != batch_key(built("tiny-flux2-klein", images=(red,)))
    img2img = [built("tiny-shapes-img2img", images=(red,), strength=s) for s in (0.5, 0.5, 0.7)]
    assert batch_key(img2img[0]) == batch_key(img2img[1]) != batch_key(img2img[2])
