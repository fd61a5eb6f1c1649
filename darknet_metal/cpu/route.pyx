# cython: language_level=3
"""``[route]``: channels of one layer's output copied into a run of the route's channels.

A route layer is one ``route_step`` per routed layer: with ``groups``/``group_id``, the
layer's channels ``[group_id*C/groups, (group_id+1)*C/groups)`` go to the route's
channels that follow the previous layer's. Its backward is one ``route_backward_step`` per
routed layer, adding the same run of the route's delta back into that layer's delta.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``; ``route_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that copies without the GIL;
``route_forward`` makes the step and runs it once.
"""

from cython cimport floating
from libc.string cimport memcpy

from darknet_metal.cpu.blas cimport cpu_threads, run_parts
from darknet_metal.cpu.step cimport NativeStep, StepData, StepFn, new_step

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.cpu.checks import check_input


cdef enum:  # buffer roles
    ROUTE_SRC, ROUTE_OUT

cdef struct RouteParams:
    # In bytes: the copy does not depend on the dtype.
    Py_ssize_t batch
    Py_ssize_t src_sample    # one sample of src
    Py_ssize_t src_offset    # from a sample of src to its first copied channel
    Py_ssize_t out_sample    # one sample of out
    Py_ssize_t out_offset    # from a sample of out to its first written channel
    Py_ssize_t size          # copied per sample


#: Least bytes of a route copy shared out among the executor's threads (in pieces of at
#: least half of it).
cdef Py_ssize_t ROUTE_SPLIT_BYTES = 1 << 20


ctypedef struct RouteJob:
    const RouteParams* p
    const char* src
    char* out
    Py_ssize_t pieces, piece  # pieces per sample, bytes per piece


cdef void _route_part(void* ctx, int part) noexcept nogil:
    cdef RouteJob* j = <RouteJob*>ctx
    cdef const RouteParams* p = j.p
    cdef Py_ssize_t b = part // j.pieces, start = (part % j.pieces) * j.piece
    cdef Py_ssize_t size = min(p.size - start, j.piece)
    if size > 0:
        memcpy(j.out + b * p.out_sample + p.out_offset + start,
               j.src + b * p.src_sample + p.src_offset + start, size)


cdef void _route_step(const StepData* d) noexcept nogil:
    cdef const RouteParams* p = <const RouteParams*>d.params
    cdef RouteJob job
    cdef int b
    if p.size == 0:
        return
    job.p, job.src, job.out = p, d.buf[ROUTE_SRC], d.buf[ROUTE_OUT]
    job.pieces, job.piece = 1, p.size
    if p.batch * p.size < ROUTE_SPLIT_BYTES:
        for b in range(p.batch):
            _route_part(&job, <int>b)
        return
    job.pieces = max(1, min(<Py_ssize_t>cpu_threads() * 2 // p.batch,
                            p.size // (ROUTE_SPLIT_BYTES // 2)))
    # Pieces of whole cache lines.
    job.piece = ((p.size + job.pieces - 1) // job.pieces + 63) // 64 * 64
    run_parts(_route_part, &job, <int>(p.batch * job.pieces))


def _count(name: str, value: object) -> int:
    # bool is an int to Python, never a channel count.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, not {value!r} "
                                f"({type(value).__name__})")
    if value < 0:
        raise ArgumentError(f"{name} must be >= 0, got {value}")
    return int(value)


def route_step(src, out, src_channel_start, channels, out_channel_start) -> NativeStep:
    """``out[:, out_channel_start:out_channel_start + channels] =
    src[:, src_channel_start:src_channel_start + channels]``.

    src: (N, C_src, H, W); out: (N, C_out, H, W) with src's dtype, writable, not sharing
    memory with src. Per sample the ``channels`` planes of H*W values are one run of
    memory in each array, copied with one memcpy.
    """
    return _route_new(_route_step, "route", False, src, out, "src", "out",
                      src_channel_start, channels, out_channel_start)


def route_forward(src, out, src_channel_start, channels, out_channel_start) -> None:
    """``route_step(src, out, src_channel_start, channels, out_channel_start)`` run once."""
    route_step(src, out, src_channel_start, channels, out_channel_start).run()


cdef void _route_add(const floating* delta, floating* grad,
                     const RouteParams* p) noexcept nogil:
    # RouteParams counts bytes; here they become elements of the dtype.
    cdef Py_ssize_t item = sizeof(floating), n = p.size // item, b, i
    cdef const floating* s
    cdef floating* d
    for b in range(p.batch):
        s = delta + (b * p.out_sample + p.out_offset) // item
        d = grad + (b * p.src_sample + p.src_offset) // item
        for i in range(n):
            d[i] = d[i] + s[i]


cdef void _route_backward_step(const StepData* d) noexcept nogil:
    # The roles are the forward's: ROUTE_OUT holds the route's delta, ROUTE_SRC the
    # routed layer's.
    cdef const RouteParams* p = <const RouteParams*>d.params
    if d.f32:
        _route_add(<const float*>d.buf[ROUTE_OUT], <float*>d.buf[ROUTE_SRC], p)
    else:
        _route_add(<const double*>d.buf[ROUTE_OUT], <double*>d.buf[ROUTE_SRC], p)


def route_backward_step(delta_out, x_grad, src_channel_start, channels,
                        out_channel_start) -> NativeStep:
    """The transpose of ``route_step``, as Darknet's backward_route_layer:
    ``x_grad[:, src_channel_start:src_channel_start + channels] +=
    delta_out[:, out_channel_start:out_channel_start + channels]``.

    delta_out: (N, C_out, H, W), the route's delta; x_grad: (N, C_src, H, W), the routed
    layer's delta, same dtype, writable, added into, not sharing memory with delta_out.
    """
    return _route_new(_route_backward_step, "route_backward", True, x_grad, delta_out,
                      "x_grad", "delta_out", src_channel_start, channels, out_channel_start)


def route_backward(delta_out, x_grad, src_channel_start, channels, out_channel_start) -> None:
    """``route_backward_step(delta_out, x_grad, src_channel_start, channels,
    out_channel_start)`` run once."""
    route_backward_step(delta_out, x_grad, src_channel_start, channels,
                        out_channel_start).run()


cdef NativeStep _route_new(StepFn fn, str kind, bint backward, src, out, str src_name,
                           str out_name, src_channel_start, channels, out_channel_start):
    """A step of ``fn`` on (src, out) by the ROUTE roles, after checking them: the array
    written (out forward, src backward) must be writable and not share memory with the
    other. The names are those of the caller's arguments."""
    check_input(src_name, src, writable=backward)
    check_input(out_name, out, like=src, like_name=src_name, writable=not backward)
    src_start = _count("src_channel_start", src_channel_start)
    count = _count("channels", channels)
    out_start = _count("out_channel_start", out_channel_start)
    n, c_src, h, w = src.shape
    c_out = out.shape[1]
    if out.shape[0] != n or out.shape[2:] != src.shape[2:]:
        raise ArgumentError(f"{out_name} must have shape ({n}, C_{out_name}, {h}, {w}) like "
                            f"{src_name}, not {out.shape}")
    if src_start + count > c_src:
        raise ArgumentError(f"src_channel_start={src_start} with channels={count} needs "
                            f"{src_start + count} channels, {src_name} has {c_src}")
    if out_start + count > c_out:
        raise ArgumentError(f"out_channel_start={out_start} with channels={count} needs "
                            f"{out_start + count} channels, {out_name} has {c_out}")
    if np.shares_memory(out, src):
        raise ArgumentError(f"{out_name} must not share memory with {src_name}")
    cdef NativeStep step = new_step(fn, kind, (src, out), src.dtype == np.float32,
                                    sizeof(RouteParams))
    cdef RouteParams* p = <RouteParams*>step.data.params
    plane = h * w * src.itemsize
    p.batch = n
    p.src_sample = c_src * plane
    p.src_offset = src_start * plane
    p.out_sample = c_out * plane
    p.out_offset = out_start * plane
    p.size = count * plane
    return step
