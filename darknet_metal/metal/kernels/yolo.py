"""Kernels of ``shaders/yolo.metal``: the [yolo] head's forward and its training loss (four
dispatches in order, see the shader's comment)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Binding, Grid, Kernel
from darknet_metal.metal.kernels.shorthand import read, read_write, write, x_to_y

SOURCE = "yolo.metal"

_OUTPUT = "batch*anchors*(5 + classes)*spatial"
_DELTA = "batch*anchors*(5 + classes)*height*width"
_PARTIALS = "batch*anchors*height*width*4"  # 4 sums per (image, anchor, cell)
_IMAGES = "batch*10"  # 10 sums per image
_CELLS = Grid(("spatial", "anchors", "batch"), (64, 1, 1))
_LOSS_INPUTS = (
    read("output", _DELTA),
    read("truths", "batch*boxes*5"),
    read("anchor_table", "2*total"),
    Binding("in", "mask", "anchors", dtype="i32"),
    read("multipliers", "classes", used_if="counters"),
)

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "yolo_fwd_f32",
        SOURCE,
        "dm_yolo_args",
        x_to_y(_OUTPUT, _OUTPUT),
        Grid(("spatial", "channels", "batch"), (64, 4, 1)),
    ),
    Kernel(
        "yolo_loss_bwd_cells_f32",
        SOURCE,
        "dm_yolo_loss_args",
        (*_LOSS_INPUTS, write("delta", _DELTA), write("partials", _PARTIALS)),
        _CELLS,
    ),
    Kernel(
        "yolo_loss_bwd_truths_f32",
        SOURCE,
        "dm_yolo_loss_args",
        (*_LOSS_INPUTS, read_write("delta", _DELTA), write("images", _IMAGES)),
        Grid(("batch",), (32,)),
    ),
    Kernel(
        "yolo_loss_bwd_squares_f32",
        SOURCE,
        "dm_yolo_loss_args",
        (read_write("delta", _DELTA), write("partials", _PARTIALS)),
        _CELLS,
    ),
    Kernel(
        "yolo_loss_bwd_stats_f32",
        SOURCE,
        "dm_yolo_loss_args",
        # The 17 stats in YOLO_STAT_NAMES order (nothing is written for an empty batch).
        (read("partials", _PARTIALS), read("images", _IMAGES), write("stats", "17*min(batch, 1)")),
        # One threadgroup: the host dispatches one = 1.
        Grid(("one",), (256,), (1,)),
    ),
)

HALF_TWINS = ("yolo_fwd_f32",)
