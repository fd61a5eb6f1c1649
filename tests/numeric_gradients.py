"""Central finite differences for the gradient checks of the CPU training kernels."""

import numpy as np


def central_difference(loss, arr, h=1e-5):
    """d loss() / d arr by central differences, perturbing ``arr`` (float64) in place one
    element at a time and restoring it; ``loss`` takes no arguments and returns a float."""
    grad = np.empty(arr.shape)
    flat = arr.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + h
        up = loss()
        flat[i] = keep - h
        down = loss()
        flat[i] = keep
        grad.flat[i] = (up - down) / (2 * h)
    return grad


def relative_error(got, want):
    """Largest absolute difference over the largest magnitude of ``want``."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-300))


def relative_l2(got, want):
    """||got - want|| / ||want|| (float64)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-300))
