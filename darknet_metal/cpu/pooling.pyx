# cython: language_level=3
"""Pooling layers: the CPU reference for ``[maxpool]`` and ``[avgpool]``.

Window geometry is Darknet's (``maxpool_layer.cpp``): with total padding ``padding`` (the
cfg key, default ``size - 1``) the output is ``(w + padding - size) / stride_x + 1`` wide
(C integer division), window ``(i, j)`` starts at ``(j*stride_x - padding/2,
i*stride_y - padding/2)``, and positions outside the image are ignored. So ``size=2
stride=1`` keeps a 13x13 map 13x13, the extra row and column being on the bottom/right.
A window that lies entirely outside the image yields Darknet's ``-FLT_MAX``.

Training (``*_forward_train_step``) also records, per output, the flat index into x (over
the whole batch: ``((n*C + c)*H + y)*W + x``) of the element it took, Darknet's
``l.indexes``; ``maxpool_backward_step`` sends each output's delta there. Indexes are
int32, Darknet's ``int`` (so x must have fewer than 2**31 elements); an output with no
element (a window wholly outside the image, or holding only values not greater than
``-FLT_MAX``) gets index -1 and passes no gradient, where Darknet would write before its
buffer. Backward visits the outputs in order, one thread, so an input that is the maximum
of several overlapping windows gets their deltas summed in Darknet's order (Darknet's own
loop runs them on OpenMP threads without synchronisation).

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``. Each ``*_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that runs the loop without the GIL
(the float32 2x2 stride-2 windows in ``kernels.h``); ``*_forward`` makes the step and runs
it once.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.stdint cimport int32_t

from darknet_metal.cpu.blas cimport cpu_threads, run_parts
from darknet_metal.cpu.kernels cimport dm_maxpool2x2s2_f32
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.cpu.checks import check_disjoint, check_input, check_out


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
    MAXPOOL_X, MAXPOOL_OUT, MAXPOOL_INDEXES  # indexes: training only

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


cdef void _maxpool(const floating* src, floating* dst, const MaxpoolParams* p,
                   Py_ssize_t first, Py_ssize_t last) noexcept nogil:
    cdef Py_ssize_t plane
    for plane in range(first, last):
        _maxpool_plane(src + plane * p.h * p.w, dst + plane * p.out_h * p.out_w, p.h, p.w,
                       p.out_h, p.out_w, p.size, p.stride_x, p.stride_y, p.offset)


cdef void _maxpool_planes(const StepData* d, Py_ssize_t first,
                          Py_ssize_t last) noexcept nogil:
    cdef const MaxpoolParams* p = <const MaxpoolParams*>d.params
    if d.f32 and p.inside_2x2s2:
        # The vectorised kernel: the same comparisons in the same order.
        dm_maxpool2x2s2_f32(<const float*>d.buf[MAXPOOL_X] + first * p.h * p.w,
                            <float*>d.buf[MAXPOOL_OUT] + first * p.out_h * p.out_w,
                            last - first, p.h, p.w, p.out_h, p.out_w)
    elif d.f32:
        _maxpool(<const float*>d.buf[MAXPOOL_X], <float*>d.buf[MAXPOOL_OUT], p, first, last)
    else:
        _maxpool(<const double*>d.buf[MAXPOOL_X], <double*>d.buf[MAXPOOL_OUT], p, first,
                 last)


#: Least outputs of a float32 max pooling whose planes are shared out among the executor's
#: threads (waking them costs tens of microseconds; yolov3-tiny's smallest, 512 x 13 x 13,
#: took 0.3 ms on one).
cdef Py_ssize_t MAXPOOL_SPLIT_OUTPUTS = 1 << 15


ctypedef void (*planes_fn)(const StepData* d, Py_ssize_t first,
                          Py_ssize_t last) noexcept nogil


ctypedef struct PlanesJob:
    # A max pooling's planes [first, last) a part, shared out among the executor's threads.
    const StepData* d
    planes_fn planes
    Py_ssize_t span  # planes per part


cdef void _planes_part(void* ctx, int part) noexcept nogil:
    cdef PlanesJob* j = <PlanesJob*>ctx
    cdef const MaxpoolParams* p = <const MaxpoolParams*>j.d.params
    cdef Py_ssize_t first = part * j.span
    j.planes(j.d, first, min(p.planes, first + j.span))


cdef void _share_planes(const StepData* d, planes_fn planes) noexcept nogil:
    # Planes are independent: whole planes a part, every output computed as on one thread.
    cdef const MaxpoolParams* p = <const MaxpoolParams*>d.params
    cdef PlanesJob job
    cdef Py_ssize_t parts = min(p.planes, <Py_ssize_t>cpu_threads() * 4)
    if parts < 1:
        return
    job.d, job.planes = d, planes
    job.span = (p.planes + parts - 1) // parts
    run_parts(_planes_part, &job, <int>((p.planes + job.span - 1) // job.span))


cdef void _maxpool_step(const StepData* d) noexcept nogil:
    # Large float32 poolings are shared out among the executor's threads.
    cdef const MaxpoolParams* p = <const MaxpoolParams*>d.params
    if (not d.f32 or cpu_threads() < 2 or p.planes < 2
            or p.planes * p.out_h * p.out_w < MAXPOOL_SPLIT_OUTPUTS):
        _maxpool_planes(d, 0, p.planes)
    else:
        _share_planes(d, _maxpool_planes)


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


cdef void _maxpool_train_planes(const floating* src, floating* dst, int32_t* indexes,
                                const MaxpoolParams* p, Py_ssize_t first,
                                Py_ssize_t last) noexcept nogil:
    # Darknet's training loop: every window position in row-major order, the first strictly
    # greater value kept (so the output equals the inference kernels').
    cdef Py_ssize_t h = p.h, w = p.w, out_h = p.out_h, out_w = p.out_w, offset = p.offset
    cdef Py_ssize_t plane, i, j, n, m, y, x, y0, x0, base, at, best_at
    cdef floating best, val
    for plane in range(first, last):
        base = plane * h * w
        for i in range(out_h):
            y0 = i * p.stride_y - offset
            for j in range(out_w):
                x0 = j * p.stride_x - offset
                at = (plane * out_h + i) * out_w + j
                best = -FLT_MAX
                best_at = -1
                if p.size == 2 and y0 >= 0 and y0 + 2 <= h and x0 >= 0 and x0 + 2 <= w:
                    # The common 2x2 window wholly inside: the same comparisons in the same
                    # order, without the bounds tests.
                    for n in range(2):
                        for m in range(2):
                            val = src[base + (y0 + n) * w + x0 + m]
                            if val > best:
                                best = val
                                best_at = base + (y0 + n) * w + x0 + m
                else:
                    for n in range(p.size):
                        y = y0 + n
                        if y < 0 or y >= h:
                            continue
                        for m in range(p.size):
                            x = x0 + m
                            if x < 0 or x >= w:
                                continue
                            val = src[base + y * w + x]
                            if val > best:
                                best = val
                                best_at = base + y * w + x
                dst[at] = best
                indexes[at] = <int32_t>best_at


cdef void _maxpool_train_range(const StepData* d, Py_ssize_t first,
                               Py_ssize_t last) noexcept nogil:
    cdef const MaxpoolParams* p = <const MaxpoolParams*>d.params
    if d.f32:
        _maxpool_train_planes(<const float*>d.buf[MAXPOOL_X], <float*>d.buf[MAXPOOL_OUT],
                              <int32_t*>d.buf[MAXPOOL_INDEXES], p, first, last)
    else:
        _maxpool_train_planes(<const double*>d.buf[MAXPOOL_X], <double*>d.buf[MAXPOOL_OUT],
                              <int32_t*>d.buf[MAXPOOL_INDEXES], p, first, last)


cdef void _maxpool_train_step(const StepData* d) noexcept nogil:
    _share_planes(d, _maxpool_train_range)


def _check_indexes(indexes, out, x, str out_name="out") -> None:
    """Raise unless ``indexes`` is a writable C-contiguous int32 array shaped like ``out``
    (called ``out_name``) and x has fewer elements than int32 can address."""
    if not isinstance(indexes, np.ndarray):
        raise ArgumentTypeError(f"indexes must be a numpy array, not {type(indexes).__name__}")
    if indexes.dtype != np.int32:
        raise ArgumentError(f"indexes must be int32 (Darknet's l.indexes), not {indexes.dtype}")
    if indexes.shape != out.shape:
        raise ArgumentError(f"indexes must have the shape of {out_name} {out.shape}, not "
                            f"{indexes.shape}")
    if not indexes.flags.c_contiguous or not indexes.flags.writeable:
        raise ArgumentError("indexes must be C-contiguous and writable (it is written to)")
    if x.size > np.iinfo(np.int32).max:
        raise ArgumentError(f"int32 indexes cannot address the {x.size} elements of x")


def maxpool_forward_train_step(x, out, indexes, int size, int stride_x, int stride_y,
                               int padding) -> NativeStep:
    """Darknet ``[maxpool]`` forward in training: ``maxpool_step``'s output, and in
    ``indexes`` (int32, shaped like out) the flat index into x of each output's maximum,
    the first in window order (rows, then columns) on ties; -1 for an output with no
    element (see the module docstring). What ``maxpool_backward_step`` reads.
    """
    # The inference step checks x, out and the geometry and works out the parameters.
    cdef NativeStep inference = maxpool_step(x, out, size, stride_x, stride_y, padding)
    _check_indexes(indexes, out, x)
    check_disjoint({"indexes": indexes}, {"x": x, "out": out})
    cdef NativeStep step = new_step(_maxpool_train_step, "maxpool_train", (x, out, indexes),
                                    x.dtype == np.float32, sizeof(MaxpoolParams))
    cdef MaxpoolParams* p = <MaxpoolParams*>step.data.params
    p[0] = (<MaxpoolParams*>inference.data.params)[0]
    return step


def maxpool_forward_train(x, out, indexes, int size, int stride_x, int stride_y,
                          int padding) -> None:
    """``maxpool_forward_train_step(x, out, indexes, size, stride_x, stride_y, padding)``
    run once."""
    maxpool_forward_train_step(x, out, indexes, size, stride_x, stride_y, padding).run()


# ----------------------------------------------------------------------------------------
# maxpool_depth

cdef enum:  # buffer roles
    MAXPOOL_DEPTH_X, MAXPOOL_DEPTH_OUT, MAXPOOL_DEPTH_INDEXES  # indexes: training only

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


@cython.cdivision(True)
cdef void _maxpool_depth_train(const floating* src, floating* dst, int32_t* indexes,
                               const MaxpoolDepthParams* p) noexcept nogil:
    cdef Py_ssize_t c = p.c, out_c = p.out_c, spatial = p.spatial
    cdef Py_ssize_t task, b, g, k, i, at, best_at
    cdef floating best, val
    for task in range(p.batch * out_c):
        b = task // out_c
        g = task % out_c
        for i in range(spatial):
            best = -FLT_MAX
            best_at = -1
            k = g
            while k < c:
                at = (b * c + k) * spatial + i
                val = src[at]
                if val > best:
                    best = val
                    best_at = at
                k = k + out_c
            dst[task * spatial + i] = best
            indexes[task * spatial + i] = <int32_t>best_at


cdef void _maxpool_depth_train_step(const StepData* d) noexcept nogil:
    cdef const MaxpoolDepthParams* p = <const MaxpoolDepthParams*>d.params
    if d.f32:
        _maxpool_depth_train(<const float*>d.buf[MAXPOOL_DEPTH_X],
                             <float*>d.buf[MAXPOOL_DEPTH_OUT],
                             <int32_t*>d.buf[MAXPOOL_DEPTH_INDEXES], p)
    else:
        _maxpool_depth_train(<const double*>d.buf[MAXPOOL_DEPTH_X],
                             <double*>d.buf[MAXPOOL_DEPTH_OUT],
                             <int32_t*>d.buf[MAXPOOL_DEPTH_INDEXES], p)


def maxpool_depth_forward_train_step(x, out, indexes) -> NativeStep:
    """Darknet ``[maxpool] maxpool_depth=1`` forward in training: ``maxpool_depth_step``'s
    output, and in ``indexes`` (int32, shaped like out) the flat index into x of each
    output's maximum (the lowest channel on ties), for ``maxpool_backward_step``.
    """
    cdef NativeStep inference = maxpool_depth_step(x, out)
    _check_indexes(indexes, out, x)
    check_disjoint({"indexes": indexes}, {"x": x, "out": out})
    cdef NativeStep step = new_step(_maxpool_depth_train_step, "maxpool_depth_train",
                                    (x, out, indexes), x.dtype == np.float32,
                                    sizeof(MaxpoolDepthParams))
    cdef MaxpoolDepthParams* p = <MaxpoolDepthParams*>step.data.params
    p[0] = (<MaxpoolDepthParams*>inference.data.params)[0]
    return step


def maxpool_depth_forward_train(x, out, indexes) -> None:
    """``maxpool_depth_forward_train_step(x, out, indexes)`` run once."""
    maxpool_depth_forward_train_step(x, out, indexes).run()


# ----------------------------------------------------------------------------------------
# maxpool backward (both kinds)

cdef enum:  # buffer roles
    MAXPOOL_BACK_DELTA, MAXPOOL_BACK_INDEXES, MAXPOOL_BACK_X_GRAD

cdef struct MaxpoolBackwardParams:
    Py_ssize_t n       # outputs (elements of delta and indexes)
    Py_ssize_t x_size  # elements of x_grad


cdef void _maxpool_backward(const floating* delta, const int32_t* indexes, floating* x_grad,
                            const MaxpoolBackwardParams* p) noexcept nogil:
    # In output order, as Darknet's loop: where windows overlap, one input's sum is formed
    # in that order. The range test keeps a stale or foreign index array from writing
    # outside x_grad (and skips the -1 of an empty window).
    cdef Py_ssize_t i, at
    for i in range(p.n):
        at = <Py_ssize_t>indexes[i]
        if 0 <= at < p.x_size:
            x_grad[at] = x_grad[at] + delta[i]


cdef void _maxpool_backward_step(const StepData* d) noexcept nogil:
    cdef const MaxpoolBackwardParams* p = <const MaxpoolBackwardParams*>d.params
    if d.f32:
        _maxpool_backward(<const float*>d.buf[MAXPOOL_BACK_DELTA],
                          <const int32_t*>d.buf[MAXPOOL_BACK_INDEXES],
                          <float*>d.buf[MAXPOOL_BACK_X_GRAD], p)
    else:
        _maxpool_backward(<const double*>d.buf[MAXPOOL_BACK_DELTA],
                          <const int32_t*>d.buf[MAXPOOL_BACK_INDEXES],
                          <double*>d.buf[MAXPOOL_BACK_X_GRAD], p)


def maxpool_backward_step(delta, indexes, x_grad) -> NativeStep:
    """Darknet's backward_maxpool_layer (plain and ``maxpool_depth``):
    ``x_grad.flat[indexes[i]] += delta.flat[i]`` for every output i.

    delta: (N, C, out_h, out_w), the layer's delta; indexes: int32 shaped like delta, as a
    ``*_forward_train_step`` fills it (read when the step runs; entries outside
    ``[0, x_grad.size)``, such as -1, are skipped); x_grad: (N, C_in, H, W), the delta of
    the layer's input, same dtype as delta, accumulated into (never assigned).
    """
    check_input("delta", delta)
    check_input("x_grad", x_grad, like=delta, like_name="delta", writable=True)
    _check_indexes(indexes, delta, x_grad, "delta")
    check_disjoint({"x_grad": x_grad}, {"delta": delta, "indexes": indexes})
    cdef NativeStep step = new_step(_maxpool_backward_step, "maxpool_backward",
                                    (delta, indexes, x_grad), delta.dtype == np.float32,
                                    sizeof(MaxpoolBackwardParams))
    cdef MaxpoolBackwardParams* p = <MaxpoolBackwardParams*>step.data.params
    p.n = delta.size
    p.x_size = x_grad.size
    return step


def maxpool_backward(delta, indexes, x_grad) -> None:
    """``maxpool_backward_step(delta, indexes, x_grad)`` run once."""
    maxpool_backward_step(delta, indexes, x_grad).run()


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


cdef enum:  # buffer roles
    AVGPOOL_BACK_DELTA, AVGPOOL_BACK_X_GRAD


@cython.cdivision(True)
cdef void _avgpool_backward(const floating* delta, floating* x_grad,
                            const AvgpoolParams* p) noexcept nogil:
    cdef Py_ssize_t spatial = p.spatial, plane, i
    cdef floating share
    for plane in range(p.planes):
        # Darknet divides the float delta by the int count h*w, the same for every pixel.
        share = delta[plane] / <floating>spatial
        for i in range(spatial):
            x_grad[plane * spatial + i] = x_grad[plane * spatial + i] + share


cdef void _avgpool_backward_step(const StepData* d) noexcept nogil:
    cdef const AvgpoolParams* p = <const AvgpoolParams*>d.params
    if d.f32:
        _avgpool_backward(<const float*>d.buf[AVGPOOL_BACK_DELTA],
                          <float*>d.buf[AVGPOOL_BACK_X_GRAD], p)
    else:
        _avgpool_backward(<const double*>d.buf[AVGPOOL_BACK_DELTA],
                          <double*>d.buf[AVGPOOL_BACK_X_GRAD], p)


def avgpool_backward_step(delta, x_grad) -> NativeStep:
    """Darknet's backward_avgpool_layer: ``x_grad[n, c, :, :] += delta[n, c] / (H*W)``.

    delta: (N, C, 1, 1), the layer's delta; x_grad: (N, C, H, W) with H*W >= 1, the delta of
    the layer's input, same dtype, accumulated into.
    """
    check_input("x_grad", x_grad, writable=True)
    check_input("delta", delta, like=x_grad, like_name="x_grad")
    n, c, h, w = x_grad.shape
    if delta.shape != (n, c, 1, 1):
        raise ArgumentError(f"delta must have shape {(n, c, 1, 1)} for x_grad {x_grad.shape}, "
                            f"not {delta.shape}")
    if h * w == 0:
        raise ArgumentError(f"avgpool needs a non-empty input, got x_grad {x_grad.shape}")
    check_disjoint({"x_grad": x_grad}, {"delta": delta})
    cdef NativeStep step = new_step(_avgpool_backward_step, "avgpool_backward",
                                    (delta, x_grad), x_grad.dtype == np.float32,
                                    sizeof(AvgpoolParams))
    cdef AvgpoolParams* p = <AvgpoolParams*>step.data.params
    p.planes = n * c
    p.spatial = h * w
    return step


def avgpool_backward(delta, x_grad) -> None:
    """``avgpool_backward_step(delta, x_grad)`` run once."""
    avgpool_backward_step(delta, x_grad).run()
