"""Kernels of ``shaders/activation.metal``: activations and the normalize_channels family,
forward and backward."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Grid, Kernel
from darknet_metal.metal.kernels.shorthand import ELEMENTS, read, read_write, x_to_y

SOURCE = "activation.metal"

_NORMALIZE_CHANNELS = (
    "normalize_channels",
    "normalize_channels_softmax",
    "normalize_channels_softmax_maxval",
)
_PER_PIXEL = Grid(("spatial", "batch"), (64, 1))  # one thread sums a pixel's channels

KERNELS: tuple[Kernel, ...] = (
    Kernel("activation_fwd_f32", SOURCE, "dm_activation_args", x_to_y("n", "n"), ELEMENTS),
    *(
        Kernel(
            f"{variant}_fwd_f32",
            SOURCE,
            "dm_normalize_channels_args",
            x_to_y("batch*channels*spatial", "batch*channels*spatial"),
            _PER_PIXEL,
        )
        for variant in _NORMALIZE_CHANNELS
    ),
    Kernel(
        "activation_bwd_f32",
        SOURCE,
        "dm_activation_args",
        (read("y_or_x", "n"), read_write("delta", "n")),
        ELEMENTS,
    ),
    *(
        Kernel(
            f"{variant}_bwd_f32",
            SOURCE,
            "dm_normalize_channels_args",
            (read("y", "batch*channels*spatial"), read_write("delta", "batch*channels*spatial")),
            _PER_PIXEL,
        )
        for variant in _NORMALIZE_CHANNELS
    ),
)

HALF_TWINS = ("activation_fwd_f32", *(f"{variant}_fwd_f32" for variant in _NORMALIZE_CHANNELS))
