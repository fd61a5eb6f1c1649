# cython: language_level=3
"""Batch normalisation in training mode: Darknet's CPU forward and backward.

At inference batch norm is folded into the convolution's weights and bias; training needs
it as its own pass with the statistics of the mini-batch. The formulas are those of
Darknet's CPU build (``forward_batchnorm_layer``, ``backward_batchnorm_layer`` and the
inlined copies in ``forward_connected_layer`` / ``backward_connected_layer``), per channel
c over the N = batch*H*W values of the mini-batch (batch alone for a connected layer):

- forward: ``mean = sum x / N``; ``var = sum (x - mean)^2 / (N - 1)`` (unbiased);
  ``x_norm = (x - mean) / sqrt(var + eps)``; ``out = x_norm*scale + bias``; and the running
  statistics ``r = momentum*r + (1 - momentum)*stat`` for the mean and the (unbiased)
  variance. Darknet's momentum is 0.9 for a convolution, 0.95 for a connected layer.
- backward, with delta the gradient with respect to ``out`` (the caller has applied the
  activation's derivative): ``bias_grad += sum delta``;
  ``scale_grad += sum delta*x_norm``; ``delta *= scale``; then
  ``mean_delta = sum delta * (-1/sqrt(var + eps))``,
  ``var_delta = sum delta*(x - mean) * (-1/2)(var + eps)^(-3/2)`` and
  ``delta = delta/(sqrt(var) + eps) + var_delta*2(x - mean)/N + mean_delta/N``.

Darknet's backward is not quite the derivative of its forward: the first term has eps
outside the square root, and the variance term divides by N although the forward's
variance divides by N - 1. Both differences are small for the large N of a convolution
(relative O(eps/sqrt(var)) and O(1/N)) but not for a connected layer's N = batch. With
``exact=True`` the backward uses ``1/sqrt(var + eps)`` and ``N - 1`` instead: the exact
gradient of the forward, for any eps (what finite differences check).

float32 follows Darknet's summation orders and precisions (sums in float, in the order of
mean_cpu, variance_cpu, backward_scale_cpu, ...; the delta formulas in double, as C
promotes them), though its optimised build may reorder some of them: on the golden data
the mini-batch statistics of most layers come out bit-identical. float64 is the
gradient-checking reference.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays of
one dtype, checked by ``checks``; every step checks its arguments when it is made and runs
without the GIL; each channel is computed by one thread in a fixed order, so results do not
depend on the thread count.
"""

cimport cython
from cython cimport floating
from libc.math cimport pow, sqrt

from darknet_metal.cpu.blas cimport cpu_threads, run_parts
from darknet_metal.cpu.step cimport NativeStep, StepData, StepFn, new_step

import math

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_like

#: Darknet's batch-norm epsilon (``.00001f``).
EPS = 1e-5
#: Darknet's CPU running-statistics momentum for a convolution and a connected layer.
MOMENTUM_CONV = 0.9
MOMENTUM_CONNECTED = 0.95


cdef struct BatchnormParams:
    Py_ssize_t batch, channels, spatial
    double momentum, eps
    bint exact


# Channels whose statistics one call sums side by side.
cdef enum:
    GROUP = 4

# Least values (batch*channels*spatial) whose channels are shared out among the threads.
cdef Py_ssize_t SPLIT_VALUES = 1 << 16

ctypedef void (*ChannelFn)(const StepData* d, Py_ssize_t c) noexcept nogil

ctypedef struct ChannelJob:
    const StepData* d
    ChannelFn fn
    Py_ssize_t group


cdef void _channel_part(void* ctx, int part) noexcept nogil:
    cdef ChannelJob* j = <ChannelJob*>ctx
    j.fn(j.d, part * j.group)


cdef void _each_channel(const StepData* d, ChannelFn fn, Py_ssize_t group=1) noexcept nogil:
    """fn(d, c) for c = 0, group, 2*group, ...: each call does channels c .. c+group-1 (those
    that exist); on the threads when the layer is big enough (channels are independent, each
    computed whole by one thread)."""
    cdef const BatchnormParams* p = <const BatchnormParams*>d.params
    cdef ChannelJob job
    cdef Py_ssize_t c, parts = (p.channels + group - 1) // group
    job.d, job.fn, job.group = d, fn, group
    if cpu_threads() > 1 and parts > 1 and p.batch * p.channels * p.spatial >= SPLIT_VALUES:
        run_parts(_channel_part, &job, <int>parts)
    else:
        for c in range(parts):
            fn(d, c * group)


# ----------------------------------------------------------------------------------------
# forward (training)

cdef enum:  # buffer roles of the statistics step
    STATS_X, STATS_MEAN, STATS_VARIANCE, STATS_ROLLING_MEAN, STATS_ROLLING_VARIANCE

cdef enum:  # buffer roles of the normalisation step
    NORM_X, NORM_MEAN, NORM_VARIANCE, NORM_X_NORM, NORM_OUT, NORM_SCALE, NORM_BIAS


@cython.cdivision(True)
cdef inline void _lanes(const floating* base, const BatchnormParams* p, Py_ssize_t b,
                        Py_ssize_t c, Py_ssize_t count, const floating** rows) noexcept nogil:
    """rows[k]: where image b's values of channel c+k start in base, for each of the GROUP
    lanes (lanes past the last of the count channels repeat channel c)."""
    cdef Py_ssize_t k
    for k in range(GROUP):
        rows[k] = base + (b * p.channels + c + (k if k < count else 0)) * p.spatial


cdef void _stats(const floating* x, floating* mean, floating* variance,
                 floating* rolling_mean, floating* rolling_variance,
                 const BatchnormParams* p, Py_ssize_t c) noexcept nogil:
    # Channels c .. c+GROUP-1 side by side: each keeps Darknet's serial float sum (the order
    # matters: some of these sums cancel), and GROUP of them in flight at once hide the
    # latency of each add. Lanes past the last channel repeat channel c and are dropped.
    cdef Py_ssize_t n = p.batch * p.spatial, b, i, k
    cdef Py_ssize_t count = min(<Py_ssize_t>GROUP, p.channels - c)
    cdef const floating* rows[GROUP]
    cdef floating total[GROUP]
    cdef floating m[GROUP]
    cdef floating v, dev
    cdef floating keep = <floating>p.momentum, take = <floating>(1.0 - p.momentum)
    for k in range(GROUP):
        total[k] = 0
    for b in range(p.batch):
        _lanes(x, p, b, c, count, rows)
        for i in range(p.spatial):
            for k in range(GROUP):
                total[k] = total[k] + rows[k][i]
    for k in range(GROUP):
        m[k] = total[k] * <floating>(1.0 / n)
        total[k] = 0
    for b in range(p.batch):
        _lanes(x, p, b, c, count, rows)
        for i in range(p.spatial):
            for k in range(GROUP):
                dev = rows[k][i] - m[k]
                if floating is float:
                    # Darknet adds pow(dev, 2), a double, to its float sum: one rounding a
                    # term.
                    total[k] = <float>(<double>total[k] + <double>dev * <double>dev)
                else:
                    total[k] = total[k] + dev * dev
    for k in range(count):
        v = total[k] * <floating>(1.0 / (n - 1))
        mean[c + k] = m[k]
        variance[c + k] = v
        rolling_mean[c + k] = rolling_mean[c + k] * keep
        rolling_mean[c + k] = rolling_mean[c + k] + take * m[k]
        rolling_variance[c + k] = rolling_variance[c + k] * keep
        rolling_variance[c + k] = rolling_variance[c + k] + take * v


cdef void _stats_channel(const StepData* d, Py_ssize_t c) noexcept nogil:
    cdef const BatchnormParams* p = <const BatchnormParams*>d.params
    if d.f32:
        _stats(<const float*>d.buf[STATS_X], <float*>d.buf[STATS_MEAN],
               <float*>d.buf[STATS_VARIANCE], <float*>d.buf[STATS_ROLLING_MEAN],
               <float*>d.buf[STATS_ROLLING_VARIANCE], p, c)
    else:
        _stats(<const double*>d.buf[STATS_X], <double*>d.buf[STATS_MEAN],
               <double*>d.buf[STATS_VARIANCE], <double*>d.buf[STATS_ROLLING_MEAN],
               <double*>d.buf[STATS_ROLLING_VARIANCE], p, c)


cdef void _stats_step(const StepData* d) noexcept nogil:
    _each_channel(d, _stats_channel, GROUP)


@cython.cdivision(True)
cdef void _normalize(const floating* x, const floating* mean, const floating* variance,
                     floating* x_norm, floating* out, const floating* scale,
                     const floating* bias, const BatchnormParams* p,
                     Py_ssize_t c) noexcept nogil:
    cdef Py_ssize_t b, i, at
    cdef floating m = mean[c], value
    cdef floating s = scale[c] if scale != NULL else 0, beta = bias[c] if bias != NULL else 0
    cdef floating sd = <floating>sqrt(<double>(variance[c] + <floating>p.eps))
    for b in range(p.batch):
        at = (b * p.channels + c) * p.spatial
        if out == NULL:
            for i in range(at, at + p.spatial):
                x_norm[i] = (x[i] - m) / sd
            continue
        for i in range(at, at + p.spatial):
            # x is read before out is written: out may be x.
            value = (x[i] - m) / sd
            x_norm[i] = value
            out[i] = value * s + beta


cdef void _normalize_channel(const StepData* d, Py_ssize_t c) noexcept nogil:
    cdef const BatchnormParams* p = <const BatchnormParams*>d.params
    if d.f32:
        _normalize(<const float*>d.buf[NORM_X], <const float*>d.buf[NORM_MEAN],
                   <const float*>d.buf[NORM_VARIANCE], <float*>d.buf[NORM_X_NORM],
                   <float*>d.buf[NORM_OUT], <const float*>d.buf[NORM_SCALE],
                   <const float*>d.buf[NORM_BIAS], p, c)
    else:
        _normalize(<const double*>d.buf[NORM_X], <const double*>d.buf[NORM_MEAN],
                   <const double*>d.buf[NORM_VARIANCE], <double*>d.buf[NORM_X_NORM],
                   <double*>d.buf[NORM_OUT], <const double*>d.buf[NORM_SCALE],
                   <const double*>d.buf[NORM_BIAS], p, c)


cdef void _normalize_step(const StepData* d) noexcept nogil:
    _each_channel(d, _normalize_channel)


def _layout(x) -> tuple:
    """(batch, channels, spatial) of an (N, C, H, W) or (N, C) array."""
    if x.ndim == 2:
        return x.shape[0], x.shape[1], 1
    return x.shape[0], x.shape[1], x.shape[2] * x.shape[3]


def _check_vectors(like, like_name, named, writable) -> None:
    """Check the (C,) arrays of ``named`` ((name, array) pairs) against (N, C, ...) ``like``."""
    channels = like.shape[1]
    for name, a in named:
        check_input(name, a, (1,), like, like_name=like_name, layout="(C,)",
                    writable=writable)
        if a.shape[0] != channels:
            raise ArgumentError(f"{name} has {a.shape[0]} entries, {like_name} has "
                                f"{channels} channels")


def _check_apart(written, read, allowed=()) -> None:
    """Raise unless no written array shares memory with another array (``allowed``: pairs
    of names that may be the very same array). written, read: (name, array) pairs."""
    named = tuple(written) + tuple(read)
    for i, (name_a, a) in enumerate(written):
        for name_b, b in named[i + 1:]:
            if not np.may_share_memory(a, b):
                continue
            if (name_a, name_b) in allowed and a.ctypes.data == b.ctypes.data:
                continue
            raise ArgumentError(f"{name_a} and {name_b} must not share memory")


def _check_scalars(double eps, double momentum=0.0) -> None:
    if not (math.isfinite(eps) and eps >= 0):
        raise ArgumentError(f"eps must be finite and >= 0, got {eps}")
    if not (math.isfinite(momentum) and 0 <= momentum <= 1):
        raise ArgumentError(f"momentum must be in [0, 1], got {momentum}")


cdef NativeStep _bn_step(StepFn fn, str kind, tuple arrays, x, double momentum, double eps,
                         bint exact):
    cdef NativeStep step = new_step(fn, kind, arrays, x.dtype == np.float32,
                                    sizeof(BatchnormParams))
    cdef BatchnormParams* p = <BatchnormParams*>step.data.params
    p.batch, p.channels, p.spatial = _layout(x)
    p.momentum, p.eps, p.exact = momentum, eps, exact
    return step


def _check_x(x, name, writable=False) -> None:
    check_input(name, x, (4, 2), writable=writable)
    batch, channels, spatial = _layout(x)
    if channels < 1 or batch * spatial < 2:
        raise ArgumentError(f"{name} {x.shape}: batch norm needs at least one channel and "
                            f"two values a channel (the variance divides by N - 1)")


def batchnorm_forward_train_step(x, mean, variance, x_norm, out, scale, bias, rolling_mean,
                                 rolling_variance, double momentum=MOMENTUM_CONV,
                                 double eps=EPS) -> list:
    """Batch norm forward with the mini-batch statistics (Darknet's training forward).

    x: (N, C, H, W), the raw convolution output, or (N, C), a connected layer's; the
    statistics of channel c run over its N*H*W values (N for (N, C)). Written: mean and
    variance (C,), the mini-batch mean and unbiased variance, kept for the backward; x_norm
    (like x), ``(x - mean)/sqrt(var + eps)``, also kept for the backward; out (like x),
    ``x_norm*scale + bias``. rolling_mean and rolling_variance (C,) are updated:
    ``r = momentum*r + (1 - momentum)*stat``. scale, bias: (C,). All C-contiguous, of one
    dtype (float32 or float64); N*H*W must be at least 2.

    ``out`` may be ``x`` (normalised in place); the raw values are then gone, and
    ``batchnorm_backward_step`` needs them, so a training pass keeps them elsewhere (as
    Darknet keeps ``l.x``). No other two arrays may share memory. With eps = 0 a channel of
    constant values divides by zero (inf or NaN).

    Returns two steps, to run in order: the statistics (with the running averages), then
    the normalisation.
    """
    _check_x(x, "x")
    check_like("x_norm", x_norm, x, "x")
    check_input("x_norm", x_norm, (x.ndim,), writable=True)
    check_like("out", out, x, "x")
    check_input("out", out, (x.ndim,), writable=True)
    _check_vectors(x, "x", (("scale", scale), ("bias", bias)), False)
    _check_vectors(x, "x", (("mean", mean), ("variance", variance),
                            ("rolling_mean", rolling_mean),
                            ("rolling_variance", rolling_variance)), True)
    _check_scalars(eps, momentum)
    _check_apart((("out", out), ("x_norm", x_norm), ("mean", mean), ("variance", variance),
                  ("rolling_mean", rolling_mean), ("rolling_variance", rolling_variance)),
                 (("x", x), ("scale", scale), ("bias", bias)), allowed=(("out", "x"),))
    return [
        _bn_step(_stats_step, "batchnorm_stats",
                 (x, mean, variance, rolling_mean, rolling_variance), x, momentum, eps, False),
        _bn_step(_normalize_step, "batchnorm_normalize",
                 (x, mean, variance, x_norm, out, scale, bias), x, momentum, eps, False),
    ]


def batchnorm_forward_train(x, mean, variance, x_norm, out, scale, bias, rolling_mean,
                            rolling_variance, double momentum=MOMENTUM_CONV,
                            double eps=EPS) -> None:
    """``batchnorm_forward_train_step(...)`` with the same arguments, run once."""
    for step in batchnorm_forward_train_step(x, mean, variance, x_norm, out, scale, bias,
                                             rolling_mean, rolling_variance, momentum, eps):
        step.run()


# ----------------------------------------------------------------------------------------
# backward

cdef enum:  # buffer roles
    BACK_DELTA, BACK_X, BACK_MEAN, BACK_VARIANCE
    BACK_X_NORM, BACK_SCALE, BACK_SCALE_GRAD, BACK_BIAS_GRAD


@cython.cdivision(True)
cdef void _backward(floating* delta, const floating* x, const floating* mean,
                    const floating* variance, const floating* x_norm, const floating* scale,
                    floating* scale_grad, floating* bias_grad, const BatchnormParams* p,
                    Py_ssize_t c) noexcept nogil:
    # Channels c .. c+GROUP-1 side by side, each sum in Darknet's serial float order (see
    # _stats); lanes past the last channel repeat channel c on a scratch row and are dropped.
    cdef Py_ssize_t n = p.batch * p.spatial, b, i, k, at
    cdef Py_ssize_t count = min(<Py_ssize_t>GROUP, p.channels - c)
    cdef floating total[GROUP]
    cdef floating scale_sum[GROUP]
    cdef floating mean_sum[GROUP]
    cdef floating var_sum[GROUP]
    cdef const floating* rows[GROUP]
    cdef const floating* norms[GROUP]
    cdef const floating* deltas[GROUP]
    cdef floating s[GROUP]
    cdef floating m[GROUP]
    cdef floating eps = <floating>p.eps
    cdef floating mean_delta, var_delta, v
    cdef double den, var_den
    for k in range(GROUP):
        scale_sum[k] = 0
        mean_sum[k] = 0
        var_sum[k] = 0
        s[k] = scale[c + (k if k < count else 0)]
        m[k] = mean[c + (k if k < count else 0)]
    # bias_grad as Darknet's backward_bias adds it: one sum per image.
    for b in range(p.batch):
        _lanes(delta, p, b, c, count, deltas)
        for k in range(GROUP):
            total[k] = 0
        for i in range(p.spatial):
            for k in range(GROUP):
                total[k] = total[k] + deltas[k][i]
        for k in range(count):
            bias_grad[c + k] = bias_grad[c + k] + total[k]
    for b in range(p.batch):
        _lanes(delta, p, b, c, count, deltas)
        _lanes(x_norm, p, b, c, count, norms)
        for i in range(p.spatial):
            for k in range(GROUP):
                scale_sum[k] = scale_sum[k] + deltas[k][i] * norms[k][i]
    for k in range(count):
        scale_grad[c + k] = scale_grad[c + k] + scale_sum[k]
    # Scaling delta in place cannot run on the repeated lanes (they would scale channel c
    # again): the real channels first, then the sums side by side.
    for k in range(count):
        for b in range(p.batch):
            at = (b * p.channels + c + k) * p.spatial
            for i in range(at, at + p.spatial):
                delta[i] = delta[i] * s[k]
    for b in range(p.batch):
        _lanes(delta, p, b, c, count, deltas)
        _lanes(x, p, b, c, count, rows)
        for i in range(p.spatial):
            for k in range(GROUP):
                mean_sum[k] = mean_sum[k] + deltas[k][i]
                var_sum[k] = var_sum[k] + deltas[k][i] * (rows[k][i] - m[k])
    for k in range(count):
        v = variance[c + k]
        mean_delta = <floating>(mean_sum[k] * (-1.0 / sqrt(<double>(v + eps))))
        var_delta = <floating>(var_sum[k] * (-0.5 * pow(<double>(v + eps), -1.5)))
        if p.exact:
            den = sqrt(<double>(v + eps))
            var_den = <double>(n - 1)
        else:
            # Darknet's normalize_delta_cpu: eps outside the root, the variance term over N.
            den = sqrt(<double>v) + <double>eps
            var_den = <double>n
        for b in range(p.batch):
            at = (b * p.channels + c + k) * p.spatial
            for i in range(at, at + p.spatial):
                delta[i] = <floating>(delta[i] / den
                                      + var_delta * 2.0 * <double>(x[i] - m[k]) / var_den
                                      + mean_delta / <floating>n)


cdef void _backward_channel(const StepData* d, Py_ssize_t c) noexcept nogil:
    cdef const BatchnormParams* p = <const BatchnormParams*>d.params
    if d.f32:
        _backward(<float*>d.buf[BACK_DELTA], <const float*>d.buf[BACK_X],
                  <const float*>d.buf[BACK_MEAN], <const float*>d.buf[BACK_VARIANCE],
                  <const float*>d.buf[BACK_X_NORM], <const float*>d.buf[BACK_SCALE],
                  <float*>d.buf[BACK_SCALE_GRAD], <float*>d.buf[BACK_BIAS_GRAD], p, c)
    else:
        _backward(<double*>d.buf[BACK_DELTA], <const double*>d.buf[BACK_X],
                  <const double*>d.buf[BACK_MEAN], <const double*>d.buf[BACK_VARIANCE],
                  <const double*>d.buf[BACK_X_NORM], <const double*>d.buf[BACK_SCALE],
                  <double*>d.buf[BACK_SCALE_GRAD], <double*>d.buf[BACK_BIAS_GRAD], p, c)


cdef void _backward_step(const StepData* d) noexcept nogil:
    _each_channel(d, _backward_channel, GROUP)


def batchnorm_normalized_step(x, mean, variance, x_norm, double eps=EPS) -> NativeStep:
    """``x_norm = (x - mean)/sqrt(variance + eps)`` per channel: what the forward's
    normalisation step wrote, bit for bit, recomputed from what it read (a training pass
    keeps x, mean and variance for the backward instead of x_norm too).

    x, x_norm: (N, C, H, W) or (N, C); mean, variance: (C,), the forward's; one dtype;
    x_norm shares memory with none of the others.
    """
    _check_x(x, "x")
    check_like("x_norm", x_norm, x, "x")
    check_input("x_norm", x_norm, (x.ndim,), writable=True)
    _check_vectors(x, "x", (("mean", mean), ("variance", variance)), False)
    _check_scalars(eps)
    _check_apart((("x_norm", x_norm),), (("x", x), ("mean", mean), ("variance", variance)))
    return _bn_step(_normalize_step, "batchnorm_normalized",
                    (x, mean, variance, x_norm, None, None, None), x, 0.0, eps, False)


def batchnorm_backward_step(delta, x_raw, mean, variance, x_norm, scale, scale_grad,
                            bias_grad, double eps=EPS, bint exact=False) -> NativeStep:
    """Batch norm backward (Darknet's CPU backward_batchnorm_layer, with the bias gradient
    the golden build adds), after the activation's derivative.

    delta: (N, C, H, W) or (N, C), the gradient with respect to the batch norm's output;
    replaced in place by the gradient with respect to its input x_raw (Darknet's l.delta
    is rewritten the same way). x_raw, x_norm: like delta, what the forward read and
    wrote; mean, variance: (C,), the forward's mini-batch statistics; scale: (C,).
    Accumulated: ``bias_grad += sum delta`` and ``scale_grad += sum delta*x_norm`` (C,),
    both from the incoming delta. eps must be the forward's. ``exact``: the exact gradient
    of the forward instead of Darknet's formulas (see the module docstring). All
    C-contiguous, of one dtype; delta shares memory with none of the others.
    """
    _check_x(delta, "delta", writable=True)
    check_like("x_raw", x_raw, delta, "delta")
    check_input("x_raw", x_raw, (delta.ndim,))
    check_like("x_norm", x_norm, delta, "delta")
    check_input("x_norm", x_norm, (delta.ndim,))
    _check_vectors(delta, "delta", (("mean", mean), ("variance", variance), ("scale", scale)),
                   False)
    _check_vectors(delta, "delta", (("scale_grad", scale_grad), ("bias_grad", bias_grad)),
                   True)
    _check_scalars(eps)
    _check_apart((("delta", delta), ("scale_grad", scale_grad), ("bias_grad", bias_grad)),
                 (("x_raw", x_raw), ("x_norm", x_norm), ("mean", mean),
                  ("variance", variance), ("scale", scale)))
    return _bn_step(_backward_step, "batchnorm_backward",
                    (delta, x_raw, mean, variance, x_norm, scale, scale_grad, bias_grad),
                    delta, 0.0, eps, exact)


def batchnorm_backward(delta, x_raw, mean, variance, x_norm, scale, scale_grad, bias_grad,
                       double eps=EPS, bint exact=False) -> None:
    """``batchnorm_backward_step(...)`` with the same arguments, run once."""
    batchnorm_backward_step(delta, x_raw, mean, variance, x_norm, scale, scale_grad,
                            bias_grad, eps, exact).run()
