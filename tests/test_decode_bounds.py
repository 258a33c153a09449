"""Decode work bounded before Pillow decodes a pixel (engine/config/images.py): a progressive JPEG's scans,
the decoded bytes of a request's uploads (16-bit RGBA counts 8 B/px), a visitor's and the server's uploads
being decoded at once; crafted EXIF is ignored with a notice. The hostile files are made here (bench/hostile.py)."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageFile

from bench.hostile import crafted_exif_jpeg, scan_bomb, wide_png
from engine.config import images as image_inputs
from engine.config.presets import get_preset
from engine.config.request import ImageRequest
from engine.config.validation import build_request
from engine.errors import EngineBusy, InvalidRequest


@pytest.fixture
def pixel_decodes(monkeypatch):
    """Every time Pillow decodes an image's pixels (ImageFile.load), counted."""
    calls = []
    load = ImageFile.ImageFile.load

    def counted(self):
        if self.tile:
            calls.append(self.format)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return calls


def test_a_scan_bomb_is_refused_from_its_markers_before_any_scan_is_decoded(pixel_decodes):
    bomb = scan_bomb(256, 2000)
    assert len(bomb) < 100_000 and Image.open(io.BytesIO(bomb)).size == (256, 256)
    with pytest.raises(InvalidRequest, match=r"image 1 is a JPEG of 2,001 scans; this server decodes at most 64"):
        image_inputs.decode(bomb, 0)
    assert pixel_decodes == []


def test_scans_times_pixels_is_bounded_for_a_large_progressive_jpeg(pixel_decodes):
    bomb = scan_bomb(4096, 40)  # under the scan count, over scans x pixels
    with pytest.raises(InvalidRequest, match=r"41 scans at 16.8 megapixels; this server decodes at most 537 "
                                             "megapixel-scans"):
        image_inputs.decode(bomb, 0)
    assert pixel_decodes == []


def test_an_ordinary_progressive_jpeg_still_decodes():
    buffer = io.BytesIO()
    Image.new("RGB", (640, 480), (20, 120, 200)).save(buffer, "JPEG", progressive=True, quality=90)
    assert 2 < buffer.getvalue().count(b"\xff\xda") < 16
    image, notices = image_inputs.decode(buffer.getvalue(), 0)
    assert image.size == (640, 480) and notices == ()


def test_decoded_bytes_are_bounded_per_request_counting_16_bit_rgba_as_8_bytes(pixel_decodes):
    one = Image.open(io.BytesIO(wide_png(4096, 4096)))
    assert image_inputs.pixel_bytes(one) == 8
    preset = get_preset("tiny-flux2-klein")
    spec = ImageRequest(preset=preset.name, prompt="a red circle", size="64x64",
                        images=(wide_png(4096, 4096), wide_png(2048, 2048)))
    with pytest.raises(InvalidRequest, match=r"take 160 MiB once decoded \(image 1: 128 MiB\); at most 128 MiB of "
                                             r"pixels per request \(16-bit RGBA: 8 bytes a pixel\)"):
        build_request(preset, spec)
    assert pixel_decodes == []  # refused from the headers


def test_a_visitors_uploads_decoding_at_once_share_one_bound_and_the_server_another():
    ledger = image_inputs.DecodeLedger(per_visitor=100, total=150)
    with ledger.hold("a", 60):
        with pytest.raises(EngineBusy, match="your other uploads are being decoded"):
            with ledger.hold("a", 60):
                pass
        with ledger.hold("b", 80):
            with pytest.raises(EngineBusy, match="the server is decoding 0 MiB of uploads"):
                with ledger.hold("c", 20):
                    pass
    assert ledger.held == {}  # all let go, refused or not


def test_the_gate_holds_a_visitors_decode_in_the_ledger(monkeypatch):
    seen = []
    hold = image_inputs.DECODES.hold

    def watched(client, nbytes):
        seen.append((client, nbytes))
        return hold(client, nbytes)

    monkeypatch.setattr(image_inputs.DECODES, "hold", watched)
    preset = get_preset("tiny-shapes-edit")
    buffer = io.BytesIO()
    Image.new("RGBA", (64, 32), (200, 30, 30, 255)).save(buffer, "PNG")
    build_request(preset, ImageRequest(preset=preset.name, prompt="green", images=(buffer.getvalue(),),
                                       client="10.0.0.7"))
    assert seen == [("10.0.0.7", 64 * 32 * 4)] and image_inputs.DECODES.held == {}


def test_crafted_exif_is_ignored_with_a_notice_not_a_failure():
    data = crafted_exif_jpeg()
    assert len(data) < 1000
    image, notices = image_inputs.decode(data, 0)
    # its orientation is applied to the pixels alone (Pillow's exif_transpose raised struct.error writing it back)
    assert image.size == (16, 24) and any("EXIF orientation (6)" in n for n in notices), notices


def test_an_exif_orientation_outside_1_to_8_is_ignored_with_a_notice():
    tall = Image.new("RGB", (8, 16), (0, 200, 0))
    exif = tall.getexif()
    exif[0x0112] = 42
    buffer = io.BytesIO()
    tall.save(buffer, "JPEG", exif=exif)
    image, notices = image_inputs.decode(buffer.getvalue(), 0)
    assert image.size == (8, 16) and "EXIF orientation of 42" in notices[0]


# -- the price of what is done: references' tokens and the one decode ------------------------------------
def test_decoding_is_priced_once_in_a_request_and_a_compare():
    from engine.errors import NotAllowed
    from engine.protocol import Size
    from engine.serving import cost

    preset, size = get_preset("tiny-shapes-edit"), Size(64, 64)
    assert cost.decode_price(4096 * 4096) == 2048 and cost.decode_price(0) == 0
    plain = cost.check_generate(cost.CostBudget(), preset, size, 2, refs=(size,))
    assert cost.check_generate(cost.CostBudget(), preset, size, 2, refs=(size,), decoded_pixels=4096 * 4096) \
        == plain + 2048
    # a Compare: its images' references and one decode of its four uploads, however many configurations run
    base = cost.check_compare(cost.CostBudget(request=None), preset, size, 1, 6, 1)
    four = cost.Uploads(count=4, pixels=4 * 4096 * 4096)
    total = cost.check_uploads(cost.CostBudget(request=None), preset, size, 1, 6, base, four)
    assert total == base + 6 * 1 * 4 * cost.tokens_per_image_step(preset, size) + 4 * 2048
    with pytest.raises(NotAllowed, match=r"8,192 for decoding the uploads \(67.1 megapixels"):
        cost.check_uploads(cost.CostBudget(request=total - 1), preset, size, 1, 6, base, four)


def test_the_n_images_of_one_admission_share_its_decode_and_its_price_once():
    from engine.protocol import EngineKey
    from engine.serving.gate import Admitted

    request, _ = build_request(get_preset("tiny-shapes-edit"),
                               ImageRequest(preset="tiny-shapes-edit", prompt="green", seed=5,
                                            images=(crafted_exif_jpeg(),)))
    admitted = Admitted(EngineKey("tiny-shapes-edit", "cpu", "fp32"), request, (), price=1000, caller=None,
                        decode_cost=10)
    images = admitted.images(3)
    assert [a.request.seed for a in images] == [5, 6, 7]
    assert len({a.request.request_id for a in images}) == 3
    assert [a.price for a in images] == [1000, 990, 990]
    assert all(a.request.images == request.images for a in images)  # the pixels the admission decoded
