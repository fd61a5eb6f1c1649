# cython: language_level=3
"""Whole-array steps: filling, copying and adding. A training program clears each delta
before the first of its layer's consumers adds its gradient into it, keeps copies of values a
later step overwrites in place (an activation's input), and adds a loss layer's delta into
its input's.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays,
checked by ``checks``; ``fill_step``, ``copy_step`` and ``add_step`` return the
``NativeStep`` that writes without the GIL.
"""

from cython cimport floating
from libc.string cimport memcpy, memset

from darknet_metal.cpu.blas cimport run_parts
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_like, check_shaped_like

cdef enum:  # buffer roles
    FILL_X

cdef struct FillParams:
    Py_ssize_t n
    double value


cdef void _fill_step(const StepData* d) noexcept nogil:
    cdef const FillParams* p = <const FillParams*>d.params
    cdef Py_ssize_t i
    cdef float* xf
    cdef double* xd
    if p.value == 0.0:
        # All-zero bits are +0.0 in IEEE 754 for both widths.
        memset(d.buf[FILL_X], 0, p.n * (sizeof(float) if d.f32 else sizeof(double)))
    elif d.f32:
        xf = <float*>d.buf[FILL_X]
        for i in range(p.n):
            xf[i] = <float>p.value
    else:
        xd = <double*>d.buf[FILL_X]
        for i in range(p.n):
            xd[i] = p.value


def fill_step(x, double value=0.0) -> NativeStep:
    """``x[...] = value`` for a C-contiguous float32/float64 array of any shape."""
    check_input("x", x, tuple(range(1, 9)), layout="any shape", writable=True)
    if not np.isfinite(value):
        raise ArgumentError(f"fill value must be finite, not {value}")
    cdef NativeStep step = new_step(_fill_step, "fill", (x,), x.dtype == np.float32,
                                    sizeof(FillParams))
    cdef FillParams* p = <FillParams*>step.data.params
    p.n = x.size
    p.value = value
    return step


def fill(x, double value=0.0) -> None:
    """``fill_step(x, value)`` run once."""
    fill_step(x, value).run()


cdef enum:  # buffer roles
    COPY_SRC, COPY_DST

cdef struct CopyParams:
    Py_ssize_t nbytes


cdef void _copy_step(const StepData* d) noexcept nogil:
    cdef const CopyParams* p = <const CopyParams*>d.params
    memcpy(d.buf[COPY_DST], d.buf[COPY_SRC], p.nbytes)


def copy_step(src, dst) -> NativeStep:
    """``dst[...] = src``: two C-contiguous arrays of one shape and dtype (float32 or
    float64) that do not overlap."""
    check_input("src", src, tuple(range(1, 9)), layout="any shape")
    check_input("dst", dst, tuple(range(1, 9)), layout="any shape", writable=True)
    check_like("dst", dst, src, "src")
    if np.shares_memory(src, dst):
        raise ArgumentError("copy_step: src and dst must not overlap")
    cdef NativeStep step = new_step(_copy_step, "copy", (src, dst), src.dtype == np.float32,
                                    sizeof(CopyParams))
    (<CopyParams*>step.data.params).nbytes = src.nbytes
    return step


cdef enum:  # buffer roles
    ADD_SRC, ADD_DST

cdef struct AddParams:
    Py_ssize_t n
    double scale


cdef void _add(const floating* src, floating* dst, const AddParams* p) noexcept nogil:
    cdef Py_ssize_t i
    # scale in the dtype (Darknet's float l.scale); 1.0*x is x exactly.
    cdef floating scale = <floating>p.scale
    for i in range(p.n):
        dst[i] = dst[i] + scale * src[i]


cdef void _add_step(const StepData* d) noexcept nogil:
    cdef const AddParams* p = <const AddParams*>d.params
    if d.f32:
        _add(<const float*>d.buf[ADD_SRC], <float*>d.buf[ADD_DST], p)
    else:
        _add(<const double*>d.buf[ADD_SRC], <double*>d.buf[ADD_DST], p)


def add_step(src, dst, double scale=1.0) -> NativeStep:
    """``dst += scale*src`` (``dst += src`` exactly when scale is 1): two C-contiguous arrays
    of one shape and dtype (float32 or float64) that do not overlap."""
    check_input("src", src, tuple(range(1, 9)), layout="any shape")
    check_input("dst", dst, tuple(range(1, 9)), layout="any shape", writable=True)
    check_like("dst", dst, src, "src")
    if np.shares_memory(src, dst):
        raise ArgumentError("add_step: src and dst must not overlap")
    if not np.isfinite(scale):
        raise ArgumentError(f"add_step: scale must be finite, not {scale}")
    cdef NativeStep step = new_step(_add_step, "add", (src, dst), src.dtype == np.float32,
                                    sizeof(AddParams))
    cdef AddParams* p = <AddParams*>step.data.params
    p.n = src.size
    p.scale = scale
    return step


# -- copy_finite: a batch staged for a device and checked in one read ----------------------

cdef extern from "copy_finite.h" nogil:
    int dm_copy_finite(const unsigned int* src, unsigned int* dst, size_t n)

cdef enum:
    # Floats in one part of the pool's loop: 256 KiB, so that a pass's input staged in 4 MiB
    # parts (runtime.gpu_program) still keeps 16 threads busy.
    _FINITE_PART = 1 << 16

cdef struct FiniteCopy:
    const unsigned int* src  # float32 bits
    unsigned int* dst        # NULL: check only
    Py_ssize_t n
    int* bad                 # per part: 1 when it found a NaN or an infinity


cdef void _copy_finite_part(void* ctx, int part) noexcept nogil:
    cdef FiniteCopy* c = <FiniteCopy*>ctx
    cdef Py_ssize_t lo = part * <Py_ssize_t>_FINITE_PART
    cdef Py_ssize_t hi = min(lo + <Py_ssize_t>_FINITE_PART, c.n)
    c.bad[part] = dm_copy_finite(c.src + lo, NULL if c.dst == NULL else c.dst + lo,
                                 <size_t>(hi - lo))


def copy_finite(src, dst=None) -> bool:
    """Copies the C-contiguous float32 array ``src`` into ``dst`` (same shape; None: only
    check) and says whether every value of ``src`` is finite: one read of ``src``, split
    across the CPU threads in parts of 256 KiB (a batch staged for a device)."""
    check_input("src", src, tuple(range(1, 9)), layout="any shape")
    if src.dtype != np.float32:
        raise ArgumentError(f"src must be float32, not {src.dtype}")
    if dst is not None:
        check_shaped_like("dst", dst, src, "src", writable=True)
    cdef Py_ssize_t n = src.size
    cdef FiniteCopy c
    cdef int parts = <int>((n + _FINITE_PART - 1) // _FINITE_PART)
    bad = np.zeros(max(parts, 1), np.intc)
    cdef int[::1] bad_view = bad
    c.src = <const unsigned int*><size_t>src.__array_interface__["data"][0]
    c.dst = NULL if dst is None else <unsigned int*><size_t>dst.__array_interface__["data"][0]
    c.n = n
    c.bad = &bad_view[0]
    with nogil:
        if parts == 1:
            _copy_finite_part(&c, 0)
        elif parts > 1:
            run_parts(_copy_finite_part, &c, parts)
    return not bad.any()
