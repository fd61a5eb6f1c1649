# cython: language_level=3
"""Filling an array with one value: a training program clears each delta before the first
of its layer's consumers adds its gradient into it.

Contract: the package's (``darknet_metal.cpu``): a C-contiguous float32 or float64 array,
checked by ``checks``; ``fill_step`` returns the ``NativeStep`` that writes it without the
GIL.
"""

from libc.string cimport memset

from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input

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
