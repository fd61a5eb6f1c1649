# cython: language_level=3
"""``[dropout]`` in training, and the uniform draws it needs.

Darknet's dropout has no arrays of its own: in training its forward pass draws
``r ~ U(0, 1)`` per element, keeps the draws (``l.rand``) and, IN PLACE on the previous
layer's output, sets ``x = 0`` where ``r < probability`` and ``x *= scale`` elsewhere, with
``scale = 1/(1 - probability)`` computed in double and stored in the working precision (a
float for Darknet; so x is multiplied by the rounded reciprocal rather than divided).
Backward does the same to the previous layer's delta with the same draws. At inference the
layer does nothing.

``uniform_fill_step`` draws with a counter-based generator instead of Darknet's
thread-local mt19937 (seeded from std::random_device, so not reproducible there): element
i of a fill is a hash of (seed, counter, i), splitmix64's output function applied to a
splitmix64 sequence keyed by (seed, counter). The counter lives in a one-element array
the step reads and advances by one per run, so every pass draws afresh, a seeded run
repeats exactly, and saving the counter is saving the generator.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays,
checked by ``checks``. Each ``*_step`` checks its arguments and returns a ``NativeStep``
(``step.pyx``) that runs without the GIL; the functions without ``_step`` make the step and
run it once.
"""

from cython cimport floating
from libc.stdint cimport uint64_t

from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.cpu.checks import check_disjoint, check_input

# Shapes a dropout input may have: a [connected] output (N, F), or any layer's.
_NDIMS = (1, 2, 3, 4)
_COUNTER_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))


# ----------------------------------------------------------------------------------------
# dropout

cdef enum:  # buffer roles
    DROPOUT_X, DROPOUT_RAND

cdef struct DropoutParams:
    Py_ssize_t n  # elements
    double probability
    double scale  # 1/(1 - probability), rounded to the dtype


cdef void _dropout(floating* x, const floating* rand, const DropoutParams* p) noexcept nogil:
    cdef Py_ssize_t i
    cdef floating probability = <floating>p.probability, scale = <floating>p.scale
    cdef floating zero = 0
    for i in range(p.n):
        if rand[i] < probability:
            x[i] = zero
        else:
            x[i] = x[i] * scale


cdef void _dropout_step(const StepData* d) noexcept nogil:
    cdef const DropoutParams* p = <const DropoutParams*>d.params
    if d.f32:
        _dropout(<float*>d.buf[DROPOUT_X], <const float*>d.buf[DROPOUT_RAND], p)
    else:
        _dropout(<double*>d.buf[DROPOUT_X], <const double*>d.buf[DROPOUT_RAND], p)


cdef NativeStep _dropout_new(str kind, str name, x, rand, double probability):
    check_input(name, x, _NDIMS, writable=True)
    check_input("rand", rand, _NDIMS, x, like_name=name)
    if rand.size != x.size:
        raise ArgumentError(f"rand must have one draw per element of {name} ({x.size}), "
                            f"not {rand.size}")
    if not 0.0 <= probability < 1.0:
        raise ArgumentError(f"dropout probability must be in [0, 1), got {probability}")
    check_disjoint({name: x}, {"rand": rand})
    f32 = x.dtype == np.float32
    cdef NativeStep step = new_step(_dropout_step, kind, (x, rand), f32,
                                    sizeof(DropoutParams))
    cdef DropoutParams* p = <DropoutParams*>step.data.params
    p.n = x.size
    # As Darknet: the cfg's float probability, and 1./(1. - probability) in double,
    # stored as a float.
    prob = float(np.float32(probability)) if f32 else probability
    p.probability = prob
    p.scale = float(np.float32(1.0 / (1.0 - prob))) if f32 else 1.0 / (1.0 - prob)
    return step


def dropout_forward_train_step(x_inplace, rand, double probability) -> NativeStep:
    """Darknet ``[dropout]`` forward in training (forward_dropout_layer), given the draws:
    in place, ``x = 0`` where ``rand < probability``, else ``x *= 1/(1 - probability)``.

    x_inplace: the previous layer's output, any shape of 1 to 4 dimensions, C-contiguous
    float32/float64, writable; rand: one draw per element of x (any shape), same dtype,
    read when the step runs (fill it first, e.g. with ``uniform_fill_step``);
    probability: in [0, 1).
    """
    return _dropout_new("dropout_train", "x_inplace", x_inplace, rand, probability)


def dropout_forward_train(x_inplace, rand, double probability) -> None:
    """``dropout_forward_train_step(x_inplace, rand, probability)`` run once."""
    dropout_forward_train_step(x_inplace, rand, probability).run()


def dropout_backward_step(delta_inplace, rand, double probability) -> NativeStep:
    """Darknet ``[dropout]`` backward (backward_dropout_layer): in place on the previous
    layer's delta, ``delta = 0`` where ``rand < probability``, else ``delta *= 1/(1 -
    probability)``, with the forward's draws. Arguments as ``dropout_forward_train_step``.

    It multiplies rather than adds: the layer shares its delta with the previous layer,
    whose delta holds exactly what was sent to the dropout when this step runs.
    """
    return _dropout_new("dropout_backward", "delta_inplace", delta_inplace, rand, probability)


def dropout_backward(delta_inplace, rand, double probability) -> None:
    """``dropout_backward_step(delta_inplace, rand, probability)`` run once."""
    dropout_backward_step(delta_inplace, rand, probability).run()


# ----------------------------------------------------------------------------------------
# uniform draws

cdef enum:  # buffer roles
    FILL_RAND, FILL_COUNTER

cdef struct UniformFillParams:
    Py_ssize_t n  # elements
    uint64_t seed

cdef inline uint64_t _gamma() noexcept nogil:
    # splitmix64's increment: 2^64 divided by the golden ratio.
    return 0x9E3779B97F4A7C15ULL


cdef inline uint64_t _mix64(uint64_t z) noexcept nogil:
    # splitmix64's output function.
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef void _uniform_fill(floating* out, uint64_t* counter,
                        const UniformFillParams* p) noexcept nogil:
    # The top bits of each hash: 24 for float32, 53 for float64, so the draws are exact
    # multiples of 2^-24 or 2^-53 in [0, 1).
    cdef uint64_t key = _mix64(p.seed ^ _mix64(counter[0] + _gamma()))
    cdef uint64_t bits
    cdef Py_ssize_t i
    for i in range(p.n):
        bits = _mix64(key + (<uint64_t>i + 1) * _gamma())
        if floating is float:
            out[i] = <float>(bits >> 40) * <float>5.9604644775390625e-08
        else:
            out[i] = <double>(bits >> 11) * 1.1102230246251565e-16
    counter[0] = counter[0] + 1


cdef void _uniform_fill_step(const StepData* d) noexcept nogil:
    cdef const UniformFillParams* p = <const UniformFillParams*>d.params
    if d.f32:
        _uniform_fill(<float*>d.buf[FILL_RAND], <uint64_t*>d.buf[FILL_COUNTER], p)
    else:
        _uniform_fill(<double*>d.buf[FILL_RAND], <uint64_t*>d.buf[FILL_COUNTER], p)


def uniform_fill_step(rand, seed, counter) -> NativeStep:
    """Fill ``rand`` with U[0, 1) draws determined by (seed, counter[0], element index),
    then advance ``counter[0]`` by one: each run draws anew, reproducibly.

    rand: C-contiguous float32/float64 array of 1 to 4 dimensions, written in full; seed:
    an int in [0, 2**64); counter: a writable int64 or uint64 array of shape (1,), read and
    advanced at every run (int64 wraps as uint64 would).
    """
    check_input("rand", rand, _NDIMS, writable=True)
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ArgumentTypeError(f"seed must be an int, not {seed!r} ({type(seed).__name__})")
    if not 0 <= int(seed) < 2 ** 64:
        raise ArgumentError(f"seed must be in [0, 2**64), got {seed}")
    if not isinstance(counter, np.ndarray):
        raise ArgumentTypeError(f"counter must be a numpy array, not {type(counter).__name__}")
    if (counter.dtype not in _COUNTER_DTYPES or counter.shape != (1,)
            or not counter.flags.writeable):
        raise ArgumentError(f"counter must be a writable int64 or uint64 array of shape (1,), "
                            f"not {'read-only ' if not counter.flags.writeable else ''}"
                            f"{counter.dtype} {counter.shape}")
    check_disjoint({"rand": rand}, {"counter": counter})
    cdef NativeStep step = new_step(_uniform_fill_step, "uniform_fill", (rand, counter),
                                    rand.dtype == np.float32, sizeof(UniformFillParams))
    cdef UniformFillParams* p = <UniformFillParams*>step.data.params
    p.n = rand.size
    p.seed = <uint64_t>int(seed)
    return step


def uniform_fill(rand, seed, counter) -> None:
    """``uniform_fill_step(rand, seed, counter)`` run once."""
    uniform_fill_step(rand, seed, counter).run()
