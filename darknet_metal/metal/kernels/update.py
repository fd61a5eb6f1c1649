"""Kernels of ``shaders/update.metal``: the optimizer updates (SGD with momentum, Adam)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Kernel
from darknet_metal.metal.kernels.shorthand import ELEMENTS, read, read_write

SOURCE = "update.metal"

# The learning rate and Adam's t are one-float buffers, read when the kernel runs.
KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "sgd_upd_f32",
        SOURCE,
        "dm_sgd_args",
        (read("lr", "min(n, 1)"), read_write("param", "n"), read_write("grad_acc", "n")),
        ELEMENTS,
    ),
    Kernel(
        "adam_upd_f32",
        SOURCE,
        "dm_adam_args",
        (
            read("lr", "min(n, 1)"),
            read("t", "min(n, 1)"),
            *(read_write(role, "n") for role in ("param", "grad_acc", "m", "v")),
        ),
        ELEMENTS,
    ),
)

HALF_TWINS: tuple[str, ...] = ()
