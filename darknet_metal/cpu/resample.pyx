# cython: language_level=3
"""Resampling layers: the CPU reference for ``[upsample]`` and ``[reorg]``.

Both follow Darknet's flat-index arithmetic (``upsample_cpu`` and ``reorg_cpu`` in
``blas.cpp``) rather than a tensor view of it, so they agree with Darknet even where its
layout is unusual:

- ``[upsample] stride=s``: nearest-neighbour, ``out[.., y, x] = scale * in[.., y//s, x//s]``.
  A negative cfg stride is Darknet's reverse mode: a sum over s x s blocks, times scale.
- ``[reorg]`` (Darknet's reorg_old layer, the one YOLOv2 uses and OpenCV implements) moves
  s x s pixel blocks into channels with Darknet's own indexing; see ``reorg_step``.
  ``[reorg3d]`` (Darknet's newer reorg layer) is the same index map over the output's
  dims, which makes it a plain space-to-depth (``layer="reorg3d"``).

Backward (``*_backward_step``) is the transpose of the forward map, ADDED into the input's
delta. Darknet assigns there in three of the four cases (reorg both ways, and upsample's
reverse mode), which erases what another consumer of the same input sent first; the sum is
the gradient when an input feeds several layers, and equals Darknet's result otherwise.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``. Each ``*_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that runs the loop without the GIL;
``*_forward`` makes the step and runs it once.
"""

from cython cimport floating

from darknet_metal.cpu.step cimport NativeStep, StepData, StepFn, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_disjoint, check_input, check_out


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


cdef void _upsample_backward(const floating* delta, floating* x_grad,
                             const UpsampleParams* p) noexcept nogil:
    # Each input takes its s x s block, rows then columns: the order in which Darknet's
    # loop adds them into it.
    cdef Py_ssize_t h = p.h, w = p.w, s = p.s
    cdef Py_ssize_t ow = w * s, oh = h * s
    cdef Py_ssize_t plane, y, x, dy, dx, at
    cdef const floating* block
    cdef floating total
    cdef floating scale = <floating>p.scale
    for plane in range(p.planes):
        for y in range(h):
            for x in range(w):
                at = plane * h * w + y * w + x
                block = delta + plane * oh * ow + y * s * ow + x * s
                total = x_grad[at]
                for dy in range(s):
                    for dx in range(s):
                        total = total + scale * block[dy * ow + dx]
                x_grad[at] = total


cdef void _downsample_backward(const floating* delta, floating* x_grad,
                               const UpsampleParams* p) noexcept nogil:
    # The transpose of _downsample's reads, flat-index quirk included.
    cdef Py_ssize_t oh = p.h, ow = p.w, s = p.s
    cdef Py_ssize_t row = ow * s, plane_in = oh * ow * s * s
    cdef Py_ssize_t plane, J, I, dj, di, at
    cdef floating v
    cdef floating scale = <floating>p.scale
    for plane in range(p.planes):
        for J in range(oh):
            for I in range(ow):
                v = scale * delta[plane * oh * ow + J * ow + I]
                for dj in range(s):
                    for di in range(s):
                        at = plane * plane_in + (J * s + dj) * row + I * s + di
                        x_grad[at] = x_grad[at] + v


cdef void _upsample_backward_step(const StepData* d) noexcept nogil:
    cdef const UpsampleParams* p = <const UpsampleParams*>d.params
    if d.f32:
        _upsample_backward(<const float*>d.buf[UPSAMPLE_OUT], <float*>d.buf[UPSAMPLE_X], p)
    else:
        _upsample_backward(<const double*>d.buf[UPSAMPLE_OUT], <double*>d.buf[UPSAMPLE_X], p)


cdef void _downsample_backward_step(const StepData* d) noexcept nogil:
    cdef const UpsampleParams* p = <const UpsampleParams*>d.params
    if d.f32:
        _downsample_backward(<const float*>d.buf[UPSAMPLE_OUT], <float*>d.buf[UPSAMPLE_X], p)
    else:
        _downsample_backward(<const double*>d.buf[UPSAMPLE_OUT], <double*>d.buf[UPSAMPLE_X],
                             p)


cdef NativeStep _upsample_new(StepFn fn, str kind, x, out, int stride, double scale):
    """A step of ``fn`` on (x, out) by the UPSAMPLE roles (out being the delta and x the
    input's delta in backward), with x's and out's geometry."""
    cdef NativeStep step = new_step(fn, kind, (x, out), x.dtype == np.float32,
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


def upsample_step(x, out, int stride, double scale=1.0) -> NativeStep:
    """Darknet ``[upsample]`` forward (forward_upsample_layer).

    x: (N, C, H, W) float32/float64, C-contiguous; out: ``upsample_output_shape(x.shape,
    stride)``, same dtype. stride > 0: nearest-neighbour upsampling, each value multiplied
    by ``scale`` (the cfg key, default 1). stride < 0 (Darknet's reverse mode): each output
    is the sum of ``scale * x`` over a ``-stride`` x ``-stride`` block.
    """
    check_input("x", x)
    check_out(out, x, upsample_output_shape(x.shape, stride))
    if stride > 0:
        return _upsample_new(_upsample_step, "upsample", x, out, stride, scale)
    return _upsample_new(_downsample_step, "upsample_reverse", x, out, stride, scale)


def upsample_forward(x, out, int stride, double scale=1.0) -> None:
    """``upsample_step(x, out, stride, scale)`` run once."""
    upsample_step(x, out, stride, scale).run()


def upsample_backward_step(delta, x_grad, int stride, double scale=1.0) -> NativeStep:
    """Darknet's backward_upsample_layer, accumulating: ``x_grad += J^T delta`` for the map
    ``upsample_step(x, out, stride, scale)`` computes.

    x_grad: (N, C, H, W), the delta of the layer's input, C-contiguous float32/float64,
    added into; delta: ``upsample_output_shape(x_grad.shape, stride)``, same dtype.
    stride > 0: each input gets ``scale`` times the sum of its s x s block of delta.
    stride < 0 (reverse): each input read by the forward gets ``scale * delta`` of the
    output it went into (Darknet assigns this; inputs the forward never read get nothing).
    """
    check_input("x_grad", x_grad, writable=True)
    expected = upsample_output_shape(x_grad.shape, stride)
    check_input("delta", delta, like=x_grad, like_name="x_grad")
    if tuple(delta.shape) != tuple(expected):
        raise ArgumentError(f"delta must have shape {tuple(expected)} for x_grad "
                            f"{x_grad.shape} and stride={stride}, not {delta.shape}")
    check_disjoint({"x_grad": x_grad}, {"delta": delta})
    if stride > 0:
        return _upsample_new(_upsample_backward_step, "upsample_backward", x_grad, delta,
                             stride, scale)
    return _upsample_new(_downsample_backward_step, "upsample_reverse_backward", x_grad,
                         delta, stride, scale)


def upsample_backward(delta, x_grad, int stride, double scale=1.0) -> None:
    """``upsample_backward_step(delta, x_grad, stride, scale)`` run once."""
    upsample_backward_step(delta, x_grad, stride, scale).run()


# ----------------------------------------------------------------------------------------
# reorg

cdef enum:  # buffer roles
    REORG_X, REORG_OUT

cdef struct ReorgParams:
    Py_ssize_t batch
    Py_ssize_t w, h, c  # the input's
    Py_ssize_t s
    bint forward        # Darknet's flag: 1 for reverse=1
    bint backward       # the transpose, added into src's delta


cdef void _reorg_core(const floating* src, floating* dst, Py_ssize_t task, Py_ssize_t w,
                      Py_ssize_t h, Py_ssize_t c, Py_ssize_t s, bint to_large,
                      bint add) noexcept nogil:
    """One (batch, channel k) slice of Darknet's reorg_cpu(x, w, h, c, batch, s, forward).

    ``(w, h, c)`` are the dims of the "small" side indexed linearly (i + w*(j + h*(k +
    c*b))); the "large" side is read as (c/s^2, h*s, w*s). to_large=0 (Darknet's
    forward=0) moves large -> small, to_large=1 small -> large; ``add`` adds into dst
    instead of assigning.
    """
    cdef Py_ssize_t in_c = c // (s * s)
    cdef Py_ssize_t b = task // c, k = task % c
    cdef Py_ssize_t c2 = k % in_c, offset = k // in_c
    cdef Py_ssize_t i, j, small, large, at, src_at
    for j in range(h):
        for i in range(w):
            small = i + w * (j + h * (k + c * b))
            large = (i * s + offset % s) + w * s * ((j * s + offset // s) + h * s * (c2 + in_c * b))
            if to_large:
                at, src_at = large, small
            else:
                at, src_at = small, large
            if add:
                dst[at] = dst[at] + src[src_at]
            else:
                dst[at] = src[src_at]


cdef void _reorg(const floating* src, floating* dst, const ReorgParams* p) noexcept nogil:
    # Backward runs the same index map the other way round: its src is the output's delta.
    cdef bint to_large = p.forward != p.backward
    cdef Py_ssize_t task
    for task in range(p.batch * p.c):
        _reorg_core(src, dst, task, p.w, p.h, p.c, p.s, to_large, p.backward)


cdef void _reorg_step(const StepData* d) noexcept nogil:
    cdef const ReorgParams* p = <const ReorgParams*>d.params
    if d.f32:
        _reorg(<const float*>d.buf[REORG_X], <float*>d.buf[REORG_OUT], p)
    else:
        _reorg(<const double*>d.buf[REORG_X], <double*>d.buf[REORG_OUT], p)


def reorg_output_shape(shape, int stride, bint reverse):
    """(N, C, H, W) output of ``[reorg]`` or ``[reorg3d]`` with this stride and reverse flag.

    Forward: (N, C*s*s, H//s, W//s); reverse: (N, C//(s*s), H*s, W*s).
    """
    n, c, h, w = shape
    _check_stride(stride)
    if reverse:
        return n, c // (stride * stride), h * stride, w * stride
    return n, c * stride * stride, h // stride, w // stride


def reorg_step(x, out, int stride, bint reverse=False, str layer="reorg") -> NativeStep:
    """Darknet's reorg forward: ``layer="reorg"`` is forward_reorg_old_layer (YOLOv2's layer;
    OpenCV's too), ``layer="reorg3d"`` forward_reorg_layer.

    x: (N, C, H, W); out: ``reorg_output_shape(x.shape, stride, reverse)``, same dtype.
    Both are Darknet's reorg_cpu with the reverse flag as its ``forward`` argument; [reorg]
    passes it the input's dims, [reorg3d] the output's.

    [reorg]: with s = stride and C' = C/s^2, the output *buffer*, read as (C, H, W), gets
    ``out[k, j, i] = x'[k % C', j*s + (k // C') // s, i*s + (k // C') % s]`` where x' is the
    input buffer read as (C', H*s, W*s); the result is then labelled (C*s^2, H/s, W/s).
    This is not a plain space-to-depth, but it is what trained YOLOv2 weights expect.
    Reverse applies the same index map from the other side with the reverse layer's own
    input dims, which makes it a plain depth-to-space (not the inverse of forward):
    ``out[c, y, x] = x[((y % s)*s + x % s)*C' + c, y // s, x // s]``, C' = C/s^2.

    [reorg3d]: a plain space-to-depth, ``out[(dy*s + dx)*C + c, y, x] = x[c, y*s + dy,
    x*s + dx]`` (the inverse of [reorg] reverse); reverse=1 is Darknet's quirky inverse
    direction, which reads its own output as (C/s^4, H*s^2, W*s^2) and so needs C divisible
    by s^4.

    Requires C divisible by s^2 (except a forward [reorg3d]) and, forward, H and W divisible
    by s (otherwise Darknet writes outside its buffers).
    """
    check_input("x", x)
    _check_reorg_input("x", x, stride, reverse, layer)
    shape = reorg_output_shape(x.shape, stride, reverse)
    check_out(out, x, shape)
    return _reorg_new(layer + ("_reverse" if reverse else ""), x, out,
                      shape if layer == "reorg3d" else x.shape, stride, reverse, False)


def reorg_forward(x, out, int stride, bint reverse=False, str layer="reorg") -> None:
    """``reorg_step(x, out, stride, reverse, layer)`` run once."""
    reorg_step(x, out, stride, reverse, layer).run()


def _check_reorg_input(name, x, int stride, bint reverse, str layer):
    if layer not in ("reorg", "reorg3d"):
        raise ArgumentError(f"layer must be 'reorg' or 'reorg3d', not {layer!r}")
    _check_stride(stride)
    n, c, h, w = x.shape
    s2 = stride * stride
    # reorg_cpu reads the side whose dims it is given as (C/s^2, H*s, W*s): those channels
    # must divide (a forward [reorg3d] is given its output's, C*s^2).
    if c % s2 and (reverse or layer == "reorg"):
        raise ArgumentError(f"[{layer}] needs channels divisible by stride^2={s2}, got "
                            f"{name} with {c}")
    if layer == "reorg3d" and reverse and c % (s2 * s2):
        raise ArgumentError(f"[reorg3d] reverse=1 needs channels divisible by stride^4="
                            f"{s2 * s2}, got {name} with {c}")
    if not reverse and (h % stride or w % stride):
        raise ArgumentError(f"[{layer}] stride={stride} must divide the {h}x{w} input "
                            f"({name} {x.shape})")


cdef NativeStep _reorg_new(str kind, src, dst, shape, int stride, bint reverse,
                           bint backward):
    """The step moving src into dst; ``shape``: the (N, C, H, W) dims reorg_cpu is given."""
    cdef NativeStep step = new_step(_reorg_step, kind, (src, dst), src.dtype == np.float32,
                                    sizeof(ReorgParams))
    cdef ReorgParams* p = <ReorgParams*>step.data.params
    p.batch, p.c, p.h, p.w = shape
    p.s = stride
    p.forward = reverse
    p.backward = backward
    return step


def reorg_backward_step(delta, x_grad, int stride, bint reverse=False,
                        str layer="reorg") -> NativeStep:
    """The backward of ``reorg_step(x, out, stride, reverse, layer)``: ``x_grad += P^T
    delta`` for its permutation P, i.e. each input's delta gets the delta of the output it
    was moved to.

    x_grad: (N, C, H, W), the delta of the layer's input (the forward's x), added into
    (Darknet's reorg backward assigns); delta: ``reorg_output_shape(x_grad.shape, stride,
    reverse)``, same dtype. The same divisibility as ``reorg_step``.
    """
    check_input("x_grad", x_grad, writable=True)
    _check_reorg_input("x_grad", x_grad, stride, reverse, layer)
    expected = reorg_output_shape(x_grad.shape, stride, reverse)
    check_input("delta", delta, like=x_grad, like_name="x_grad")
    if tuple(delta.shape) != tuple(expected):
        raise ArgumentError(f"delta must have shape {tuple(expected)} for x_grad "
                            f"{x_grad.shape}, stride={stride} and reverse={bool(reverse)}, "
                            f"not {delta.shape}")
    check_disjoint({"x_grad": x_grad}, {"delta": delta})
    return _reorg_new(layer + ("_reverse" if reverse else "") + "_backward", delta, x_grad,
                      expected if layer == "reorg3d" else x_grad.shape, stride, reverse,
                      True)


def reorg_backward(delta, x_grad, int stride, bint reverse=False, str layer="reorg") -> None:
    """``reorg_backward_step(delta, x_grad, stride, reverse, layer)`` run once."""
    reorg_backward_step(delta, x_grad, stride, reverse, layer).run()
