# cython: language_level=3
"""float32 1x1 convolutions for inference, with their weights packed once.

A plain 1x1 convolution (stride 1, no padding, one group) is the product of its (F, C)
weights with its (C, H*W) input planes. BLAS packs both operands into its own layout on every
call; here the weights are packed once, when the network is prepared (``pack_weights``), and
the input planes are read where they lie: ``kernels.h``'s ``dm_gemm8_f32`` multiplies blocks of
8 filters by runs of columns with fused multiply-adds, and adds the bias and the activation
while each block is in cache. Only for inference: training keeps Darknet's im2col + GEMM
(``conv.conv2d_step``).

Contract: the package's (``darknet_metal.cpu``), float32 only; ``conv1x1_step`` checks its
arguments and returns the ``NativeStep`` that runs a layer without the GIL.
"""

from darknet_metal.cpu.activations cimport ACT_COUNT
from darknet_metal.cpu.blas cimport cpu_threads, run_parts
from darknet_metal.cpu.kernels cimport DM_GEMM8_M, dm_gemm8_f32, dm_pack8_f32, dm_pack8_size
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input

# Columns of one part's share, a multiple of the kernel's blocks.
cdef Py_ssize_t COLUMN_STEP = 32
# Parts per thread, and the fewest multiply-adds worth waking the helper threads for.
cdef int PARTS_PER_THREAD = 4
cdef double SPLIT_WORK = 4.0 * (1 << 20)


def packed_size(int filters, int channels) -> int:
    """Floats of the packed weights of a (filters, channels) 1x1 convolution."""
    return dm_pack8_size(filters, channels)


def pack_weights(weights: np.ndarray) -> np.ndarray:
    """(F, C) float32 weights in the packed order ``conv1x1_step`` takes: blocks of 8 filters,
    each stored channel by channel (filters past F are zero). Returns a new 1-D array."""
    check_input("weights", weights, (2,), layout="(F, C)")
    if weights.dtype != np.float32:
        raise ArgumentError(f"pack_weights: weights must be float32, not {weights.dtype}")
    cdef Py_ssize_t filters = weights.shape[0], channels = weights.shape[1]
    packed = np.empty(dm_pack8_size(filters, channels), np.float32)
    cdef float[:, ::1] w = weights
    cdef float[::1] p = packed
    if filters and channels:
        dm_pack8_f32(&w[0, 0], filters, channels, &p[0])
    return packed


cdef enum:  # buffer roles
    PW_X, PW_PACKED, PW_BIAS, PW_OUT

cdef struct PointwiseParams:
    Py_ssize_t batch, channels, filters, pixels
    int act


ctypedef struct PointwiseJob:
    const float* x
    const float* packed
    const float* bias
    float* out
    const PointwiseParams* p
    Py_ssize_t mblocks, mb_parts, mbs, col_parts, cols


cdef void _pointwise_part(void* ctx, int part) noexcept nogil:
    cdef PointwiseJob* j = <PointwiseJob*>ctx
    cdef const PointwiseParams* p = j.p
    cdef Py_ssize_t mb0 = (part // j.col_parts) * j.mbs, mb1 = min(j.mblocks, mb0 + j.mbs)
    cdef Py_ssize_t x0 = (part % j.col_parts) * j.cols, x1 = min(p.pixels, x0 + j.cols)
    dm_gemm8_f32(p.filters, p.channels, j.packed, j.x, p.pixels, j.bias, p.act, mb0, mb1, x0,
                 x1, j.out)


cdef void _pointwise_step(const StepData* d) noexcept nogil:
    cdef const PointwiseParams* p = <const PointwiseParams*>d.params
    cdef PointwiseJob job
    cdef Py_ssize_t b, parts = 1, col_blocks = (p.pixels + COLUMN_STEP - 1) // COLUMN_STEP
    cdef int threads = cpu_threads()
    job.packed, job.bias, job.p = <const float*>d.buf[PW_PACKED], <const float*>d.buf[PW_BIAS], p
    job.mblocks = (p.filters + DM_GEMM8_M - 1) // DM_GEMM8_M
    if threads > 1 and <double>p.filters * p.channels * p.pixels >= SPLIT_WORK:
        parts = threads * PARTS_PER_THREAD
    # Parts take runs of columns with every block of filters first (the columns are then read
    # from memory once), and split the filters too only when there are fewer runs than parts.
    job.col_parts = min(col_blocks, parts)
    job.cols = (col_blocks + job.col_parts - 1) // job.col_parts * COLUMN_STEP
    job.col_parts = (p.pixels + job.cols - 1) // job.cols
    job.mb_parts = min(job.mblocks, (parts + job.col_parts - 1) // job.col_parts)
    job.mbs = (job.mblocks + job.mb_parts - 1) // job.mb_parts
    job.mb_parts = (job.mblocks + job.mbs - 1) // job.mbs
    for b in range(p.batch):
        job.x = <const float*>d.buf[PW_X] + b * p.channels * p.pixels
        job.out = <float*>d.buf[PW_OUT] + b * p.filters * p.pixels
        run_parts(_pointwise_part, &job, <int>(job.mb_parts * job.col_parts))


def conv1x1_step(x, packed, bias, out, int act) -> NativeStep:
    """A 1x1 convolution, stride 1, no padding, one group: ``out = act(w @ x + bias)``.

    x: (N, C, H, W) float32; packed: ``pack_weights`` of the
    (F, C) weights (batch norm folded in); bias: (F,); out: (N, F, H, W). All C-contiguous.
    ``act`` is an elementwise activation id from ``darknet_metal.model.activations`` (any
    other is the caller's). Each output is a chain of fused multiply-adds over the channels
    in order, then + bias: the same bits on every CPU, but not BLAS's rounding.
    """
    check_input("x", x)
    if x.dtype != np.float32:
        raise ArgumentError(f"conv1x1_forward: x must be float32, not {x.dtype}")
    check_input("packed", packed, (1,), x, layout="(packed weights,)")
    check_input("bias", bias, (1,), x, layout="(F,)")
    check_input("out", out, (4,), x, writable=True)
    cdef Py_ssize_t batch = x.shape[0], channels = x.shape[1]
    cdef Py_ssize_t filters = bias.shape[0], pixels = x.shape[2] * x.shape[3]
    if out.shape != (batch, filters, x.shape[2], x.shape[3]):
        raise ArgumentError(f"conv1x1_forward: out shape {out.shape}, expected "
                            f"{(batch, filters, x.shape[2], x.shape[3])}")
    if packed.shape[0] != dm_pack8_size(filters, channels):
        raise ArgumentError(f"conv1x1_forward: packed weights have {packed.shape[0]} floats, "
                            f"expected {dm_pack8_size(filters, channels)} for {filters} "
                            f"filters of {channels} channels (pack_weights)")
    if pixels < 1 or channels < 1 or filters < 1:
        raise ArgumentError(f"conv1x1_forward: {x.shape[2]}x{x.shape[3]} outputs, {channels} "
                            f"channels and {filters} filters: each must be >= 1")
    if not 0 <= act < ACT_COUNT:
        raise ArgumentError(f"conv1x1_forward: activation id {act} out of range")
    cdef NativeStep step = new_step(_pointwise_step, "conv1x1", (x, packed, bias, out), True,
                                    sizeof(PointwiseParams))
    cdef PointwiseParams* p = <PointwiseParams*>step.data.params
    p.batch, p.channels, p.filters, p.pixels, p.act = batch, channels, filters, pixels, act
    return step


def conv1x1_forward(x, packed, bias, out, int act) -> None:
    """``conv1x1_step(x, packed, bias, out, act)`` run once."""
    conv1x1_step(x, packed, bias, out, act).run()
