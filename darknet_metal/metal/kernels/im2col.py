"""Kernels of ``shaders/im2col.metal``: im2col and its adjoint col2im (the convolution's input
gradient)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid, Kernel
from darknet_metal.metal.kernels.shorthand import read, write

SOURCE = "im2col.metal"

_IMAGE = "slices*channels*height*width"
_COLUMNS = "slices*channels*ksize*ksize*out_h*out_w"

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "im2col_fwd_f32",
        SOURCE,
        "dm_im2col_args",
        # Slice z reads input slice z whole at most and writes its column matrix whole.
        (read("image", _IMAGE), write("col", _COLUMNS)),
        # One thread per column and channel.
        Grid(("spatial", "channels", "slices"), (64, 4, 1)),
    ),
    Kernel(
        "col2im_bwd_f32",
        SOURCE,
        "dm_im2col_args",
        # Slice z reads (at most) the whole column matrix of slice z and adds into its input
        # (accumulate) or writes it whole.
        (read("col", _COLUMNS), Binding("inout", "image", _IMAGE, read_if="accumulate")),
        Grid(("spatial", "channels", "slices"), (64, 4, 1)),
    ),
)

HALF_TWINS = ("im2col_fwd_f32",)
