"""Dispatches: a kernel, its packed argument struct, its buffers by role, and its grid.

``pack`` turns a kernel name, buffers by registry role, argument fields and grid sizes into
the tuple ``Device.dispatch`` and dispatch lists take; the GEMM helpers give every GEMM's
argument fields once (strides default to 0: one slice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from darknet_metal.errors import ArgumentTypeError
from darknet_metal.metal import registry
from darknet_metal.metal.registry import (
    BIAS_COLS,
    BIAS_NONE,
    BIAS_ROWS,
    GEMM_TILE,
    gemm_kernel,
)

__all__ = ["BIAS_COLS", "BIAS_NONE", "BIAS_ROWS", "GEMM_TILE", "Dispatch", "gemm_args",
           "gemm_kernel", "pack"]

Dispatch = tuple[str, bytes, tuple[Any, ...], tuple[int, int, int], tuple[int, int, int]]

_GEMM_STRIDES = (
    "a_batch_stride",
    "a_group_stride",
    "b_batch_stride",
    "b_group_stride",
    "c_batch_stride",
    "c_group_stride",
    "bias_group_stride",
)


def pack(
    name: str, buffers: Mapping[str, Any], args: Mapping[str, int | float],
    sizes: Mapping[str, int],
) -> Dispatch:
    """The dispatch of kernel ``name``: ``buffers`` by role (checked by the registry: a
    missing, unknown or too small buffer raises ``BindingError``), ``args`` packed into its
    struct, the grid its registry entry gives for ``sizes``."""
    k = registry.kernel(name)
    bound = k.bind(buffers, args, sizes)
    grid, group = k.grid.dispatch(**sizes)
    return (name, registry.ARGS[k.args].pack(**args), bound, grid, group)


def gemm_args(
    *, M: int, N: int, K: int, lda: int, ldb: int, ldc: int, bias_mode: int, act: int,
    groups: int = 1, slices: int = 1, beta: float = 0.0, **strides: int,
) -> tuple[dict[str, int | float], dict[str, int]]:
    """(argument fields, grid sizes) of a GEMM ``c = act(A·B + bias + beta*c)`` over
    ``slices`` = batch x groups slices (``beta`` 0: c is written, not read)."""
    unknown = set(strides) - set(_GEMM_STRIDES)
    if unknown:
        raise ArgumentTypeError(f"gemm_args: unknown strides {sorted(unknown)}")
    args: dict[str, int | float] = dict(
        M=M, N=N, K=K, lda=lda, ldb=ldb, ldc=ldc, groups=groups, bias_mode=bias_mode, act=act,
        beta=beta,
    )
    args.update({n: strides.get(n, 0) for n in _GEMM_STRIDES})
    return args, {"N": N, "M": M, "slices": slices}
