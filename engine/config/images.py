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
from dataclasses import dataclass

from engine.config import masks
from engine.config.masks import MaskConvention
from engine.errors import InvalidRequest
from engine.protocol import DEFAULT_STRENGTH, BucketKey, ImageInputs, ModelPreset, PixelImage, Size

MAX_UPLOAD_BYTES = 32 * 2**20  # one file, before decoding
MAX_UPLOADS_BYTES = 64 * 2**20  # all of a request's files together
MAX_INPUT_SIDE = 4096
MAX_INPUT_PIXELS = 4096 * 4096  # read from the header; a larger image is refused before its pixels exist
MAX_IMAGES = 16  # any request, before the preset's own bound
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
    return image


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:120]


def _load(name: str, image) -> tuple[object, list[str]]:
    """The first frame's pixels, upright (EXIF orientation applied)."""
    from PIL import ImageOps

    notices = []
    if getattr(image, "is_animated", False):
        notices.append(f"{name} is animated ({image.format}); its first frame was used")
        image.seek(0)
    try:
        image.load()
        orientation = image.getexif().get(0x0112, 1)
        upright = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, EOFError, IndexError) as exc:  # truncated, damaged data
        raise InvalidRequest(f"{name} is truncated or damaged ({_reason(exc)}); upload the whole file") from None
    if orientation not in (1, None) and upright is not None:
        notices.append(f"{name} was rotated upright as its EXIF orientation ({orientation}) says")
        image = upright
    return image, notices


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
    image, notices = _load(name, image)
    if index is None and convention is MaskConvention.ALPHA:  # its transparency is what it says
        return masks.alpha_mask(image), tuple(notices)
    image, converted = _to_rgb(name, image, (0, 0, 0) if index is None else (255, 255, 255))
    if index is None:
        image = image.convert("L")
    return image, tuple(notices + converted)


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
    """A request's uploads decoded (PIL, at their own sizes), before the output size is known."""

    images: tuple = ()
    mask: object = None
    notices: tuple[str, ...] = ()

    @property
    def source_size(self) -> Size | None:
        """The first image's size: an edit's output follows it when the request names no size."""
        return Size(*self.images[0].size) if self.images else None


def decode_inputs(preset: ModelPreset, images, mask, strength,
                  mask_convention: MaskConvention = MaskConvention.LUMINANCE) -> Decoded:
    """Every upload of a request decoded and checked against its preset (see `check_count`); the mask, read by
    the door's `mask_convention`, must match the source's size."""
    images = tuple(images or ())
    check_count(preset, images, mask, strength)
    decoded, notices = [], []
    for index, data in enumerate(images):
        image, said = decode(data, index)
        decoded.append(image)
        notices += said
    mask_image = None
    if mask is not None:
        mask_image, said = decode(mask, None, mask_convention)
        notices += said
        if mask_image.size != decoded[0].size:
            raise InvalidRequest(f"mask is {Size(*mask_image.size)} but image 1 is {Size(*decoded[0].size)}; draw the "
                                 "mask at the source image's size")
        notices += masks.coverage_notices(mask_image, mask_convention, strength)
    return Decoded(tuple(decoded), mask_image, tuple(notices))


def fit_inputs(preset: ModelPreset, decoded: Decoded, size: Size, strength) -> CheckedImages:
    """The decoded images at the bucket's reference size (`size`, the output's), as the worker takes them."""
    from PIL import Image

    notices = list(decoded.notices)
    fitted = []
    for index, image in enumerate(decoded.images):
        if image.size != (size.width, size.height):
            notices.append(f"{_field_name(index)} ({Size(*image.size)}) resized to {size} ({RESAMPLE}, as the "
                           "pipeline's image processor resizes; aspect not kept)")
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
