# cython: language_level=3
"""Pooling layers: the CPU reference for ``[maxpool]`` and ``[avgpool]``.

Window geometry is Darknet's (``maxpool_layer.cpp``): with total padding ``padding`` (the
cfg key, default ``size - 1``) the output is ``(w + padding - size) / stride_x + 1`` wide
(C integer division), window ``(i, j)`` starts at ``(j*stride_x - padding/2,
i*stride_y - padding/2)``, and positions outside the image are ignored. So ``size=2
stride=1`` keeps a 13x13 map 13x13, the extra row and column being on the bottom/right.
A window that lies entirely outside the image yields Darknet's ``-FLT_MAX``.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``. Each ``*_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that runs the loop without the GIL
(the float32 2x2 stride-2 windows in ``kernels.h``); ``*_forward`` makes the step and runs
it once.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX

from darknet_metal.cpu.kernels cimport dm_maxpool2x2s2_f32
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_out


def _c_div(int a, int b) -> int:
    """C's truncating integer division (Darknet's shape arithmetic)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def pool_output_hw(int h, int w, int size, int stride_x, int stride_y, int padding):
    """Output (height, width) of a Darknet ``[maxpool]`` on an h x w map.

    Raises ValueError for a non-positive size or stride, a negative padding, or an empty
    output.
    """
    if size < 1 or stride_x < 1 or stride_y < 1:
        raise ArgumentError(f"pooling needs size >= 1 and strides >= 1, got size={size} "
                         f"stride_x={stride_x} stride_y={stride_y}")
    if padding < 0:
        raise ArgumentError(f"pooling padding must be >= 0, got {padding}")
    out_h = _c_div(h + padding - size, stride_y) + 1
    out_w = _c_div(w + padding - size, stride_x) + 1
    if out_h < 1 or out_w < 1:
        raise ArgumentError(f"pooling size={size} padding={padding} gives an empty output on a "
                         f"{h}x{w} input")
    return out_h, out_w


# ----------------------------------------------------------------------------------------
# maxpool

cdef enum:  # buffer roles
    MAXPOOL_X, MAXPOOL_OUT

cdef struct MaxpoolParams:
    Py_ssize_t planes  # N * C
    Py_ssize_t h, w, out_h, out_w
    Py_ssize_t size, stride_x, stride_y
    Py_ssize_t offset  # padding // 2: rows and columns the first window starts before the image
    bint inside_2x2s2  # 2x2 windows, stride 2, every one inside the image


cdef void _maxpool_plane(const floating* src, floating* dst, Py_ssize_t h, Py_ssize_t w,
                         Py_ssize_t out_h, Py_ssize_t out_w, Py_ssize_t size,
                         Py_ssize_t stride_x, Py_ssize_t stride_y,
                         Py_ssize_t offset) noexcept nogil:
    cdef Py_ssize_t i, j, n, m, y, x, y0, x0
    cdef floating best, val
    cdef const floating* window
    cdef bint rows_inside
    for i in range(out_h):
        y0 = i * stride_y - offset
        rows_inside = y0 >= 0 and y0 + size <= h
        for j in range(out_w):
            best = -FLT_MAX
            x0 = j * stride_x - offset
            if rows_inside and size == 2 and x0 >= 0 and x0 + 2 <= w:
                # The common 2x2 window, unrolled (same comparison order).
                window = src + y0 * w + x0
                best = window[0] if window[0] > best else best
                best = window[1] if window[1] > best else best
                best = window[w] if window[w] > best else best
                best = window[w + 1] if window[w + 1] > best else best
                dst[i * out_w + j] = best
                continue
            if rows_inside and x0 >= 0 and x0 + size <= w:
                # Window wholly inside: the same comparisons in the same order, unchecked.
                window = src + y0 * w + x0
                for n in range(size):
                    for m in range(size):
                        val = window[n * w + m]
                        if val > best:
                            best = val
                dst[i * out_w + j] = best
                continue
            for n in range(size):
                y = i * stride_y + n - offset
                if y < 0 or y >= h:
                    continue
                for m in range(size):
                    x = j * stride_x + m - offset
                    if x < 0 or x >= w:
                        continue
                    val = src[y * w + x]
                    # Strict ">" keeps Darknet's choice: NaN never wins, ties keep the first.
                    if val > best:
                        best = val
            dst[i * out_w + j] = best


cdef void _maxpool(const floating* src, floating* dst, const MaxpoolParams* p) noexcept nogil:
    cdef Py_ssize_t plane
    for plane in range(p.planes):
        _maxpool_plane(src + plane * p.h * p.w, dst + plane * p.out_h * p.out_w, p.h, p.w,
                       p.out_h, p.out_w, p.size, p.stride_x, p.stride_y, p.offset)


cdef void _maxpool_step(const StepData* d) noexcept nogil:
    cdef const MaxpoolParams* p = <const MaxpoolParams*>d.params
    if d.f32 and p.inside_2x2s2:
        # The vectorised kernel: the same comparisons in the same order.
        dm_maxpool2x2s2_f32(<const float*>d.buf[MAXPOOL_X], <float*>d.buf[MAXPOOL_OUT],
                            p.planes, p.h, p.w, p.out_h, p.out_w)
    elif d.f32:
        _maxpool(<const float*>d.buf[MAXPOOL_X], <float*>d.buf[MAXPOOL_OUT], p)
    else:
        _maxpool(<const double*>d.buf[MAXPOOL_X], <double*>d.buf[MAXPOOL_OUT], p)


def maxpool_step(x, out, int size, int stride_x, int stride_y, int padding) -> NativeStep:
    """Darknet ``[maxpool]`` forward (forward_maxpool_layer).

    x: (N, C, H, W) C-contiguous float32/float64; out: (N, C, out_h, out_w) of the same
    dtype, written in full, with ``(out_h, out_w) = pool_output_hw(H, W, size, stride_x,
    stride_y, padding)``. padding is Darknet's total padding (the cfg key ``padding``,
    default ``size - 1``); the window starts ``padding // 2`` before the image.
    """
    check_input("x", x)
    out_h, out_w = pool_output_hw(x.shape[2], x.shape[3], size, stride_x, stride_y, padding)
    check_out(out, x, (x.shape[0], x.shape[1], out_h, out_w))
    cdef NativeStep step = new_step(_maxpool_step, "maxpool", (x, out), x.dtype == np.float32,
                                    sizeof(MaxpoolParams))
    cdef MaxpoolParams* p = <MaxpoolParams*>step.data.params
    p.planes = x.shape[0] * x.shape[1]
    p.h, p.w = x.shape[2], x.shape[3]
    p.out_h, p.out_w = out_h, out_w
    p.size, p.stride_x, p.stride_y = size, stride_x, stride_y
    p.offset = padding // 2
    p.inside_2x2s2 = (size == 2 and stride_x == 2 and stride_y == 2 and p.offset == 0
                      and 2 * p.out_h <= p.h and 2 * p.out_w <= p.w)
    return step


def maxpool_forward(x, out, int size, int stride_x, int stride_y, int padding) -> None:
    """``maxpool_step(x, out, size, stride_x, stride_y, padding)`` run once."""
    maxpool_step(x, out, size, stride_x, stride_y, padding).run()


# ----------------------------------------------------------------------------------------
# maxpool_depth

cdef enum:  # buffer roles
    MAXPOOL_DEPTH_X, MAXPOOL_DEPTH_OUT

cdef struct MaxpoolDepthParams:
    Py_ssize_t batch, c, out_c
    Py_ssize_t spatial  # H * W


@cython.cdivision(True)
cdef void _maxpool_depth(const floating* src, floating* dst,
                         const MaxpoolDepthParams* p) noexcept nogil:
    cdef Py_ssize_t c = p.c, out_c = p.out_c, spatial = p.spatial
    cdef Py_ssize_t task, b, g, k, i
    cdef floating best, val
    for task in range(p.batch * out_c):
        b = task // out_c
        g = task % out_c
        for i in range(spatial):
            best = -FLT_MAX
            k = g
            while k < c:
                val = src[(b * c + k) * spatial + i]
                if val > best:
                    best = val
                k = k + out_c
            dst[task * spatial + i] = best


cdef void _maxpool_depth_step(const StepData* d) noexcept nogil:
    cdef const MaxpoolDepthParams* p = <const MaxpoolDepthParams*>d.params
    if d.f32:
        _maxpool_depth(<const float*>d.buf[MAXPOOL_DEPTH_X],
                       <float*>d.buf[MAXPOOL_DEPTH_OUT], p)
    else:
        _maxpool_depth(<const double*>d.buf[MAXPOOL_DEPTH_X],
                       <double*>d.buf[MAXPOOL_DEPTH_OUT], p)


def maxpool_depth_step(x, out) -> NativeStep:
    """Darknet ``[maxpool] maxpool_depth=1``: a maximum across channels at each pixel.

    x: (N, C, H, W); out: (N, out_channels, H, W), same dtype. Output channel ``g`` is the
    maximum of input channels ``g, g + out_channels, g + 2*out_channels, ...`` (Darknet
    ignores size, stride and padding in this mode). Requires 1 <= out_channels.
    """
    check_input("x", x)
    check_input("out", out, (4,), x, layout="(N, out_channels, H, W)")
    if out.shape[1] < 1:
        raise ArgumentError(f"out must be (N, out_channels >= 1, H, W), got {out.shape}")
    check_out(out, x, (x.shape[0], out.shape[1], x.shape[2], x.shape[3]))
    cdef NativeStep step = new_step(_maxpool_depth_step, "maxpool_depth", (x, out),
                                    x.dtype == np.float32, sizeof(MaxpoolDepthParams))
    cdef MaxpoolDepthParams* p = <MaxpoolDepthParams*>step.data.params
    p.batch, p.c, p.out_c = x.shape[0], x.shape[1], out.shape[1]
    p.spatial = x.shape[2] * x.shape[3]
    return step


def maxpool_depth_forward(x, out) -> None:
    """``maxpool_depth_step(x, out)`` run once."""
    maxpool_depth_step(x, out).run()


# ----------------------------------------------------------------------------------------
# avgpool

cdef enum:  # buffer roles
    AVGPOOL_X, AVGPOOL_OUT

cdef struct AvgpoolParams:
    Py_ssize_t planes   # N * C
    Py_ssize_t spatial  # H * W, at least 1


@cython.cdivision(True)
cdef void _avgpool(const floating* src, floating* dst, const AvgpoolParams* p) noexcept nogil:
    cdef Py_ssize_t spatial = p.spatial, plane, i
    cdef floating total
    for plane in range(p.planes):
        total = 0
        for i in range(spatial):
            total = total + src[plane * spatial + i]
        # Darknet accumulates in the output and divides by the int count h*w.
        dst[plane] = total / <floating>spatial


cdef void _avgpool_step(const StepData* d) noexcept nogil:
    cdef const AvgpoolParams* p = <const AvgpoolParams*>d.params
    if d.f32:
        _avgpool(<const float*>d.buf[AVGPOOL_X], <float*>d.buf[AVGPOOL_OUT], p)
    else:
        _avgpool(<const double*>d.buf[AVGPOOL_X], <double*>d.buf[AVGPOOL_OUT], p)


def avgpool_step(x, out) -> NativeStep:
    """Darknet ``[avgpool]`` (global average): (N, C, H, W) -> (N, C, 1, 1), same dtype.

    Each channel is summed in order in the working precision, then divided by H*W.
    """
    check_input("x", x)
    check_out(out, x, (x.shape[0], x.shape[1], 1, 1))
    if x.shape[2] * x.shape[3] == 0:
        raise ArgumentError(f"avgpool needs a non-empty input, got {x.shape}")
    cdef NativeStep step = new_step(_avgpool_step, "avgpool", (x, out), x.dtype == np.float32,
                                    sizeof(AvgpoolParams))
    cdef AvgpoolParams* p = <AvgpoolParams*>step.data.params
    p.planes = x.shape[0] * x.shape[1]
    p.spatial = x.shape[2] * x.shape[3]
    return step


def avgpool_forward(x, out) -> None:
    """``avgpool_step(x, out)`` run once."""
    avgpool_step(x, out).run()
