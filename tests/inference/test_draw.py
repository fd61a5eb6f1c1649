"""Label size of drawn detections: it grows with the image, as the box lines do."""

from __future__ import annotations

import numpy as np
import pytest

from darknet_metal import Detection
from darknet_metal.inference.draw import class_color, draw_detections, label_font_size


def _label_band_height(height: int) -> int:
    """Height in pixels of the filled label band drawn above a box on a black image
    ``height`` pixels tall (and as wide)."""
    blank = np.zeros((height, height, 3), np.uint8)
    left, top = height // 10, height // 2
    det = Detection(0, "dog", 0.87, 0.9, float(left), float(top), height / 4, height / 4)
    out = np.asarray(draw_detections(blank, [det]))
    color = class_color(0)
    # Column ``left`` of the band is background only (the text starts a padding further
    # right); count its pixels of the class colour upwards from just above the box.
    column = out[:top, left]
    band = 0
    for y in range(top - 1, -1, -1):
        if tuple(column[y]) != color:
            break
        band += 1
    return band


def test_label_grows_with_the_image() -> None:
    small, large = _label_band_height(400), _label_band_height(4000)
    assert small >= 10  # readable on a small image
    assert large >= 5 * small, (small, large)
    # About 3.5% of the height on a large image (Darknet's band is 1.8% + 3 px).
    assert 0.015 * 4000 <= large <= 0.04 * 4000, large


@pytest.mark.parametrize(
    ("height", "size"), [(1, 10), (80, 10), (333, 10), (400, 12), (1000, 30), (4000, 120)]
)
def test_label_font_size_rule(height: int, size: int) -> None:
    assert label_font_size(height) == size
