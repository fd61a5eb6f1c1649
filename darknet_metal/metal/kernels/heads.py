"""Kernels of ``shaders/heads.metal``: the [softmax] and [cost] heads (softmax at inference;
in training the loss heads' forward, which also assigns the delta)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Grid, Kernel
from darknet_metal.metal.kernels.shorthand import ELEMENTS, read, write, x_to_y

SOURCE = "heads.metal"

KERNELS: tuple[Kernel, ...] = (
    Kernel("softmax_fwd_f32", SOURCE, "dm_softmax_args", x_to_y("rows*n", "rows*n"),
           Grid(("rows",), (64,))),
    *(
        Kernel(
            name,
            SOURCE,
            "dm_loss_args",
            (read("pred", "n"), read("truth", "n"), write("delta", "n"), write("loss", "n")),
            ELEMENTS,
        )
        for name in ("softmax_fwd_xent_f32", "cost_fwd_sse_f32")
    ),
)

HALF_TWINS = ("softmax_fwd_f32",)
