# A native step: one layer kernel bound to its arrays, runnable without the GIL.
# See step.pyx for the contract.

cdef enum:
    STEP_BUFFERS = 8     # buffers one step may bind
    STEP_PARAM_WORDS = 32  # 8-byte words of kernel parameters (256 bytes)

cdef struct StepData:
    # Bound buffers, by the kind's role constants (declared beside its kernel); NULL for an
    # optional role left unbound.
    char* buf[STEP_BUFFERS]
    # The kind's parameter struct lives here (``params_of``); doubles keep it 8-byte aligned.
    double params[STEP_PARAM_WORDS]
    bint f32  # float32 buffers (else float64)

ctypedef void (*StepFn)(const StepData* data) noexcept nogil

cdef class NativeStep:
    cdef StepFn fn
    cdef StepData data
    cdef readonly str kind
    cdef readonly tuple arrays  # what buf points into, kept alive with the step

cdef NativeStep new_step(StepFn fn, str kind, tuple arrays, bint f32, Py_ssize_t params_size)

# The address of an array's first element (any array with the buffer protocol: NumPy's,
# strided or read-only too); the caller keeps the array alive while it uses the address.
cdef char* data_pointer(object array) except? NULL
