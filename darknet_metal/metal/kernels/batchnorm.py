"""Kernels of ``shaders/batchnorm.metal``: the per-channel training steps of convolutional and
connected layers, the bias gradient and batch normalisation (forward with mini-batch
statistics, backward). Their weight and input gradients are GEMMs (``gemm``) and col2im
(``im2col``)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Grid, Kernel
from darknet_metal.metal.kernels.shorthand import SPATIAL_3D, read, read_write, write

SOURCE = "batchnorm.metal"

_PER_CHANNEL = Grid(("channels",), (32,))  # one thread sums each channel, serially
_VALUES = "batch*channels*spatial"
# What x_norm = (x - mean) / sqrt(variance + eps) is computed from.
_NORMALIZED_FROM = (read("x", _VALUES), read("mean", "channels"), read("variance", "channels"))

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "bias_bwd_f32",
        SOURCE,
        "dm_bias_args",
        (read("delta", _VALUES), read_write("bias_grad", "channels")),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_fwd_stats_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            read("x", _VALUES),
            write("mean", "channels"),
            write("variance", "channels"),
            read_write("rolling_mean", "channels"),
            read_write("rolling_variance", "channels"),
        ),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_fwd_norm_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            *_NORMALIZED_FROM,
            read("scale", "channels"),
            read("bias", "channels"),
            write("x_norm", _VALUES),
            write("out", _VALUES),
        ),
        SPATIAL_3D,
    ),
    Kernel(
        "batchnorm_fwd_xnorm_f32",
        SOURCE,
        "dm_batchnorm_args",
        (*_NORMALIZED_FROM, write("x_norm", _VALUES)),
        SPATIAL_3D,
    ),
    Kernel(
        "batchnorm_bwd_sums_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            read("delta", _VALUES),
            *_NORMALIZED_FROM,
            read("x_norm", _VALUES),
            read("scale", "channels"),
            read_write("scale_grad", "channels"),
            read_write("bias_grad", "channels"),
            write("mean_delta", "channels"),
            write("var_delta", "channels"),
        ),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_bwd_delta_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            *_NORMALIZED_FROM,
            read("scale", "channels"),
            read("mean_delta", "channels"),
            read("var_delta", "channels"),
            read_write("delta", _VALUES),
        ),
        SPATIAL_3D,
    ),
)

HALF_TWINS: tuple[str, ...] = ()
