# cython: language_level=3
"""Parameter updates: Darknet's SGD with momentum and weight decay, Adam, and a finiteness
check, as native steps.

``sgd_update_step`` is ``update_convolutional_layer`` / ``update_connected_layer`` /
``update_shortcut_layer`` (CPU) for one parameter array ``w`` and its gradient accumulator
``wu`` (Darknet's ``*_updates``: the summed negative gradient of the iteration plus the
momentum carried over from the previous one), B images per iteration::

    wu += (-decay * B) * w          only where Darknet applies decay (weights)
    w  += (lr / B) * wu
    wu *= momentum

Darknet's ``axpy_cpu`` is OpenBLAS ``cblas_saxpy``, a fused multiply-add: in float32 each
``a * x + y`` is computed in double, where the product of two floats is exact, and then
rounded to float32, which reproduces Darknet's parameters bit for bit (rounding ``a * x``
to float32 first gets 0.4% to 7% of the weights of Darknet's training steps wrong). The
coefficients are float32 expressions as in Darknet (``-decay * B`` and ``lr / B``).

``adam_update_step`` is Adam as Darknet's GPU build runs it (``adam_update_gpu``; the CPU
build has no Adam), with decay on every array it is given and t Darknet's batch number::

    d  = wu - decay * B * w
    m  = B1 * m + (1 - B1) * d
    v  = B2 * v + (1 - B2) * d * d
    w += lr * (m / (1 - B1**t)) / (sqrt(v / (1 - B2**t)) + eps)
    wu = 0

The learning rate (and Adam's t) are read from one-element arrays when the step runs, so a
step bound once serves every iteration: the trainer writes ``lr_buffer[0]`` (Darknet's
``get_current_rate``, ``darknet_metal.training.learning_rate``) before each pass.

``all_finite_step`` clears a flag when an array holds a NaN or an infinity, for a trainer
to refuse an update that diverged.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays of
one dtype, any shape, checked by ``checks``; updates are in place. Each ``*_step`` checks its
arguments and returns a ``NativeStep`` (``step.pyx``) that runs without the GIL; the
functions without ``_step`` make the step and run it once.
"""

cimport cython
from cython cimport floating
from libc.math cimport pow, powf, sqrt, sqrtf

from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import math

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_like

_ANY = (1, 2, 3, 4, 5, 6)
_ANY_SHAPE = "any shape"


cdef inline floating _axpy(floating a, floating x, floating y) noexcept nogil:
    """``a * x + y`` as cblas_saxpy's fused multiply-add computes it. float32: the exact
    product plus y in double, then float32, which differs from a single rounding only when
    the double sum ties two floats exactly; float64: plain, being the reference."""
    if floating is float:
        return <float>(<double>a * <double>x + <double>y)
    else:
        return a * x + y


cdef inline floating _pow(floating x, floating y) noexcept nogil:
    if floating is float:
        return powf(x, y)
    else:
        return pow(x, y)


cdef inline floating _sqrt(floating x) noexcept nogil:
    if floating is float:
        return sqrtf(x)
    else:
        return sqrt(x)


def _check_param(param, grad_acc):
    check_input("param", param, _ANY, layout=_ANY_SHAPE, writable=True)
    _check_state("grad_acc", grad_acc, param)


def _check_state(name, a, param):
    """An array updated beside ``param``: its shape and dtype, writable."""
    check_input(name, a, _ANY, param, like_name="param", layout=_ANY_SHAPE, writable=True)
    check_like(name, a, param, "param")


def _check_scalar_buffer(name, buf, like):
    """A one-element array of ``like``'s dtype that a step reads when it runs."""
    check_input(name, buf, (1,), like, like_name="param", layout="(1,)")
    if buf.shape[0] != 1:
        raise ArgumentError(f"{name} must hold exactly one value, not {buf.shape[0]}")


def _check_apart(named):
    """Raise unless the named arrays share no memory (an update reads one while writing
    another)."""
    items = list(named.items())
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1:]:
            if a.size and b.size and np.may_share_memory(a, b):
                raise ArgumentError(f"{name_a} and {name_b} must not overlap")


def _check_number(name, value, lo=None, hi=None, *, lo_open=False, hi_open=False):
    ok = math.isfinite(value)
    ok = ok and (lo is None or (value > lo if lo_open else value >= lo))
    ok = ok and (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        low = "" if lo is None else f"{lo:g} {'<' if lo_open else '<='} "
        high = "" if hi is None else f" {'<' if hi_open else '<='} {hi:g}"
        bounds = f" with {low}{name}{high}" if low or high else ""
        raise ArgumentError(f"{name} must be finite{bounds}, not {value!r}")


def _check_update(decay, lr_scale, batch):
    """The arguments every update takes."""
    _check_number("decay", decay, 0.0)
    _check_number("lr_scale", lr_scale)
    if batch < 1:
        raise ArgumentError(f"batch must be >= 1 (images per iteration), not {batch}")


# ----------------------------------------------------------------------------------------
# SGD with momentum

cdef enum:  # buffer roles
    SGD_W, SGD_WU, SGD_LR

cdef struct SgdParams:
    Py_ssize_t n
    double decay
    double momentum
    double lr_scale
    int batch
    bint apply_decay


@cython.cdivision(True)
cdef void _sgd(floating* w, floating* wu, const floating* lr_buf,
               const SgdParams* p) noexcept nogil:
    # In the dtype, like Darknet's float expressions: learning_rate_init * l.learning_rate_scale,
    # learning_rate / batch, -decay * batch.
    cdef floating batch = <floating>p.batch
    cdef floating rate = lr_buf[0] * <floating>p.lr_scale / batch
    cdef floating shrink = -(<floating>p.decay) * batch
    cdef floating momentum = <floating>p.momentum
    cdef floating g
    cdef Py_ssize_t i
    if p.apply_decay:
        for i in range(p.n):
            g = _axpy(shrink, w[i], wu[i])
            w[i] = _axpy(rate, g, w[i])
            wu[i] = momentum * g
    else:
        for i in range(p.n):
            w[i] = _axpy(rate, wu[i], w[i])
            wu[i] = momentum * wu[i]


cdef void _sgd_step(const StepData* d) noexcept nogil:
    cdef const SgdParams* p = <const SgdParams*>d.params
    if d.f32:
        _sgd(<float*>d.buf[SGD_W], <float*>d.buf[SGD_WU], <const float*>d.buf[SGD_LR], p)
    else:
        _sgd(<double*>d.buf[SGD_W], <double*>d.buf[SGD_WU], <const double*>d.buf[SGD_LR], p)


def sgd_update_step(param, grad_acc, lr_buffer, double decay, double momentum, int batch,
                    bint apply_decay, double lr_scale=1.0) -> NativeStep:
    """Darknet's SGD update of one parameter array, in place.

    param: the parameters w, any shape; grad_acc: Darknet's accumulator wu of the same shape
    and dtype (the iteration's summed gradient, Darknet-signed, plus the carried momentum),
    left holding ``momentum * wu`` for the next iteration; lr_buffer: shape (1,), the dtype
    of param, the iteration's learning rate, read when the step runs; decay: weight decay
    per image (``[net] decay``), applied only when ``apply_decay`` (Darknet decays conv,
    connected and shortcut weights, not biases or batch-norm scales); momentum: ``[net]
    momentum``; batch: images per iteration B (``batch`` of the cfg, all subdivisions);
    lr_scale: the layer's ``learning_rate`` multiplier (Darknet applies it to conv and
    shortcut layers, not to [connected]).
    """
    _check_param(param, grad_acc)
    _check_scalar_buffer("lr_buffer", lr_buffer, param)
    _check_apart({"param": param, "grad_acc": grad_acc})
    _check_update(decay, lr_scale, batch)
    _check_number("momentum", momentum, 0.0)
    cdef NativeStep step = new_step(_sgd_step, "sgd_update", (param, grad_acc, lr_buffer),
                                    param.dtype == np.float32, sizeof(SgdParams))
    cdef SgdParams* p = <SgdParams*>step.data.params
    p.n = param.size
    p.decay = decay
    p.momentum = momentum
    p.lr_scale = lr_scale
    p.batch = batch
    p.apply_decay = apply_decay
    return step


def sgd_update(param, grad_acc, lr_buffer, double decay, double momentum, int batch,
               bint apply_decay, double lr_scale=1.0) -> None:
    """``sgd_update_step(...)`` run once."""
    sgd_update_step(param, grad_acc, lr_buffer, decay, momentum, batch, apply_decay,
                    lr_scale).run()


# ----------------------------------------------------------------------------------------
# Adam

cdef enum:  # buffer roles
    ADAM_W, ADAM_WU, ADAM_M, ADAM_V, ADAM_LR, ADAM_T

cdef struct AdamParams:
    Py_ssize_t n
    double decay
    double b1, b2, eps
    double lr_scale
    int batch


@cython.cdivision(True)
cdef void _adam(floating* w, floating* wu, floating* m, floating* v, const floating* lr_buf,
                const floating* t_buf, const AdamParams* p) noexcept nogil:
    cdef floating one = 1
    cdef floating b1 = <floating>p.b1, b2 = <floating>p.b2, eps = <floating>p.eps
    cdef floating rate = lr_buf[0] * <floating>p.lr_scale
    cdef floating shrink = -(<floating>p.decay) * <floating>p.batch
    cdef floating keep1 = one - b1, keep2 = one - b2
    cdef floating debias1 = one - _pow(b1, t_buf[0]), debias2 = one - _pow(b2, t_buf[0])
    cdef floating d, mi, vi
    cdef Py_ssize_t i
    # The order of adam_update_gpu's passes (scale m and v, decay into d, accumulate, step),
    # fused per element; each axpy is a fused multiply-add on the GPU.
    for i in range(p.n):
        d = _axpy(shrink, w[i], wu[i])
        mi = _axpy(keep1, d, b1 * m[i])
        vi = _axpy(keep2, d * d, b2 * v[i])
        m[i] = mi
        v[i] = vi
        w[i] = w[i] + rate * (mi / debias1) / (_sqrt(vi / debias2) + eps)
        wu[i] = 0


cdef void _adam_step(const StepData* d) noexcept nogil:
    cdef const AdamParams* p = <const AdamParams*>d.params
    if d.f32:
        _adam(<float*>d.buf[ADAM_W], <float*>d.buf[ADAM_WU], <float*>d.buf[ADAM_M],
              <float*>d.buf[ADAM_V], <const float*>d.buf[ADAM_LR],
              <const float*>d.buf[ADAM_T], p)
    else:
        _adam(<double*>d.buf[ADAM_W], <double*>d.buf[ADAM_WU], <double*>d.buf[ADAM_M],
              <double*>d.buf[ADAM_V], <const double*>d.buf[ADAM_LR],
              <const double*>d.buf[ADAM_T], p)


def adam_update_step(param, grad_acc, m, v, lr_buffer, t_buffer, double decay, double B1,
                     double B2, double eps, int batch, double lr_scale=1.0) -> NativeStep:
    """Adam (Darknet's GPU ``adam_update_gpu``) of one parameter array, in place.

    param, grad_acc: as for ``sgd_update_step`` (grad_acc is left 0: Adam keeps no
    momentum in it); m, v: the first and second moment estimates, same shape and dtype,
    zero before the first update; lr_buffer, t_buffer: shape (1,), param's dtype, read when
    the step runs: the learning rate (not divided by the batch) and t, Darknet's batch
    number (1 at the first update; 0 would divide by zero); decay: applied to every array
    (Darknet's GPU Adam decays biases and scales too), times B; B1, B2 in [0, 1); eps > 0;
    batch: images per iteration B; lr_scale: the layer's ``learning_rate`` multiplier.
    """
    _check_param(param, grad_acc)
    _check_state("m", m, param)
    _check_state("v", v, param)
    _check_scalar_buffer("lr_buffer", lr_buffer, param)
    _check_scalar_buffer("t_buffer", t_buffer, param)
    _check_apart({"param": param, "grad_acc": grad_acc, "m": m, "v": v})
    _check_update(decay, lr_scale, batch)
    _check_number("B1", B1, 0.0, 1.0, hi_open=True)
    _check_number("B2", B2, 0.0, 1.0, hi_open=True)
    _check_number("eps", eps, 0.0, lo_open=True)
    cdef NativeStep step = new_step(_adam_step, "adam_update",
                                    (param, grad_acc, m, v, lr_buffer, t_buffer),
                                    param.dtype == np.float32, sizeof(AdamParams))
    cdef AdamParams* p = <AdamParams*>step.data.params
    p.n = param.size
    p.decay = decay
    p.b1 = B1
    p.b2 = B2
    p.eps = eps
    p.lr_scale = lr_scale
    p.batch = batch
    return step


def adam_update(param, grad_acc, m, v, lr_buffer, t_buffer, double decay, double B1,
                double B2, double eps, int batch, double lr_scale=1.0) -> None:
    """``adam_update_step(...)`` run once."""
    adam_update_step(param, grad_acc, m, v, lr_buffer, t_buffer, decay, B1, B2, eps, batch,
                     lr_scale).run()


# ----------------------------------------------------------------------------------------
# finiteness

cdef enum:  # buffer roles
    FINITE_X, FINITE_FLAG

cdef struct FiniteParams:
    Py_ssize_t n


cdef void _all_finite(const floating* x, floating* flag, const FiniteParams* p) noexcept nogil:
    cdef floating zero = 0
    cdef int bad = 0
    cdef Py_ssize_t i
    # x - x is 0 for every finite x and NaN for NaN and the infinities; a branch-free OR
    # lets the compiler vectorise the scan.
    for i in range(p.n):
        bad |= (x[i] - x[i]) != zero
    if bad:
        flag[0] = zero


cdef void _all_finite_step(const StepData* d) noexcept nogil:
    cdef const FiniteParams* p = <const FiniteParams*>d.params
    if d.f32:
        _all_finite(<const float*>d.buf[FINITE_X], <float*>d.buf[FINITE_FLAG], p)
    else:
        _all_finite(<const double*>d.buf[FINITE_X], <double*>d.buf[FINITE_FLAG], p)


def all_finite_step(array, flag_buffer) -> NativeStep:
    """A check that sets ``flag_buffer[0] = 0`` when ``array`` holds a NaN or an infinity.

    array: any shape, float32/float64; flag_buffer: shape (1,), array's dtype, writable.
    The flag is only ever cleared, never set: set it to 1, run the checks of every array
    that must stay finite (they may share the flag), and it is still 1 when all were.
    """
    check_input("array", array, _ANY, layout=_ANY_SHAPE)
    check_input("flag_buffer", flag_buffer, (1,), array, like_name="array", layout="(1,)",
                writable=True)
    if flag_buffer.shape[0] != 1:
        raise ArgumentError(f"flag_buffer must hold exactly one value, not "
                            f"{flag_buffer.shape[0]}")
    cdef NativeStep step = new_step(_all_finite_step, "all_finite", (array, flag_buffer),
                                    array.dtype == np.float32, sizeof(FiniteParams))
    cdef FiniteParams* p = <FiniteParams*>step.data.params
    p.n = array.size
    return step


def all_finite(array) -> bool:
    """True when ``array`` (float32/float64, any shape) holds no NaN and no infinity."""
    check_input("array", array, _ANY, layout=_ANY_SHAPE)
    flag = np.ones(1, array.dtype)
    all_finite_step(array, flag).run()
    return bool(flag[0])
