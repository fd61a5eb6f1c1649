# cython: language_level=3
"""Convolution and fully connected layers: im2col + BLAS GEMM, bias and activation fused.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays of
one dtype, checked by ``checks``. The loops run without the GIL: ``bias_activate`` and the
kernels it and the GEMM loop call (``blas.gemm_rowmajor``, ``im2col.im2col``,
``activations.activate_array``, ``kernels.h``) are ``noexcept nogil``.

float32 3x3 stride-1 pad-1 convolutions with at most ``DIRECT_MAX_CHANNELS`` input channels
(the first layers of a detector) skip im2col and BLAS: ``kernels.h`` computes them directly,
vectorised along output rows. With K = 9*C of 27 or 144, BLAS was measured at a fraction of
its peak, and the direct loop is 2-3x faster on one core than the GEMM on two.
"""

from cython cimport floating

from darknet_metal.cpu.activations cimport activate_array
from darknet_metal.cpu.blas cimport gemm_rowmajor
from darknet_metal.cpu.im2col cimport im2col
from darknet_metal.cpu.kernels cimport (
    dm_act_fusable,
    dm_bias_act_f32,
    dm_conv3x3_direct_f32,
    dm_conv3x3_direct_scratch,
)

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_workspace


cdef void bias_activate(floating* out, const floating* bias, Py_ssize_t channels,
                        Py_ssize_t spatial, int act) noexcept nogil:
    """out[ch, i] = act(out[ch, i] + bias[ch]) for (channels, spatial) ``out``.

    float32 takes kernels.h's vectorised activations for every activation it has (all
    elementwise ones but gelu and stair); float64 and the others the scalar ones here."""
    cdef Py_ssize_t ch, i
    cdef floating* row
    if floating is float:
        if dm_act_fusable(act):
            dm_bias_act_f32(out, bias, channels, spatial, act)
            return
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
DIRECT_MAX_CHANNELS = 16


def workspace_size(int channels, int ksize, int groups, int out_h, int out_w) -> int:
    """Elements of im2col workspace one convolution needs (0 for plain 1x1 convolutions)."""
    return (channels // groups) * ksize * ksize * out_h * out_w


def conv2d_forward(x, weights, bias, out, workspace, int ksize, int stride_x, int stride_y,
                   int pad, int dilation, int groups, int act):
    """Darknet convolution forward: ``out = act(conv(x, weights) + bias)``.

    x: (N, C, H, W); weights: (F, C/groups*ksize*ksize) in Darknet's (F, C, ky, kx) order;
    bias: (F,) (batch norm already folded in); out: (N, F, out_h, out_w) with Darknet's
    ``out = (in + 2*pad - ksize)//stride + 1``; workspace: 1-D, at least
    ``workspace_size(C, ksize, groups, out_h, out_w)`` elements. All C-contiguous, of one
    dtype (float32 or float64). ``act`` is an elementwise activation id from
    ``darknet_metal.activations``; channel-mixing activations are applied by the caller.
    Dilation samples the input every ``dilation`` pixels with padding ``pad*dilation``, as
    Darknet does.
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
    cdef bint one_by_one = ksize == 1 and stride_x == 1 and stride_y == 1 and pad == 0
    check_workspace(workspace, x, 0 if one_by_one else k * out_h * out_w, "conv2d_forward")
    _conv2d(x, weights, bias, out, workspace, ksize, stride_x, stride_y, pad, dilation, groups,
            act, one_by_one)


def _conv2d(const floating[:, :, :, ::1] x, const floating[:, ::1] weights,
            const floating[::1] bias, floating[:, :, :, ::1] out, floating[::1] workspace,
            int ksize, int stride_x, int stride_y, int pad, int dilation, int groups, int act,
            bint one_by_one):
    cdef Py_ssize_t batch = x.shape[0], channels = x.shape[1], height = x.shape[2]
    cdef Py_ssize_t width = x.shape[3], filters = weights.shape[0]
    cdef Py_ssize_t out_h = out.shape[2], out_w = out.shape[3]
    cdef Py_ssize_t cg = channels // groups, fg = filters // groups
    cdef Py_ssize_t k = cg * ksize * ksize, spatial = out_h * out_w
    # The direct kernel takes its scratch from the workspace; a caller that sized it for
    # im2col only may have given too little, and then the GEMM path runs instead.
    cdef bint direct3 = (floating is float and ksize == 3 and stride_x == 1 and stride_y == 1
                         and pad == 1 and dilation == 1 and groups == 1
                         and channels <= DIRECT_MAX_CHANNELS
                         and workspace.shape[0] >= dm_conv3x3_direct_scratch(
                             channels, filters, height, width)
                         and dm_act_fusable(act))
    # Unfold a block of output rows at a time so the im2col columns stay in cache between
    # being written and being multiplied.
    cdef Py_ssize_t block_rows = max(1, IM2COL_BLOCK // max(1, k * out_w))
    cdef Py_ssize_t b, g, oy0, oy1, cols
    cdef const floating* src
    cdef floating* dst
    with nogil:
        for b in range(batch):
            if floating is float:
                if direct3:
                    dm_conv3x3_direct_f32(&x[b, 0, 0, 0], channels, height, width,
                                          &weights[0, 0], &bias[0], filters, act,
                                          &workspace[0], &out[b, 0, 0, 0])
                    continue
            for g in range(groups):
                src = &x[b, g * cg, 0, 0]
                dst = &out[b, g * fg, 0, 0]
                if one_by_one:
                    # The input planes already are the GEMM operand: no unfolding.
                    gemm_rowmajor(False, False, <int>fg, <int>spatial, <int>k,
                                  &weights[g * fg, 0], <int>k, src, <int>spatial, 0, dst,
                                  <int>spatial)
                    continue
                oy0 = 0
                while oy0 < out_h:
                    oy1 = min(out_h, oy0 + block_rows)
                    cols = (oy1 - oy0) * out_w
                    im2col(src, cg, height, width, ksize, stride_x, stride_y, pad * dilation,
                           dilation, oy0, oy1, out_w, &workspace[0])
                    gemm_rowmajor(False, False, <int>fg, <int>cols, <int>k,
                                  &weights[g * fg, 0], <int>k, &workspace[0], <int>cols, 0,
                                  dst + oy0 * out_w, <int>spatial)
                    oy0 = oy1
            bias_activate(&out[b, 0, 0, 0], &bias[0], filters, spatial, act)


def connected_forward(x, weights, bias, out, int act):
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
    _connected(x, weights, bias, out, act)


def _connected(const floating[:, ::1] x, const floating[:, ::1] weights,
               const floating[::1] bias, floating[:, ::1] out, int act):
    cdef Py_ssize_t batch = x.shape[0], inputs = x.shape[1], outputs = weights.shape[0]
    cdef Py_ssize_t b
    with nogil:
        gemm_rowmajor(False, True, <int>batch, <int>outputs, <int>inputs, &x[0, 0], <int>inputs,
                      &weights[0, 0], <int>inputs, 0, &out[0, 0], <int>outputs)
        for b in range(batch):
            bias_activate(&out[b, 0], &bias[0], outputs, 1, act)
