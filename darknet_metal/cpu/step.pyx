# cython: language_level=3
"""Native steps: a CPU kernel bound to its arrays, run later without the GIL.

Each Cython layer module turns a checked call (``maxpool_step(x, out, ...)``) into a
``NativeStep``: a C function pointer, the data pointers of its arrays (``StepData.buf``, by
the role constants the module declares beside the kernel) and the kernel's parameter struct
copied into ``StepData.params``. Everything that can fail is checked when the step is made;
running it cannot raise. ``StepList`` (``executor.pyx``) runs a whole program's steps in one
GIL-free loop; ``NativeStep.run`` runs one (what the modules' ``*_forward`` functions do).

A step holds references to its arrays, so they outlive it; it does not lock them: the
caller must not resize or free them, and must not run two steps writing one array at once.
"""

from cpython.buffer cimport PyBUF_RECORDS_RO, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport memset

import numpy as np

from darknet_metal.errors import ArgumentError


cdef char* data_pointer(object array) except? NULL:
    # The buffer protocol's address is NumPy's data pointer (PyArray_DATA), without building
    # against NumPy's headers; strides and a format are accepted, so any array qualifies.
    cdef Py_buffer view
    PyObject_GetBuffer(array, &view, PyBUF_RECORDS_RO)
    cdef char* address = <char*>view.buf
    PyBuffer_Release(&view)
    return address


cdef class NativeStep:
    """One bound kernel call. ``kind``: the kernel's name; ``arrays``: the bound arrays, by
    role (None for an unbound optional role)."""

    def run(self) -> None:
        """Runs the kernel once, the GIL released."""
        with nogil:
            self.fn(&self.data)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.data.f32 else np.float64)

    def __repr__(self) -> str:
        return f"NativeStep({self.kind!r}, {self.dtype})"


cdef NativeStep new_step(StepFn fn, str kind, tuple arrays, bint f32, Py_ssize_t params_size):
    """A step running ``fn`` over ``arrays`` (checked ndarrays or None, in role order),
    float32 if ``f32`` else float64, with ``params_size`` bytes of parameters for the caller
    to fill in ``step.data.params``."""
    if len(arrays) > STEP_BUFFERS:
        raise ArgumentError(f"{kind}: {len(arrays)} buffers, at most {STEP_BUFFERS}")
    if params_size > <Py_ssize_t>sizeof(double) * STEP_PARAM_WORDS:
        raise ArgumentError(f"{kind}: {params_size} bytes of parameters, at most "
                            f"{sizeof(double) * STEP_PARAM_WORDS}")
    cdef NativeStep step = NativeStep.__new__(NativeStep)
    memset(&step.data, 0, sizeof(StepData))
    step.fn = fn
    step.kind = kind
    step.arrays = arrays
    step.data.f32 = f32
    cdef Py_ssize_t i
    for i, obj in enumerate(arrays):
        if obj is None:
            continue
        if not isinstance(obj, np.ndarray):
            raise ArgumentError(f"{kind}: buffer {i} is a {type(obj).__name__}, not an ndarray")
        step.data.buf[i] = data_pointer(obj)
    return step

