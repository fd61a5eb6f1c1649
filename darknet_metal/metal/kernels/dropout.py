"""Kernels of ``shaders/dropout.metal``: [dropout]'s counter-based draws and the dropout
itself, forward (training) and backward."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid, Kernel
from darknet_metal.metal.kernels.shorthand import ELEMENTS, read, read_write, write

SOURCE = "dropout.metal"

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "uniform_buf_f32",
        SOURCE,
        "dm_uniform_args",
        # The 64-bit counter as two uint32 words, low first (a uint64 array's bytes).
        (Binding("in", "counter", "2*min(n, 1)", dtype="u32"), write("rand", "n")),
        ELEMENTS,
    ),
    Kernel(
        "uniform_buf_advance_f32",
        SOURCE,
        "dm_counter_args",
        (Binding("inout", "counter", "2*count", dtype="u32"),),
        Grid(("count",), (32,)),
    ),
    *(
        Kernel(name, SOURCE, "dm_dropout_args", (read("rand", "n"), read_write(role, "n")),
               ELEMENTS)
        for name, role in (("dropout_fwd_train_f32", "x"), ("dropout_bwd_f32", "delta"))
    ),
)

HALF_TWINS: tuple[str, ...] = ()
