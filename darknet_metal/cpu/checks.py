"""Argument checks shared by the Python-visible wrappers of the Cython layers.

Every wrapper checks its arrays here before handing them to a typed-memoryview kernel, so a
bad argument gets a message naming it rather than Cython's buffer error, and every module
raises the same error types: TypeError for something that is not a numpy array, ValueError
for a wrong shape, dtype, contiguity or writability.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError

_LAYOUTS = {1: "(n,)", 2: "(N, F)", 3: "(C, H, W)", 4: "(N, C, H, W)"}
# dtype instances, not the scalar types: comparing with a type converts it on every call,
# and these checks run once per layer call.
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def check_input(name: str, a: object, ndims: tuple[int, ...] = (4,),
                like: np.ndarray | None = None, *, like_name: str = "x",
                layout: str | None = None, writable: bool = False) -> None:
    """Raise TypeError/ValueError unless ``a`` is a C-contiguous float32/float64 ndarray with
    one of ``ndims`` dimensions (and the dtype of ``like``, called ``like_name`` in the
    message, when given; and writable when ``writable``).

    ``layout`` names the expected shape in the message; by default it is derived from
    ``ndims`` ((N, C, H, W) for 4, (N, F) for 2, ...).
    """
    if not isinstance(a, np.ndarray):
        raise ArgumentTypeError(f"{name} must be a numpy array, not {type(a).__name__}")
    if a.ndim not in ndims:
        layouts = layout or " or ".join(_LAYOUTS.get(d, f"{d}-D") for d in ndims)
        raise ArgumentError(f"{name} must have shape {layouts}, not {a.shape}")
    if a.dtype not in _FLOATS:
        raise ArgumentError(f"{name} must be float32 or float64, not {a.dtype}")
    if like is not None and a.dtype != like.dtype:
        raise ArgumentError(f"{name} must have the dtype of {like_name} ({like.dtype}), "
                         f"not {a.dtype}")
    if not a.flags.c_contiguous:
        raise ArgumentError(f"{name} must be C-contiguous")
    if writable and not a.flags.writeable:
        raise ArgumentError(f"{name} must be writable (it is written to)")


def check_out(out: object, like: np.ndarray, shape: tuple[int, ...], *,
              like_name: str = "x") -> None:
    """Raise unless ``out`` is a writable C-contiguous array of ``shape`` and like's dtype."""
    check_input("out", out, (len(shape),), like, like_name=like_name, writable=True)
    if tuple(out.shape) != tuple(shape):
        raise ArgumentError(f"out must have shape {tuple(shape)}, not {tuple(out.shape)}")


def check_like(name: str, a: np.ndarray, like: np.ndarray, like_name: str) -> None:
    """Raise ValueError unless ``a`` has the shape and dtype of ``like``."""
    if a.shape != like.shape or a.dtype != like.dtype:
        raise ArgumentError(f"{name} must have the shape and dtype of {like_name} {like.shape} "
                         f"{like.dtype}, not {a.shape} {a.dtype}")


def check_shaped_like(name: str, a: object, like: np.ndarray, like_name: str, *,
                      writable: bool = False) -> None:
    """Raise unless ``a`` is a C-contiguous array with the shape and dtype of ``like`` (and
    writable when ``writable``); messages name ``a`` as ``name``, like as ``like_name``."""
    check_input(name, a, (like.ndim,), writable=writable)
    check_like(name, a, like, like_name)


def check_workspace(workspace: object, like: np.ndarray, needed: int, where: str) -> None:
    """Raise unless ``workspace`` is a writable 1-D array of like's dtype with at least
    ``needed`` elements; ``where`` (the caller's name) starts the size message."""
    check_input("workspace", workspace, (1,), like, writable=True)
    if workspace.shape[0] < needed:
        raise ArgumentError(f"{where}: workspace has {workspace.shape[0]} elements, "
                         f"needs {needed}")


def check_disjoint(written: dict, read: dict) -> None:
    """Raise unless no array of ``written`` shares memory with one of ``read`` (each a dict
    name -> array or None): a kernel reading one while adding into the other would read its
    own partial results. Arrays of ``written`` may share memory with each other."""
    for out_name, out in written.items():
        for in_name, a in read.items():
            if out is not None and a is not None and np.shares_memory(out, a):
                raise ArgumentError(f"{out_name} must not share memory with {in_name}")


#: The environment variables that choose how the CPU's FMA kernels run, each with its values
#: and what unset or empty means: the variant's cap (``blas.cpu_kernels`` reports the variant
#: that runs) and whether the packed product copies its right-hand rows first.
CPU_KERNELS_VARIABLE = "DARKNET_METAL_CPU_KERNELS"
CPU_KERNEL_VARIANTS = ("avx512", "avx2", "portable")
CPU_COPY_ROWS_VARIABLE = "DARKNET_METAL_CPU_COPY_ROWS"
CPU_KERNEL_SETTINGS = {
    CPU_KERNELS_VARIABLE: (CPU_KERNEL_VARIANTS, "the widest the CPU has"),
    CPU_COPY_ROWS_VARIABLE: (("0", "1"), "copied on Intel CPUs only"),
}


def check_cpu_kernels_setting(environ: Mapping[str, str] | None = None) -> None:
    """Raise ArgumentError if one of ``CPU_KERNEL_SETTINGS``' variables (in ``environ``, by
    default the process's environment) is set to a value other than its own or empty (the
    kernels would ignore it)."""
    environ = os.environ if environ is None else environ
    for name, (values, default) in CPU_KERNEL_SETTINGS.items():
        value = environ.get(name)
        if value and value not in values:
            raise ArgumentError(f"{name}={value!r}: expected one of {', '.join(values)} "
                                f"(or unset or empty: {default})")
