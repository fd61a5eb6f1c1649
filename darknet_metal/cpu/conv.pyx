# cython: language_level=3
"""Convolution and fully connected layers: im2col + BLAS GEMM, bias and activation fused.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays of
one dtype, checked by ``checks``; ``*_step`` returns the ``NativeStep`` that runs a layer
without the GIL: ``bias_activate`` and the kernels it and the GEMM loop call (``blas.gemm_rowmajor``, ``im2col.im2col``,
``activations.activate_array``, ``kernels.h``) are ``noexcept nogil``.

float32 3x3 stride-1 pad-1 convolutions with at most ``DIRECT_MAX_CHANNELS`` input channels
(the first layers of a detector) skip im2col and BLAS: ``kernels.h`` computes them directly,
vectorised along output rows. With K = 9*C of 27 or 144, BLAS was measured at a fraction of
its peak, and the direct loop is 2-3x faster on one core than the GEMM on two.
"""

from cython cimport floating

from darknet_metal.cpu.activations cimport ACT_COUNT, activate_array
from darknet_metal.cpu.blas cimport cpu_threads, gemm_rowmajor, run_parts
from darknet_metal.cpu.im2col cimport im2col
from darknet_metal.cpu.kernels cimport (
    dm_bias_act_f32,
    DM_DIRECT_FB,
    dm_conv3x3_direct_prepare_f32,
    dm_conv3x3_direct_rows_f32,
    dm_conv3x3_direct_scratch,
)
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_workspace


cdef void bias_activate(floating* out, const floating* bias, Py_ssize_t channels,
                        Py_ssize_t spatial, int act) noexcept nogil:
    """out[ch, i] = act(out[ch, i] + bias[ch]) for (channels, spatial) ``out``.

    float32 takes kernels.h's vectorised activations (every elementwise one), float64 the
    scalar ones here; channel activations are left to the caller."""
    cdef Py_ssize_t ch, i
    cdef floating* row
    if floating is float:
        dm_bias_act_f32(out, bias, channels, spatial, act)
    else:
        for ch in range(channels):
            row = out + ch * spatial
            for i in range(spatial):
                row[i] = row[i] + bias[ch]
            activate_array(row, spatial, act)


# Elements of im2col columns unfolded at once: 256 KiB of float32, well within L2 (measured
# 1.2-3x faster than unfolding a whole 416x416 image for the thin early layers).
cdef Py_ssize_t IM2COL_BLOCK = 1 << 16

#: Most input channels for which a float32 3x3 stride-1 convolution is computed directly
#: rather than by im2col + GEMM: with K = 9*C this small, BLAS runs far below its peak.
cdef Py_ssize_t DIRECT_MAX = 16
DIRECT_MAX_CHANNELS = DIRECT_MAX


def workspace_size(int channels, int ksize, int groups, int out_h, int out_w) -> int:
    """Elements of im2col workspace one convolution needs (0 for plain 1x1 convolutions)."""
    return (channels // groups) * ksize * ksize * out_h * out_w


cdef enum:  # buffer roles
    CONV_X, CONV_WEIGHTS, CONV_BIAS, CONV_OUT, CONV_WORKSPACE

cdef struct ConvParams:
    Py_ssize_t batch, channels, height, width, filters, out_h, out_w, workspace_size
    int ksize, stride_x, stride_y, pad, dilation, groups, act
    bint one_by_one


# Least multiply-adds of a convolution whose row blocks (or direct-kernel rows) are shared out
# among the GEMM threads; below it one thread does all (waking the helpers would cost more).
cdef double SPLIT_WORK = 4.0 * (1 << 20)
# Parts per thread of a direct convolution.
cdef int DIRECT_PARTS_PER_THREAD = 4


ctypedef struct BlockJob:
    # float32 im2col + GEMM of one (image, group): a part is one block of output rows.
    const float* src
    const float* weights
    const float* bias
    float* dst
    float* workspace
    const ConvParams* p
    Py_ssize_t cg, fg, k, block_rows


cdef void _block_part(void* ctx, int part) noexcept nogil:
    cdef BlockJob* j = <BlockJob*>ctx
    cdef const ConvParams* p = j.p
    cdef Py_ssize_t out_w = p.out_w, spatial = p.out_h * p.out_w
    cdef Py_ssize_t oy0 = part * j.block_rows, oy1 = min(p.out_h, oy0 + j.block_rows)
    cdef Py_ssize_t cols = (oy1 - oy0) * out_w, f
    # Each block unfolds into its own stretch of the workspace (the blocks together are one
    # whole im2col), so parts running at once never share scratch.
    cdef float* columns = j.workspace + oy0 * out_w * j.k
    im2col(j.src, j.cg, p.height, p.width, p.ksize, p.stride_x, p.stride_y,
           p.pad * p.dilation, p.dilation, oy0, oy1, out_w, columns)
    gemm_rowmajor(False, False, <int>j.fg, <int>cols, <int>j.k, j.weights, <int>j.k, columns,
                  <int>cols, 0, j.dst + oy0 * out_w, <int>spatial)
    for f in range(j.fg):
        bias_activate(j.dst + f * spatial + oy0 * out_w, j.bias + f, 1, cols, p.act)


ctypedef struct DirectJob:
    const float* bias
    const float* scratch
    float* out
    const ConvParams* p
    Py_ssize_t row_parts, rows


cdef void _direct_part(void* ctx, int part) noexcept nogil:
    cdef DirectJob* j = <DirectJob*>ctx
    cdef const ConvParams* p = j.p
    cdef Py_ssize_t fb = part // j.row_parts
    cdef Py_ssize_t y0 = (part % j.row_parts) * j.rows, y1 = min(p.height, y0 + j.rows)
    dm_conv3x3_direct_rows_f32(p.channels, p.height, p.width, j.bias, p.filters, p.act,
                               j.scratch, fb, y0, y1, j.out)


cdef void _conv2d(const floating* x, const floating* weights, const floating* bias,
                  floating* out, floating* workspace, const ConvParams* p) noexcept nogil:
    cdef Py_ssize_t channels = p.channels, height = p.height, width = p.width
    cdef Py_ssize_t filters = p.filters, out_h = p.out_h, out_w = p.out_w
    cdef Py_ssize_t cg = channels // p.groups, fg = filters // p.groups
    cdef Py_ssize_t k = cg * p.ksize * p.ksize, spatial = out_h * out_w
    cdef Py_ssize_t in_plane = height * width
    # The direct kernel takes its scratch from the workspace; a caller that sized it for
    # im2col only may have given too little, and then the GEMM path runs instead.
    cdef bint direct3 = (floating is float and p.ksize == 3 and p.stride_x == 1
                         and p.stride_y == 1 and p.pad == 1 and p.dilation == 1
                         and p.groups == 1 and channels <= DIRECT_MAX
                         and p.workspace_size >= dm_conv3x3_direct_scratch(
                             channels, filters, height, width))
    # Unfold a block of output rows at a time so the im2col columns stay in cache between
    # being written and being multiplied.
    cdef Py_ssize_t block_rows = max(1, IM2COL_BLOCK // max(1, k * out_w))
    cdef Py_ssize_t blocks = (out_h + block_rows - 1) // block_rows
    cdef int threads = cpu_threads()
    cdef bint split = threads > 1 and <double>fg * spatial * k >= SPLIT_WORK
    cdef Py_ssize_t b, g, oy0, oy1, cols, fblocks
    cdef const floating* src
    cdef floating* dst
    cdef BlockJob block_job
    cdef DirectJob direct_job
    for b in range(p.batch):
        if floating is float:
            if direct3:
                dm_conv3x3_direct_prepare_f32(x + b * channels * in_plane, channels, height,
                                              width, weights, filters, workspace)
                fblocks = (filters + DM_DIRECT_FB - 1) // DM_DIRECT_FB
                direct_job.bias, direct_job.scratch = bias, workspace
                direct_job.out, direct_job.p = out + b * filters * spatial, p
                direct_job.row_parts = 1
                if split:
                    direct_job.row_parts = max(
                        1, min(height, (threads * DIRECT_PARTS_PER_THREAD + fblocks - 1)
                               // fblocks))
                direct_job.rows = (height + direct_job.row_parts - 1) // direct_job.row_parts
                direct_job.row_parts = (height + direct_job.rows - 1) // direct_job.rows
                run_parts(_direct_part, &direct_job, <int>(fblocks * direct_job.row_parts))
                continue
        for g in range(p.groups):
            src = x + (b * channels + g * cg) * in_plane
            dst = out + (b * filters + g * fg) * spatial
            if p.one_by_one:
                # The input planes already are the GEMM operand: no unfolding.
                gemm_rowmajor(False, False, <int>fg, <int>spatial, <int>k,
                              weights + g * fg * k, <int>k, src, <int>spatial, 0, dst,
                              <int>spatial)
            else:
                if floating is float:
                    if split and blocks > 1:
                        # Blocks of rows on the GEMM threads, each with its bias and
                        # activation.
                        block_job.src, block_job.weights = src, weights + g * fg * k
                        block_job.bias, block_job.dst = bias + g * fg, dst
                        block_job.workspace, block_job.p = workspace, p
                        block_job.cg, block_job.fg, block_job.k = cg, fg, k
                        block_job.block_rows = block_rows
                        run_parts(_block_part, &block_job, <int>blocks)
                        continue
                oy0 = 0
                while oy0 < out_h:
                    oy1 = min(out_h, oy0 + block_rows)
                    cols = (oy1 - oy0) * out_w
                    im2col(src, cg, height, width, p.ksize, p.stride_x, p.stride_y,
                           p.pad * p.dilation, p.dilation, oy0, oy1, out_w, workspace)
                    gemm_rowmajor(False, False, <int>fg, <int>cols, <int>k,
                                  weights + g * fg * k, <int>k, workspace, <int>cols, 0,
                                  dst + oy0 * out_w, <int>spatial)
                    oy0 = oy1
            bias_activate(dst, bias + g * fg, fg, spatial, p.act)


cdef void _conv2d_step(const StepData* d) noexcept nogil:
    cdef const ConvParams* p = <const ConvParams*>d.params
    if d.f32:
        _conv2d(<const float*>d.buf[CONV_X], <const float*>d.buf[CONV_WEIGHTS],
                <const float*>d.buf[CONV_BIAS], <float*>d.buf[CONV_OUT],
                <float*>d.buf[CONV_WORKSPACE], p)
    else:
        _conv2d(<const double*>d.buf[CONV_X], <const double*>d.buf[CONV_WEIGHTS],
                <const double*>d.buf[CONV_BIAS], <double*>d.buf[CONV_OUT],
                <double*>d.buf[CONV_WORKSPACE], p)


def conv2d_step(x, weights, bias, out, workspace, int ksize, int stride_x, int stride_y,
                int pad, int dilation, int groups, int act) -> NativeStep:
    """Darknet convolution forward: ``out = act(conv(x, weights) + bias)``.

    x: (N, C, H, W); weights: (F, C/groups*ksize*ksize) in Darknet's (F, C, ky, kx) order;
    bias: (F,) (batch norm already folded in); out: (N, F, out_h, out_w) with Darknet's
    ``out = (in + 2*pad - ksize)//stride + 1``; workspace: 1-D, at least
    ``workspace_size(C, ksize, groups, out_h, out_w)`` elements (may be None for a plain
    1x1 convolution). All C-contiguous, of one dtype (float32 or float64). ``act`` is an
    elementwise activation id from ``darknet_metal.activations``; channel-mixing
    activations are applied by the caller. Dilation samples the input every ``dilation``
    pixels with padding ``pad*dilation``, as Darknet does.
    """
    check_input("x", x)
    check_input("weights", weights, (2,), x, layout="(F, C/groups*ksize*ksize)")
    check_input("bias", bias, (1,), x, layout="(F,)")
    check_input("out", out, (4,), x, writable=True)
    cdef Py_ssize_t batch, channels, height, width, out_h, out_w, k
    cdef Py_ssize_t filters = weights.shape[0]
    batch, channels, height, width = x.shape
    out_h, out_w = out.shape[2], out.shape[3]
    if ksize < 1 or stride_x < 1 or stride_y < 1 or dilation < 1 or pad < 0:
        raise ArgumentError(f"conv2d_forward: ksize={ksize}, strides ({stride_x}, {stride_y}) and "
                         f"dilation={dilation} must be >= 1 and pad={pad} >= 0")
    if groups < 1 or channels % groups or filters % groups:
        raise ArgumentError(f"conv2d_forward: groups={groups} must divide C={channels} and "
                         f"F={filters}")
    k = channels // groups * ksize * ksize
    if weights.shape[1] != k:
        raise ArgumentError(f"conv2d_forward: weights shape {weights.shape}, expected "
                         f"{(filters, k)}")
    if bias.shape[0] != filters:
        raise ArgumentError(f"conv2d_forward: bias has {bias.shape[0]} entries, expected {filters}")
    if out.shape[0] != batch or out.shape[1] != filters:
        raise ArgumentError(f"conv2d_forward: out shape ({out.shape[0]}, {out.shape[1]}, ...) does "
                         f"not match batch {batch} and {filters} filters")
    if (out_h != (height + 2 * pad * dilation - dilation * (ksize - 1) - 1) // stride_y + 1
            or out_w != (width + 2 * pad * dilation - dilation * (ksize - 1) - 1) // stride_x + 1):
        raise ArgumentError(f"conv2d_forward: out spatial size {out_h}x{out_w} does not match input "
                         f"{height}x{width} with ksize={ksize} stride=({stride_x},{stride_y}) "
                         f"pad={pad} dilation={dilation}")
    if not 0 <= act < ACT_COUNT:
        raise ArgumentError(f"conv2d_forward: activation id {act} out of range")
    cdef bint one_by_one = ksize == 1 and stride_x == 1 and stride_y == 1 and pad == 0
    if workspace is not None or not one_by_one:
        check_workspace(workspace, x, 0 if one_by_one else k * out_h * out_w, "conv2d_forward")
    cdef NativeStep step = new_step(_conv2d_step, "conv2d", (x, weights, bias, out, workspace),
                                    x.dtype == np.float32, sizeof(ConvParams))
    cdef ConvParams* p = <ConvParams*>step.data.params
    p.batch, p.channels, p.height, p.width = batch, channels, height, width
    p.filters, p.out_h, p.out_w = filters, out_h, out_w
    p.workspace_size = 0 if workspace is None else workspace.shape[0]
    p.ksize, p.stride_x, p.stride_y, p.pad, p.dilation = ksize, stride_x, stride_y, pad, dilation
    p.groups, p.act, p.one_by_one = groups, act, one_by_one
    return step


def conv2d_forward(x, weights, bias, out, workspace, int ksize, int stride_x, int stride_y,
                   int pad, int dilation, int groups, int act) -> None:
    """``conv2d_step(...)`` with the same arguments, run once."""
    conv2d_step(x, weights, bias, out, workspace, ksize, stride_x, stride_y, pad, dilation,
                groups, act).run()


cdef enum:  # buffer roles
    FC_X, FC_WEIGHTS, FC_BIAS, FC_OUT

cdef struct ConnectedParams:
    Py_ssize_t batch, inputs, outputs
    int act


cdef void _connected(const floating* x, const floating* weights, const floating* bias,
                     floating* out, const ConnectedParams* p) noexcept nogil:
    cdef Py_ssize_t b
    gemm_rowmajor(False, True, <int>p.batch, <int>p.outputs, <int>p.inputs, x, <int>p.inputs,
                  weights, <int>p.inputs, 0, out, <int>p.outputs)
    for b in range(p.batch):
        bias_activate(out + b * p.outputs, bias, p.outputs, 1, p.act)


cdef void _connected_step(const StepData* d) noexcept nogil:
    cdef const ConnectedParams* p = <const ConnectedParams*>d.params
    if d.f32:
        _connected(<const float*>d.buf[FC_X], <const float*>d.buf[FC_WEIGHTS],
                   <const float*>d.buf[FC_BIAS], <float*>d.buf[FC_OUT], p)
    else:
        _connected(<const double*>d.buf[FC_X], <const double*>d.buf[FC_WEIGHTS],
                   <const double*>d.buf[FC_BIAS], <double*>d.buf[FC_OUT], p)


def connected_step(x, weights, bias, out, int act) -> NativeStep:
    """Darknet connected forward: ``out = act(x @ weights.T + bias)``.

    x: (N, inputs); weights: (outputs, inputs) in Darknet's order; bias: (outputs,);
    out: (N, outputs). All C-contiguous, of one dtype (float32 or float64). ``act`` is an
    elementwise activation id.
    """
    check_input("x", x, (2,), layout="(N, inputs)")
    check_input("weights", weights, (2,), x, layout="(outputs, inputs)")
    check_input("bias", bias, (1,), x, layout="(outputs,)")
    check_input("out", out, (2,), x, layout="(N, outputs)", writable=True)
    cdef Py_ssize_t batch, inputs
    cdef Py_ssize_t outputs = weights.shape[0]
    batch, inputs = x.shape
    if weights.shape[1] != inputs:
        raise ArgumentError(f"connected_forward: weights shape {weights.shape}, expected "
                         f"{(outputs, inputs)}")
    if bias.shape[0] != outputs or out.shape[0] != batch or out.shape[1] != outputs:
        raise ArgumentError(f"connected_forward: bias {bias.shape[0]} / out {out.shape} do not "
                         f"match ({batch}, {outputs})")
    if not 0 <= act < ACT_COUNT:
        raise ArgumentError(f"connected_forward: activation id {act} out of range")
    cdef NativeStep step = new_step(_connected_step, "connected", (x, weights, bias, out),
                                    x.dtype == np.float32, sizeof(ConnectedParams))
    cdef ConnectedParams* p = <ConnectedParams*>step.data.params
    p.batch, p.inputs, p.outputs, p.act = batch, inputs, outputs, act
    return step


def connected_forward(x, weights, bias, out, int act) -> None:
    """``connected_step(x, weights, bias, out, act)`` run once."""
    connected_step(x, weights, bias, out, act).run()
