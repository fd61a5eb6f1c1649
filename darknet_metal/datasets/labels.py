"""YOLO label files (``class cx cy w h`` per line, normalised) and names files.

Darknet V5 reads a label file with ``fscanf("%d %f %f %f %f")`` until a read fails
(``read_boxes`` in ``src-lib/data.cpp``): the first malformed line silently ends the file, an
extra column is read as the next line's class, ``1.0`` as a class reads ``1`` and then
``.0`` as cx. Coordinates are clamped to [0, 1] and a box of zero or negative size is a
fatal error. Here each line is checked on its own and every fault is reported:

==========================================  ===========================================
line                                        here
==========================================  ===========================================
blank (or only spaces/tabs)                 skipped (Darknet's fscanf skips it too)
fewer or more than 5 values                 error (Darknet misreads the rest of the file)
class not an integer (``1.0``, ``a``)       error
class < 0 or >= classes                     error (Darknet: fatal)
value not a number, NaN or infinite         error
width or height <= 0                        error (Darknet: fatal)
box beyond the image by more than 1e-6      error, saying by how much (Darknet clamps it
                                            silently)
the same box twice                          warning
box narrower or lower than one image pixel  warning (needs the image size)
==========================================  ===========================================

A missing label file means "no objects" (a warning in ``check-data``), as in the Darknet
releases before V5 (V5 stops with a fatal error).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Protocol

import numpy as np

from darknet_metal.datasets.problems import Problems, raise_first_error
from darknet_metal.datasets.textfile import read_lines, split_lines
from darknet_metal.errors import DatasetError

__all__ = ["EDGE_TOLERANCE", "parse_labels", "read_boxes", "read_names"]

#: How far (normalised) a box edge may lie outside [0, 1] before it is an error: rounding
#: in tools that write labels with six decimals.
EDGE_TOLERANCE = 1e-6

_INTEGER = re.compile(r"[+-]?[0-9]+")
_FIELDS = ("cx", "cy", "width", "height")


class _HasLabels(Protocol):
    labels: Path


def parse_labels(
    data: bytes,
    path: str | os.PathLike[str],
    problems: Problems,
    *,
    classes: int | None = None,
    image_size: tuple[int, int] | None = None,
) -> np.ndarray:
    """The boxes of a label file's content ``data``; each fault is added to ``problems``
    at ``path`` and its line, and the line left out.

    ``classes``: class ids must be below it (None: not checked). ``image_size``: (width,
    height) in pixels, to report sizes in pixels and warn about boxes under one pixel.
    Returns (k, 5) float32 rows (class, cx, cy, w, h), in file order.
    """
    rows: list[tuple[float, float, float, float, float]] = []
    seen: dict[tuple[str, ...], int] = {}
    for number, text in split_lines(data):
        tokens = text.split()
        if not tokens:
            continue
        row = _parse_row(tokens, path, number, problems, classes, image_size)
        if row is None:
            continue
        key = tuple(tokens)
        if key in seen:
            problems.warning(path, number, f"the same box as line {seen[key]}")
        else:
            seen[key] = number
        rows.append(row)
    if not rows:
        return np.zeros((0, 5), np.float32)
    return np.asarray(rows, dtype=np.float32)


def _parse_row(
    tokens: list[str],
    path: str | os.PathLike[str],
    number: int,
    problems: Problems,
    classes: int | None,
    image_size: tuple[int, int] | None,
) -> tuple[float, float, float, float, float] | None:
    if len(tokens) != 5:
        extra = " (Darknet would read the extra values as the next box)" if len(tokens) > 5 else ""
        problems.error(
            path, number, f"{len(tokens)} values, expected 5 (class cx cy w h){extra}: "
            f"'{' '.join(tokens)}'"
        )
        return None
    class_text = tokens[0]
    if not _INTEGER.fullmatch(class_text):
        problems.error(path, number, f"class id '{class_text}' is not an integer")
        return None
    class_id = int(class_text)
    if class_id < 0:
        problems.error(path, number, f"class id {class_id} is negative")
        return None
    if classes is not None and class_id >= classes:
        problems.error(
            path, number, f"class id {class_id} is out of range: the dataset has {classes} "
            f"class{'es' if classes != 1 else ''} (ids 0..{classes - 1})"
        )
        return None
    values = []
    for field, text in zip(_FIELDS, tokens[1:], strict=True):
        try:
            value = float(text)
        except ValueError:
            problems.error(path, number, f"{field} '{text}' is not a number")
            return None
        if not math.isfinite(value):
            problems.error(path, number, f"{field} is {text}: must be a finite number")
            return None
        values.append(value)
    cx, cy, w, h = values
    if w <= 0 or h <= 0:
        sizes = [f"{name} is {v:g}" for name, v in (("width", w), ("height", h)) if v <= 0]
        problems.error(path, number, f"{' and '.join(sizes)}: a box must have a size > 0")
        return None
    beyond = _beyond_image(cx, cy, w, h, image_size)
    if beyond:
        problems.error(
            path, number, f"box outside the image by {', '.join(beyond)} "
            f"(cx={cx:g} cy={cy:g} w={w:g} h={h:g})"
        )
        return None
    if image_size is not None:
        width_px, height_px = w * image_size[0], h * image_size[1]
        if width_px < 1 or height_px < 1:
            problems.warning(
                path, number, f"box smaller than one pixel: {width_px:.2g} x {height_px:.2g} "
                f"px in a {image_size[0]}x{image_size[1]} image"
            )
    return (float(class_id), cx, cy, w, h)


def _beyond_image(
    cx: float, cy: float, w: float, h: float, image_size: tuple[int, int] | None
) -> list[str]:
    """How far each edge of the box lies outside [0, 1], beyond the tolerance."""
    edges = (
        ("on the left", -(cx - w / 2), 0),
        ("on the right", cx + w / 2 - 1, 0),
        ("at the top", -(cy - h / 2), 1),
        ("at the bottom", cy + h / 2 - 1, 1),
    )
    out = []
    for side, amount, axis in edges:
        if amount > EDGE_TOLERANCE:
            text = f"{amount:.6g}"
            if image_size is not None:
                text += f" ({amount * image_size[axis]:.1f} px)"
            out.append(f"{text} {side}")
    return out


def read_boxes(
    sample: _HasLabels | str | os.PathLike[str], classes: int | None = None
) -> np.ndarray:
    """The boxes of a sample's label file (a ``Sample`` or the label file's path).

    Returns (k, 5) float32 rows (class, cx, cy, w, h), normalised to the image, in file order;
    (0, 5) when the label file does not exist (an image without objects, as Darknet before
    V5 reads it). Reads only the text file, never the image. Raises ``DatasetError`` at the
    file and line of the first fault (see the module's table); class ids are checked against
    ``classes`` when given.
    """
    path = Path(sample.labels if hasattr(sample, "labels") else sample)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return np.zeros((0, 5), np.float32)
    except IsADirectoryError:
        raise DatasetError("is a folder, not a label file", path=path) from None
    except OSError as exc:
        raise DatasetError(f"cannot read label file: {exc.strerror or exc}", path=path) from None
    problems = Problems()
    boxes = parse_labels(data, path, problems, classes=classes)
    raise_first_error(problems)
    return boxes


def read_names(path: str | os.PathLike[str], problems: Problems) -> list[str]:
    """The class names of a names file, one a line, spaces trimmed (Darknet V5's
    ``load_names``). Blank lines at the end are dropped; a blank line before a name is a
    class with an empty name, as in Darknet, and a warning. ``DatasetError`` when the file
    cannot be read."""
    lines = read_lines(path, "names file")
    names = [text.strip() for _, text in lines]
    while names and not names[-1]:
        names.pop()
    for (number, _), name in zip(lines, names, strict=False):
        if not name:
            problems.warning(path, number, "blank line: counts as a class with an empty name")
    return names
