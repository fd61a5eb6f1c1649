"""Helpers of the backward kernels' tests: central finite differences, error measures.

A backward kernel given ``delta = R`` must return the gradient of ``L = sum(forward(...) * R)``
with respect to each input; ``numeric_grad`` estimates that gradient from float64 forward
passes, ``rel_err`` compares the two.
"""

from __future__ import annotations

import numpy as np
import pytest


def numeric_grad(loss, a: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d loss() / d a by central differences, perturbing ``a`` in place (restored after)."""
    grad = np.zeros(a.shape, np.float64)
    flat, gflat = a.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = loss()
        flat[i] = keep - eps
        down = loss()
        flat[i] = keep
        gflat[i] = (up - down) / (2 * eps)
    return grad


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (0 when both are 0)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = np.abs(want).max(initial=0.0)
    diff = np.abs(got - want).max(initial=0.0)
    return 0.0 if diff == 0 else diff / max(scale, 1e-300)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are 0)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    diff = np.linalg.norm(got - want)
    return 0.0 if diff == 0 else diff / max(np.linalg.norm(want), 1e-300)


def distinct(shape, seed: int, dtype=np.float64, spacing: float = 0.05) -> np.ndarray:
    """Values in shuffled order that differ pairwise by at least ``spacing``: no ties, so a
    maximum does not switch under a finite-difference step."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    values = (rng.permutation(n) - n / 2) * spacing + rng.uniform(0, spacing / 4, n)
    return values.reshape(shape).astype(dtype)


def assert_raises_naming(call, error, words) -> None:
    """``call()`` raises ``error`` with every one of ``words`` in its message."""
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value)
