"""Kernels of ``shaders/buffers.metal``: fill, copy, accumulate, the sum of a split-K GEMM's
slices and the finiteness check."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Kernel
from darknet_metal.metal.kernels.shorthand import ELEMENTS, read, read_write, write

SOURCE = "buffers.metal"

KERNELS: tuple[Kernel, ...] = (
    Kernel("fill_buf_f32", SOURCE, "dm_fill_args", (write("x", "n"),), ELEMENTS),
    Kernel("copy_buf_f32", SOURCE, "dm_copy_args", (read("src", "n"), write("dst", "n")),
           ELEMENTS),
    Kernel("add_buf_f32", SOURCE, "dm_add_args", (read("src", "n"), read_write("dst", "n")),
           ELEMENTS),
    Kernel("sum_slices_buf_f32", SOURCE, "dm_sum_slices_args",
           (read("src", "max(slices - 1, 0)*stride + n"), read_write("dst", "n")), ELEMENTS,
           flops="slices*n"),
    Kernel(
        "finite_buf_f32",
        SOURCE,
        "dm_finite_args",
        # The flag keeps its value unless the kernel finds a non-finite element.
        (read("x", "n"), read_write("flag", "min(n, 1)")),
        ELEMENTS,
    ),
)

HALF_TWINS = ("copy_buf_f32",)
