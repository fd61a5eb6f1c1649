# cython: language_level=3
"""Resampling layers: the CPU reference for ``[upsample]`` and ``[reorg]``.

Both follow Darknet's flat-index arithmetic (``upsample_cpu`` and ``reorg_cpu`` in
``blas.cpp``) rather than a tensor view of it, so they agree with Darknet even where its
layout is unusual:

- ``[upsample] stride=s``: nearest-neighbour, ``out[.., y, x] = scale * in[.., y//s, x//s]``.
  A negative cfg stride is Darknet's reverse mode: a sum over s x s blocks, times scale.
- ``[reorg]`` (Darknet's reorg_old layer, the one YOLOv2 uses and OpenCV implements) moves
  s x s pixel blocks into channels with Darknet's own indexing; see ``reorg_step``.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``. Each ``*_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that runs the loop without the GIL;
``*_forward`` makes the step and runs it once.
"""

from cython cimport floating

from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_out


def _check_stride(int stride):
    if stride < 1:
        raise ArgumentError(f"stride must be >= 1, got {stride}")


# ----------------------------------------------------------------------------------------
# upsample

def upsample_output_shape(shape, int stride):
    """(N, C, H, W) output of ``[upsample] stride=stride`` on an input of ``shape``.

    stride > 0 multiplies H and W; stride < 0 is the reverse mode and divides them by
    ``-stride`` (C integer division). Raises ValueError for stride 0 or an empty output.
    """
    n, c, h, w = shape
    if stride == 0:
        raise ArgumentError("upsample stride must not be 0")
    if stride > 0:
        return n, c, h * stride, w * stride
    if h < -stride or w < -stride:
        raise ArgumentError(f"reverse upsample stride={-stride} is larger than the {h}x{w} input")
    return n, c, h // -stride, w // -stride


cdef enum:  # buffer roles
    UPSAMPLE_X, UPSAMPLE_OUT

cdef struct UpsampleParams:
    Py_ssize_t planes  # N * C
    Py_ssize_t h, w    # the input's (upsample) or the output's (reverse) plane
    Py_ssize_t s       # stride, or -stride in reverse
    double scale


cdef void _upsample(const floating* src, floating* dst, const UpsampleParams* p) noexcept nogil:
    cdef Py_ssize_t h = p.h, w = p.w, s = p.s
    cdef Py_ssize_t ow = w * s, oh = h * s
    cdef Py_ssize_t plane, j, i, k
    cdef const floating* srow
    cdef floating* drow
    cdef floating v
    cdef floating scale = <floating>p.scale
    for plane in range(p.planes):
        for j in range(oh):
            srow = src + plane * h * w + (j // s) * w
            drow = dst + plane * oh * ow + j * ow
            for i in range(w):
                v = scale * srow[i]
                for k in range(s):
                    drow[i * s + k] = v


cdef void _downsample(const floating* src, floating* dst, const UpsampleParams* p) noexcept nogil:
    # Darknet reads the input as if its rows were out_w*s long (exactly so when s divides
    # the size) and adds the s*s products into a zeroed output in row-major order.
    cdef Py_ssize_t oh = p.h, ow = p.w, s = p.s
    cdef Py_ssize_t row = ow * s, plane_in = oh * ow * s * s
    cdef Py_ssize_t plane, J, I, dj, di
    cdef floating total
    cdef floating scale = <floating>p.scale
    for plane in range(p.planes):
        for J in range(oh):
            for I in range(ow):
                total = 0
                for dj in range(s):
                    for di in range(s):
                        total = total + scale * src[plane * plane_in + (J * s + dj) * row
                                                    + I * s + di]
                dst[plane * oh * ow + J * ow + I] = total


cdef void _upsample_step(const StepData* d) noexcept nogil:
    cdef const UpsampleParams* p = <const UpsampleParams*>d.params
    if d.f32:
        _upsample(<const float*>d.buf[UPSAMPLE_X], <float*>d.buf[UPSAMPLE_OUT], p)
    else:
        _upsample(<const double*>d.buf[UPSAMPLE_X], <double*>d.buf[UPSAMPLE_OUT], p)


cdef void _downsample_step(const StepData* d) noexcept nogil:
    cdef const UpsampleParams* p = <const UpsampleParams*>d.params
    if d.f32:
        _downsample(<const float*>d.buf[UPSAMPLE_X], <float*>d.buf[UPSAMPLE_OUT], p)
    else:
        _downsample(<const double*>d.buf[UPSAMPLE_X], <double*>d.buf[UPSAMPLE_OUT], p)


def upsample_step(x, out, int stride, double scale=1.0) -> NativeStep:
    """Darknet ``[upsample]`` forward (forward_upsample_layer).

    x: (N, C, H, W) float32/float64, C-contiguous; out: ``upsample_output_shape(x.shape,
    stride)``, same dtype. stride > 0: nearest-neighbour upsampling, each value multiplied
    by ``scale`` (the cfg key, default 1). stride < 0 (Darknet's reverse mode): each output
    is the sum of ``scale * x`` over a ``-stride`` x ``-stride`` block.
    """
    check_input("x", x)
    check_out(out, x, upsample_output_shape(x.shape, stride))
    f32 = x.dtype == np.float32
    cdef NativeStep step
    if stride > 0:
        step = new_step(_upsample_step, "upsample", (x, out), f32, sizeof(UpsampleParams))
    else:
        step = new_step(_downsample_step, "upsample_reverse", (x, out), f32,
                        sizeof(UpsampleParams))
    cdef UpsampleParams* p = <UpsampleParams*>step.data.params
    p.planes = x.shape[0] * x.shape[1]
    if stride > 0:
        p.h, p.w, p.s = x.shape[2], x.shape[3], stride
    else:
        p.h, p.w, p.s = out.shape[2], out.shape[3], -stride
    # The float32 kernel rounds scale to float32 once, as Darknet's float cfg value.
    p.scale = scale
    return step


def upsample_forward(x, out, int stride, double scale=1.0) -> None:
    """``upsample_step(x, out, stride, scale)`` run once."""
    upsample_step(x, out, stride, scale).run()


# ----------------------------------------------------------------------------------------
# reorg

cdef enum:  # buffer roles
    REORG_X, REORG_OUT

cdef struct ReorgParams:
    Py_ssize_t batch
    Py_ssize_t w, h, c  # the input's
    Py_ssize_t s
    bint forward        # Darknet's flag: 1 for reverse=1


cdef void _reorg_core(const floating* src, floating* dst, Py_ssize_t task, Py_ssize_t w,
                      Py_ssize_t h, Py_ssize_t c, Py_ssize_t s, bint forward) noexcept nogil:
    """One (batch, channel k) slice of Darknet's reorg_cpu(x, w, h, c, batch, s, forward).

    ``(w, h, c)`` are the dims of the "small" side indexed linearly (i + w*(j + h*(k +
    c*b))); the "large" side is read as (c/s^2, h*s, w*s). forward=0 copies large ->
    small, forward=1 copies small -> large.
    """
    cdef Py_ssize_t in_c = c // (s * s)
    cdef Py_ssize_t b = task // c, k = task % c
    cdef Py_ssize_t c2 = k % in_c, offset = k // in_c
    cdef Py_ssize_t i, j, small, large
    for j in range(h):
        for i in range(w):
            small = i + w * (j + h * (k + c * b))
            large = (i * s + offset % s) + w * s * ((j * s + offset // s) + h * s * (c2 + in_c * b))
            if forward:
                dst[large] = src[small]
            else:
                dst[small] = src[large]


cdef void _reorg(const floating* src, floating* dst, const ReorgParams* p) noexcept nogil:
    cdef Py_ssize_t task
    for task in range(p.batch * p.c):
        _reorg_core(src, dst, task, p.w, p.h, p.c, p.s, p.forward)


cdef void _reorg_step(const StepData* d) noexcept nogil:
    cdef const ReorgParams* p = <const ReorgParams*>d.params
    if d.f32:
        _reorg(<const float*>d.buf[REORG_X], <float*>d.buf[REORG_OUT], p)
    else:
        _reorg(<const double*>d.buf[REORG_X], <double*>d.buf[REORG_OUT], p)


def reorg_output_shape(shape, int stride, bint reverse):
    """(N, C, H, W) output of ``[reorg]`` with this stride and reverse flag.

    Forward: (N, C*s*s, H//s, W//s); reverse: (N, C//(s*s), H*s, W*s).
    """
    n, c, h, w = shape
    _check_stride(stride)
    if reverse:
        return n, c // (stride * stride), h * stride, w * stride
    return n, c * stride * stride, h // stride, w // stride


def reorg_step(x, out, int stride, bint reverse=False) -> NativeStep:
    """Darknet ``[reorg]`` forward: forward_reorg_old_layer (YOLOv2's layer; OpenCV's too).

    x: (N, C, H, W); out: ``reorg_output_shape(x.shape, stride, reverse)``, same dtype.
    Forward: with s = stride and C' = C/s^2, the output *buffer*, read as (C, H, W), gets
    ``out[k, j, i] = x'[k % C', j*s + (k // C') // s, i*s + (k // C') % s]`` where x' is the
    input buffer read as (C', H*s, W*s); the result is then labelled (C*s^2, H/s, W/s).
    This is not a plain space-to-depth, but it is what trained YOLOv2 weights expect.
    Reverse applies the same index map from the other side with the reverse layer's own
    input dims, which makes it a plain depth-to-space (not the inverse of forward):
    ``out[c, y, x] = x[((y % s)*s + x % s)*C' + c, y // s, x // s]``, C' = C/s^2.
    Requires C divisible by s^2 and, forward, H and W divisible by s (otherwise Darknet
    writes outside its buffers).
    """
    check_input("x", x)
    _check_stride(stride)
    n, c, h, w = x.shape
    s2 = stride * stride
    if c % s2:
        raise ArgumentError(f"[reorg] needs channels divisible by stride^2={s2}, got {c}")
    if not reverse and (h % stride or w % stride):
        raise ArgumentError(f"[reorg] stride={stride} must divide the {h}x{w} input")
    check_out(out, x, reorg_output_shape(x.shape, stride, reverse))
    cdef NativeStep step = new_step(_reorg_step, "reorg_reverse" if reverse else "reorg",
                                    (x, out), x.dtype == np.float32, sizeof(ReorgParams))
    cdef ReorgParams* p = <ReorgParams*>step.data.params
    p.batch, p.c, p.h, p.w = n, c, h, w
    p.s = stride
    p.forward = reverse
    return step


def reorg_forward(x, out, int stride, bint reverse=False) -> None:
    """``reorg_step(x, out, stride, reverse)`` run once."""
    reorg_step(x, out, stride, reverse).run()
