# cython: language_level=3
"""im2col: unfold convolution windows into the columns of a GEMM operand.

``im2col`` (the cdef kernel declared in ``im2col.pxd``: ``noexcept nogil``, float32 or
float64 through the ``floating`` fused type) fills the columns of output rows
``oy_begin..oy_end-1`` only, so a convolution can unfold and multiply a cache-sized block of
rows at a time. ``col`` receives ``channels*ksize*ksize`` rows of ``(oy_end - oy_begin)*out_w``
elements; ``pad`` is in input pixels (a dilated convolution passes ``pad*dilation``).

Layout (Darknet's and Caffe's): row ``(c*ksize + ky)*ksize + kx`` of the column matrix holds,
for every output pixel ``oy*out_w + ox``, the input at
``(oy*stride_y - pad + ky*dilation, ox*stride_x - pad + kx*dilation)`` of channel ``c``, or 0
outside the image. Rows therefore match the flattened ``(n, c, ky, kx)`` weight layout.

``col2im`` (also in ``im2col.pxd``) is its adjoint, the convolution's input gradient:
it adds every column element back into the pixel it came from, accumulating into the
image (a layer's input may feed several consumers, whose gradients add up).

``im2col_forward`` unfolds one whole image from Python and ``col2im_add`` folds columns
back into one, for tests and tools.
"""

from cython cimport floating
from libc.string cimport memset

from darknet_metal.cpu.kernels cimport dm_copy_even_f32

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input


cdef inline void _valid_columns(Py_ssize_t kx, Py_ssize_t width, Py_ssize_t stride_x,
                                Py_ssize_t pad, Py_ssize_t dilation, Py_ssize_t out_w,
                                Py_ssize_t* ox_lo, Py_ssize_t* ox_hi) noexcept nogil:
    """The output columns [ox_lo, ox_hi) whose tap kx lies inside the image:
    0 <= ox*stride_x - pad + kx*dilation < width."""
    cdef Py_ssize_t lo = 0, hi = out_w
    while lo < out_w and lo * stride_x - pad + kx * dilation < 0:
        lo = lo + 1
    while hi > lo and (hi - 1) * stride_x - pad + kx * dilation >= width:
        hi = hi - 1
    ox_lo[0] = lo
    ox_hi[0] = hi


cdef void im2col(const floating* im, Py_ssize_t channels, Py_ssize_t height, Py_ssize_t width,
                 Py_ssize_t ksize, Py_ssize_t stride_x, Py_ssize_t stride_y,
                 Py_ssize_t pad, Py_ssize_t dilation, Py_ssize_t oy_begin, Py_ssize_t oy_end,
                 Py_ssize_t out_w, floating* col) noexcept nogil:
    cdef Py_ssize_t rows = channels * ksize * ksize, block_h = oy_end - oy_begin
    cdef Py_ssize_t row, c, ky, kx, oy, ox, iy, ix, ox_lo, ox_hi
    cdef const floating* src
    cdef floating* dst
    for row in range(rows):
        kx = row % ksize
        ky = (row // ksize) % ksize
        c = row // (ksize * ksize)
        _valid_columns(kx, width, stride_x, pad, dilation, out_w, &ox_lo, &ox_hi)
        for oy in range(oy_begin, oy_end):
            dst = col + (row * block_h + oy - oy_begin) * out_w
            iy = oy * stride_y - pad + ky * dilation
            if iy < 0 or iy >= height or ox_lo >= ox_hi:
                memset(dst, 0, out_w * sizeof(floating))
                continue
            src = im + (c * height + iy) * width
            if ox_lo > 0:
                memset(dst, 0, ox_lo * sizeof(floating))
            ix = ox_lo * stride_x - pad + kx * dilation
            if stride_x == 1:
                for ox in range(ox_lo, ox_hi):
                    dst[ox] = src[ix + ox - ox_lo]
            elif floating is float and stride_x == 2:
                dm_copy_even_f32(src + ix, dst + ox_lo, ox_hi - ox_lo)
            else:
                for ox in range(ox_lo, ox_hi):
                    dst[ox] = src[ix]
                    ix = ix + stride_x
            if ox_hi < out_w:
                memset(dst + ox_hi, 0, (out_w - ox_hi) * sizeof(floating))


cdef void col2im(const floating* col, Py_ssize_t channels, Py_ssize_t height,
                 Py_ssize_t width, Py_ssize_t ksize, Py_ssize_t stride_x,
                 Py_ssize_t stride_y, Py_ssize_t pad, Py_ssize_t dilation,
                 Py_ssize_t oy_begin, Py_ssize_t oy_end, Py_ssize_t out_w,
                 floating* im) noexcept nogil:
    cdef Py_ssize_t block_h = oy_end - oy_begin, row = -1
    cdef Py_ssize_t c, ky, kx, oy, ox, iy, ix, ox_lo, ox_hi
    cdef const floating* src
    cdef floating* dst
    # Column rows in order ((c, ky, kx), as im2col lays them out), then output rows, then
    # columns: each pixel receives its taps in one fixed order, so the sums are
    # deterministic.
    for c in range(channels):
        for ky in range(ksize):
            for kx in range(ksize):
                row = row + 1
                _valid_columns(kx, width, stride_x, pad, dilation, out_w, &ox_lo, &ox_hi)
                for oy in range(oy_begin, oy_end):
                    iy = oy * stride_y - pad + ky * dilation
                    if iy < 0 or iy >= height or ox_lo >= ox_hi:
                        continue
                    src = col + (row * block_h + oy - oy_begin) * out_w
                    dst = im + (c * height + iy) * width + ox_lo * stride_x - pad + kx * dilation
                    if stride_x == 1:
                        for ox in range(ox_lo, ox_hi):
                            dst[ox - ox_lo] = dst[ox - ox_lo] + src[ox]
                    else:
                        ix = 0
                        for ox in range(ox_lo, ox_hi):
                            dst[ix] = dst[ix] + src[ox]
                            ix = ix + stride_x


def _check_geometry(int ksize, int stride_x, int stride_y, int pad, int dilation, int out_h,
                    int out_w):
    if ksize < 1 or stride_x < 1 or stride_y < 1 or dilation < 1 or pad < 0:
        raise ArgumentError(
            f"im2col: invalid ksize={ksize} stride=({stride_x},{stride_y}) pad={pad} "
            f"dilation={dilation}"
        )
    if out_h < 1 or out_w < 1:
        raise ArgumentError(f"im2col: invalid output size {out_h}x{out_w}")


def im2col_forward(image, int ksize, int stride_x, int stride_y, int pad, int dilation,
                   int out_h, int out_w):
    """Unfold one image (C, H, W), C-contiguous float32 or float64, into a new
    (C*ksize*ksize, out_h*out_w) array of its dtype."""
    check_input("image", image, (3,))
    _check_geometry(ksize, stride_x, stride_y, pad, dilation, out_h, out_w)
    out = np.empty((image.shape[0] * ksize * ksize, out_h * out_w), dtype=image.dtype)
    _im2col_image(image, ksize, stride_x, stride_y, pad, dilation, out_h, out_w, out)
    return out


def _im2col_image(const floating[:, :, ::1] image, int ksize, int stride_x, int stride_y,
                  int pad, int dilation, int out_h, int out_w, floating[:, ::1] col):
    with nogil:
        im2col(&image[0, 0, 0], image.shape[0], image.shape[1], image.shape[2], ksize,
               stride_x, stride_y, pad, dilation, 0, out_h, out_w, &col[0, 0])


def col2im_add(col, image, int ksize, int stride_x, int stride_y, int pad, int dilation,
               int out_h, int out_w) -> None:
    """Add the (C*ksize*ksize, out_h*out_w) columns ``col`` into ``image`` (C, H, W), both
    C-contiguous of one dtype (float32 or float64): the adjoint of ``im2col_forward``."""
    check_input("image", image, (3,), writable=True)
    check_input("col", col, (2,), image, like_name="image",
                layout="(C*ksize*ksize, out_h*out_w)")
    _check_geometry(ksize, stride_x, stride_y, pad, dilation, out_h, out_w)
    if col.shape[0] != image.shape[0] * ksize * ksize or col.shape[1] != out_h * out_w:
        raise ArgumentError(f"col2im: col shape {col.shape}, expected "
                            f"{(image.shape[0] * ksize * ksize, out_h * out_w)}")
    _col2im_image(col, ksize, stride_x, stride_y, pad, dilation, out_h, out_w, image)


def _col2im_image(const floating[:, ::1] col, int ksize, int stride_x, int stride_y, int pad,
                  int dilation, int out_h, int out_w, floating[:, :, ::1] image):
    with nogil:
        col2im(&col[0, 0], image.shape[0], image.shape[1], image.shape[2], ksize, stride_x,
               stride_y, pad, dilation, 0, out_h, out_w, &image[0, 0, 0])
