"""Argument checks shared by the Python-visible wrappers of the Cython layers."""

from __future__ import annotations

import numpy as np

_LAYOUTS = {2: "(N, F)", 4: "(N, C, H, W)"}


def check_input(name: str, a: object, ndims: tuple[int, ...] = (4,),
                like: np.ndarray | None = None) -> None:
    """Raise TypeError/ValueError unless ``a`` is a C-contiguous float32/float64 ndarray with
    one of ``ndims`` dimensions (and the dtype of ``like`` when given)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, not {type(a).__name__}")
    if a.ndim not in ndims:
        layouts = " or ".join(_LAYOUTS.get(d, f"{d}-D") for d in ndims)
        raise ValueError(f"{name} must have shape {layouts}, not {a.shape}")
    if a.dtype not in (np.float32, np.float64):
        raise ValueError(f"{name} must be float32 or float64, not {a.dtype}")
    if like is not None and a.dtype != like.dtype:
        raise ValueError(f"{name} must have the dtype of x ({like.dtype}), not {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_out(out: object, like: np.ndarray, shape: tuple[int, ...]) -> None:
    """Raise unless ``out`` is a writable C-contiguous array of ``shape`` and like's dtype."""
    check_input("out", out, (len(shape),), like)
    if not out.flags.writeable:
        raise ValueError("out must be writable")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, not {tuple(out.shape)}")
