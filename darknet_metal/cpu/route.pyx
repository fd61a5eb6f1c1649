# cython: language_level=3
"""``[route]``: channels of one layer's output copied into a run of the route's channels.

A route layer is one ``route_step`` per routed layer: with ``groups``/``group_id``, the
layer's channels ``[group_id*C/groups, (group_id+1)*C/groups)`` go to the route's
channels that follow the previous layer's.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``; ``route_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that copies without the GIL;
``route_forward`` makes the step and runs it once.
"""

from libc.string cimport memcpy

from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

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


cdef void _route_step(const StepData* d) noexcept nogil:
    cdef const RouteParams* p = <const RouteParams*>d.params
    cdef const char* src = d.buf[ROUTE_SRC]
    cdef char* out = d.buf[ROUTE_OUT]
    cdef Py_ssize_t b
    if p.size == 0:
        return
    for b in range(p.batch):
        memcpy(out + b * p.out_sample + p.out_offset, src + b * p.src_sample + p.src_offset,
               p.size)


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
    check_input("src", src)
    check_input("out", out, like=src, like_name="src", writable=True)
    src_start = _count("src_channel_start", src_channel_start)
    count = _count("channels", channels)
    out_start = _count("out_channel_start", out_channel_start)
    n, c_src, h, w = src.shape
    c_out = out.shape[1]
    if out.shape[0] != n or out.shape[2:] != src.shape[2:]:
        raise ArgumentError(f"out must have shape ({n}, C_out, {h}, {w}) like src, "
                            f"not {out.shape}")
    if src_start + count > c_src:
        raise ArgumentError(f"src_channel_start={src_start} with channels={count} needs "
                            f"{src_start + count} channels, src has {c_src}")
    if out_start + count > c_out:
        raise ArgumentError(f"out_channel_start={out_start} with channels={count} needs "
                            f"{out_start + count} channels, out has {c_out}")
    if np.shares_memory(out, src):
        raise ArgumentError("out must not share memory with src")
    cdef NativeStep step = new_step(_route_step, "route", (src, out), src.dtype == np.float32,
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


def route_forward(src, out, src_channel_start, channels, out_channel_start) -> None:
    """``route_step(src, out, src_channel_start, channels, out_channel_start)`` run once."""
    route_step(src, out, src_channel_start, channels, out_channel_start).run()
