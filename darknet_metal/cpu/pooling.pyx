# cython: language_level=3
"""Pooling layers: the CPU reference for ``[maxpool]`` and ``[avgpool]``.

Window geometry is Darknet's (``maxpool_layer.cpp``): with total padding ``padding`` (the
cfg key, default ``size - 1``) the output is ``(w + padding - size) / stride_x + 1`` wide
(C integer division), window ``(i, j)`` starts at ``(j*stride_x - padding/2,
i*stride_y - padding/2)``, and positions outside the image are ignored. So ``size=2
stride=1`` keeps a 13x13 map 13x13, the extra row and column being on the bottom/right.
A window that lies entirely outside the image yields Darknet's ``-FLT_MAX``.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``; the loops run without the GIL, the
float32 2x2 stride-2 windows in ``kernels.h``.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX

from darknet_metal.cpu.kernels cimport dm_maxpool2x2s2_f32

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


def _maxpool(const floating[:, :, :, ::1] x, floating[:, :, :, ::1] out, int size,
             int stride_x, int stride_y, int padding):
    cdef Py_ssize_t planes = x.shape[0] * x.shape[1]
    cdef Py_ssize_t h = x.shape[2], w = x.shape[3]
    cdef Py_ssize_t out_h = out.shape[2], out_w = out.shape[3]
    cdef Py_ssize_t p, offset = padding // 2
    if planes == 0:
        return
    cdef const floating* src = &x[0, 0, 0, 0]
    cdef floating* dst = &out[0, 0, 0, 0]
    if (floating is float and size == 2 and stride_x == 2 and stride_y == 2
            and offset == 0 and 2 * out_h <= h and 2 * out_w <= w):
        # Every window inside the image: the vectorised kernel, same comparisons.
        with nogil:
            dm_maxpool2x2s2_f32(src, dst, planes, h, w, out_h, out_w)
        return
    with nogil:
        for p in range(planes):
            _maxpool_plane(src + p * h * w, dst + p * out_h * out_w, h, w, out_h, out_w, size,
                           stride_x, stride_y, offset)


def maxpool_forward(x, out, int size, int stride_x, int stride_y, int padding) -> None:
    """Darknet ``[maxpool]`` forward (forward_maxpool_layer).

    x: (N, C, H, W) C-contiguous float32/float64; out: (N, C, out_h, out_w) of the same
    dtype, written in full, with ``(out_h, out_w) = pool_output_hw(H, W, size, stride_x,
    stride_y, padding)``. padding is Darknet's total padding (the cfg key ``padding``,
    default ``size - 1``); the window starts ``padding // 2`` before the image.
    """
    check_input("x", x)
    out_h, out_w = pool_output_hw(x.shape[2], x.shape[3], size, stride_x, stride_y, padding)
    check_out(out, x, (x.shape[0], x.shape[1], out_h, out_w))
    _maxpool(x, out, size, stride_x, stride_y, padding)


def _maxpool_depth(const floating[:, :, :, ::1] x, floating[:, :, :, ::1] out):
    cdef Py_ssize_t batch = x.shape[0], c = x.shape[1]
    cdef Py_ssize_t spatial = x.shape[2] * x.shape[3], out_c = out.shape[1]
    cdef Py_ssize_t task, b, g, k, i
    cdef floating best, val
    if batch * out_c * spatial == 0:
        return
    cdef const floating* src = &x[0, 0, 0, 0]
    cdef floating* dst = &out[0, 0, 0, 0]
    with nogil:
        for task in range(batch * out_c):
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


def maxpool_depth_forward(x, out) -> None:
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
    _maxpool_depth(x, out)


@cython.cdivision(True)
def _avgpool(const floating[:, :, :, ::1] x, floating[:, :, :, ::1] out):
    cdef Py_ssize_t planes = x.shape[0] * x.shape[1]
    cdef Py_ssize_t spatial = x.shape[2] * x.shape[3]
    cdef Py_ssize_t p, i
    cdef floating total
    if planes == 0:
        return
    cdef const floating* src = &x[0, 0, 0, 0]
    cdef floating* dst = &out[0, 0, 0, 0]
    with nogil:
        for p in range(planes):
            total = 0
            for i in range(spatial):
                total = total + src[p * spatial + i]
            # Darknet accumulates in the output and divides by the int count h*w.
            dst[p] = total / <floating>spatial


def avgpool_forward(x, out) -> None:
    """Darknet ``[avgpool]`` (global average): (N, C, H, W) -> (N, C, 1, 1), same dtype.

    Each channel is summed in order in the working precision, then divided by H*W.
    """
    check_input("x", x)
    check_out(out, x, (x.shape[0], x.shape[1], 1, 1))
    if x.shape[2] * x.shape[3] == 0:
        raise ArgumentError(f"avgpool needs a non-empty input, got {x.shape}")
    _avgpool(x, out)
