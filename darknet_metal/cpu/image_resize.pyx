# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Darknet's two-pass bilinear ``resize_image`` in C, for ``image.resize_image``.

The same arithmetic as the NumPy version there, value for value: sample positions and
fractions in float32, each interpolation a float32 product added in float64 and rounded
once to float32 (``fp32.fma32``: the fused multiply-add of Darknet's reference build), and
Darknet's last output row keeping only the ``(1 - dy) * row[iy]`` term. Runs without the GIL,
so frames resize in parallel in a stream's worker threads.
"""

import numpy as np


cdef inline float _fma32(float a, float b, float c) noexcept nogil:
    return <float>(<double>a * <double>b + <double>c)


cdef void _axis(Py_ssize_t src, Py_ssize_t dst, Py_ssize_t* idx, float* frac) noexcept nogil:
    # Destination d samples source d * (src - 1) / (dst - 1) in float32, truncated.
    cdef float scale = 0
    cdef float pos
    cdef Py_ssize_t d, i
    if dst > 1:
        scale = <float>(src - 1) / <float>(dst - 1)
    for d in range(dst):
        pos = <float>d * scale
        i = <Py_ssize_t>pos
        if i > src - 1:
            i = src - 1
        idx[d] = i
        frac[d] = pos - <float>i


def resize_bilinear(src_array, Py_ssize_t width, Py_ssize_t height):
    """(C, H, W) float32 C-contiguous -> new float32 (C, height, width) array; sizes of
    at least 1 (checked by the caller)."""
    cdef float[:, :, ::1] src = src_array
    cdef Py_ssize_t channels = src.shape[0], src_h = src.shape[1], src_w = src.shape[2]
    out_array = np.empty((channels, height, width), np.float32)
    cdef float[:, :, ::1] out = out_array
    cdef Py_ssize_t[::1] ix = np.empty(width, np.intp)
    cdef Py_ssize_t[::1] iy = np.empty(height, np.intp)
    cdef float[::1] dx = np.empty(width, np.float32)
    cdef float[::1] dy = np.empty(height, np.float32)
    # One horizontally resized source row at a time (the second pass reads two).
    cdef float[:, ::1] part = np.empty((2, width), np.float32)
    cdef Py_ssize_t c, y, x, r, row, have0, have1, i1
    cdef float fy, a
    cdef bint rows = src_h > 1 and height > 1
    with nogil:
        _axis(src_w, width, &ix[0], &dx[0])
        _axis(src_h, height, &iy[0], &dy[0])
        for c in range(channels):
            have0 = -1
            have1 = -1
            for y in range(height):
                # Rows iy[y] and iy[y] + 1 of this channel, resized horizontally.
                for r in range(2):
                    row = iy[y] + r
                    if row > src_h - 1:
                        row = src_h - 1
                    if (r == 0 and have0 == row) or (r == 1 and have1 == row):
                        continue
                    if r == 1 and have0 == row:
                        part[1, :] = part[0, :]
                        have1 = row
                        continue
                    if r == 0 and have1 == row:
                        part[0, :] = part[1, :]
                        have0 = row
                        continue
                    for x in range(width):
                        if src_w == 1:
                            part[r, x] = src[c, row, 0]
                        elif x == width - 1:
                            part[r, x] = src[c, row, src_w - 1]
                        else:
                            i1 = ix[x] + 1
                            if i1 > src_w - 1:
                                i1 = src_w - 1
                            part[r, x] = _fma32(src[c, row, ix[x]], <float>1 - dx[x],
                                                dx[x] * src[c, row, i1])
                    if r == 0:
                        have0 = row
                    else:
                        have1 = row
                fy = dy[y]
                for x in range(width):
                    a = (<float>1 - fy) * part[0, x]
                    if rows and y < height - 1:
                        a = _fma32(part[1, x], fy, a)
                    out[c, y, x] = a
    return out_array
