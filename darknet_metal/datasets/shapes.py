"""A seeded demo dataset of coloured shapes: ``darknet-metal make-shapes``.

Each image has a background of muted colours (a gradient, stripes or a checkerboard, with
grey noise) and one to five flat, strongly coloured shapes: class 0 a circle, 1 a square,
2 an upright or upside-down triangle, of random colour and size, some overlapping (a later
shape covers at most a third of what is left of an earlier one). Labels are exact: a
shape's box is the bounding box of its visible pixels, so the box of a partly covered shape
is that of what is seen of it.

Colours are chosen so a pixel tells which it is: shapes have HSV saturation and value of at
least 0.7 (channel spread max - min >= 125), backgrounds saturation at most 0.2 (spread <= 51)
with the same noise added to every channel (which leaves the spread as it is).

Layout of OUT (every file written by ``files.atomic_write`` into a temporary folder beside
OUT, which is renamed to OUT at the end: a failure leaves no OUT):

- ``images/train_00000.jpg`` ... and ``images/valid_00000.jpg`` ... (JPEG quality 95, no
  chroma subsampling) with each image's labels beside it (``images/train_00000.txt``): the
  place Darknet V5's label rule looks;
- ``train.txt``, ``valid.txt``: the image lists; ``shapes.names``; ``backup/`` (empty);
- ``shapes.data``: ``classes``, ``train``, ``valid``, ``names``, ``backup``, with absolute
  paths (as are the lists'), so it works from any working directory, here and in Darknet.

Image ``i`` of a set is drawn from ``numpy.random.default_rng([seed, set, i])``: the same seed
gives the same pixels and the same bytes (for the same OUT: the absolute paths in the text
files name it).
"""

from __future__ import annotations

import colorsys
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.files import atomic_write

__all__ = ["SHAPE_NAMES", "make_shapes"]

#: Class names by class id.
SHAPE_NAMES = ("circle", "square", "triangle")

_MAX_OBJECTS = 5
_PLACEMENT_TRIES = 30
# A new shape may cover at most this fraction of an earlier shape's visible pixels.
_MAX_COVERED = 1 / 3
_SET_IDS = {"train": 0, "valid": 1}


@dataclass(frozen=True)
class _Shape:
    class_id: int
    mask: np.ndarray  # (H, W) bool: the pixels the shape covers
    colour: tuple[int, int, int]


def make_shapes(
    out: str | os.PathLike[str],
    *,
    train: int = 200,
    valid: int = 50,
    size: tuple[int, int] = (224, 224),
    seed: int = 0,
    classes: int = 3,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the shapes dataset into the folder ``out`` and return its ``.data`` file.

    ``train``, ``valid``: images per set (at least 1 each); ``size``: (width, height) in
    pixels, each 32..4096; ``seed``: 0 <= seed < 2**63; ``classes``: 1..3 (the first
    ``classes`` of circle, square, triangle). ``out`` must not exist, be empty, or ``force``
    be given (its old content is replaced only once the new one is complete); its parent
    folder must exist. ``progress(n)`` is called after every n images written.
    Raises ``ArgumentError`` for a bad argument; on any failure ``out`` is left as it was.
    """
    width, height = _check_arguments(train, valid, size, seed, classes)
    out = Path(os.path.abspath(out))
    if out.exists():
        if not out.is_dir():
            raise ArgumentError(f"{out}: exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ArgumentError(f"{out}: the folder is not empty (pass force=True / --force to "
                                "replace it)")
    if not out.parent.is_dir():
        raise ArgumentError(f"{out.parent}: the parent folder of the output does not exist")

    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    tmp.mkdir()
    try:
        _write_dataset(tmp, out, train, valid, width, height, seed, classes, progress)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "shapes.data"


def _check_arguments(
    train: int, valid: int, size: tuple[int, int], seed: int, classes: int
) -> tuple[int, int]:
    for name, value in (("train", train), ("valid", valid)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"{name}: expected a number of images >= 1, got {value!r}")
    if (
        not isinstance(size, tuple | list) or len(size) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in size)
        or not all(32 <= v <= 4096 for v in size)
    ):
        raise ArgumentError(f"size: expected (width, height) of 32..4096 pixels, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ArgumentError(f"seed: expected an integer in 0..2**63-1, got {seed!r}")
    if isinstance(classes, bool) or not isinstance(classes, int) or not 1 <= classes <= 3:
        raise ArgumentError(f"classes: expected 1, 2 or 3, got {classes!r}")
    return int(size[0]), int(size[1])


def _write_dataset(
    tmp: Path, out: Path, train: int, valid: int, width: int, height: int, seed: int,
    classes: int, progress: Callable[[int], None] | None,
) -> None:
    (tmp / "images").mkdir()
    (tmp / "backup").mkdir()
    for set_name, count in (("train", train), ("valid", valid)):
        listed = []
        for index in range(count):
            stem = f"{set_name}_{index:05d}"
            rng = np.random.default_rng([seed, _SET_IDS[set_name], index])
            pixels, labels = render_image(rng, width, height, classes)
            _write_jpeg(tmp / "images" / f"{stem}.jpg", pixels)
            _write_text(tmp / "images" / f"{stem}.txt", "".join(labels))
            listed.append(f"{out / 'images' / stem}.jpg\n")
            if progress is not None:
                progress(1)
        _write_text(tmp / f"{set_name}.txt", "".join(listed))
    _write_text(tmp / "shapes.names", "".join(f"{n}\n" for n in SHAPE_NAMES[:classes]))
    _write_text(
        tmp / "shapes.data",
        f"classes = {classes}\n"
        f"train = {out / 'train.txt'}\n"
        f"valid = {out / 'valid.txt'}\n"
        f"names = {out / 'shapes.names'}\n"
        f"backup = {out / 'backup'}\n",
    )


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is set aside first and removed only
    once the new folder is in place (put back if the rename fails)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.{secrets.token_hex(6)}.old"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def _write_jpeg(path: Path, pixels: np.ndarray) -> None:
    from PIL import Image

    image = Image.fromarray(pixels, "RGB")
    atomic_write(path, lambda f: image.save(f, format="JPEG", quality=95, subsampling=0))


def render_image(
    rng: np.random.Generator, width: int, height: int, classes: int
) -> tuple[np.ndarray, list[str]]:
    """One image: (H, W, 3) uint8 RGB pixels and its label lines (``class cx cy w h\\n``,
    normalised, six decimals), drawn from ``rng``."""
    pixels = _background(rng, width, height)
    shapes: list[_Shape] = []
    visible: list[np.ndarray] = []
    for _ in range(int(rng.integers(1, _MAX_OBJECTS + 1))):
        placed = _place_shape(rng, width, height, classes, visible)
        if placed is None:
            continue
        for v in visible:
            v &= ~placed.mask
        shapes.append(placed)
        visible.append(placed.mask.copy())
    labels = []
    for shape, seen in zip(shapes, visible, strict=True):
        pixels[shape.mask] = shape.colour
        rows = np.flatnonzero(seen.any(axis=1))
        cols = np.flatnonzero(seen.any(axis=0))
        left, right = cols[0], cols[-1] + 1
        top, bottom = rows[0], rows[-1] + 1
        labels.append(
            f"{shape.class_id} {(left + right) / 2 / width:.6f} {(top + bottom) / 2 / height:.6f} "
            f"{(right - left) / width:.6f} {(bottom - top) / height:.6f}\n"
        )
    return pixels, labels


def _place_shape(
    rng: np.random.Generator, width: int, height: int, classes: int, visible: list[np.ndarray]
) -> _Shape | None:
    """A shape that covers at most a third of any earlier shape's visible pixels, or None
    when none fits after a few tries."""
    for _ in range(_PLACEMENT_TRIES):
        class_id = int(rng.integers(0, classes))
        extent = rng.uniform(0.12, 0.45) * min(width, height)
        mask = _shape_mask(rng, class_id, extent, width, height)
        if not mask.any():
            continue
        if all(
            np.count_nonzero(v & mask) <= _MAX_COVERED * np.count_nonzero(v) for v in visible
        ):
            return _Shape(class_id, mask, _shape_colour(rng))
    return None


def _shape_mask(
    rng: np.random.Generator, class_id: int, extent: float, width: int, height: int
) -> np.ndarray:
    """The pixels whose centres lie inside a shape of class ``class_id`` about ``extent``
    pixels across, placed at random wholly inside the image."""
    half_w = extent / 2
    half_h = extent / 2 if class_id != 2 else extent * rng.uniform(0.35, 0.5)
    cx = rng.uniform(half_w + 1, width - half_w - 1)
    cy = rng.uniform(half_h + 1, height - half_h - 1)
    x = np.arange(width, dtype=np.float64)[None, :] + 0.5
    y = np.arange(height, dtype=np.float64)[:, None] + 0.5
    if class_id == 0:
        return (x - cx) ** 2 + (y - cy) ** 2 <= half_w**2
    if class_id == 1:
        return (np.abs(x - cx) <= half_w) & (np.abs(y - cy) <= half_h)
    # A triangle with its apex at the top (or bottom) middle and its base opposite: inside
    # when within the rows and within the half-width the row's distance from the apex allows.
    upside_down = bool(rng.integers(0, 2))
    depth = (y - (cy - half_h)) if not upside_down else ((cy + half_h) - y)
    within_rows = (depth >= 0) & (depth <= 2 * half_h)
    return within_rows & (np.abs(x - cx) <= half_w * depth / (2 * half_h))


def _shape_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    rgb = colorsys.hsv_to_rgb(rng.uniform(0, 1), rng.uniform(0.7, 1.0), rng.uniform(0.7, 1.0))
    return tuple(int(round(c * 255)) for c in rgb)  # type: ignore[return-value]


def _muted_colour(rng: np.random.Generator) -> np.ndarray:
    rgb = colorsys.hsv_to_rgb(rng.uniform(0, 1), rng.uniform(0.0, 0.2), rng.uniform(0.25, 0.95))
    return np.array(rgb, dtype=np.float64) * 255


def _background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """(H, W, 3) uint8: two muted colours as a gradient, stripes or checkerboard, plus the
    same grey noise on every channel."""
    a, b = _muted_colour(rng), _muted_colour(rng)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    kind = int(rng.integers(0, 3))
    angle = rng.uniform(0, np.pi)
    along = x * np.cos(angle) + y * np.sin(angle)
    if kind == 0:
        t = (along - along.min()) / max(np.ptp(along), 1.0)
    elif kind == 1:
        period = rng.uniform(8, 40)
        t = (np.floor(along / period) % 2).astype(np.float64)
    else:
        cell = rng.uniform(10, 48)
        t = ((np.floor(x / cell) + np.floor(y / cell)) % 2).astype(np.float64)
    image = a[None, None, :] * (1 - t[..., None]) + b[None, None, :] * t[..., None]
    noise = rng.normal(0.0, 4.0, size=(height, width, 1))
    return np.clip(np.rint(image + noise), 0, 255).astype(np.uint8)
