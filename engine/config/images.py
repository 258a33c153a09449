"""Input images of a request (a source to edit, references, a mask), decoded and checked once, at the gate.

Every door hands the uploads over as the bytes it received (`ImageRequest.images`, `ImageRequest.mask`); this
module is the one place they are read, so a visitor's file is judged the same way through the page, /generate,
/v1/images/edits, MCP and the CLI. Hosting-grade: the bytes are bounded before anything decodes them, only
the formats listed below are opened, and the pixel count is read from the header (`Image.open` reads no
pixels) and refused before a single pixel is allocated, so a decompression bomb costs a header read. What
can be turned into 8-bit RGB is, with a notice saying so (CMYK, 16-bit, transparency, EXIF rotation, an
animation's first frame); what cannot is an `InvalidRequest` naming the field and what to change.

The worker gets `PixelImage`s (raw 8-bit pixels, engine/protocol/requests.py) already at the bucket's
reference size: every reference is resized to the output size with Lanczos, which is what the pipelines'
`VaeImageProcessor.resize` does (the aspect is not kept: the pipelines stretch too), so a warm edit
bucket never meets a new shape. Nothing here imports torch; PIL and numpy load on first use.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.config import masks
from engine.config.masks import MaskConvention
from engine.errors import EngineBusy, InvalidRequest
from engine.protocol import DEFAULT_STRENGTH, BucketKey, ImageInputs, ModelPreset, PixelImage, Size

MAX_UPLOAD_BYTES = 32 * 2**20  # one file, before decoding
MAX_UPLOADS_BYTES = 64 * 2**20  # all of a request's files together
MAX_INPUT_SIDE = 4096
MAX_INPUT_PIXELS = 4096 * 4096  # read from the header; a larger image is refused before its pixels exist
MAX_IMAGES = 16  # any request, before the preset's own bound
# Decode work, bounded before Pillow decodes a pixel. Pillow decodes every scan of a progressive JPEG, each a pass
# over all its blocks, and bounds only pixels; libjpeg-turbo's own scan limit is not reachable through Pillow.
MAX_JPEG_SCANS = 64  # a progressive encoder writes about 10; ImageMagick stops at 1024, DALI at 500
MAX_SCAN_PIXELS = 32 * MAX_INPUT_PIXELS  # scans x pixels: about 0.1 s of one core, whatever the file's size
# Decoded pixels x bytes per pixel (16-bit RGBA: 8 B/px): per request, per visitor in flight, and for the server.
MAX_DECODE_BYTES = 128 * 2**20  # one 4096x4096 16-bit RGBA image, or two 8-bit RGBA ones
MAX_VISITOR_DECODE_BYTES = 128 * 2**20  # a visitor's requests decoding at once share it
MAX_TOTAL_DECODE_BYTES = 512 * 2**20
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # what Pillow may try; nothing else is opened
RESAMPLE = "Lanczos"  # the pipelines' VaeImageProcessor default (resample="lanczos")
_FLATTEN = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_CONVERTIBLE = {"CMYK": "CMYK", "YCbCr": "YCbCr", "LAB": "Lab", "HSV": "HSV"}


@dataclass(frozen=True)
class CheckedImages:
    """What `check_images` made of a request's uploads: the worker's images and mask at the bucket's size, the
    strength (img2img / inpaint), whether the images' tokens join the sequence, and the notices to show."""

    images: tuple[PixelImage, ...] = ()
    mask: PixelImage | None = None
    strength: float | None = None
    in_sequence: bool = False
    shared: bool = False
    notices: tuple[str, ...] = ()


def _field_name(index: int | None) -> str:
    return "mask" if index is None else f"image {index + 1}"


def _bytes_of(name: str, data) -> bytes:
    if isinstance(data, memoryview | bytearray):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise InvalidRequest(f"{name} must be an uploaded image file (its bytes), got {type(data).__name__}")
    if not data:
        raise InvalidRequest(f"{name} is empty; upload a PNG, JPEG or WebP image")
    if len(data) > MAX_UPLOAD_BYTES:
        raise InvalidRequest(f"{name} is {len(data):,} bytes; upload at most {MAX_UPLOAD_BYTES // 2**20} MiB "
                             f"({MAX_UPLOAD_BYTES:,} bytes: a smaller or compressed image)")
    return data


def _open(name: str, data: bytes):
    """The image's header read (no pixels), its size checked against the bounds."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(f"{name} declares more pixels than Pillow's limit ({Image.MAX_IMAGE_PIXELS}); upload an "
                             f"image of at most {MAX_INPUT_SIDE}x{MAX_INPUT_SIDE}") from None
    except UnidentifiedImageError:
        raise InvalidRequest(f"{name} is not an image this server reads; upload one of "
                             f"{', '.join(f.lower() for f in FORMATS)}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidRequest(f"{name} has a damaged header ({_reason(exc)}); upload the image again") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequest(f"{name} is {width}x{height} pixels; upload an image with pixels")
    if width > MAX_INPUT_SIDE or height > MAX_INPUT_SIDE or width * height > MAX_INPUT_PIXELS:
        raise InvalidRequest(f"{name} is {width}x{height} pixels; upload at most {MAX_INPUT_SIDE}x{MAX_INPUT_SIDE} "
                             f"({MAX_INPUT_PIXELS // 10**6} megapixels): it is resized to the output size anyway")
    if image.format == "JPEG":
        check_scans(name, data, width * height)
    return image


def check_scans(name: str, data: bytes, pixels: int) -> None:
    """A JPEG's scans bounded before any is decoded. A 0xFF byte in entropy-coded data is always followed by
    0x00, so the count of start-of-scan markers is an upper bound on the scans (an EXIF thumbnail's count too)."""
    scans = data.count(b"\xff\xda")
    if scans > MAX_JPEG_SCANS:
        raise InvalidRequest(f"{name} is a JPEG of {scans:,} scans; this server decodes at most {MAX_JPEG_SCANS} "
                             "(a progressive JPEG has about 10): save it again as a baseline JPEG or a PNG")
    if scans * pixels > MAX_SCAN_PIXELS:
        raise InvalidRequest(f"{name} is a progressive JPEG of {scans} scans at {pixels / 10**6:.1f} megapixels; "
                             f"this server decodes at most {MAX_SCAN_PIXELS / 10**6:,.0f} megapixel-scans: save it "
                             "again as a baseline JPEG, or smaller")


def pixel_bytes(image) -> int:
    """The bytes a decoded pixel of `image` takes as its decoder writes it (16-bit bands count 2 B each)."""
    from PIL import Image

    mode = image.mode
    if mode in ("I", "F", "I;32", "I;32B", "I;32L"):
        return 4
    if mode.startswith("I;16"):
        return 2
    bands = Image.getmodebands(mode) if mode in Image.MODES else 4
    wide = any(";16" in str(getattr(tile, "args", "")) for tile in getattr(image, "tile", ()) or ())
    return bands * (2 if wide else 1)


class DecodeLedger:
    """The decoded bytes of the uploads being decoded now, per visitor and in all: a request whose pixels
    would take a visitor or the server past its share waits its turn (EngineBusy) instead of growing memory."""

    def __init__(self, per_visitor: int = MAX_VISITOR_DECODE_BYTES, total: int = MAX_TOTAL_DECODE_BYTES):
        self.per_visitor, self.total = per_visitor, total
        self.held: dict[str, int] = {}
        self.lock = threading.Lock()

    @contextmanager
    def hold(self, client: str, nbytes: int) -> Iterator[None]:
        with self.lock:
            mine, everyone = self.held.get(client, 0), sum(self.held.values())
            if mine + nbytes > self.per_visitor:
                raise EngineBusy(f"your other uploads are being decoded ({mine / 2**20:.0f} MiB of pixels); "
                                 f"a visitor decodes at most {self.per_visitor // 2**20} MiB at once: wait for "
                                 "them, then send this again", retry_after_s=2)
            if everyone + nbytes > self.total:
                raise EngineBusy(f"the server is decoding {everyone / 2**20:.0f} MiB of uploads (at most "
                                 f"{self.total // 2**20} MiB at once); send this again in a moment",
                                 retry_after_s=2)
            self.held[client] = mine + nbytes
        try:
            yield
        finally:
            with self.lock:
                left = self.held.get(client, 0) - nbytes
                if left > 0:
                    self.held[client] = left
                else:
                    self.held.pop(client, None)


DECODES = DecodeLedger()


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:120]


# EXIF orientation -> the transposition that makes the picture upright (what ImageOps.exif_transpose applies)
_UPRIGHT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
            7: "TRANSVERSE", 8: "ROTATE_90"}


def _load(name: str, image) -> tuple[object, list[str]]:
    """The first frame's pixels, upright (EXIF orientation applied; EXIF that cannot be read is ignored)."""
    from PIL import Image

    notices = []
    if getattr(image, "is_animated", False):
        notices.append(f"{name} is animated ({image.format}); its first frame was used")
        image.seek(0)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError, IndexError) as exc:  # truncated, damaged data
        raise InvalidRequest(f"{name} is truncated or damaged ({_reason(exc)}); upload the whole file") from None
    try:  # the pixels alone are turned: a crafted EXIF block cannot fail the upload
        orientation = image.getexif().get(0x0112, 1)
    except Exception as exc:  # noqa: BLE001 - any parse failure of the metadata: the picture is still good
        notices.append(f"{name} has EXIF data that cannot be read ({_reason(exc)[:60]}); it was ignored")
        return image, notices
    if orientation in (1, None):
        return image, notices
    if orientation not in _UPRIGHT:
        notices.append(f"{name} has an EXIF orientation of {repr(orientation)[:20]}, which is not one of 1-8; "
                       "it was ignored")
        return image, notices
    notices.append(f"{name} was rotated upright as its EXIF orientation ({orientation}) says")
    return image.transpose(getattr(Image.Transpose, _UPRIGHT[orientation])), notices


def _to_rgb(name: str, image, background: tuple[int, ...]) -> tuple[object, list[str]]:
    """8-bit RGB, converting what can be converted (with a notice) and refusing what cannot."""
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image, []
    if mode in ("L", "1"):
        return image.convert("RGB"), []
    if mode in _SIXTEEN_BIT:
        import numpy as np

        pixels = np.asarray(image).astype(np.uint32)
        top = 65535 if mode != "I" else max(int(pixels.max()), 1)
        eight = (pixels * 255 // top).clip(0, 255).astype(np.uint8)
        return Image.fromarray(eight, "L").convert("RGB"), [f"{name} has 16-bit pixels; reduced to 8 bits"]
    if mode == "P":
        if "transparency" not in image.info:
            return image.convert("RGB"), []
        image, mode = image.convert("RGBA"), "PA"
    if mode in _FLATTEN:
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, background + (255,))
        flat.alpha_composite(rgba)
        shade = "white" if background[0] else "black"
        return flat.convert("RGB"), [f"{name} has transparency ({mode}); flattened onto {shade}"]
    if mode in _CONVERTIBLE:
        return image.convert("RGB"), [f"{name} is {_CONVERTIBLE[mode]}; converted to RGB without a colour profile "
                                      "(colours may shift)"]
    raise InvalidRequest(f"{name} has pixel mode {mode}, which is not a picture's colours; save it as an 8-bit "
                         "RGB PNG or JPEG")


def decode(data, index: int | None = 0, convention: MaskConvention = MaskConvention.LUMINANCE):
    """One upload as an upright 8-bit RGB PIL image (a mask, index None: grayscale, white where it repaints, read
    by the door's `convention`, engine/config/masks.py) and the notices of what was converted; InvalidRequest
    naming the field ("image N", "mask")."""
    name = _field_name(index)
    image = _open(name, _bytes_of(name, data))
    check_decode_bytes([(name, image)])
    return _decoded(name, index, image, convention)


def _decoded(name: str, index: int | None, image,
             convention: MaskConvention = MaskConvention.LUMINANCE) -> tuple[object, tuple[str, ...]]:
    image, notices = _load(name, image)
    if index is None and convention is MaskConvention.ALPHA:  # its transparency is what it says
        return masks.alpha_mask(image), tuple(notices)
    image, converted = _to_rgb(name, image, (0, 0, 0) if index is None else (255, 255, 255))
    if index is None:
        image = image.convert("L")
    return image, tuple(notices + converted)


def check_decode_bytes(opened) -> int:
    """The decoded bytes of a request's opened uploads ((name, image) pairs, headers read), refused past
    MAX_DECODE_BYTES naming the largest one."""
    sizes = [(name, image.width * image.height * pixel_bytes(image)) for name, image in opened]
    total = sum(nbytes for _, nbytes in sizes)
    if total > MAX_DECODE_BYTES:
        name, largest = max(sizes, key=lambda pair: pair[1])
        raise InvalidRequest(f"the request's images take {total / 2**20:.0f} MiB once decoded ({name}: "
                             f"{largest / 2**20:.0f} MiB); at most {MAX_DECODE_BYTES // 2**20} MiB of pixels per "
                             "request (16-bit RGBA: 8 bytes a pixel): send fewer, smaller or 8-bit images")
    return total


# -- a request's images against its preset --------------------------------------------------------------
def check_count(preset: ModelPreset, images, mask, strength) -> None:
    """The fields the preset's family takes (its `inputs` declaration) and the number of images, before any
    decoding."""
    inputs, takes = preset.inputs, preset.inputs.describe(preset.video)
    if not isinstance(images, tuple | list):
        raise InvalidRequest(f"images must be a list of uploaded files, got {type(images).__name__}")
    if len(images) > MAX_IMAGES:
        raise InvalidRequest(f"{len(images)} images uploaded; at most {MAX_IMAGES} are read")
    if images and not inputs.takes_images:
        raise InvalidRequest(f"preset {preset.name} takes {takes}: remove the input image, or choose a preset that "
                             f"takes images ({', '.join(editing_presets(preset.video)) or 'none is configured'})")
    if len(images) > preset.max_references:
        raise InvalidRequest(f"preset {preset.name} takes at most {preset.max_references} input image"
                             f"{'s' if preset.max_references != 1 else ''} ({takes}), got {len(images)}; "
                             "remove some")
    if inputs.needs_source and not images:
        raise InvalidRequest(f"preset {preset.name} takes {takes}: upload {inputs.source_role}")
    if mask is not None and not inputs.takes_mask:
        raise InvalidRequest(f"preset {preset.name} takes {takes}, no mask: remove the mask or choose an "
                             "inpainting preset")
    if inputs.takes_mask and mask is None:
        raise InvalidRequest(f"preset {preset.name} inpaints: upload a mask at the source's size (white where it "
                             "repaints, black where it keeps; /v1/images/edits: transparent where it edits)")
    if strength not in (None, "") and not inputs.takes_strength:
        raise InvalidRequest(f"preset {preset.name} takes {takes}, no strength: strength is for img2img "
                             "and inpainting presets; leave it empty")
    total = sum(len(d) for d in (*images, mask or b"") if isinstance(d, bytes | bytearray | memoryview))
    if total > MAX_UPLOADS_BYTES:
        raise InvalidRequest(f"the request's images are {total / 2**20:.1f} MiB together; at most "
                             f"{MAX_UPLOADS_BYTES // 2**20} MiB")


def editing_presets(video: bool = False) -> list[str]:
    """The configured presets that take input images, among the video ones (`video`) or the image ones."""
    from engine.config.presets import load_presets

    return [name for name, p in load_presets().items() if p.inputs.takes_images and p.video == video]


def check_strength(strength) -> float:
    """img2img / inpaint strength in (0, 1] (None or "": diffusers' default); it runs the last
    `steps * strength` of the schedule, at least one step (GenerateRequest.denoise_steps)."""
    if strength in (None, ""):
        strength = DEFAULT_STRENGTH
    if isinstance(strength, bool):
        raise InvalidRequest(f"strength must be a number from 0 to 1, got {strength!r}")
    try:
        value = float(strength)
    except (TypeError, ValueError):
        raise InvalidRequest(f"strength must be a number from 0 to 1, got {str(strength)[:40]!r}") from None
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise InvalidRequest(f"strength must be above 0 and at most 1 (1: the source is all noise), got {value:g}")
    return value


@dataclass(frozen=True)
class Decoded:
    """A request's uploads decoded (PIL, at their own sizes), before the output size is known; `pixels`: the
    pixels decoded (what the decoding cost, priced with the request)."""

    images: tuple = ()
    mask: object = None
    notices: tuple[str, ...] = ()
    pixels: int = 0

    @property
    def source_size(self) -> Size | None:
        """The first image's size: an edit's output follows it when the request names no size."""
        return Size(*self.images[0].size) if self.images else None

    def fitted(self, size: Size) -> Decoded:
        """These uploads resized to `size` once (as `fit_inputs` resizes them), for the admissions that share
        them at that size: a Compare's configurations."""
        from PIL import Image

        images, notices = [], list(self.notices)
        for index, image in enumerate(self.images):
            if image.size != (size.width, size.height):
                notices.append(_resized(index, image, size))
                image = image.resize((size.width, size.height), Image.Resampling.LANCZOS)
            images.append(image)
        mask = self.mask
        if mask is not None and mask.size != (size.width, size.height):
            mask = mask.resize((size.width, size.height), Image.Resampling.LANCZOS)
        return Decoded(tuple(images), mask, tuple(notices), self.pixels)


def _resized(index: int, image, size: Size) -> str:
    return (f"{_field_name(index)} ({Size(*image.size)}) resized to {size} ({RESAMPLE}, as the pipeline's image "
            "processor resizes; aspect not kept)")


def decode_inputs(preset: ModelPreset, images, mask, strength, client: str = "",
                  mask_convention: MaskConvention = MaskConvention.LUMINANCE) -> Decoded:
    """Every upload of a request decoded and checked against its preset (see `check_count`); the mask must
    match the source's size and is read by the door's `mask_convention`. Every header is read and the decode work
    bounded (scans, decoded bytes per request, then `client`'s and the server's share in DECODES) before the first
    pixel is decoded."""
    images = tuple(images or ())
    check_count(preset, images, mask, strength)
    fields = [*enumerate(images), *([(None, mask)] if mask is not None else [])]
    opened = []
    for index, data in fields:
        name = _field_name(index)
        opened.append((index, name, _open(name, _bytes_of(name, data))))
    nbytes = check_decode_bytes([(name, image) for _, name, image in opened])
    decoded, notices, mask_image = [], [], None
    with DECODES.hold(client, nbytes):
        for index, name, image in opened:
            pil, said = _decoded(name, index, image, mask_convention)
            notices += said
            if index is None:
                mask_image = pil
            else:
                decoded.append(pil)
    if mask_image is not None and mask_image.size != decoded[0].size:
        raise InvalidRequest(f"mask is {Size(*mask_image.size)} but image 1 is {Size(*decoded[0].size)}; draw the "
                             "mask at the source image's size")
    if mask_image is not None:
        notices += masks.coverage_notices(mask_image, mask_convention, strength)
    pixels = sum(image.width * image.height for _, _, image in opened)
    return Decoded(tuple(decoded), mask_image, tuple(notices), pixels)


def fit_inputs(preset: ModelPreset, decoded: Decoded, size: Size, strength) -> CheckedImages:
    """The decoded images at the bucket's reference size (`size`, the output's), as the worker takes them."""
    from PIL import Image

    notices = list(decoded.notices)
    fitted = []
    for index, image in enumerate(decoded.images):
        if image.size != (size.width, size.height):
            notices.append(_resized(index, image, size))
            image = image.resize((size.width, size.height), Image.Resampling.LANCZOS)
        fitted.append(PixelImage.from_pil(image))
    mask = decoded.mask
    if mask is not None and mask.size != (size.width, size.height):
        mask = mask.resize((size.width, size.height), Image.Resampling.LANCZOS)
    inputs = preset.inputs
    return CheckedImages(
        images=tuple(fitted),
        mask=PixelImage.from_pil(mask) if mask is not None else None,
        strength=check_strength(strength) if inputs.takes_strength else None,
        in_sequence=inputs.in_sequence and bool(fitted),
        shared=inputs is ImageInputs.REFERENCES and bool(fitted),
        notices=tuple(notices),
    )


def read_image_file(path, name: str = "image") -> bytes:
    """A local image file's bytes for the CLI (`--image PATH`), bounded like an upload: at most
    MAX_UPLOAD_BYTES are read, a larger file is refused."""
    import stat
    from pathlib import Path

    path = Path(path).expanduser()
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise InvalidRequest(f"{name} {str(path)[:80]!r} is not a regular file; give an image file")
        with open(path, "rb") as f:
            data = f.read(MAX_UPLOAD_BYTES + 1)
    except OSError as exc:
        raise InvalidRequest(f"{name} {str(path)[:80]!r} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_UPLOAD_BYTES:
        raise InvalidRequest(f"{name} {str(path)[:80]!r} is over {MAX_UPLOAD_BYTES // 2**20} MiB; give a smaller image")
    return data


def synthetic_inputs(preset, bucket: BucketKey) -> dict:
    """A warm-up's input images at `bucket`: a mid-grey source at the output size (img2img, inpaint), a mask
    repainting its centre, the bucket's references: the shapes a request's resized uploads have, so the graph
    it compiles is the one they run."""
    inputs = preset.inputs
    if not inputs.takes_images:
        return {}
    size = bucket.size
    sizes = bucket.refs if inputs.in_sequence else (size,)
    images = tuple(PixelImage(s.width, s.height, bytes([128]) * (s.width * s.height * 3)) for s in sizes)
    fields = {"images": images, "images_in_sequence": inputs.in_sequence and bool(images),
              "images_shared": inputs is ImageInputs.REFERENCES and bool(images)}
    if inputs.takes_strength:
        fields["strength"] = 1.0  # every step runs: the same graph, the whole schedule warmed
    if inputs.takes_mask:
        rows = [bytes(size.width // 4) + bytes([255]) * (size.width - size.width // 4 * 2) + bytes(size.width // 4)
                if size.height // 4 <= y < size.height - size.height // 4 else bytes(size.width)
                for y in range(size.height)]
        fields["mask"] = PixelImage(size.width, size.height, b"".join(rows), "L")
    return fields
