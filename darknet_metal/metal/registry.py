"""The Metal kernel registry: every kernel in ``shaders/*.metal``, declared once as data.

For each kernel: its Metal function name (the registry key,
``<op>_<direction>[_<part>]_<dtype>`` or a direction-free op such as ``gemm_nn_f32``; the
direction is ``fwd`` or ``bwd`` for a layer's forward or backward pass, ``upd`` for an optimizer
update such as ``sgd_upd_f32``, ``buf`` for a buffer utility such as ``fill_buf_f32``; the dtype
is that of the data the kernel computes on), the ``.metal`` file defining it, its argument
struct (``shaders/dm_args.h``, read from the header itself), its buffers by role in index
order with their extents, and the grid rule, all written in the language of
``darknet_metal.metal.kernel_spec`` (whose docstring describes it, and whose names this module
re-exports). The kernels of ``shaders/<family>.metal`` are declared in
``darknet_metal.metal.kernels.<family>``; this module assembles them into ``KERNELS`` and
reads ``ARGS``. Which kernels a layer uses is its op's business (``darknet_metal.ops``), not
the registry's.

Forward kernels listed in ``HALF_TWINS`` also exist for half storage (``_f16``), declared
from their float twins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import ModuleType

from darknet_metal.errors import ArgumentError
from darknet_metal.metal import kernel_spec
from darknet_metal.metal.kernel_spec import (  # noqa: F401 (re-exported through __all__)
    ArgsStruct,
    Binding,
    BindingError,
    Expr,
    Grid,
    Kernel,
    parse_args_header,
)
from darknet_metal.metal.kernels import (
    activation,
    batchnorm,
    buffers,
    combine,
    dropout,
    gemm,
    heads,
    im2col,
    pooling,
    resample,
    route,
    update,
    yolo,
)
from darknet_metal.metal.kernels.gemm import (
    BIAS_COLS,
    BIAS_NONE,
    BIAS_ROWS,
    GEMM_TILE,
    gemm_kernel,
)
from darknet_metal.metal.sources import shader_header

__all__ = [
    "ARGS",
    "BIAS_COLS",
    "BIAS_NONE",
    "BIAS_ROWS",
    "FAMILIES",
    "GEMM_TILE",
    "HALF_TWINS",
    "KERNELS",
    "gemm_kernel",
    "half_name",
    "kernel",
    # The description language is part of the registry's interface.
    *kernel_spec.__all__,
]

#: The modules declaring the kernels, one per shader file (see ``darknet_metal.metal.kernels``).
FAMILIES: tuple[ModuleType, ...] = (
    activation,
    im2col,
    gemm,
    batchnorm,
    pooling,
    resample,
    route,
    combine,
    heads,
    yolo,
    buffers,
    dropout,
    update,
)


def _read_args() -> dict[str, ArgsStruct]:
    with open(shader_header("dm_args.h"), encoding="utf-8") as f:
        return parse_args_header(f.read())


#: Argument structs, read from shaders/dm_args.h.
ARGS: dict[str, ArgsStruct] = _read_args()

#: Forward kernels that also exist for half storage (fp16 networks): the same template
#: instantiated for ``half`` in its shader, named with ``_f16`` for ``_f32``, every float
#: role holding half instead (sums stay float inside the kernels).
HALF_TWINS: tuple[str, ...] = tuple(name for family in FAMILIES for name in family.HALF_TWINS)


def half_name(name: str) -> str:
    """The ``_f16`` twin's name of ``_f32`` kernel ``name``."""
    if not name.endswith("_f32"):
        raise ArgumentError(f"{name} is not a float32 kernel name")
    return name[: -len("_f32")] + "_f16"


def _half_twins(table: Mapping[str, Kernel]) -> tuple[Kernel, ...]:
    twins = []
    for name in HALF_TWINS:
        k = table[name]
        bindings = tuple(dataclasses.replace(b, dtype="f16") if b.dtype == "f32" else b
                         for b in k.bindings)
        twins.append(dataclasses.replace(k, name=half_name(name), bindings=bindings))
    return tuple(twins)


def _table(*groups: tuple[Kernel, ...]) -> dict[str, Kernel]:
    table: dict[str, Kernel] = {}
    for group in groups:
        for k in group:
            if k.name in table:
                raise ValueError(f"kernel {k.name} is declared twice")
            table[k.name] = k
    return table


_SINGLE = _table(*(family.KERNELS for family in FAMILIES))
#: Every kernel, keyed by its Metal function name.
KERNELS: dict[str, Kernel] = _table(tuple(_SINGLE.values()), _half_twins(_SINGLE))


def kernel(name: str) -> Kernel:
    """The registry entry of kernel ``name``; KeyError naming the known kernels otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown Metal kernel {name!r}; known: {sorted(KERNELS)}") from None
