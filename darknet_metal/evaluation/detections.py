"""The plain data the evaluation reads: truths and detections per image, checked.

Forms (all coordinates normalised to the image: 0..1 of its width and height):

- truths of one image: a (k, 5) array of rows ``class, cx, cy, w, h`` (a YOLO label file's
  rows; k may be 0);
- detections of one image: a (m, 6) array of rows ``cx, cy, w, h, class, probability``
  (m may be 0), or a list of :class:`darknet_metal.Detection` (pixel boxes, converted with
  :func:`detections_to_array` and the image's size);
- image sizes: one ``(width, height)`` in pixels per image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from darknet_metal.arguments import is_integer
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.inference.boxes import Detection

__all__ = [
    "DETECTION_COLUMNS",
    "TRUTH_COLUMNS",
    "check_detections",
    "check_image_sizes",
    "check_truths",
    "detections_to_array",
]

#: Columns of a truths array.
TRUTH_COLUMNS: tuple[str, ...] = ("class", "cx", "cy", "w", "h")
#: Columns of a detections array.
DETECTION_COLUMNS: tuple[str, ...] = ("cx", "cy", "w", "h", "class", "probability")


def detections_to_array(detections: Sequence[Detection], width: int, height: int) -> np.ndarray:
    """``Detection``s of one image (pixel boxes) as a (m, 6) float32 detections array.

    ``width``, ``height``: the image's size in pixels. The centre and size are recovered from
    ``left``/``top``/``width``/``height`` in float64 (within a float32 rounding of the
    normalised box the decoder computed); the probability is ``confidence``.
    """
    if not is_integer(width) or not is_integer(height) or width < 1 or height < 1:
        raise ArgumentError(f"image size must be two positive integers, not {(width, height)!r}")
    out = np.empty((len(detections), 6), dtype=np.float64)
    for row, det in enumerate(detections):
        if not isinstance(det, Detection):
            raise ArgumentTypeError(
                f"detections[{row}] must be a darknet_metal.Detection, not {type(det).__name__}"
            )
        out[row] = (
            (det.left + det.width / 2.0) / width,
            (det.top + det.height / 2.0) / height,
            det.width / width,
            det.height / height,
            det.class_id,
            det.confidence,
        )
    return out.astype(np.float32)


def _as_rows(value: Any, columns: int, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ArgumentTypeError(f"{what} must be an array of numbers, not "
                                f"{type(value).__name__} ({exc})") from None
    if arr.size == 0 and not (arr.ndim == 2 and arr.shape[1] != columns):
        return np.zeros((0, columns), dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != columns:
        raise ArgumentError(f"{what} must have shape (n, {columns}), not {arr.shape}")
    return arr


def _check_finite(arr: np.ndarray, what: str, names: tuple[str, ...]) -> None:
    bad = np.argwhere(~np.isfinite(arr))
    if len(bad):
        row, col = (int(i) for i in bad[0])
        raise ArgumentError(f"{what} row {row + 1}: {names[col]} is {float(arr[row, col])!r}; "
                            "expected a finite number")


def _check_classes(ids: np.ndarray, classes: int, what: str) -> np.ndarray:
    bad = np.flatnonzero((ids != np.round(ids)) | (ids < 0) | (ids >= classes))
    if len(bad):
        row = int(bad[0])
        raise ArgumentError(f"{what} row {row + 1}: class {float(ids[row]):g} is not an integer in "
                            f"0..{classes - 1}")
    return ids.astype(np.int64)


def check_truths(truths: Sequence[Any], classes: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Checked truths: per image (class ids (k,) int64, boxes (k, 4) float32 cx, cy, w, h).

    Raises ``ArgumentError`` naming the image (0-based index), the row (1-based, as the
    label file's line) and the value: a class outside 0..classes-1 or not an integer, a
    non-finite number, a negative width or height.
    """
    if isinstance(truths, np.ndarray) or not isinstance(truths, Sequence):
        raise ArgumentTypeError("truths must be a sequence with one (k, 5) array per image, "
                                f"not {type(truths).__name__}")
    out = []
    for i, value in enumerate(truths):
        what = f"truths of image {i}"
        arr = _as_rows(value, 5, what)
        _check_finite(arr, what, TRUTH_COLUMNS)
        ids = _check_classes(arr[:, 0], classes, what)
        negative = np.argwhere(arr[:, 3:5] < 0)
        if len(negative):
            row, col = (int(j) for j in negative[0])
            raise ArgumentError(f"{what} row {row + 1}: {TRUTH_COLUMNS[col + 3]} is "
                                f"{float(arr[row, col + 3])!r}; expected >= 0")
        out.append((ids, np.ascontiguousarray(arr[:, 1:5], dtype=np.float32)))
    return out


def check_detections(
    detections: Sequence[Any],
    classes: int,
    image_sizes: Sequence[tuple[int, int]] | None,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Checked detections: per image (boxes (m, 4) float32 cx, cy, w, h; class ids (m,)
    int64; probabilities (m,) float32), rows with probability 0 dropped (Darknet's map skips
    them).

    Each image's detections are a (m, 6) array or a list of ``Detection`` (which needs
    ``image_sizes``). Raises ``ArgumentError`` naming the image, row (1-based) and value: a
    class outside 0..classes-1, a probability outside [0, 1], a non-finite number, a
    negative width or height.
    """
    if isinstance(detections, np.ndarray) or not isinstance(detections, Sequence):
        raise ArgumentTypeError("detections must be a sequence with one entry per image, "
                                f"not {type(detections).__name__}")
    out = []
    for i, value in enumerate(detections):
        what = f"detections of image {i}"
        if isinstance(value, Sequence) and len(value) and isinstance(value[0], Detection):
            if image_sizes is None:
                raise ArgumentError(f"{what} are Detection objects (pixel boxes): pass "
                                    "image_sizes to normalise them")
            value = detections_to_array(value, *image_sizes[i])
        arr = _as_rows(value, 6, what)
        _check_finite(arr, what, DETECTION_COLUMNS)
        ids = _check_classes(arr[:, 4], classes, what)
        prob = arr[:, 5]
        bad = np.flatnonzero((prob < 0) | (prob > 1))
        if len(bad):
            row = int(bad[0])
            raise ArgumentError(f"{what} row {row + 1}: probability {float(prob[row])!r} is "
                                "outside [0, 1]")
        negative = np.argwhere(arr[:, 2:4] < 0)
        if len(negative):
            row, col = (int(j) for j in negative[0])
            raise ArgumentError(f"{what} row {row + 1}: {DETECTION_COLUMNS[col + 2]} is "
                                f"{float(arr[row, col + 2])!r}; expected >= 0")
        keep = prob > 0
        out.append((np.ascontiguousarray(arr[keep, :4], dtype=np.float32), ids[keep],
                    prob[keep].astype(np.float32)))
    return out


def check_image_sizes(image_sizes: Sequence[Any] | None, images: int) -> list[tuple[int, int]]:
    """``image_sizes`` as one (width, height) pair of positive integers per image."""
    if image_sizes is None:
        raise ArgumentError("image_sizes is required here")
    if isinstance(image_sizes, str | bytes) or not hasattr(image_sizes, "__len__"):
        raise ArgumentTypeError("image_sizes must be a sequence of (width, height) pairs, not "
                                f"{type(image_sizes).__name__}")
    if len(image_sizes) != images:
        raise ArgumentError(f"image_sizes has {len(image_sizes)} entries for {images} images")
    out = []
    for i, size in enumerate(image_sizes):
        try:
            w, h = size
        except (TypeError, ValueError):
            raise ArgumentError(f"image_sizes[{i}] must be (width, height), not "
                                f"{size!r}") from None
        ok = all(is_integer(v) or (isinstance(v, float) and math.isfinite(v) and v == int(v))
                 for v in (w, h))
        if not ok or w < 1 or h < 1:
            raise ArgumentError(f"image_sizes[{i}] must be two positive integers (pixels), "
                                f"not {size!r}")
        out.append((int(w), int(h)))
    return out
