"""Kernels of ``shaders/route.metal``: [route]'s channel concatenation, forward and
backward."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Kernel
from darknet_metal.metal.kernels.shorthand import SPATIAL_3D, read, x_to_y

SOURCE = "route.metal"

# One source's channel slice into its place in the output: the last image's slice ends the
# touched range on both sides.
_SOURCE_SLICE = "((batch - 1)*src_channels + src_offset + channels)*spatial"
_OUTPUT_SLICE = "((batch - 1)*dst_channels + dst_offset + channels)*spatial"

KERNELS: tuple[Kernel, ...] = (
    Kernel("route_fwd_f32", SOURCE, "dm_route_args", x_to_y(_SOURCE_SLICE, _OUTPUT_SLICE),
           SPATIAL_3D),
    Kernel(
        "route_bwd_f32",
        SOURCE,
        "dm_route_args",
        (read("delta", _OUTPUT_SLICE),
         Binding("inout", "x_grad", _SOURCE_SLICE, read_if="accumulate")),
        SPATIAL_3D,
    ),
)

HALF_TWINS = ("route_fwd_f32",)
