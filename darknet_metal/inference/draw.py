"""Drawing detections on an image and writing image files atomically.

Boxes use Darknet's per-class colours and line width (``draw_detections_v3``); labels read
``"name confidence%"`` in Pillow's scalable default font, sized with the image height (see
:func:`label_font_size`), on a box of the class colour.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from darknet_metal.errors import ArgumentError, ImageError
from darknet_metal.files import atomic_write
from darknet_metal.inference.boxes import Detection

__all__ = ["class_color", "draw_detections", "label_font_size", "save_image_atomic"]

# Darknet's colour ramp: magenta, blue, cyan, green, yellow, red.
_RAMP = (
    (1.0, 0.0, 1.0),
    (0.0, 0.0, 1.0),
    (0.0, 1.0, 1.0),
    (0.0, 1.0, 0.0),
    (1.0, 1.0, 0.0),
    (1.0, 0.0, 0.0),
)


def _ramp(channel: int, x: int, top: int) -> float:
    ratio = x / top * 5.0
    i = math.floor(ratio)
    j = math.ceil(ratio)
    ratio -= i
    return (1.0 - ratio) * _RAMP[i][channel] + ratio * _RAMP[j][channel]


def class_color(class_id: int, num_classes: int = 80) -> tuple[int, int, int]:
    """Darknet's box colour for a class: (r, g, b) bytes.

    Darknet spreads classes over its colour ramp with ``offset = class_id * 123457 %
    num_classes`` and takes red, green and blue from ramp channels 2, 1 and 0.
    """
    if num_classes < 1:
        raise ArgumentError(f"num_classes must be >= 1, got {num_classes}")
    offset = class_id * 123457 % num_classes
    r, g, b = (int(round(_ramp(ch, offset, num_classes) * 255.0)) for ch in (2, 1, 0))
    return r, g, b


def label_font_size(height: int) -> int:
    """Font size in pixels (the em height) of the labels on an image ``height`` pixels tall:
    ``max(10, round(0.03 * height))``.

    Darknet scales its labels with the image height as it does the box lines: its OpenCV
    drawing uses a font scale of ``rows / 1000`` on a label band ``3 + 18 * rows / 1000``
    pixels tall. A fixed size would leave a label on a 4000-pixel photo ~0.3% of the
    height, unreadable once the photo is shown scaled down to a screen. An em of 3% of the
    height (a label band of about 3.5% with descenders and padding) looks the same on a
    screen-sized view whatever the image size and stays legible there; it is about twice
    Darknet's band, whose thin Hershey glyphs fill it less. 10 pixels, the size of Pillow's
    bitmap default font, is the floor so small images keep readable text.
    """
    return max(10, round(0.03 * height))


def _label_text(dets: list[Detection]) -> str:
    return ", ".join(f"{d.name} {d.confidence * 100.0:.0f}%" for d in dets)


def _group_by_box(detections: Iterable[Detection]) -> list[list[Detection]]:
    """Detections of one box (one per class above the threshold), most confident first;
    groups ordered by their best confidence, lowest first so the best is drawn on top."""
    groups: dict[tuple[float, float, float, float], list[Detection]] = {}
    for det in detections:
        groups.setdefault((det.left, det.top, det.width, det.height), []).append(det)
    ordered = [sorted(g, key=lambda d: -d.confidence) for g in groups.values()]
    return sorted(ordered, key=lambda g: g[0].confidence)


def draw_detections(
    image: np.ndarray, detections: Iterable[Detection], *, num_classes: int = 80
) -> Image.Image:
    """Draw boxes and labels on a copy of ``image``.

    ``image`` is (H, W, 3) uint8 RGB; ``detections`` carry pixel boxes of that image.
    Each box is drawn as Darknet does: corners truncated to integers and clipped to the
    image, line width max(1, int(0.002 * H)) pixels growing inwards, colour
    :func:`class_color` (``num_classes`` is the model's class count, which sets the
    colours). A box found for several classes is drawn once, in the colour of its most
    confident class, labelled ``"name confidence%, name confidence%"`` in text
    :func:`label_font_size` pixels tall (growing with H as the lines do). The label sits just
    above the box, or just inside its top edge when there is no room above. Higher
    confidences are drawn last, on top.
    Returns a new RGB ``PIL.Image.Image``; ``image`` is not modified.
    """
    if (
        not isinstance(image, np.ndarray)
        or image.dtype != np.uint8
        or image.ndim != 3
        or image.shape[2] != 3
    ):
        shape = getattr(image, "shape", None)
        dtype = getattr(image, "dtype", type(image).__name__)
        raise ImageError(
            f"draw_detections needs an (H, W, 3) uint8 RGB image, got shape {shape} "
            f"and dtype {dtype}"
        )
    height, width = image.shape[:2]
    if height == 0 or width == 0:
        raise ImageError(f"draw_detections: the image is empty (shape {image.shape})")
    canvas = Image.fromarray(np.ascontiguousarray(image))
    draw = ImageDraw.Draw(canvas)
    font_size = label_font_size(height)
    font = ImageFont.load_default(size=font_size)  # scalable with FreeType (Pillow >= 10.1)
    pad = max(2, font_size // 10)
    line = max(1, int(height * 0.002))

    for group in _group_by_box(detections):
        det = group[0]
        left = max(0, min(width - 1, int(det.left)))
        right = max(0, min(width - 1, int(det.left + det.width)))
        top = max(0, min(height - 1, int(det.top)))
        bottom = max(0, min(height - 1, int(det.top + det.height)))
        if right < left or bottom < top:
            continue
        color = class_color(det.class_id, num_classes)
        draw.rectangle((left, top, right, bottom), outline=color, width=line)

        text = _label_text(group)
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
        label_w, label_h = x1 - x0 + 2 * pad, y1 - y0 + 2 * pad
        label_top = top - label_h if top - label_h >= 0 else top + line
        draw.rectangle((left, label_top, left + label_w - 1, label_top + label_h - 1), fill=color)
        ink = (0, 0, 0) if sum(color) > 382 else (255, 255, 255)
        draw.text((left + pad - x0, label_top + pad - y0), text, fill=ink, font=font)
    return canvas


def _format_for(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    fmt = Image.registered_extensions().get(ext)
    if fmt is None or fmt not in Image.SAVE:
        raise ImageError(
            f"{path}: cannot tell the image format from the extension {ext!r} "
            "(use .jpg, .png, .bmp, ...)"
        )
    return fmt


def save_image_atomic(img: Image.Image, path: str | os.PathLike[str]) -> None:
    """Write ``img`` to ``path`` atomically, in the format named by the extension.

    The image is written to a temporary file in the same directory, flushed to disk, then
    renamed over ``path``: readers see the old file or the complete new one, never a
    partial file, and an existing file is replaced. Raises ImageError naming the path when
    the extension names no writable format, the directory does not exist or is not
    writable, or encoding fails; no temporary file is left behind.
    """
    if not isinstance(img, Image.Image):
        raise ImageError(f"save_image_atomic needs a PIL image, got {type(img).__name__}")
    target = os.fspath(path)
    fmt = _format_for(target)
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ImageError(f"{target}: directory {directory} does not exist")
    if os.path.isdir(target):
        raise ImageError(f"{target}: is a directory")
    if fmt == "JPEG" and img.mode not in ("RGB", "L", "CMYK"):
        img = img.convert("RGB")

    try:
        atomic_write(target, lambda f: img.save(f, format=fmt))
    except Exception as exc:
        raise ImageError(f"{target}: cannot write image ({type(exc).__name__}: {exc})") from exc
