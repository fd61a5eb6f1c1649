"""float32 arithmetic in the order and rounding Darknet's reference build uses."""

from __future__ import annotations

import numpy as np


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once, as a fused multiply-add (Darknet's build fuses
    ``p * q + r`` into fma, observed bit for bit on its resize_image and box overlaps).

    The product of two float32 values is exact in float64, so only the final sum is
    rounded twice (to float64, then float32); that differs from a true fused result only
    when the float64 sum lands exactly halfway between two float32 values, which the data
    here essentially never does.
    """
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)
