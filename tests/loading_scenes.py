"""Synthetic scenes for the loading tests: filled rectangles of distinct colours on a grey
background, with their truth boxes, and the rectangle a colour occupies in an output image."""

from __future__ import annotations

import os

import cv2
import numpy as np

BACKGROUND = np.array([90, 90, 90], np.float32)


COLOURS = 12


def colour(index: int) -> tuple[int, int, int]:
    """A saturated colour far from the grey background, distinct for each index < 12."""
    assert 0 <= index < COLOURS
    hue = (index * 5) % COLOURS * 15  # OpenCV 8-bit hue: 0..180, neighbours far apart
    hsv = np.array([[[hue, 255, 255]]], np.uint8)
    return tuple(int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0])


_PALETTE = np.array([BACKGROUND] + [colour(i) for i in range(COLOURS)], np.float32)


def scene(
    width: int, height: int, rects: list[tuple[int, int, int, int]], first_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (height, width, 3) RGB with rectangle i ((x0, y0, x1, y1), x1/y1 exclusive) in
    colour(first_id + i), and (k, 5) truths (class first_id + i, cx, cy, w, h)."""
    rgb = np.empty((height, width, 3), np.uint8)
    rgb[:] = BACKGROUND.astype(np.uint8)
    boxes = []
    for i, (x0, y0, x1, y1) in enumerate(rects):
        rgb[y0:y1, x0:x1] = colour(first_id + i)
        boxes.append([first_id + i, (x0 + x1) / 2 / width, (y0 + y1) / 2 / height,
                      (x1 - x0) / width, (y1 - y0) / height])
    return rgb, np.array(boxes, np.float32).reshape(-1, 5)


def write_png(path: str | os.PathLike[str], rgb: np.ndarray) -> str:
    """Write an RGB image losslessly; returns the path as a string."""
    cv2.imwrite(os.fspath(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    return os.fspath(path)


class Colours:
    """An output image's pixels against the palette (background and the 12 colours)."""

    def __init__(self, rgb: np.ndarray) -> None:
        pixels = rgb.astype(np.float32)
        self.distances = np.linalg.norm(pixels[..., None, :] - _PALETTE, axis=-1)
        self.nearest = self.distances.argmin(axis=-1)

    def mask(self, class_id: int, *, pure: bool = False) -> np.ndarray:
        """Pixels nearer to the class's colour than to the background and every other
        colour (bilinear edges split half way), or with ``pure`` only those within 40
        levels of it (a blend of another colour with the grey can lie nearest to this
        one)."""
        if pure:
            return self.distances[..., class_id + 1] < 40
        return self.nearest == class_id + 1


def scene_samples(folder: str | os.PathLike[str],
                  count: int = 5) -> list[tuple[str, np.ndarray]]:
    """``count`` (png path, boxes) training samples of two rectangles each, in ``folder``."""
    out = []
    for i in range(count):
        rects = [(10 + 8 * i, 12, 60 + 8 * i, 70), (90, 60 - 4 * i, 150, 110)]
        rgb, boxes = scene(160, 120, rects, first_id=(2 * i) % 12)
        out.append((write_png(os.path.join(folder, f"img{i}.png"), rgb), boxes))
    return out


def colour_mask(rgb: np.ndarray, class_id: int, *, pure: bool = False) -> np.ndarray:
    """``Colours(rgb).mask(class_id, pure=pure)``."""
    return Colours(rgb).mask(class_id, pure=pure)


def pixel_box(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    """(x0, y0, x1, y1) of the mask's pixels, x1/y1 exclusive; None if empty."""
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def truth_pixels(row: np.ndarray, width: int, height: int) -> tuple[float, float, float, float]:
    """A truth row's (left, top, right, bottom) in output pixels."""
    _, cx, cy, w, h = (float(v) for v in row)
    return (cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height


def to_uint8(planar: np.ndarray) -> np.ndarray:
    """(3, H, W) float in [0, 1] -> (H, W, 3) uint8."""
    return np.rint(planar.transpose(1, 2, 0) * 255).astype(np.uint8)
