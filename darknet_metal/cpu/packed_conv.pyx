# cython: language_level=3
"""float32 convolutions for inference with their weights packed once (one group).

A convolution is the product of its (F, C*k*k) weights with its input unfolded into
(C*k*k, out_h*out_w) columns (im2col; a plain 1x1 convolution's input planes already are the
columns). BLAS packs both operands into its own layout on every call, the whole weight matrix
again for each block of columns; here the weights are packed once, when the network is
prepared (``pack_weights``), and the columns are read where they lie (on Intel CPUs, copied a
chunk at a time into one contiguous panel first): ``kernels.h``'s ``dm_gemm8_f32`` multiplies
blocks of 8 filters by runs of columns with fused multiply-adds, and adds the bias and the
activation while each block is in cache. Only for inference:
training keeps Darknet's im2col + GEMM (``conv.conv2d_step``).

The unfolding is shared out with the product: on large outputs each part takes a run of
blocks of output rows (at least ``MIN_BLOCK_COLUMNS`` columns a block) and unfolds one block
after another into its own stretch of the workspace, multiplying each by every filter while it
is in cache; when there are fewer blocks than parts (small outputs with many channels), the
whole input is unfolded first, by channels, and the product shared out by runs of columns and
blocks of filters.

Contract: the package's (``darknet_metal.cpu``), float32 only; ``conv_step`` checks its
arguments and returns the ``NativeStep`` that runs a layer without the GIL.
"""

from darknet_metal.cpu.activation cimport ACT_COUNT
from darknet_metal.cpu.blas cimport cpu_threads, run_parts
from darknet_metal.cpu.im2col cimport im2col
from darknet_metal.cpu.kernels cimport (
    DM_GEMM8_M,
    dm_gemm8_columns,
    dm_gemm8_f32,
    dm_pack8_f32,
    dm_pack8_size,
)
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_workspace
from darknet_metal.cpu.conv import conv_geometry

# Parts per thread, and the fewest multiply-adds worth waking the helper threads for.
cdef int PARTS_PER_THREAD = 4
cdef double SPLIT_WORK = 4.0 * (1 << 20)
# Fewest columns of a block of output rows unfolded and multiplied by one part (4 runs of the
# kernel's 32: the weights are read once per block, from L2 or L3).
cdef Py_ssize_t MIN_BLOCK_COLUMNS = 128


def packed_size(int filters, int k) -> int:
    """Floats of the packed weights of a convolution with ``filters`` rows of ``k`` weights."""
    return dm_pack8_size(filters, k)


def pack_weights(weights: np.ndarray) -> np.ndarray:
    """(F, K) float32 weights (K = C*k*k, Darknet's order) in the packed order ``conv_step``
    takes: blocks of 8 filters, each stored weight by weight (filters past F are zero).
    Returns a new 1-D array."""
    check_input("weights", weights, (2,), layout="(F, K)")
    if weights.dtype != np.float32:
        raise ArgumentError(f"pack_weights: weights must be float32, not {weights.dtype}")
    cdef Py_ssize_t filters = weights.shape[0], k = weights.shape[1]
    packed = np.empty(dm_pack8_size(filters, k), np.float32)
    cdef float[:, ::1] w = weights
    cdef float[::1] p = packed
    if filters and k:
        dm_pack8_f32(&w[0, 0], filters, k, &p[0])
    return packed


cdef enum:  # buffer roles
    PC_X, PC_PACKED, PC_BIAS, PC_OUT, PC_WORKSPACE

cdef struct PackedParams:
    Py_ssize_t batch, channels, height, width, filters, out_h, out_w, k
    int ksize, stride_x, stride_y, pad, dilation, act
    bint unfold  # else a plain 1x1: the input planes are the columns


ctypedef struct PackedJob:
    const float* x        # this image
    const float* packed
    const float* bias
    float* out            # this image
    float* columns        # the workspace, or x itself for a plain 1x1
    const PackedParams* p
    Py_ssize_t mblocks, spatial
    # A product shared out by runs of columns and blocks of filters.
    Py_ssize_t mb_parts, mbs, col_parts, cols
    # Runs of blocks of output rows, each block unfolded and multiplied in turn by one part.
    Py_ssize_t block_rows, part_blocks
    # The unfolding shared out by channels.
    Py_ssize_t unfold_channels


cdef inline void _unfold(const PackedJob* j, Py_ssize_t c0, Py_ssize_t c1, Py_ssize_t oy0,
                         Py_ssize_t oy1, float* columns) noexcept nogil:
    cdef const PackedParams* p = j.p
    im2col(j.x + c0 * p.height * p.width, c1 - c0, p.height, p.width, p.ksize, p.stride_x,
           p.stride_y, p.pad * p.dilation, p.dilation, oy0, oy1, p.out_w, columns)


cdef void _unfold_part(void* ctx, int part) noexcept nogil:
    # Channels [c0, c1) of the whole image: rows [c0*k*k, c1*k*k) of the columns.
    cdef PackedJob* j = <PackedJob*>ctx
    cdef Py_ssize_t c0 = part * j.unfold_channels
    cdef Py_ssize_t c1 = min(j.p.channels, c0 + j.unfold_channels)
    _unfold(j, c0, c1, 0, j.p.out_h, j.columns + c0 * j.p.ksize * j.p.ksize * j.spatial)


cdef void _product_part(void* ctx, int part) noexcept nogil:
    cdef PackedJob* j = <PackedJob*>ctx
    cdef const PackedParams* p = j.p
    cdef Py_ssize_t mb0 = (part // j.col_parts) * j.mbs, mb1 = min(j.mblocks, mb0 + j.mbs)
    cdef Py_ssize_t x0 = (part % j.col_parts) * j.cols, x1 = min(j.spatial, x0 + j.cols)
    dm_gemm8_f32(p.filters, p.k, j.packed, j.columns, j.spatial, j.bias, p.act, mb0, mb1, x0,
                 x1, j.out, j.spatial)


cdef void _block_part(void* ctx, int part) noexcept nogil:
    # Blocks of output rows [oy0, oy1) one after the other, each unfolded into this part's
    # own stretch of the workspace (which stays in cache from block to block; parts running
    # at once never share one) and multiplied by every filter while in cache.
    cdef PackedJob* j = <PackedJob*>ctx
    cdef const PackedParams* p = j.p
    cdef Py_ssize_t first = part * j.part_blocks * j.block_rows
    cdef Py_ssize_t last = min(p.out_h, first + j.part_blocks * j.block_rows)
    cdef Py_ssize_t oy0, oy1, cols
    cdef float* columns = j.columns + part * j.block_rows * p.out_w * p.k
    oy0 = first
    while oy0 < last:
        oy1 = min(last, oy0 + j.block_rows)
        cols = (oy1 - oy0) * p.out_w
        _unfold(j, 0, p.channels, oy0, oy1, columns)
        dm_gemm8_f32(p.filters, p.k, j.packed, columns, cols, j.bias, p.act, 0, j.mblocks, 0,
                     cols, j.out + oy0 * p.out_w, j.spatial)
        oy0 = oy1


cdef void _share_product(PackedJob* job, Py_ssize_t parts) noexcept nogil:
    # Parts take runs of columns with every block of filters first (the columns are then read
    # from memory once), and split the filters too only when there are fewer runs than parts.
    # A run is whole blocks of the kernel's columns.
    cdef Py_ssize_t step = dm_gemm8_columns()
    cdef Py_ssize_t col_blocks = (job.spatial + step - 1) // step
    job.col_parts = min(col_blocks, parts)
    job.cols = (col_blocks + job.col_parts - 1) // job.col_parts * step
    job.col_parts = (job.spatial + job.cols - 1) // job.cols
    job.mb_parts = min(job.mblocks, (parts + job.col_parts - 1) // job.col_parts)
    job.mbs = (job.mblocks + job.mb_parts - 1) // job.mb_parts
    job.mb_parts = (job.mblocks + job.mbs - 1) // job.mbs


cdef void _packed_step(const StepData* d) noexcept nogil:
    cdef const PackedParams* p = <const PackedParams*>d.params
    cdef PackedJob job
    cdef Py_ssize_t b, parts = 1, blocks = 1, unfold_parts = 1
    cdef int threads = cpu_threads()
    job.packed, job.bias, job.p = <const float*>d.buf[PC_PACKED], <const float*>d.buf[PC_BIAS], p
    job.mblocks = (p.filters + DM_GEMM8_M - 1) // DM_GEMM8_M
    job.spatial = p.out_h * p.out_w
    if threads > 1 and <double>p.filters * p.k * job.spatial >= SPLIT_WORK:
        parts = threads * PARTS_PER_THREAD
    _share_product(&job, parts)
    job.block_rows = (MIN_BLOCK_COLUMNS + p.out_w - 1) // p.out_w
    blocks = (p.out_h + job.block_rows - 1) // job.block_rows
    job.part_blocks = (blocks + parts - 1) // parts
    job.unfold_channels = (p.channels + threads - 1) // threads if parts > 1 else p.channels
    unfold_parts = (p.channels + job.unfold_channels - 1) // job.unfold_channels
    for b in range(p.batch):
        job.x = <const float*>d.buf[PC_X] + b * p.channels * p.height * p.width
        job.out = <float*>d.buf[PC_OUT] + b * p.filters * job.spatial
        if not p.unfold:
            job.columns = <float*>job.x
            run_parts(_product_part, &job, <int>(job.mb_parts * job.col_parts))
        elif blocks >= parts:
            job.columns = <float*>d.buf[PC_WORKSPACE]
            run_parts(_block_part, &job, <int>((blocks + job.part_blocks - 1) // job.part_blocks))
        else:
            job.columns = <float*>d.buf[PC_WORKSPACE]
            run_parts(_unfold_part, &job, <int>unfold_parts)
            run_parts(_product_part, &job, <int>(job.mb_parts * job.col_parts))


def workspace_size(int channels, int ksize, int stride_x, int stride_y, int pad, int out_h,
                   int out_w) -> int:
    """Elements of workspace ``conv_step`` needs: one image's unfolded input, or 0 for a plain
    1x1 convolution (stride 1, no padding), whose input planes are multiplied as they are."""
    if (ksize, stride_x, stride_y, pad) == (1, 1, 1, 0):
        return 0
    return channels * ksize * ksize * out_h * out_w


def conv_step(x, packed, bias, out, workspace, int ksize, int stride_x, int stride_y, int pad,
              int dilation, int act) -> NativeStep:
    """A convolution of one group: ``out = act(conv(x, w) + bias)`` with ``w`` packed.

    x: (N, C, H, W) float32; packed: ``pack_weights`` of the (F, C*ksize*ksize) weights
    (batch norm folded in); bias: (F,); out: (N, F, out_h, out_w) with Darknet's geometry
    (``conv.conv2d_step``'s); workspace: 1-D float32 of at least ``workspace_size(...)``
    elements (None for a plain 1x1). All C-contiguous. ``act`` is an elementwise activation
    id from ``darknet_metal.model.activations`` (any other is the caller's). Each output is a
    chain of fused multiply-adds over its weights in Darknet's order, then + bias: the same
    bits on every CPU and for every thread count, but not BLAS's rounding.
    """
    check_input("x", x)
    if x.dtype != np.float32:
        raise ArgumentError(f"packed conv: x must be float32, not {x.dtype}")
    check_input("packed", packed, (1,), x, layout="(packed weights,)")
    check_input("bias", bias, (1,), x, layout="(F,)")
    check_input("out", out, (4,), x, writable=True)
    cdef Py_ssize_t filters = bias.shape[0], k = x.shape[1] * ksize * ksize
    cdef Py_ssize_t batch, channels, height, width, out_h, out_w
    batch, channels, height, width, _, out_h, out_w, k = conv_geometry(
        "packed conv", x.shape, "weights", (filters, k), "out", out.shape, ksize, stride_x,
        stride_y, pad, dilation, 1)
    if packed.shape[0] != dm_pack8_size(filters, k):
        raise ArgumentError(f"packed conv: packed weights have {packed.shape[0]} floats, "
                            f"expected {dm_pack8_size(filters, k)} for {filters} filters of "
                            f"{k} weights (pack_weights)")
    if not 0 <= act < ACT_COUNT:
        raise ArgumentError(f"packed conv: activation id {act} out of range")
    cdef Py_ssize_t needed = workspace_size(channels, ksize, stride_x, stride_y, pad, out_h,
                                            out_w)
    if needed:
        check_workspace(workspace, x, needed, "packed conv")
    cdef NativeStep step = new_step(_packed_step, "packed_conv",
                                    (x, packed, bias, out, workspace), True,
                                    sizeof(PackedParams))
    cdef PackedParams* p = <PackedParams*>step.data.params
    p.batch, p.channels, p.height, p.width = batch, channels, height, width
    p.filters, p.out_h, p.out_w, p.k = filters, out_h, out_w, k
    p.ksize, p.stride_x, p.stride_y, p.pad, p.dilation = ksize, stride_x, stride_y, pad, dilation
    p.act, p.unfold = act, needed > 0
    return step


def conv_forward(x, packed, bias, out, workspace, int ksize, int stride_x, int stride_y,
                 int pad, int dilation, int act) -> None:
    """``conv_step(...)`` with the same arguments, run once."""
    conv_step(x, packed, bias, out, workspace, ksize, stride_x, stride_y, pad, dilation,
              act).run()
