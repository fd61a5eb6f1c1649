"""Kernels of ``shaders/resample.metal``: [upsample] (and its reverse/sum mode) and [reorg],
forward and backward."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Grid, Kernel
from darknet_metal.metal.kernels.shorthand import PLANE_3D, flag, read, read_write, x_to_y

SOURCE = "resample.metal"

# reorg_fwd_f32's "large" side, read as (channels/s^2, height*s, width*s) per image: the sum
# of each index term's largest value (exactly batch*channels*height*width when s^2 divides
# channels, which the layer requires; larger otherwise, where the kernel overruns it).
_REORG_SMALL = "batch*channels*height*width"
_REORG_LARGE = (
    "width*stride + width*stride*((height - 1)*stride "
    "+ ((channels - 1)//(channels//(stride*stride)))//stride) "
    "+ width*height*stride*stride*((channels//(stride*stride))*batch - 1)"
)
# reverse=0 copies the large side (x) to the small side (y), reverse=1 the other way.
_REORG_FROM = f"{flag('reverse')}*{_REORG_SMALL} + (1 - {flag('reverse')})*({_REORG_LARGE})"
_REORG_TO = f"{flag('reverse')}*({_REORG_LARGE}) + (1 - {flag('reverse')})*{_REORG_SMALL}"
_REORG_GRID = Grid(("width", "height", "slices"), (16, 16, 1))

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "upsample_fwd_f32",
        SOURCE,
        "dm_upsample_args",
        # stride > 0 reads pixel (j/s, i/s) of each plane; stride < 0 sums s x s blocks of
        # planes out_h*out_w*s*s long (stride 0 reads nothing).
        x_to_y(
            "min(1, max(stride, 0))*(((planes - 1)*height + (out_h - 1)//max(stride, 1))"
            "*width + (out_w - 1)//max(stride, 1) + 1) "
            "+ min(1, max(0 - stride, 0))*planes*out_h*out_w*stride*stride",
            "planes*out_h*out_w",
        ),
        PLANE_3D,
    ),
    Kernel("reorg_fwd_f32", SOURCE, "dm_reorg_args", x_to_y(_REORG_FROM, _REORG_TO),
           _REORG_GRID),
    Kernel(
        "upsample_bwd_f32",
        SOURCE,
        "dm_upsample_args",
        # stride > 0: input pixel (y, x) reads delta rows y*s.., columns x*s.. of its plane;
        # stride < 0: x_grad planes are out_h*out_w*s*s long, as the forward reads them.
        (
            read(
                "delta",
                "min(1, max(stride, 0))*((planes - 1)*out_h*out_w "
                "+ (height*stride - 1)*out_w + width*stride) "
                "+ min(1, max(0 - stride, 0))*planes*out_h*out_w",
            ),
            read_write(
                "x_grad",
                "min(1, max(stride, 0))*planes*height*width "
                "+ min(1, max(0 - stride, 0))*planes*out_h*out_w*stride*stride",
            ),
        ),
        # cols, rows: the input's width and height (stride > 0) or the output's (< 0).
        Grid(("cols", "rows", "planes"), (16, 16, 1)),
    ),
    Kernel(
        "reorg_bwd_f32",
        SOURCE,
        "dm_reorg_args",
        # The forward's extents with the sides swapped: delta is the forward's y.
        (read("delta", _REORG_TO), read_write("x_grad", _REORG_FROM)),
        _REORG_GRID,
    ),
)

HALF_TWINS = ("upsample_fwd_f32", "reorg_fwd_f32")
