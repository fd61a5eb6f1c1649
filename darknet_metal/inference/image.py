"""Loading and resizing images exactly as Darknet prepares a network input.

Images are float32 arrays of shape (3, H, W): planar RGB, values in [0, 1], Darknet's own
layout. Darknet V5 decodes files with OpenCV's ``imread`` (8-bit, 3 channels, EXIF
orientation applied, alpha dropped without compositing) and scales bytes by 1/255; this
module decodes with Pillow and reproduces those conversions. Resizing reproduces Darknet's
two-pass bilinear ``resize_image`` bit for bit in float32, including its quirk on the last
output row (see :func:`resize_image`).
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, ImageOps

from darknet_metal.cpu.image_resize import resize_bilinear
from darknet_metal.errors import ArgumentError, ImageError, ImageTooLargeError
from darknet_metal.image_errors import decode_failure

__all__ = [
    "check_image_header",
    "decode_image",
    "letterbox_geometry",
    "letterbox_image",
    "load_image",
    "prepare_input",
    "preprocess",
    "resize_image",
]

# OpenCV converts bytes with a float32 multiply by the rounded reciprocal of 255, not a
# division; the two differ by one ulp for some byte values.
_INV_255 = np.float32(1.0 / 255.0)

# Pillow modes holding more than 8 bits per sample: OpenCV keeps the high byte.
_WIDE_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})


def check_image_header(path: str | os.PathLike[str]) -> None:
    """Raises ImageError naming ``path`` when Pillow cannot tell what image format the file
    is. Only the header is read (no pixels): cheap enough to run over every input before a
    model is loaded, so that a file that is not an image is reported at once. A file whose
    pixels are corrupt passes, and fails when it is decoded."""
    name = os.fspath(path)
    try:
        with Image.open(name) as im:
            _ = im.size
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise ImageError(f"{name}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # Pillow raises many types for a corrupt header
        raise ImageError(f"{name}: cannot decode image ({decode_failure(exc)})") from None


def load_image(source: str | os.PathLike[str] | np.ndarray) -> np.ndarray:
    """Load an image as Darknet's network sees it before resizing.

    ``source`` is a path to any image file Pillow decodes, or an array:

    - (H, W, 3) uint8 RGB;
    - (H, W) or (H, W, 1) uint8 gray, repeated into the three channels (as a gray file);
    - (H, W, 4) uint8 RGBA, the alpha channel dropped (as a file with alpha).

    Files are converted the way OpenCV's ``imread`` does for Darknet: EXIF orientation is
    applied, gray is repeated into RGB, alpha is dropped (colours are not composited), and
    16-bit samples keep their high byte.

    Alpha is ignored, as Darknet does: a transparent pixel (alpha 0, or a palette or colour
    key marked transparent) is read as the colour stored under it, exactly as an opaque one,
    and is not blended with any background. A fully transparent PNG is thus seen as the
    picture its colour channels hold, often black. ``darknet-metal detect`` prints a warning
    for an image with transparent pixels.

    Returns a float32 C-contiguous array of shape (3, H, W), RGB, values in [0, 1].
    Raises ImageError (naming the path, or the array's shape and dtype) for a missing,
    unreadable, truncated or undecodable file, an empty image, or an unsupported array.
    """
    if isinstance(source, np.ndarray):
        rgb = _rgb_from_array(source)
    elif isinstance(source, str | os.PathLike):
        rgb = _rgb_from_file(source)
    else:
        raise ImageError(
            f"cannot load an image from a {type(source).__name__}: "
            "pass a file path or a uint8 array of shape (H, W, 3)"
        )
    return _planar_unit_float(rgb)


def _rgb_from_array(array: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 RGB view or copy of a user array; ImageError if unsupported."""
    what = f"image array of shape {array.shape} and dtype {array.dtype}"
    if array.dtype != np.uint8:
        raise ImageError(f"{what}: expected dtype uint8 (values 0..255)")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise ImageError(f"{what}: expected (H, W, 3) RGB, (H, W) gray or (H, W, 4) RGBA")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"{what}: the image is empty")
    if array.shape[2] == 1:
        return np.repeat(array, 3, axis=2)
    return array[:, :, :3]


def _rgb_from_file(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode a file into (H, W, 3) uint8 RGB; ImageError naming the path on any failure."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise ImageError(f"{name}: image file not found")
    if os.path.isdir(name):
        raise ImageError(f"{name}: is a directory, not an image file")
    return _decode(name, name)


def decode_image(data: bytes, what: str = "image", max_pixels: int | None = None) -> np.ndarray:
    """An encoded image (``data``: the bytes of a JPEG, PNG or any file Pillow reads) as
    (H, W, 3) uint8 RGB, converted as ``load_image`` converts files. ``what`` names the image
    in errors. Raises ``ImageError``, or ``ImageTooLargeError`` when it has more than
    ``max_pixels`` pixels (found from its header, before decoding)."""
    return _decode(io.BytesIO(data), what, max_pixels)


def _decode(source: str | io.BytesIO, name: str, max_pixels: int | None = None) -> np.ndarray:
    """Decode into (H, W, 3) uint8 RGB; ImageError naming ``name`` on any failure."""
    try:
        with Image.open(source) as im:
            if max_pixels is not None and im.width * im.height > max_pixels:
                raise ImageTooLargeError(f"{name}: {im.width}x{im.height} is more than "
                                         f"{max_pixels} pixels")
            im.load()
            im = ImageOps.exif_transpose(im)
            rgb = _pillow_to_rgb(im)
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{name}: image too large to decode safely ({exc})") from exc
    except Exception as exc:  # Pillow raises many types for corrupt data; all mean "unreadable"
        raise ImageError(f"{name}: cannot decode image ({decode_failure(exc)})") from exc
    if rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise ImageError(f"{name}: the image is empty ({rgb.shape[1]}x{rgb.shape[0]})")
    return rgb


def _pillow_to_rgb(im: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8 RGB from a decoded Pillow image, following imread's 8-bit rules."""
    if im.mode == "F":
        raise ImageError("32-bit floating-point images are not supported")
    if im.mode in _WIDE_MODES:
        # Pillow's own conversion clips 16-bit gray at 255; imread keeps the high byte.
        wide = np.asarray(im).astype(np.int64)
        gray = (wide >> 8).clip(0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.asarray(im, dtype=np.uint8)


def _planar_unit_float(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 -> (3, H, W) float32 in [0, 1], scaled as Darknet V5 scales bytes."""
    planar = np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32)
    planar *= _INV_255
    return planar


def _check_chw(img: np.ndarray, who: str) -> None:
    if not isinstance(img, np.ndarray) or img.ndim != 3 or img.shape[0] < 1:
        shape = getattr(img, "shape", None)
        raise ImageError(f"{who}: expected a (C, H, W) float array, got shape {shape}")
    if img.shape[1] < 1 or img.shape[2] < 1:
        raise ImageError(f"{who}: the image is empty (shape {img.shape})")


def _check_size(width: int, height: int, who: str) -> None:
    for value in (width, height):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ArgumentError(
                f"{who}: target size must be positive integers, got {width}x{height}"
            )


def resize_image(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """Darknet's ``resize_image``: bilinear, two passes, float32, bit-exact.

    ``img`` is (C, H, W) float; returns float32 (C, height, width).

    The first pass resizes rows to ``width``: output column c samples source
    x = c * (W-1)/(width-1) (float32, truncated to ix with fraction dx) as
    ``(1-dx) * p[ix] + dx * p[ix+1]``; the last column copies the last source column. The
    second pass resizes columns to ``height`` the same way, except that Darknet's last
    output row keeps only the ``(1-dy) * row[iy]`` term: when float rounding puts its
    source position just below H - 1, that row comes out darkened, and so it does here.

    Darknet's reference build (the one that produced the golden outputs) compiles both
    interpolations into fused multiply-adds: ``fma(1-dx, p[ix], dx * p[ix+1])`` and
    ``fma(dy, row[iy+1], (1-dy) * row[iy])``. This function does the same, which makes it
    bit-identical to those outputs; a Darknet build without FMA differs by 1 ulp here and
    there. Same size in and out returns a float32 copy. The loops are C
    (``cpu/image_resize.pyx``) and release the GIL.
    """
    _check_chw(img, "resize_image")
    _check_size(width, height, "resize_image")
    src = np.ascontiguousarray(img, dtype=np.float32)
    if src.shape[1:] == (height, width):
        return src.copy()
    return resize_bilinear(src, width, height)


def letterbox_geometry(
    image_w: int, image_h: int, net_w: int, net_h: int
) -> tuple[int, int, int, int]:
    """Darknet's letterbox placement: (new_w, new_h, dx, dy) in network pixels.

    The image is resized to new_w x new_h (aspect kept, integer-truncated) and placed at
    column dx, row dy of the net_w x net_h canvas. The ratio test is done in float32 as in
    Darknet; the box decoder uses the same new_w/new_h to undo it.
    """
    if np.float32(net_w) / np.float32(image_w) < np.float32(net_h) / np.float32(image_h):
        new_w = net_w
        new_h = (image_h * net_w) // image_w
    else:
        new_h = net_h
        new_w = (image_w * net_h) // image_h
    return new_w, new_h, (net_w - new_w) // 2, (net_h - new_h) // 2


def letterbox_image(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """Darknet's ``letterbox_image``: resize keeping aspect, centred on a 0.5 canvas.

    ``img`` is (C, H, W) float; returns float32 (C, height, width). See
    :func:`letterbox_geometry` for the rounding of the resized size and offsets.
    """
    _check_chw(img, "letterbox_image")
    _check_size(width, height, "letterbox_image")
    channels, src_h, src_w = img.shape
    new_w, new_h, dx, dy = letterbox_geometry(src_w, src_h, width, height)
    if new_w < 1 or new_h < 1:
        raise ImageError(
            f"letterbox_image: a {src_w}x{src_h} image letterboxed into {width}x{height} "
            f"would be {new_w}x{new_h} pixels"
        )
    resized = resize_image(img, new_w, new_h)
    boxed = np.full((channels, height, width), 0.5, dtype=np.float32)
    boxed[:, dy : dy + new_h, dx : dx + new_w] = resized
    return boxed


def prepare_input(img: np.ndarray, width: int, height: int, letterbox: bool) -> np.ndarray:
    """The network input for one image: (C, H, W) float -> float32 (C, height, width).

    ``letterbox`` selects :func:`letterbox_image` (cfg ``letter_box=1`` or ``-letter_box``)
    instead of the plain stretch of :func:`resize_image` that ``darknet detector test`` uses
    by default.
    """
    if letterbox:
        return letterbox_image(img, width, height)
    return resize_image(img, width, height)


def preprocess(source: str | os.PathLike[str] | np.ndarray, size: int | tuple[int, int], *,
               letterbox: bool = False) -> np.ndarray:
    """The input tensor ``detect`` builds for one image: (3, height, width) float32, planar
    RGB in [0, 1], bit for bit.

    ``source``: a path, or an (H, W, 3) uint8 RGB array (see :func:`load_image`). ``size``:
    the network input, ``(width, height)`` in pixels or one int for a square. ``letterbox``:
    keep the aspect on a grey canvas, as a cfg with ``letter_box=1`` does (an exported
    model's ``darknet_metal.postprocess`` metadata says which); otherwise Darknet's bilinear
    stretch. Stack the results along a new first axis for a batch.

    Raises ``ImageError`` naming an unreadable image, ``ArgumentError`` for a bad size.
    """
    if isinstance(size, int | np.integer) and not isinstance(size, bool):
        width = height = int(size)
    elif isinstance(size, tuple | list) and len(size) == 2:
        width, height = size
    else:
        raise ArgumentError(f"size must be an int or a (width, height) pair, not {size!r}")
    _check_size(width, height, "preprocess")
    return prepare_input(load_image(source), int(width), int(height), bool(letterbox))
