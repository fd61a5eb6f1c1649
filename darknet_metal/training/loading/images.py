"""Reading training images as Darknet's ``load_rgb_mat_image`` does: OpenCV's decoder, 8 bits
per sample, EXIF orientation applied, alpha dropped, RGB order."""

from __future__ import annotations

import os

import numpy as np

from darknet_metal.errors import ImageError

__all__ = ["read_image"]


def read_image(path: str | os.PathLike[str], channels: int = 3) -> np.ndarray:
    """Decode ``path`` into uint8 (H, W, channels): RGB for 3 channels, gray for 1.

    Raises ``ImageError`` naming the file when it is missing, unreadable or not an image
    OpenCV decodes (Darknet stops the whole training run there).
    """
    import cv2

    name = os.fspath(path)
    try:
        data = np.fromfile(name, dtype=np.uint8)
    except FileNotFoundError:
        raise ImageError(f"{name}: image file not found") from None
    except IsADirectoryError:
        raise ImageError(f"{name}: is a directory, not an image file") from None
    except OSError as exc:
        raise ImageError(f"{name}: cannot read image file ({exc.strerror or exc})") from None
    if data.size == 0:
        raise ImageError(f"{name}: the image file is empty")
    flag = cv2.IMREAD_GRAYSCALE if channels == 1 else cv2.IMREAD_COLOR
    try:
        mat = cv2.imdecode(data, flag)
    except cv2.error as exc:
        raise ImageError(f"{name}: cannot decode image ({exc.err or exc})") from None
    if mat is None or mat.size == 0:
        raise ImageError(f"{name}: cannot decode image (not a format OpenCV reads, or corrupt)")
    if channels == 1:
        return mat[:, :, None]
    return cv2.cvtColor(mat, cv2.COLOR_BGR2RGB)
