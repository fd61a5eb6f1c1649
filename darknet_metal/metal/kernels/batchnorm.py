"""Kernels of ``shaders/batchnorm.metal``: the per-channel training steps of convolutional and
connected layers, the bias gradient and batch normalisation (forward with mini-batch
statistics, backward). Their weight and input gradients are GEMMs (``gemm``) and col2im
(``im2col``). Each per-channel sum is a ``*_part`` kernel over runs of ``chunk`` values and a
kernel adding the runs' sums (``sum_runs`` picks the runs)."""

from __future__ import annotations

from darknet_metal.metal.kernel_spec import Grid, Kernel
from darknet_metal.metal.kernels.shorthand import SPATIAL_3D, read, read_write, write

SOURCE = "batchnorm.metal"

#: Per-channel sums: a threadgroup of SUM_THREADS per run of ``chunk`` values of a channel
#: (``*_part`` kernels), then one of FINISH_THREADS per channel adding the runs' partial sums
#: (the shader's DM_SUM_THREADS and DM_FINISH_THREADS).
SUM_THREADS = 64
FINISH_THREADS = 32
#: The most runs a channel is cut into (beyond, runs get longer instead).
MAX_RUNS = 256
_RUNS = Grid(("chunks", "channels"), (SUM_THREADS, 1), (1, 1))
_PER_CHANNEL = Grid(("channels",), (FINISH_THREADS,), (1,))
_VALUES = "batch*channels*spatial"
_PARTIALS = "channels*chunks"
# What x_norm = (x - mean) / sqrt(variance + eps) is computed from.
_NORMALIZED_FROM = (read("x", _VALUES), read("mean", "channels"), read("variance", "channels"))
# One addition per value summed.
_SUM_FLOPS = "batch*channels*spatial"


def sum_runs(batch: int, spatial: int) -> dict[str, int]:
    """The runs a per-channel sum over ``batch`` x ``spatial`` values per channel is cut into:
    ``chunk`` values each (a multiple of SUM_THREADS, at least 8 per thread, so that a
    threadgroup's loads are worth its barriers) and ``chunks`` runs (at most MAX_RUNS). The
    fields ``chunk`` and ``chunks`` of the argument structs."""
    n = max(1, batch * spatial)
    per_thread = max(8, -(-n // (SUM_THREADS * MAX_RUNS)))
    chunk = SUM_THREADS * per_thread
    return {"chunk": chunk, "chunks": -(-n // chunk)}

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "bias_bwd_part_f32",
        SOURCE,
        "dm_bias_args",
        (read("delta", _VALUES), write("partials", _PARTIALS)),
        _RUNS,
        flops=_SUM_FLOPS,
    ),
    Kernel(
        "bias_bwd_f32",
        SOURCE,
        "dm_bias_args",
        (read("partials", _PARTIALS), read_write("bias_grad", "channels")),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_fwd_mean_part_f32",
        SOURCE,
        "dm_batchnorm_args",
        (read("x", _VALUES), write("partials", _PARTIALS)),
        _RUNS,
        flops=_SUM_FLOPS,
    ),
    Kernel(
        "batchnorm_fwd_mean_f32",
        SOURCE,
        "dm_batchnorm_args",
        (read("partials", _PARTIALS), write("mean", "channels")),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_fwd_var_part_f32",
        SOURCE,
        "dm_batchnorm_args",
        (read("x", _VALUES), read("mean", "channels"), write("partials", _PARTIALS)),
        _RUNS,
        flops="3*batch*channels*spatial",
    ),
    Kernel(
        "batchnorm_fwd_var_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            read("partials", _PARTIALS),
            read("mean", "channels"),
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
            write("out", _VALUES),
        ),
        SPATIAL_3D,
    ),
    Kernel(
        "batchnorm_bwd_part_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            read("delta", _VALUES),
            read("x", _VALUES),
            read("mean", "channels"),
            read("variance", "channels"),
            write("partials", "3*" + _PARTIALS),
        ),
        _RUNS,
        flops="8*batch*channels*spatial",
    ),
    Kernel(
        "batchnorm_bwd_sums_f32",
        SOURCE,
        "dm_batchnorm_args",
        (
            read("partials", "3*" + _PARTIALS),
            read("variance", "channels"),
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
