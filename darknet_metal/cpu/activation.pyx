# cython: language_level=3
"""Darknet's activation functions and their derivatives: the CPU reference.

Formulas, constants and the float32 order of operations are Darknet's (``activations.hpp``
and ``activations.cpp``), so float32 results equal those of a Darknet built without
fast-math on the same C library (``expf``, ``tanhf``, ``logf``). A fast-math build, like the
one that produced ../shared/golden, evaluates ``exp`` with vectorised routines and differs
by a few ulps. Points where Darknet's arithmetic is unusual and is kept on purpose:

- ``tanh`` is ``2/(1 + exp(-2x)) - 1`` (not libm's tanh), also inside ``mish``;
- ``mish`` is ``x * tanh(softplus(x))`` with Darknet's softplus threshold 20
  (``x`` above 20, ``exp(x)`` below -20);
- ``gelu`` is ``0.5x(1 + tanh(0.797885x + 0.035677x^3))`` with the constants in double
  precision as C promotes them; its derivative uses 0.0356774 as Darknet's does;
- ``elu``/``selu`` choose their branch: Darknet adds both branches times 0/1 masks, which
  gives NaN (0 * inf) once ``exp`` overflows (x > 88.7) and for -inf; the values are
  Darknet's wherever those are finite;
- ``revleaky`` is the same function as ``leaky`` (slope 0.1, as the float ``0.1f``;
  Darknet's convolution epilogue multiplies part of the array by the double 0.1 instead,
  a 1-ulp difference on some negative inputs);
- ``relu6`` clamps to [0, 6] (some Darknet V5 releases return the input unchanged);
- the ``normalize_channels*`` activations work across the channels of each pixel with
  Darknet's epsilon 1e-4 in the denominator; their "derivatives" are Darknet's (the delta
  is multiplied by ``sum(y * delta)`` over the pixel's channels).

Derivatives follow Darknet's ``gradient_array``: for most activations the argument is the
activation's *output* ``y`` (``logistic``: ``(1-y)y``, ``tanh``: ``1-y^2``, ...). The
exceptions take the *input* ``x``: ``mish``, ``swish`` and ``hard_mish`` (Darknet keeps the
input for them) and ``gelu`` (its formula is written in terms of the input, although
Darknet's backward pass feeds it the output).

The convolution epilogues (``conv``, ``winograd``) apply float32 activations with the
vectorised loops of ``kernels.h`` instead: the same formulas with ``expf`` replaced by a
branch-free polynomial exp, within a few ulps of the functions here (the exp-free ones are
the same arithmetic, bit for bit). ``activate_fused`` applies those loops on their own.
float64 always takes the functions here.

Contract: the array kernels declared in ``activation.pxd`` (``activate_array``,
``gradient_array``, ``activate_channels``, ``gradient_channels``) work in place on float32 or
float64 (the ``floating`` fused type) and are ``noexcept nogil``, so the convolution modules
call them inside their own GIL-free loops; the activation ids are the ``ACT_*`` enum there.
``activate`` and ``gradient`` are the Python entry points, on (N, C, H, W) or (N, F) arrays
under the package's contract (``darknet_metal.cpu``).
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.math cimport exp, expf, pow, powf, tanh, tanhf

from darknet_metal.cpu.fmath cimport fcube, fexp, ffloor, flog, logistic
from darknet_metal.cpu cimport kernels as K
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.model.activations import ACTIVATION_ID, ACTIVATIONS
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.cpu.checks import check_input, check_like

_ENUM = {
    "linear": ACT_LINEAR, "leaky": ACT_LEAKY, "relu": ACT_RELU, "relu6": ACT_RELU6,
    "logistic": ACT_LOGISTIC, "loggy": ACT_LOGGY, "tanh": ACT_TANH, "elu": ACT_ELU,
    "selu": ACT_SELU, "gelu": ACT_GELU, "mish": ACT_MISH, "swish": ACT_SWISH,
    "hard_mish": ACT_HARD_MISH, "hardtan": ACT_HARDTAN, "lhtan": ACT_LHTAN, "plse": ACT_PLSE,
    "stair": ACT_STAIR, "ramp": ACT_RAMP, "relie": ACT_RELIE, "revleaky": ACT_REVLEAKY,
    "normalize_channels": ACT_NORM_CHAN,
    "normalize_channels_softmax": ACT_NORM_CHAN_SOFTMAX,
    "normalize_channels_softmax_maxval": ACT_NORM_CHAN_SOFTMAX_MAXVAL,
}
# The ids are shared with the Metal kernels through darknet_metal.model.activations: a silent
# mismatch would apply the wrong function, so refuse to load instead.
if len(ACTIVATIONS) != ACT_COUNT or any(ACTIVATION_ID[k] != v for k, v in _ENUM.items()):
    raise ImportError("darknet_metal.cpu.activation ids disagree with "
                      "darknet_metal.model.activations.ACTIVATIONS")
# kernels.h numbers them itself for its fused loops.
_KERNEL_IDS = (
    K.DM_ACT_LINEAR, K.DM_ACT_LEAKY, K.DM_ACT_RELU, K.DM_ACT_RELU6, K.DM_ACT_LOGISTIC,
    K.DM_ACT_LOGGY, K.DM_ACT_TANH, K.DM_ACT_ELU, K.DM_ACT_SELU, K.DM_ACT_GELU, K.DM_ACT_MISH,
    K.DM_ACT_SWISH, K.DM_ACT_HARD_MISH, K.DM_ACT_HARDTAN, K.DM_ACT_LHTAN, K.DM_ACT_PLSE,
    K.DM_ACT_STAIR, K.DM_ACT_RAMP, K.DM_ACT_RELIE, K.DM_ACT_REVLEAKY,
)
if _KERNEL_IDS != tuple(range(ACT_NORM_CHAN)):
    raise ImportError("darknet_metal/cpu/kernels.h activation ids disagree with "
                      "darknet_metal.model.activations.ACTIVATIONS")

# ----------------------------------------------------------------------------------------
# Scalar functions (the libm wrappers and the logistic are in fmath.pxd, shared with the
# other layers). Every constant is typed ``floating``: Cython would otherwise emit C double
# literals and the float32 path would compute parts of an expression in double.

@cython.cdivision(True)
cdef inline floating _tanh_darknet(floating x) noexcept nogil:
    cdef floating one = 1, two = 2
    return two / (one + fexp(-two * x)) - one


cdef inline floating _softplus(floating x, floating threshold) noexcept nogil:
    cdef floating one = 1
    if x > threshold:
        return x
    elif x < -threshold:
        return fexp(x)
    return flog(fexp(x) + one)


cdef inline floating _gelu(floating x) noexcept nogil:
    # C promotes Darknet's unsuffixed constants to double; the tanh itself is float.
    cdef double arg
    cdef float one_f = 1
    if floating is float:
        arg = 0.797885 * <double>x + 0.035677 * <double>powf(x, 3.0)
        return <float>(0.5 * <double>x * <double>(one_f + tanhf(<float>arg)))
    else:
        return 0.5 * x * (1.0 + tanh(0.797885 * x + 0.035677 * pow(x, 3.0)))


@cython.cdivision(True)
cdef inline floating _gelu_gradient(floating x) noexcept nogil:
    cdef floating x3 = fcube(x)
    cdef float a_f, s_f
    cdef float two_f = 2
    cdef double a, s
    if floating is float:
        a_f = <float>(0.0356774 * <double>x3 + 0.797885 * <double>x)
        s_f = two_f / (expf(a_f) + expf(-a_f))
        return <float>(0.5 * <double>tanhf(a_f)
                       + (0.0535161 * <double>x3 + 0.398942 * <double>x)
                       * <double>powf(s_f, 2.0)
                       + 0.5)
    else:
        a = 0.0356774 * x3 + 0.797885 * x
        s = 2.0 / (exp(a) + exp(-a))
        return 0.5 * tanh(a) + (0.0535161 * x3 + 0.398942 * x) * s * s + 0.5


@cython.cdivision(True)
cdef inline floating _stair(floating x) noexcept nogil:
    # Darknet converts floor(x) to int to test parity; testing on the float avoids the
    # undefined conversion for huge inputs and agrees everywhere else.
    cdef floating two = 2
    cdef floating fl = ffloor(x)
    cdef floating half = ffloor(x / two)
    if ffloor(fl / two) * two == fl:
        return half
    return (x - fl) + half


@cython.cdivision(True)
cdef inline floating _activate(floating x, int act) noexcept nogil:
    cdef floating zero = 0, one = 1, two = 2, four = 4, six = 6
    cdef floating a
    if act == ACT_LINEAR:
        return x
    elif act == ACT_LEAKY or act == ACT_REVLEAKY:
        return x if x > zero else <floating>0.1 * x
    elif act == ACT_RELU:
        return x * <floating>(x > zero)
    elif act == ACT_RELU6:
        a = x if x > zero else zero
        return a if a < six else six
    elif act == ACT_LOGISTIC:
        return logistic(x)
    elif act == ACT_LOGGY:
        return two / (one + fexp(-x)) - one
    elif act == ACT_TANH:
        return _tanh_darknet(x)
    elif act == ACT_ELU:
        return x if x >= zero else fexp(x) - one
    elif act == ACT_SELU:
        if x >= zero:
            return <floating>1.0507 * x
        return <floating>1.0507 * <floating>1.6732 * (fexp(x) - one)
    elif act == ACT_GELU:
        return _gelu(x)
    elif act == ACT_MISH:
        return x * _tanh_darknet(_softplus(x, <floating>20))
    elif act == ACT_SWISH:
        return x * logistic(x)
    elif act == ACT_HARD_MISH:
        if x > zero:
            return x
        if x > -two:
            return x * x / two + x
        return zero
    elif act == ACT_HARDTAN:
        if x < -one:
            return -one
        if x > one:
            return one
        return x
    elif act == ACT_LHTAN:
        if x < zero:
            return <floating>0.001 * x
        if x > one:
            return <floating>0.001 * (x - one) + one
        return x
    elif act == ACT_PLSE:
        if x < -four:
            return <floating>0.01 * (x + four)
        if x > four:
            return <floating>0.01 * (x - four) + one
        return <floating>0.125 * x + <floating>0.5
    elif act == ACT_STAIR:
        return _stair(x)
    elif act == ACT_RAMP:
        return x * <floating>(x > zero) + <floating>0.1 * x
    elif act == ACT_RELIE:
        return x if x > zero else <floating>0.01 * x
    return x


@cython.cdivision(True)
cdef inline floating _gradient(floating v, int act) noexcept nogil:
    """Darknet's derivative; ``v`` is the output, or the input for gelu/mish/swish/hard_mish."""
    cdef floating zero = 0, one = 1, two = 2, six = 6
    cdef floating t, sp, tsp, s, sw
    if act == ACT_LINEAR:
        return one
    elif act == ACT_LEAKY or act == ACT_REVLEAKY:
        return one if v > zero else <floating>0.1
    elif act == ACT_RELU:
        return <floating>(v > zero)
    elif act == ACT_RELU6:
        return <floating>(v > zero and v < six)
    elif act == ACT_LOGISTIC:
        return (one - v) * v
    elif act == ACT_LOGGY:
        t = (v + one) / two
        return two * (one - t) * t
    elif act == ACT_TANH:
        return one - v * v
    elif act == ACT_ELU:
        return <floating>(v >= zero) + <floating>(v < zero) * (v + one)
    elif act == ACT_SELU:
        return (<floating>(v >= zero) * <floating>1.0507
                + <floating>(v < zero) * (v + <floating>1.0507 * <floating>1.6732))
    elif act == ACT_GELU:
        return _gelu_gradient(v)
    elif act == ACT_MISH:
        # Darknet calls the double exp/tanh here (unsuffixed in its source) and rounds.
        sp = _softplus(v, <floating>20)
        t = <floating>(1.0 - exp(-<double>sp))
        tsp = <floating>tanh(<double>sp)
        return v * ((one - tsp * tsp) * t) + tsp
    elif act == ACT_SWISH:
        s = logistic(v)
        sw = v * s
        return sw + s * (one - sw)
    elif act == ACT_HARD_MISH:
        if v > zero:
            return one
        if v > -two:
            return v + one
        return zero
    elif act == ACT_HARDTAN:
        return one if (v > -one and v < one) else zero
    elif act == ACT_LHTAN:
        return one if (v > zero and v < one) else <floating>0.001
    elif act == ACT_PLSE:
        return <floating>0.01 if (v < zero or v > one) else <floating>0.125
    elif act == ACT_STAIR:
        return zero if ffloor(v) == v else one
    elif act == ACT_RAMP:
        return <floating>(v > zero) + <floating>0.1
    elif act == ACT_RELIE:
        return one if v > zero else <floating>0.01
    return one


# ----------------------------------------------------------------------------------------
# Array kernels (the cdef API in activation.pxd).

cdef void activate_array(floating* x, Py_ssize_t n, int act) noexcept nogil:
    """Apply elementwise activation ``act`` to x[0:n] in place.

    Channel activations (ACT_NORM_CHAN*) are not elementwise and are left to
    ``activate_channels``; for them this does nothing.
    """
    cdef Py_ssize_t i
    cdef floating zero = 0
    if act == ACT_LINEAR or act >= ACT_NORM_CHAN or act < 0:
        return
    if act == ACT_LEAKY or act == ACT_REVLEAKY:
        for i in range(n):
            x[i] = x[i] if x[i] > zero else <floating>0.1 * x[i]
    elif act == ACT_LOGISTIC:
        for i in range(n):
            x[i] = logistic(x[i])
    else:
        for i in range(n):
            x[i] = _activate(x[i], act)


cdef void gradient_array(const floating* y, Py_ssize_t n, int act,
                         floating* delta) noexcept nogil:
    """``delta[i] *= f'(y[i])`` for elementwise ``act`` (see the module docstring for which
    of output or input ``y`` must be). Does nothing for channel activations."""
    cdef Py_ssize_t i
    cdef floating zero = 0, one = 1, tenth = <floating>0.1
    if act == ACT_LINEAR or act >= ACT_NORM_CHAN or act < 0:
        return
    # The common ones in loops of their own (the same arithmetic as _gradient), which the
    # compiler vectorises; a switch per element would keep every loop scalar.
    if act == ACT_LEAKY or act == ACT_REVLEAKY:
        for i in range(n):
            delta[i] = delta[i] * (one if y[i] > zero else tenth)
    elif act == ACT_RELU:
        for i in range(n):
            delta[i] = delta[i] * <floating>(y[i] > zero)
    elif act == ACT_LOGISTIC:
        for i in range(n):
            delta[i] = delta[i] * ((one - y[i]) * y[i])
    else:
        for i in range(n):
            delta[i] = delta[i] * _gradient(y[i], act)


@cython.cdivision(True)
cdef void activate_channels(floating* x, Py_ssize_t batch, Py_ssize_t channels,
                            Py_ssize_t spatial, int act) noexcept nogil:
    """Darknet's normalize_channels[_softmax[_maxval]] in place on x (batch, channels,
    spatial); each pixel is normalised across its channels."""
    cdef Py_ssize_t b, p, k
    cdef floating* base
    cdef floating total, val, max_val
    cdef floating zero = 0
    cdef floating eps = <floating>0.0001
    if act < ACT_NORM_CHAN or act > ACT_NORM_CHAN_SOFTMAX_MAXVAL:
        return
    for b in range(batch):
        for p in range(spatial):
            base = x + b * channels * spatial + p
            total = eps
            if act == ACT_NORM_CHAN:
                for k in range(channels):
                    val = base[k * spatial]
                    if val > zero:
                        total = total + val
                for k in range(channels):
                    val = base[k * spatial]
                    base[k * spatial] = val / total if val > zero else zero
            else:
                max_val = zero
                if act == ACT_NORM_CHAN_SOFTMAX_MAXVAL:
                    max_val = -FLT_MAX
                    for k in range(channels):
                        val = base[k * spatial]
                        if val > max_val or k == 0:
                            max_val = val
                for k in range(channels):
                    total = total + fexp(base[k * spatial] - max_val)
                for k in range(channels):
                    base[k * spatial] = fexp(base[k * spatial] - max_val) / total


cdef void gradient_channels(const floating* y, Py_ssize_t batch, Py_ssize_t channels,
                            Py_ssize_t spatial, int act, floating* delta) noexcept nogil:
    """Darknet's gradient_array_normalize_channels[_softmax] on the layer output ``y``:
    per pixel ``g = sum_k y_k delta_k``, then ``delta_k *= g`` (only where ``y_k > 0`` for
    plain normalize_channels)."""
    cdef Py_ssize_t b, p, k, idx
    cdef floating grad, zero = 0
    if act < ACT_NORM_CHAN or act > ACT_NORM_CHAN_SOFTMAX_MAXVAL:
        return
    for b in range(batch):
        for p in range(spatial):
            grad = zero
            for k in range(channels):
                idx = b * channels * spatial + k * spatial + p
                grad = grad + y[idx] * delta[idx]
            for k in range(channels):
                idx = b * channels * spatial + k * spatial + p
                if act != ACT_NORM_CHAN or y[idx] > zero:
                    delta[idx] = delta[idx] * grad


# ----------------------------------------------------------------------------------------
# Python entry points.

def _activate_fused_flat(float[::1] flat, int act):
    if flat.shape[0] == 0:
        return
    with nogil:
        K.dm_act_f32(&flat[0], flat.shape[0], act)


def fusable(act) -> bool:
    """Whether the float32 convolution epilogues apply ``act`` themselves (``activate_fused``
    has it): every elementwise activation."""
    return bool(K.dm_act_fusable(activation_id(act)))


def activate_fused(x, act) -> None:
    """Apply ``act`` to the float32 array ``x`` in place with the vectorised loop the
    convolution epilogues use (kernels.h), not the scalar function ``activate`` uses.

    x: C-contiguous float32, shape as for ``activate``; act: a name or id for which
    ``fusable`` is true.
    """
    a = activation_id(act)
    check_input("x", x, _NDIMS, writable=True)
    if x.dtype != np.float32:
        raise ArgumentTypeError(f"activate_fused: x must be float32, not {x.dtype}")
    if not K.dm_act_fusable(a):
        raise ArgumentError(f"activate_fused: {ACTIVATIONS[a]!r} has no fused loop")
    _activate_fused_flat(x.reshape(-1), a)


def activation_id(act) -> int:
    """Return the integer id of ``act``: a name from ``ACTIVATIONS`` or an id already.

    Raises ValueError for an unknown name or an out-of-range id, TypeError otherwise.
    """
    if isinstance(act, str):
        if act not in ACTIVATION_ID:
            raise ArgumentError(f"unknown activation {act!r}; expected one of {list(ACTIVATIONS)}")
        return ACTIVATION_ID[act]
    if isinstance(act, (int, np.integer)) and not isinstance(act, bool):
        if not 0 <= int(act) < len(ACTIVATIONS):
            raise ArgumentError(f"activation id {int(act)} out of range 0..{len(ACTIVATIONS) - 1}")
        return int(act)
    raise ArgumentTypeError(f"activation must be a name or an int id, not {type(act).__name__}")


# (N, C, H, W) first: the layout the message names first.
_NDIMS = (4, 2)


def _layout(a):
    """(batch, channels, spatial) of an (N, C, H, W) or (N, F) array."""
    if a.ndim == 2:
        return a.shape[0], a.shape[1], 1
    return a.shape[0], a.shape[1], a.shape[2] * a.shape[3]


cdef enum:  # buffer roles
    ACTIVATE_X

cdef struct ActivateParams:
    Py_ssize_t batch, channels, spatial
    int act


cdef void _activate_step(const StepData* d) noexcept nogil:
    cdef const ActivateParams* p = <const ActivateParams*>d.params
    cdef Py_ssize_t n = p.batch * p.channels * p.spatial
    if p.act >= ACT_NORM_CHAN:
        if d.f32:
            activate_channels(<float*>d.buf[ACTIVATE_X], p.batch, p.channels, p.spatial, p.act)
        else:
            activate_channels(<double*>d.buf[ACTIVATE_X], p.batch, p.channels, p.spatial,
                              p.act)
    elif d.f32:
        activate_array(<float*>d.buf[ACTIVATE_X], n, p.act)
    else:
        activate_array(<double*>d.buf[ACTIVATE_X], n, p.act)


def activate_step(x, act) -> NativeStep:
    """Darknet activation ``act`` applied to ``x`` in place.

    x: C-contiguous float32 or float64 array of shape (N, C, H, W), or (N, F) which is
    treated as (N, F, 1, 1). act: an activation name or its id (its index in
    ``darknet_metal.model.activations.ACTIVATIONS``). The channel activations
    (``normalize_channels*``) normalise each pixel across C; all others are elementwise.
    """
    a = activation_id(act)
    check_input("x", x, _NDIMS, writable=True)
    cdef NativeStep step = new_step(_activate_step, f"activate_{ACTIVATIONS[a]}", (x,),
                                    x.dtype == np.float32, sizeof(ActivateParams))
    cdef ActivateParams* p = <ActivateParams*>step.data.params
    p.batch, p.channels, p.spatial = _layout(x)
    p.act = a
    return step


def activate(x, act) -> None:
    """``activate_step(x, act)`` run once."""
    activate_step(x, act).run()


cdef enum:  # buffer roles
    ACTGRAD_Y, ACTGRAD_DELTA


cdef void _activation_gradient_step(const StepData* d) noexcept nogil:
    cdef const ActivateParams* p = <const ActivateParams*>d.params
    cdef Py_ssize_t n = p.batch * p.channels * p.spatial
    if p.act >= ACT_NORM_CHAN:
        if d.f32:
            gradient_channels(<const float*>d.buf[ACTGRAD_Y], p.batch, p.channels, p.spatial,
                              p.act, <float*>d.buf[ACTGRAD_DELTA])
        else:
            gradient_channels(<const double*>d.buf[ACTGRAD_Y], p.batch, p.channels,
                              p.spatial, p.act, <double*>d.buf[ACTGRAD_DELTA])
    elif d.f32:
        gradient_array(<const float*>d.buf[ACTGRAD_Y], n, p.act, <float*>d.buf[ACTGRAD_DELTA])
    else:
        gradient_array(<const double*>d.buf[ACTGRAD_Y], n, p.act,
                       <double*>d.buf[ACTGRAD_DELTA])


def activation_gradient_step(y_or_x, delta, act) -> NativeStep:
    """Darknet's gradient_array as a step: ``delta *= act'`` in place, elementwise (the
    channel activations: Darknet's per-pixel rule, see ``gradient_channels``).

    y_or_x: the activation's output for most activations; its input for ``gelu``, ``mish``,
    ``swish`` and ``hard_mish`` (see the module docstring). delta: the layer's own delta,
    same shape and dtype, multiplied in place (it is the layer's, so nothing else has added
    into it that must be kept). Shapes as for ``activate_step``.
    """
    a = activation_id(act)
    check_input("y_or_x", y_or_x, _NDIMS)
    check_input("delta", delta, _NDIMS, writable=True)
    check_like("delta", delta, y_or_x, "y_or_x")
    cdef NativeStep step = new_step(_activation_gradient_step,
                                    f"activation_gradient_{ACTIVATIONS[a]}", (y_or_x, delta),
                                    delta.dtype == np.float32, sizeof(ActivateParams))
    cdef ActivateParams* p = <ActivateParams*>step.data.params
    p.batch, p.channels, p.spatial = _layout(delta)
    p.act = a
    return step


def gradient(y_or_x, act, delta) -> None:
    """Multiply ``delta`` in place by the derivative of ``act``, as Darknet's gradient_array:
    ``activation_gradient_step(y_or_x, delta, act)`` run once.

    y_or_x: the activation's output for most activations; its input for ``gelu``, ``mish``,
    ``swish`` and ``hard_mish`` (see the module docstring). delta: same shape and dtype,
    modified in place. Shapes as for ``activate``.
    """
    activation_gradient_step(y_or_x, delta, act).run()
