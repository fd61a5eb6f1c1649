# cython: language_level=3
"""The CPU executor's inner loop: a program's native steps run in order, without the GIL.

``StepList`` holds the steps of one loaded program (bound to its planned memory). A pass is
one GIL-free loop over C function pointers, so other Python threads (a data loader, a
server, other networks) run meanwhile. The program's input is the caller's array: every
buffer pointer a step took into the stand-in input array is re-pointed, at the same offset,
into the array of each pass.

A ``StepList`` runs one pass at a time (its callers hold the network's lock); passes of
different lists may run concurrently. Each step's wall time is summed as it runs (two clock
reads a step, some 40 ns against steps of microseconds or more), for a profile to take.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from darknet_metal.cpu.step cimport STEP_BUFFERS, NativeStep, StepData, StepFn, data_pointer

import numpy as np

from darknet_metal.errors import ArgumentError, MemoryLimitError


cdef struct InputRef:
    Py_ssize_t step    # index in the list
    int role           # index in the step's buf
    Py_ssize_t offset  # bytes from the start of the input


cdef int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class StepList:
    """The native steps of one program, run as a whole without the GIL.

    ``steps``: NativeStep objects in program order. ``input_array``: the stand-in array the
    steps reading the program input were bound to (None if no step reads it); ``run`` binds
    those reads to its own input instead.
    """

    cdef readonly tuple steps  # the NativeStep objects, in order
    cdef StepFn* fns
    cdef StepData** datas
    cdef int64_t* step_ns  # per step: nanoseconds summed since the last take_step_seconds
    cdef Py_ssize_t count
    cdef InputRef* input_refs
    cdef Py_ssize_t input_ref_count
    cdef Py_ssize_t input_nbytes
    cdef readonly tuple input_shape
    cdef readonly object input_dtype
    #: CLOCK_MONOTONIC nanoseconds at which the last ``run`` entered and left its GIL-free
    #: loop (``time.monotonic_ns`` reads the same clock).
    cdef readonly int64_t last_started_ns
    cdef readonly int64_t last_finished_ns

    def __cinit__(self, steps, input_array=None):
        self.steps = tuple(steps)
        self.count = len(self.steps)
        cdef size_t n = max(1, self.count)
        self.fns = <StepFn*>PyMem_Malloc(n * sizeof(StepFn))
        self.datas = <StepData**>PyMem_Malloc(n * sizeof(StepData*))
        self.input_refs = <InputRef*>PyMem_Malloc(n * STEP_BUFFERS * sizeof(InputRef))
        self.step_ns = <int64_t*>PyMem_Calloc(n, sizeof(int64_t))
        if (self.fns == NULL or self.datas == NULL or self.input_refs == NULL
                or self.step_ns == NULL):
            needed = n * (sizeof(StepFn) + sizeof(StepData*) + STEP_BUFFERS * sizeof(InputRef)
                          + sizeof(int64_t))
            raise MemoryLimitError(f"out of memory for a list of {self.count} steps",
                                   needed=needed, available=0)
        cdef NativeStep step
        cdef Py_ssize_t i
        cdef int role
        cdef char* base = NULL
        cdef char* p
        self.input_nbytes = 0
        self.input_shape = ()
        self.input_dtype = None
        if input_array is not None:
            if not isinstance(input_array, np.ndarray) or not input_array.flags.c_contiguous:
                raise ArgumentError("input_array must be a C-contiguous ndarray")
            base = data_pointer(input_array)
            self.input_nbytes = input_array.nbytes
            self.input_shape = input_array.shape
            self.input_dtype = input_array.dtype
        self.input_ref_count = 0
        for i in range(self.count):
            if not isinstance(self.steps[i], NativeStep):
                raise ArgumentError(f"step {i} is a {type(self.steps[i]).__name__}, "
                                    "not a NativeStep")
            step = self.steps[i]
            self.fns[i] = step.fn
            self.datas[i] = &step.data
            if base == NULL:
                continue
            for role in range(STEP_BUFFERS):
                p = step.data.buf[role]
                if p != NULL and base <= p < base + self.input_nbytes:
                    self.input_refs[self.input_ref_count].step = i
                    self.input_refs[self.input_ref_count].role = role
                    self.input_refs[self.input_ref_count].offset = p - base
                    self.input_ref_count += 1

    def __dealloc__(self):
        PyMem_Free(self.fns)
        PyMem_Free(self.datas)
        PyMem_Free(self.input_refs)
        PyMem_Free(self.step_ns)

    def __len__(self) -> int:
        return self.count

    def run(self, x=None, Py_ssize_t start=0, Py_ssize_t stop=-1) -> None:
        """Runs steps ``start`` up to ``stop`` (-1: the end) with the GIL released.

        ``x``: the pass's input, of the stand-in's shape and dtype and C-contiguous (needed
        when a step in the range reads the input).
        """
        if stop < 0:
            stop = self.count
        if not 0 <= start <= stop <= self.count:
            raise ArgumentError(f"steps {start}:{stop} out of range for {self.count} steps")
        cdef char* base = NULL
        cdef Py_ssize_t i
        cdef InputRef* ref
        if self.input_ref_count:
            if (not isinstance(x, np.ndarray) or x.shape != self.input_shape
                    or x.dtype != self.input_dtype or not x.flags.c_contiguous):
                raise ArgumentError(
                    f"the input must be a C-contiguous {self.input_dtype} array of shape "
                    f"{self.input_shape}, not "
                    + (f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else repr(x)))
            base = data_pointer(x)
            for i in range(self.input_ref_count):
                ref = &self.input_refs[i]
                self.datas[ref.step].buf[ref.role] = base + ref.offset
        cdef int64_t before, after
        with nogil:
            self.last_started_ns = before = _now_ns()
            for i in range(start, stop):
                self.fns[i](self.datas[i])
                after = _now_ns()
                self.step_ns[i] += after - before
                before = after
            self.last_finished_ns = before

    def take_step_seconds(self) -> list:
        """Per step, the seconds its runs took since the last call (all runs summed), and
        the sums start again at 0. Call it between runs: a run in progress adds as it goes."""
        cdef Py_ssize_t i
        out = [self.step_ns[i] * 1e-9 for i in range(self.count)]
        for i in range(self.count):
            self.step_ns[i] = 0
        return out
