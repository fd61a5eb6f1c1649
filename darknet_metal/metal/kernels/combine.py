"""Kernels of ``shaders/combine.metal``: [shortcut], [scale_channels] and [sam], forward and
backward (backward kernels add into their gradient roles)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid, Kernel
from darknet_metal.metal.kernels.shorthand import (
    ELEMENTS,
    SPATIAL_3D,
    flag,
    read,
    read_write,
    write,
)

SOURCE = "combine.metal"

_VALUES = "batch*channels*spatial"
# The shortcut's weights: one per input, or one per input and channel (per_channel).
_WEIGHTS = f"n_inputs*max(1, {flag('per_channel')}*channels)"
# Only the first min(channels, src_channels) channels of a source meet the output.
_SHARED = "min(channels, src_channels)"
_SOURCE_VALUES = f"((batch - 1)*src_channels + {_SHARED})*spatial"
_DELTA_VALUES = f"((batch - 1)*channels + {_SHARED})*spatial"
_PARTIALS = f"(batch - 1)*channels + {_SHARED}"
# One factor per (image, channel), or per (image, pixel) with scale_wh.
_FACTORS = f"batch*max({flag('scale_wh')}*spatial, (1 - {flag('scale_wh')})*channels)"
_COLUMNS = Grid(("columns",), (64,))
#: Threads of a threadgroup summing one row of products (the shader's DM_DOT_THREADS).
DOT_THREADS = 64

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "shortcut_weights_fwd_f32",
        SOURCE,
        "dm_shortcut_weights_args",
        (read("weights", _WEIGHTS), write("table", "n_inputs*channels")),
        Grid(("channels",), (64,)),
    ),
    Kernel(
        "shortcut_fwd_f32",
        SOURCE,
        "dm_shortcut_args",
        (
            read("x", _VALUES),
            read("source", _SOURCE_VALUES),
            # Row 0 (x's weights) when first, row `source` for the source's channels.
            read(
                "table",
                f"max({flag('first')}*channels, min(channels, src_channels, 1)"
                f"*(source*channels + {_SHARED}))",
                used_if="weighted",
            ),
            write("y", _VALUES),
        ),
        SPATIAL_3D,
    ),
    Kernel(
        "scale_channels_fwd_f32",
        SOURCE,
        "dm_scale_channels_args",
        (read("x_from", _VALUES), read("scale", _FACTORS), write("y", _VALUES)),
        SPATIAL_3D,
    ),
    Kernel(
        "sam_fwd_f32",
        SOURCE,
        "dm_sam_args",
        (read("x_from", "n"), read("x", "n"), write("y", "n")),
        ELEMENTS,
    ),
    Kernel(
        "shortcut_bwd_f32",
        SOURCE,
        "dm_shortcut_bwd_args",
        (
            read("delta", _DELTA_VALUES),
            read("table", f"row*channels + {_SHARED}", used_if="weighted"),
            read_write("grad", _SOURCE_VALUES),
        ),
        SPATIAL_3D,
    ),
    Kernel(
        "shortcut_bwd_dot_f32",
        SOURCE,
        "dm_shortcut_bwd_args",
        (read("delta", _DELTA_VALUES), read("input", _SOURCE_VALUES), write("partial", _PARTIALS)),
        # A threadgroup per (channel, image) sums its pixels' products as a tree.
        Grid(("channels", "batch"), (DOT_THREADS, 1), (1, 1)),
    ),
    Kernel(
        "shortcut_bwd_weights_f32",
        SOURCE,
        "dm_shortcut_wgrad_args",
        (
            read("partial", _PARTIALS),
            Binding(
                "inout",
                "acc",
                f"{flag('per_channel')}*(row + 1)*channels "
                f"+ (1 - {flag('per_channel')})*(row + 1)",
                read_if="accumulate",
            ),
        ),
        _COLUMNS,
    ),
    Kernel(
        "shortcut_bwd_norm_f32",
        SOURCE,
        "dm_shortcut_weights_args",
        (read("weights", _WEIGHTS), read("g", _WEIGHTS), read_write("weight_grad", _WEIGHTS)),
        _COLUMNS,
    ),
    Kernel(
        "scale_channels_bwd_f32",
        SOURCE,
        "dm_scale_channels_args",
        (read("delta", _VALUES), read("scale", _FACTORS), read_write("x_from_grad", _VALUES)),
        SPATIAL_3D,
    ),
    Kernel(
        "scale_channels_bwd_scale_f32",
        SOURCE,
        "dm_scale_channels_args",
        (read("delta", _VALUES), read("x_from", _VALUES), read_write("scale_grad", _FACTORS)),
        Grid(("factors",), (DOT_THREADS,), (1,)),
    ),
    Kernel(
        "sam_bwd_f32",
        SOURCE,
        "dm_sam_args",
        (
            read("delta", "n"),
            read("x_from", "n"),
            read("x", "n"),
            read_write("x_from_grad", "n"),
            read_write("x_grad", "n"),
        ),
        ELEMENTS,
    ),
)

HALF_TWINS = ("shortcut_weights_fwd_f32", "shortcut_fwd_f32", "scale_channels_fwd_f32",
              "sam_fwd_f32")
