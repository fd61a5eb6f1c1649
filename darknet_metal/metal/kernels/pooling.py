"""Kernels of ``shaders/pooling.metal``: [maxpool] (windows and maxpool_depth) and global
[avgpool], forward (with the argmax in training) and backward."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid, Kernel
from darknet_metal.metal.kernels.shorthand import PLANE_3D, SPATIAL_3D, read, read_write, x_to_y

SOURCE = "pooling.metal"

_DEPTH_GRID = Grid(("spatial", "out_channels", "batch"), (64, 4, 1))


def _indexes(extent: str, direction: str) -> Binding:
    """The int32 flat index of each output's maximum, which training's forward records."""
    return Binding(direction, "indexes", extent, dtype="i32")


KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "maxpool_fwd_f32",
        SOURCE,
        "dm_pool_args",
        x_to_y("planes*height*width", "planes*out_h*out_w"),
        PLANE_3D,
    ),
    Kernel(
        "maxpool_depth_fwd_f32",
        SOURCE,
        "dm_maxpool_depth_args",
        x_to_y("batch*channels*spatial", "batch*out_channels*spatial"),
        _DEPTH_GRID,
    ),
    Kernel(
        "avgpool_fwd_f32",
        SOURCE,
        "dm_avgpool_args",
        x_to_y("planes*spatial", "planes"),
        Grid(("planes",), (64,)),
    ),
    Kernel(
        "maxpool_fwd_train_f32",
        SOURCE,
        "dm_pool_args",
        (
            *x_to_y("planes*height*width", "planes*out_h*out_w"),
            _indexes("planes*out_h*out_w", "out"),
        ),
        PLANE_3D,
    ),
    Kernel(
        "maxpool_depth_fwd_train_f32",
        SOURCE,
        "dm_maxpool_depth_args",
        (
            *x_to_y("batch*channels*spatial", "batch*out_channels*spatial"),
            _indexes("batch*out_channels*spatial", "out"),
        ),
        _DEPTH_GRID,
    ),
    Kernel(
        "maxpool_bwd_f32",
        SOURCE,
        "dm_pool_args",
        (
            read("delta", "planes*out_h*out_w"),
            _indexes("planes*out_h*out_w", "in"),
            Binding("inout", "x_grad", "planes*height*width", read_if="accumulate"),
        ),
        Grid(("width", "height", "planes"), (16, 16, 1)),
    ),
    Kernel(
        "maxpool_depth_bwd_f32",
        SOURCE,
        "dm_maxpool_depth_args",
        (
            read("delta", "batch*out_channels*spatial"),
            _indexes("batch*out_channels*spatial", "in"),
            read_write("x_grad", "batch*channels*spatial"),
        ),
        SPATIAL_3D,
    ),
    Kernel(
        "avgpool_bwd_f32",
        SOURCE,
        "dm_avgpool_args",
        (read("delta", "planes"), read_write("x_grad", "planes*spatial")),
        Grid(("spatial", "planes"), (64, 4)),
    ),
)

HALF_TWINS = ("maxpool_fwd_f32", "maxpool_depth_fwd_f32", "avgpool_fwd_f32")
