"""The kernel cases: every registry kernel against the CPU reference, declared once as data
(``darknet_metal.diagnostics.kernel_parity`` says what a case is and runs one). The cases of
``shaders/<family>.metal`` are declared in ``kernel_cases.<family>``, those of the half-storage
twins beside those of their float kernels (``kernel_cases.half``: what the twins are held
to); cases composing whole convolutional and connected layers from several shaders in
``kernel_cases.conv``. ``darknet-metal doctor`` runs every case on the user's device;
tests/metal run every case on the emulator under each thread order.

Sizes are odd on purpose (partial threadgroups, 1x1 maps, channel counts no group divides),
some above 2^16 elements; where a kernel sums in the reference's order its result is held
bit for bit.

Owns: ``CASES`` and the inputs, references and tolerances of each. May import: ``metal``
(the registry), ``cpu`` (the reference kernels), ``model`` (activation ids, option names),
``errors``.
"""

from __future__ import annotations

from darknet_metal.diagnostics.kernel_cases import (
    activation,
    batchnorm,
    buffers,
    combine,
    conv,
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
from darknet_metal.diagnostics.kernel_parity import KernelCase

__all__ = ["CASES", "FAMILIES", "case"]

#: The modules declaring the cases.
FAMILIES = (activation, im2col, gemm, batchnorm, pooling, resample, route, combine, heads,
            yolo, buffers, dropout, update, conv)


def _table() -> tuple[KernelCase, ...]:
    cases = tuple(c for family in FAMILIES for c in family.CASES)
    names = [c.name for c in cases]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"kernel cases declared twice: {twice}")
    return cases


#: Every case, in family order.
CASES: tuple[KernelCase, ...] = _table()


def case(name: str) -> KernelCase:
    """The case named ``name``; KeyError naming the known cases' count otherwise."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"unknown kernel case {name!r} (of {len(CASES)})")
