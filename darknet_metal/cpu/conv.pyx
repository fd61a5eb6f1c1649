# cython: language_level=3
"""Convolution and fully connected layers: im2col + BLAS GEMM, bias and activation fused;
their gradients for training (weights, bias, input; see the section at the end).

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays of
one dtype, checked by ``checks``; ``*_step`` returns the ``NativeStep`` that runs a layer
without the GIL: ``bias_activate`` and the kernels it and the GEMM loops call
(``blas.gemm_rowmajor``, ``im2col.im2col`` and ``col2im``, ``activations.activate_array``,
``kernels.h``) are ``noexcept nogil``.

float32 3x3 pad-1 convolutions with at most ``DIRECT_MAX_CHANNELS`` input channels at stride 1
and ``DIRECT_MAX_CHANNELS_STRIDE2`` at stride 2 (the first layers of a detector) skip im2col
and BLAS: ``kernels.h`` computes them directly, vectorised along output rows, each sum in
Darknet's own order and rounding (so training keeps Darknet's arithmetic). With K = 9*C this
small, BLAS runs far below its peak; the direct loop was measured 2-3x faster on one core
than the GEMM on two at stride 1 (C <= 16), and at stride 2 0.62x the GEMM's time for C = 3.
From 32 channels the inference path's packed product (``packed_conv``) is faster than either.
"""

from cython cimport floating

from darknet_metal.cpu.activation cimport ACT_COUNT, activate_array
from darknet_metal.cpu.blas cimport cpu_threads, gemm_rowmajor, run_parts
from darknet_metal.cpu.im2col cimport col2im, im2col
from darknet_metal.cpu.kernels cimport (
    dm_bias_act_f32,
    DM_DIRECT_FB,
    dm_conv3x3_direct_pad_f32,
    dm_conv3x3_direct_rows_f32,
    dm_conv3x3_direct_scratch,
    dm_conv3x3_direct_weights_f32,
)
from darknet_metal.cpu.step cimport NativeStep, StepData, StepFn, new_step

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
#: rather than by im2col + GEMM.
cdef Py_ssize_t DIRECT_MAX = 16
DIRECT_MAX_CHANNELS = DIRECT_MAX
#: The same for stride 2.
cdef Py_ssize_t DIRECT_MAX_STRIDE2 = 16
DIRECT_MAX_CHANNELS_STRIDE2 = DIRECT_MAX_STRIDE2


cdef Py_ssize_t _direct_scratch(Py_ssize_t channels, Py_ssize_t filters, Py_ssize_t height,
                                Py_ssize_t width, int ksize, int stride_x, int stride_y,
                                int pad, int dilation, int groups) noexcept nogil:
    # The scratch of the float32 direct path, 0 for a convolution it does not take.
    if (ksize != 3 or stride_x != stride_y or pad != 1 or dilation != 1 or groups != 1
            or not ((stride_x == 1 and channels <= DIRECT_MAX)
                    or (stride_x == 2 and channels <= DIRECT_MAX_STRIDE2))):
        return 0
    return dm_conv3x3_direct_scratch(channels, filters, height, width, stride_x)


def direct_workspace_size(int channels, int filters, int height, int width, int ksize,
                          int stride_x, int stride_y, int pad, int dilation, int groups) -> int:
    """Elements of workspace a float32 convolution computed directly needs (its padded input
    and regrouped weights), or 0 where it is computed by im2col + GEMM. ``conv2d_step`` takes
    the direct path only when its workspace holds this much."""
    return _direct_scratch(channels, filters, height, width, ksize, stride_x, stride_y, pad,
                           dilation, groups)


def workspace_size(int channels, int ksize, int groups, int out_h, int out_w) -> int:
    """Elements of im2col workspace one convolution needs (0 for plain 1x1 convolutions)."""
    return (channels // groups) * ksize * ksize * out_h * out_w


def conv_geometry(str where, tuple x_shape, str w_name, tuple w_shape, str o_name,
                   tuple o_shape, int ksize, int stride_x, int stride_y, int pad, int dilation,
                   int groups) -> tuple:
    """Check a convolution's shapes against each other and its geometry.

    x_shape: (N, C, H, W) of the input (or of its gradient); w_shape: (F, C/groups*k*k) of
    the weights (or of their gradient), named ``w_name``; o_shape: (N, F, out_h, out_w) of
    the output (or of its delta), named ``o_name``. Returns (N, C, H, W, F, out_h, out_w,
    C/groups*k*k); raises ArgumentError, starting with ``where``, on any mismatch.
    """
    batch, channels, height, width = x_shape
    filters = w_shape[0]
    out_h, out_w = o_shape[2], o_shape[3]
    if ksize < 1 or stride_x < 1 or stride_y < 1 or dilation < 1 or pad < 0:
        raise ArgumentError(f"{where}: ksize={ksize}, strides ({stride_x}, {stride_y}) and "
                            f"dilation={dilation} must be >= 1 and pad={pad} >= 0")
    if groups < 1 or channels % groups or filters % groups:
        raise ArgumentError(f"{where}: groups={groups} must divide C={channels} and "
                            f"F={filters}")
    if channels < 1 or filters < 1:
        raise ArgumentError(f"{where}: C={channels} and F={filters} must be >= 1")
    k = channels // groups * ksize * ksize
    if w_shape[1] != k:
        raise ArgumentError(f"{where}: {w_name} shape {w_shape}, expected {(filters, k)}")
    if o_shape[0] != batch or o_shape[1] != filters:
        raise ArgumentError(f"{where}: {o_name} shape ({o_shape[0]}, {o_shape[1]}, ...) does "
                            f"not match batch {batch} and {filters} filters")
    if (out_h != (height + 2 * pad * dilation - dilation * (ksize - 1) - 1) // stride_y + 1
            or out_w != (width + 2 * pad * dilation - dilation * (ksize - 1) - 1) // stride_x + 1):
        raise ArgumentError(f"{where}: {o_name} spatial size {out_h}x{out_w} does not match "
                            f"input {height}x{width} with ksize={ksize} "
                            f"stride=({stride_x},{stride_y}) pad={pad} dilation={dilation}")
    if out_h < 1 or out_w < 1:
        raise ArgumentError(f"{where}: ksize={ksize} dilation={dilation} pad={pad} leave no "
                            f"output pixels on a {height}x{width} input")
    return batch, channels, height, width, filters, out_h, out_w, k


cdef enum:  # buffer roles
    CONV_X, CONV_WEIGHTS, CONV_BIAS, CONV_OUT, CONV_WORKSPACE

cdef struct ConvParams:
    Py_ssize_t batch, channels, height, width, filters, out_h, out_w, workspace_size
    int ksize, stride_x, stride_y, pad, dilation, groups, act
    bint one_by_one, fused


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
    const float* x
    const float* bias
    float* scratch
    float* out
    const ConvParams* p
    Py_ssize_t row_parts, rows, fblocks, fb_parts, fbs, pad_channels


cdef void _direct_pad_part(void* ctx, int part) noexcept nogil:
    cdef DirectJob* j = <DirectJob*>ctx
    cdef Py_ssize_t c0 = part * j.pad_channels
    dm_conv3x3_direct_pad_f32(j.x, j.p.height, j.p.width, j.p.stride_x, c0,
                              min(j.p.channels, c0 + j.pad_channels), j.scratch)


cdef void _direct_part(void* ctx, int part) noexcept nogil:
    cdef DirectJob* j = <DirectJob*>ctx
    cdef const ConvParams* p = j.p
    cdef Py_ssize_t fb0 = (part // j.row_parts) * j.fbs, fb1 = min(j.fblocks, fb0 + j.fbs)
    cdef Py_ssize_t y0 = (part % j.row_parts) * j.rows, y1 = min(p.out_h, y0 + j.rows)
    dm_conv3x3_direct_rows_f32(p.channels, p.height, p.width, p.stride_x, j.bias, p.filters,
                               p.act, j.scratch, fb0, fb1, y0, y1, p.fused, j.out)


cdef void _conv2d_direct(const float* x, const float* weights, const float* bias, float* out,
                         float* workspace, const ConvParams* p, bint split) noexcept nogil:
    cdef Py_ssize_t b, pad_parts = 1, parts = 1
    cdef int threads = cpu_threads()
    cdef DirectJob job
    job.bias, job.scratch, job.p = bias, workspace, p
    job.fblocks = (p.filters + DM_DIRECT_FB - 1) // DM_DIRECT_FB
    if split:
        parts = threads * DIRECT_PARTS_PER_THREAD
        pad_parts = min(p.channels, threads)
    # Parts are blocks of rows with every filter block (a row's input then stays in cache
    # across them), split by filter blocks too only when there are fewer rows than parts.
    job.fb_parts = min(job.fblocks, (parts + p.out_h - 1) // p.out_h)
    job.fbs = (job.fblocks + job.fb_parts - 1) // job.fb_parts
    job.fb_parts = (job.fblocks + job.fbs - 1) // job.fbs
    job.row_parts = min(p.out_h, (parts + job.fb_parts - 1) // job.fb_parts)
    job.rows = (p.out_h + job.row_parts - 1) // job.row_parts
    job.row_parts = (p.out_h + job.rows - 1) // job.rows
    job.pad_channels = (p.channels + pad_parts - 1) // pad_parts
    pad_parts = (p.channels + job.pad_channels - 1) // job.pad_channels
    dm_conv3x3_direct_weights_f32(weights, p.channels, p.height, p.width, p.stride_x,
                                  p.filters, workspace)
    for b in range(p.batch):
        job.x = x + b * p.channels * p.height * p.width
        job.out = out + b * p.filters * p.out_h * p.out_w
        run_parts(_direct_pad_part, &job, <int>pad_parts)
        run_parts(_direct_part, &job, <int>(job.fb_parts * job.row_parts))


cdef void _conv2d(const floating* x, const floating* weights, const floating* bias,
                  floating* out, floating* workspace, const ConvParams* p) noexcept nogil:
    cdef Py_ssize_t channels = p.channels, height = p.height, width = p.width
    cdef Py_ssize_t filters = p.filters, out_h = p.out_h, out_w = p.out_w
    cdef Py_ssize_t cg = channels // p.groups, fg = filters // p.groups
    cdef Py_ssize_t k = cg * p.ksize * p.ksize, spatial = out_h * out_w
    cdef Py_ssize_t in_plane = height * width
    # The direct kernel takes its scratch from the workspace; a caller that sized it for
    # im2col only may have given too little, and then the GEMM path runs instead.
    cdef Py_ssize_t direct = _direct_scratch(channels, filters, height, width, p.ksize,
                                             p.stride_x, p.stride_y, p.pad, p.dilation,
                                             p.groups)
    cdef bint direct3 = floating is float and 0 < direct <= p.workspace_size
    # Unfold a block of output rows at a time so the im2col columns stay in cache between
    # being written and being multiplied.
    cdef Py_ssize_t block_rows = max(1, IM2COL_BLOCK // max(1, k * out_w))
    cdef Py_ssize_t blocks = (out_h + block_rows - 1) // block_rows
    cdef int threads = cpu_threads()
    cdef bint split = threads > 1 and <double>fg * spatial * k >= SPLIT_WORK
    cdef Py_ssize_t b, g, oy0, oy1, cols
    cdef const floating* src
    cdef floating* dst
    cdef BlockJob block_job
    if floating is float:
        if direct3:
            _conv2d_direct(x, weights, bias, out, workspace, p, split)
            return
    for b in range(p.batch):
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
                int pad, int dilation, int groups, int act, bint fused=False) -> NativeStep:
    """Darknet convolution forward: ``out = act(conv(x, weights) + bias)``.

    x: (N, C, H, W); weights: (F, C/groups*ksize*ksize) in Darknet's (F, C, ky, kx) order;
    bias: (F,) (batch norm already folded in); out: (N, F, out_h, out_w) with Darknet's
    ``out = (in + 2*pad - ksize)//stride + 1``; workspace: 1-D, at least
    ``workspace_size(C, ksize, groups, out_h, out_w)`` elements (may be None for a plain
    1x1 convolution). All C-contiguous, of one dtype (float32 or float64). ``act`` is an
    elementwise activation id from ``darknet_metal.model.activations``; channel-mixing
    activations are applied by the caller. Dilation samples the input every ``dilation``
    pixels with padding ``pad*dilation``, as Darknet does. ``fused``: where the float32
    direct 3x3 kernel runs (``direct_workspace_size`` > 0), it sums with fused multiply-adds,
    each rounded once (for inference; faster where a multiply and an add take two issue slots),
    instead of Darknet's rounded products then added (training's arithmetic).
    """
    check_input("x", x)
    check_input("weights", weights, (2,), x, layout="(F, C/groups*ksize*ksize)")
    check_input("bias", bias, (1,), x, layout="(F,)")
    check_input("out", out, (4,), x, writable=True)
    cdef Py_ssize_t batch, channels, height, width, filters, out_h, out_w, k
    batch, channels, height, width, filters, out_h, out_w, k = conv_geometry(
        "conv2d_forward", x.shape, "weights", weights.shape, "out", out.shape, ksize,
        stride_x, stride_y, pad, dilation, groups)
    if bias.shape[0] != filters:
        raise ArgumentError(f"conv2d_forward: bias has {bias.shape[0]} entries, expected {filters}")
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
    p.groups, p.act, p.one_by_one, p.fused = groups, act, one_by_one, fused
    return step


def conv2d_forward(x, weights, bias, out, workspace, int ksize, int stride_x, int stride_y,
                   int pad, int dilation, int groups, int act, bint fused=False) -> None:
    """``conv2d_step(...)`` with the same arguments, run once."""
    conv2d_step(x, weights, bias, out, workspace, ksize, stride_x, stride_y, pad, dilation,
                groups, act, fused).run()


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


# ----------------------------------------------------------------------------------------
# Training: gradients of the convolution and of the connected layer.
#
# Darknet's backward_convolutional_layer / backward_connected_layer, split into kernels that
# are linear in the incoming delta and ADD into their targets: the weight and bias
# gradient accumulators (summed over the images of a mini-batch and over the mini-batches
# of an iteration) and the input's delta (a layer's output may feed several consumers,
# whose gradients add up). The activation derivative and batch norm are separate kernels
# (activations.gradient, batchnorm.pyx). No kernel here depends on the sign convention:
# with Darknet's negative-gradient deltas the accumulators hold negative gradients.

# Elements of im2col columns a backward pass unfolds at once (1 MiB of float32): bigger
# than the forward's blocks, since the weight-gradient GEMM sums over the block's columns
# and runs well below its peak when they are few.
cdef Py_ssize_t BACKWARD_BLOCK = 1 << 18


cdef inline Py_ssize_t _backward_block_rows(Py_ssize_t k, Py_ssize_t out_h,
                                            Py_ssize_t out_w) noexcept nogil:
    return max(1, min(out_h, BACKWARD_BLOCK // max(1, k * out_w)))


def backward_workspace_size(int channels, int ksize, int groups, int out_h, int out_w) -> int:
    """Elements of workspace the backward steps of a convolution need: the im2col columns of
    one block of output rows (``workspace_size``, the forward's, is always enough). A plain
    1x1 convolution (stride 1, pad 0) needs none."""
    cdef Py_ssize_t k = (channels // groups) * ksize * ksize
    return k * out_w * _backward_block_rows(k, out_h, out_w)


cdef enum:  # buffer roles
    CONV_BW_X, CONV_BW_DELTA, CONV_BW_GRAD, CONV_BW_WORKSPACE

cdef enum:  # buffer roles
    CONV_BX_WEIGHTS, CONV_BX_DELTA, CONV_BX_GRAD, CONV_BX_WORKSPACE

cdef struct ConvBackwardParams:
    Py_ssize_t batch, channels, height, width, filters, out_h, out_w, block_rows
    int ksize, stride_x, stride_y, pad, dilation, groups
    bint one_by_one


cdef void _conv2d_backward_weights(const floating* x, const floating* delta,
                                   floating* weight_grad, floating* workspace,
                                   const ConvBackwardParams* p) noexcept nogil:
    cdef Py_ssize_t cg = p.channels // p.groups, fg = p.filters // p.groups
    cdef Py_ssize_t k = cg * p.ksize * p.ksize, spatial = p.out_h * p.out_w
    cdef Py_ssize_t in_plane = p.height * p.width, out_w = p.out_w
    cdef Py_ssize_t b, g, oy0, oy1, cols
    cdef const floating* src
    cdef const floating* dlt
    cdef floating* grad
    # Images, groups and row blocks in a fixed order, each GEMM adding into the
    # accumulator (beta 1): the sums do not depend on the thread count.
    for b in range(p.batch):
        for g in range(p.groups):
            src = x + (b * p.channels + g * cg) * in_plane
            dlt = delta + (b * p.filters + g * fg) * spatial
            grad = weight_grad + g * fg * k
            if p.one_by_one:
                # grad (fg, cg) += delta (fg, HW) @ x (cg, HW)^T: the planes are the columns.
                gemm_rowmajor(False, True, <int>fg, <int>k, <int>spatial, dlt, <int>spatial,
                              src, <int>spatial, 1, grad, <int>k)
                continue
            oy0 = 0
            while oy0 < p.out_h:
                oy1 = min(p.out_h, oy0 + p.block_rows)
                cols = (oy1 - oy0) * out_w
                im2col(src, cg, p.height, p.width, p.ksize, p.stride_x, p.stride_y,
                       p.pad * p.dilation, p.dilation, oy0, oy1, out_w, workspace)
                gemm_rowmajor(False, True, <int>fg, <int>k, <int>cols, dlt + oy0 * out_w,
                              <int>spatial, workspace, <int>cols, 1, grad, <int>k)
                oy0 = oy1


cdef void _conv2d_backward_weights_step(const StepData* d) noexcept nogil:
    cdef const ConvBackwardParams* p = <const ConvBackwardParams*>d.params
    if d.f32:
        _conv2d_backward_weights(<const float*>d.buf[CONV_BW_X],
                                 <const float*>d.buf[CONV_BW_DELTA],
                                 <float*>d.buf[CONV_BW_GRAD],
                                 <float*>d.buf[CONV_BW_WORKSPACE], p)
    else:
        _conv2d_backward_weights(<const double*>d.buf[CONV_BW_X],
                                 <const double*>d.buf[CONV_BW_DELTA],
                                 <double*>d.buf[CONV_BW_GRAD],
                                 <double*>d.buf[CONV_BW_WORKSPACE], p)


cdef void _conv2d_backward_input(const floating* weights, const floating* delta,
                                 floating* x_grad, floating* workspace,
                                 const ConvBackwardParams* p) noexcept nogil:
    cdef Py_ssize_t cg = p.channels // p.groups, fg = p.filters // p.groups
    cdef Py_ssize_t k = cg * p.ksize * p.ksize, spatial = p.out_h * p.out_w
    cdef Py_ssize_t in_plane = p.height * p.width, out_w = p.out_w
    cdef Py_ssize_t b, g, oy0, oy1, cols
    cdef const floating* wg
    cdef const floating* dlt
    cdef floating* grad
    for b in range(p.batch):
        for g in range(p.groups):
            wg = weights + g * fg * k
            dlt = delta + (b * p.filters + g * fg) * spatial
            grad = x_grad + (b * p.channels + g * cg) * in_plane
            if p.one_by_one:
                # x_grad (cg, HW) += W (fg, cg)^T @ delta (fg, HW).
                gemm_rowmajor(True, False, <int>k, <int>spatial, <int>fg, wg, <int>k, dlt,
                              <int>spatial, 1, grad, <int>spatial)
                continue
            oy0 = 0
            while oy0 < p.out_h:
                oy1 = min(p.out_h, oy0 + p.block_rows)
                cols = (oy1 - oy0) * out_w
                # The columns' gradient, W^T @ delta, then folded back onto the pixels.
                gemm_rowmajor(True, False, <int>k, <int>cols, <int>fg, wg, <int>k,
                              dlt + oy0 * out_w, <int>spatial, 0, workspace, <int>cols)
                col2im(workspace, cg, p.height, p.width, p.ksize, p.stride_x, p.stride_y,
                       p.pad * p.dilation, p.dilation, oy0, oy1, out_w, grad)
                oy0 = oy1


cdef void _conv2d_backward_input_step(const StepData* d) noexcept nogil:
    cdef const ConvBackwardParams* p = <const ConvBackwardParams*>d.params
    if d.f32:
        _conv2d_backward_input(<const float*>d.buf[CONV_BX_WEIGHTS],
                               <const float*>d.buf[CONV_BX_DELTA],
                               <float*>d.buf[CONV_BX_GRAD],
                               <float*>d.buf[CONV_BX_WORKSPACE], p)
    else:
        _conv2d_backward_input(<const double*>d.buf[CONV_BX_WEIGHTS],
                               <const double*>d.buf[CONV_BX_DELTA],
                               <double*>d.buf[CONV_BX_GRAD],
                               <double*>d.buf[CONV_BX_WORKSPACE], p)


cdef NativeStep _conv_backward_step(StepFn fn, str kind, tuple arrays, tuple x_shape,
                                    tuple w_shape, str w_name, tuple delta_shape, workspace,
                                    int ksize, int stride_x, int stride_y, int pad,
                                    int dilation, int groups):
    """The shared checks and parameters of the two backward steps; ``arrays`` are in the
    kind's role order, workspace last."""
    like = arrays[0]
    batch, channels, height, width, filters, out_h, out_w, k = conv_geometry(
        kind, x_shape, w_name, w_shape, "delta", delta_shape, ksize, stride_x, stride_y, pad,
        dilation, groups)
    cdef bint one_by_one = ksize == 1 and stride_x == 1 and stride_y == 1 and pad == 0
    cdef Py_ssize_t block_rows = _backward_block_rows(k, out_h, out_w)
    if workspace is not None or not one_by_one:
        check_workspace(workspace, like, 0 if one_by_one else k * out_w * block_rows, kind)
    cdef NativeStep step = new_step(fn, kind, arrays, like.dtype == np.float32,
                                    sizeof(ConvBackwardParams))
    cdef ConvBackwardParams* p = <ConvBackwardParams*>step.data.params
    p.batch, p.channels, p.height, p.width = batch, channels, height, width
    p.filters, p.out_h, p.out_w, p.block_rows = filters, out_h, out_w, block_rows
    p.ksize, p.stride_x, p.stride_y, p.pad, p.dilation = ksize, stride_x, stride_y, pad, dilation
    p.groups, p.one_by_one = groups, one_by_one
    return step


def conv2d_backward_weights_step(x, delta, weight_grad, workspace, int ksize, int stride_x,
                                 int stride_y, int pad, int dilation,
                                 int groups) -> NativeStep:
    """Weight gradient of a convolution: ``weight_grad += sum_images delta (x) im2col(x)``.

    Darknet's ``weight_updates`` term of backward_convolutional_layer, summed over the N
    images in a fixed order and ADDED to ``weight_grad`` (an accumulator: clear it before
    the first mini-batch of an iteration). The bias gradient is ``bias_grad_step``.

    x: (N, C, H, W), the layer's input; delta: (N, F, out_h, out_w), the gradient with
    respect to the raw convolution output (after the activation derivative and batch norm);
    weight_grad: (F, C/groups*ksize*ksize) in the weights' (F, C, ky, kx) order; workspace:
    1-D, at least ``backward_workspace_size(C, ksize, groups, out_h, out_w)`` elements (may
    be None for a plain 1x1 convolution); it is clobbered. All C-contiguous, of one dtype
    (float32 or float64). Geometry as in ``conv2d_step``.
    """
    check_input("x", x)
    check_input("delta", delta, (4,), x, layout="(N, F, out_h, out_w)")
    check_input("weight_grad", weight_grad, (2,), x, layout="(F, C/groups*ksize*ksize)",
                writable=True)
    return _conv_backward_step(_conv2d_backward_weights_step, "conv2d_backward_weights",
                               (x, delta, weight_grad, workspace), x.shape, weight_grad.shape,
                               "weight_grad", delta.shape, workspace, ksize, stride_x,
                               stride_y, pad, dilation, groups)


def conv2d_backward_weights(x, delta, weight_grad, workspace, int ksize, int stride_x,
                            int stride_y, int pad, int dilation, int groups) -> None:
    """``conv2d_backward_weights_step(...)`` with the same arguments, run once."""
    conv2d_backward_weights_step(x, delta, weight_grad, workspace, ksize, stride_x, stride_y,
                                 pad, dilation, groups).run()


def conv2d_backward_input_step(weights, delta, x_grad, workspace, int ksize, int stride_x,
                               int stride_y, int pad, int dilation,
                               int groups) -> NativeStep:
    """Input gradient of a convolution: ``x_grad += col2im(W^T @ delta)`` per image.

    Darknet's ``state.delta`` term of backward_convolutional_layer, with col2im ADDING into
    ``x_grad`` (as in the golden build, which fixed the stock CPU col2im that cleared it
    first): other consumers of the input may already have sent their share.

    weights: (F, C/groups*ksize*ksize); delta: (N, F, out_h, out_w), with respect to the raw
    convolution output; x_grad: (N, C, H, W), the input's delta, added to; workspace: 1-D,
    at least ``backward_workspace_size(C, ksize, groups, out_h, out_w)`` elements (may be
    None for a plain 1x1 convolution), clobbered. All C-contiguous, of one dtype (float32 or
    float64). Geometry as in ``conv2d_step``.
    """
    check_input("x_grad", x_grad, writable=True)
    check_input("weights", weights, (2,), x_grad, like_name="x_grad",
                layout="(F, C/groups*ksize*ksize)")
    check_input("delta", delta, (4,), x_grad, like_name="x_grad",
                layout="(N, F, out_h, out_w)")
    return _conv_backward_step(_conv2d_backward_input_step, "conv2d_backward_input",
                               (weights, delta, x_grad, workspace), x_grad.shape,
                               weights.shape, "weights", delta.shape, workspace, ksize,
                               stride_x, stride_y, pad, dilation, groups)


def conv2d_backward_input(weights, delta, x_grad, workspace, int ksize, int stride_x,
                          int stride_y, int pad, int dilation, int groups) -> None:
    """``conv2d_backward_input_step(...)`` with the same arguments, run once."""
    conv2d_backward_input_step(weights, delta, x_grad, workspace, ksize, stride_x, stride_y,
                               pad, dilation, groups).run()


cdef enum:  # buffer roles
    BIAS_GRAD_DELTA, BIAS_GRAD_OUT

cdef struct BiasGradParams:
    Py_ssize_t batch, channels, spatial


cdef void _bias_grad(const floating* delta, floating* bias_grad,
                     const BiasGradParams* p) noexcept nogil:
    cdef Py_ssize_t b, f, i
    cdef const floating* plane
    cdef floating total
    # Darknet's backward_bias order: one sum per (image, channel) plane, added in turn.
    for b in range(p.batch):
        for f in range(p.channels):
            plane = delta + (b * p.channels + f) * p.spatial
            total = 0
            for i in range(p.spatial):
                total = total + plane[i]
            bias_grad[f] = bias_grad[f] + total


cdef void _bias_grad_step(const StepData* d) noexcept nogil:
    cdef const BiasGradParams* p = <const BiasGradParams*>d.params
    if d.f32:
        _bias_grad(<const float*>d.buf[BIAS_GRAD_DELTA], <float*>d.buf[BIAS_GRAD_OUT], p)
    else:
        _bias_grad(<const double*>d.buf[BIAS_GRAD_DELTA], <double*>d.buf[BIAS_GRAD_OUT], p)


def bias_grad_step(delta, bias_grad) -> NativeStep:
    """Bias gradient: ``bias_grad[f] += sum over images and pixels of delta[:, f]``.

    delta: (N, F, H, W) (a convolution) or (N, F) (a connected layer), the gradient with
    respect to the layer's pre-activation output; bias_grad: (F,), added to. Both
    C-contiguous, of one dtype. With batch norm the bias gradient comes from
    ``batchnorm.batchnorm_backward_step`` instead.
    """
    check_input("delta", delta, (4, 2))
    check_input("bias_grad", bias_grad, (1,), delta, like_name="delta", writable=True)
    if bias_grad.shape[0] != delta.shape[1]:
        raise ArgumentError(f"bias_grad_step: bias_grad has {bias_grad.shape[0]} entries, "
                            f"delta {delta.shape} has {delta.shape[1]} channels")
    cdef NativeStep step = new_step(_bias_grad_step, "bias_grad", (delta, bias_grad),
                                    delta.dtype == np.float32, sizeof(BiasGradParams))
    cdef BiasGradParams* p = <BiasGradParams*>step.data.params
    p.batch, p.channels = delta.shape[0], delta.shape[1]
    p.spatial = 1 if delta.ndim == 2 else delta.shape[2] * delta.shape[3]
    return step


def bias_grad(delta, bias_grad) -> None:
    """``bias_grad_step(delta, bias_grad)`` run once."""
    bias_grad_step(delta, bias_grad).run()


cdef enum:  # buffer roles
    FC_BACK_X, FC_BACK_WEIGHTS, FC_BACK_DELTA, FC_BACK_WGRAD, FC_BACK_XGRAD


cdef void _connected_backward(const floating* x, const floating* weights,
                              const floating* delta, floating* weight_grad, floating* x_grad,
                              const ConnectedParams* p) noexcept nogil:
    # weight_grad (outputs, inputs) += delta^T @ x, summed over the batch by the GEMM.
    gemm_rowmajor(True, False, <int>p.outputs, <int>p.inputs, <int>p.batch, delta,
                  <int>p.outputs, x, <int>p.inputs, 1, weight_grad, <int>p.inputs)
    if x_grad != NULL:
        gemm_rowmajor(False, False, <int>p.batch, <int>p.inputs, <int>p.outputs, delta,
                      <int>p.outputs, weights, <int>p.inputs, 1, x_grad, <int>p.inputs)


cdef void _connected_backward_step(const StepData* d) noexcept nogil:
    cdef const ConnectedParams* p = <const ConnectedParams*>d.params
    if d.f32:
        _connected_backward(<const float*>d.buf[FC_BACK_X], <const float*>d.buf[FC_BACK_WEIGHTS],
                            <const float*>d.buf[FC_BACK_DELTA], <float*>d.buf[FC_BACK_WGRAD],
                            <float*>d.buf[FC_BACK_XGRAD], p)
    else:
        _connected_backward(<const double*>d.buf[FC_BACK_X],
                            <const double*>d.buf[FC_BACK_WEIGHTS],
                            <const double*>d.buf[FC_BACK_DELTA],
                            <double*>d.buf[FC_BACK_WGRAD], <double*>d.buf[FC_BACK_XGRAD], p)


def connected_backward_step(x, weights, delta, weight_grad, x_grad) -> NativeStep:
    """Connected layer backward (backward_connected_layer after its activation derivative
    and batch norm): ``weight_grad += delta^T @ x`` and ``x_grad += delta @ weights``.

    x: (N, inputs), the layer's input; weights: (outputs, inputs); delta: (N, outputs), the
    gradient with respect to the pre-activation output (after batch norm, if any);
    weight_grad: (outputs, inputs), added to; x_grad: (N, inputs), the input's delta, added
    to, or None when the input has no delta (the network's input). All C-contiguous, of one
    dtype (float32 or float64). The bias gradient is ``bias_grad_step``.
    """
    check_input("x", x, (2,), layout="(N, inputs)")
    check_input("weights", weights, (2,), x, layout="(outputs, inputs)")
    check_input("delta", delta, (2,), x, layout="(N, outputs)")
    check_input("weight_grad", weight_grad, (2,), x, layout="(outputs, inputs)",
                writable=True)
    cdef Py_ssize_t batch = x.shape[0], inputs = x.shape[1], outputs = weights.shape[0]
    if weights.shape[1] != inputs or batch < 1 or inputs < 1 or outputs < 1:
        raise ArgumentError(f"connected_backward: weights shape {weights.shape} does not "
                            f"match x {x.shape} (each dimension at least 1)")
    if delta.shape[0] != batch or delta.shape[1] != outputs:
        raise ArgumentError(f"connected_backward: delta shape {delta.shape}, expected "
                            f"{(batch, outputs)}")
    if weight_grad.shape != weights.shape:
        raise ArgumentError(f"connected_backward: weight_grad shape {weight_grad.shape}, "
                            f"expected {weights.shape}")
    if x_grad is not None:
        check_input("x_grad", x_grad, (2,), x, layout="(N, inputs)", writable=True)
        if x_grad.shape != x.shape:
            raise ArgumentError(f"connected_backward: x_grad shape {x_grad.shape}, expected "
                                f"{x.shape}")
    cdef NativeStep step = new_step(_connected_backward_step, "connected_backward",
                                    (x, weights, delta, weight_grad, x_grad),
                                    x.dtype == np.float32, sizeof(ConnectedParams))
    cdef ConnectedParams* p = <ConnectedParams*>step.data.params
    p.batch, p.inputs, p.outputs, p.act = batch, inputs, outputs, 0
    return step


def connected_backward(x, weights, delta, weight_grad, x_grad) -> None:
    """``connected_backward_step(x, weights, delta, weight_grad, x_grad)`` run once."""
    connected_backward_step(x, weights, delta, weight_grad, x_grad).run()
