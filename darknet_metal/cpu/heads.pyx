# cython: language_level=3
"""Output heads: the CPU reference for ``[softmax]`` and ``[cost]`` (``[yolo]`` is ``yolo``).

``softmax_forward`` is Darknet's softmax_cpu as forward_softmax_layer calls it (no
hierarchical ``tree=`` softmax).

Training: the loss layers compute their delta in the forward pass, with Darknet's sign
(``delta = truth - prediction``, the NEGATIVE gradient): ``softmax_cross_entropy_step``
(forward_softmax_layer given a truth) and ``cost_sse_step`` ([cost] type=sse). Their
backward passes only add a delta into their input's: ``softmax_backward_step`` (the
[softmax] delta as is, not through the softmax's Jacobian: with cross-entropy, t - p is
already the logits' delta) and ``cost_backward_step`` (``scale * delta``). So a [cost]
after a [softmax] hands its delta with respect to the probabilities on to the logits
unchanged, as Darknet does: the [softmax] delta becomes (t - p) + scale*(t - p).

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays,
checked by ``checks``; ``out`` has the shape and dtype of ``x`` and may be ``x``. Each
``*_step`` checks its arguments and returns a ``NativeStep`` (``step.pyx``) that runs the
loop without the GIL; ``*_forward`` makes the step and runs it once.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.math cimport exp

from darknet_metal.cpu.fmath cimport flog
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_disjoint, check_input, check_out, check_shaped_like
from darknet_metal.cpu.fill import add_step


# ----------------------------------------------------------------------------------------
# softmax

cdef enum:  # buffer roles
    SOFTMAX_X, SOFTMAX_OUT

cdef struct SoftmaxParams:
    Py_ssize_t tasks  # batch * groups
    Py_ssize_t n      # values per group
    double temperature


@cython.cdivision(True)
cdef void _softmax(const floating* src, floating* dst, const SoftmaxParams* p) noexcept nogil:
    cdef Py_ssize_t n = p.n, task, i
    cdef floating largest, total, e, zero = 0
    cdef floating temp = <floating>p.temperature
    # Group g of sample b starts at b*inputs + g*n == (b*groups + g)*n.
    for task in range(p.tasks):
        largest = -FLT_MAX
        for i in range(n):
            if src[task * n + i] > largest:
                largest = src[task * n + i]
        total = zero
        for i in range(n):
            # Darknet calls the double exp on a float argument and stores a float.
            e = <floating>exp(<double>(src[task * n + i] / temp - largest / temp))
            total = total + e
            dst[task * n + i] = e
        for i in range(n):
            dst[task * n + i] = dst[task * n + i] / total


cdef void _softmax_step(const StepData* d) noexcept nogil:
    cdef const SoftmaxParams* p = <const SoftmaxParams*>d.params
    if d.f32:
        _softmax(<const float*>d.buf[SOFTMAX_X], <float*>d.buf[SOFTMAX_OUT], p)
    else:
        _softmax(<const double*>d.buf[SOFTMAX_X], <double*>d.buf[SOFTMAX_OUT], p)


def softmax_step(x, out, int groups=1, double temperature=1.0) -> NativeStep:
    """Darknet ``[softmax]`` forward: softmax_cpu(x, F/groups, N, F, groups, F/groups, 1, T).

    x: (N, F) or (N, C, H, W) float32/float64, C-contiguous, each sample taken as F values
    in memory order; out: same shape and dtype (may be x). Each sample is split into
    ``groups`` consecutive runs of F/groups values and each run becomes
    ``exp(x/T - max/T) / sum``, the maximum taken over the run.
    """
    check_input("x", x, (2, 4))
    check_out(out, x, x.shape)
    features = x.shape[1] if x.ndim == 2 else x.shape[1] * x.shape[2] * x.shape[3]
    if groups < 1 or features % groups:
        raise ArgumentError(f"softmax groups={groups} must be >= 1 and divide the {features} "
                         "inputs per sample")
    if temperature == 0 or not np.isfinite(temperature):
        raise ArgumentError(f"softmax temperature must be finite and non-zero, got {temperature}")
    cdef NativeStep step = new_step(_softmax_step, "softmax", (x, out), x.dtype == np.float32,
                                    sizeof(SoftmaxParams))
    cdef SoftmaxParams* p = <SoftmaxParams*>step.data.params
    p.tasks = x.shape[0] * groups
    p.n = features // groups
    p.temperature = temperature
    return step


def softmax_forward(x, out, int groups=1, double temperature=1.0) -> None:
    """``softmax_step(x, out, groups, temperature)`` run once."""
    softmax_step(x, out, groups, temperature).run()


# ----------------------------------------------------------------------------------------
# loss layers: [softmax] with a truth, [cost] type=sse

cdef enum:  # buffer roles
    LOSS_PRED, LOSS_TRUTH, LOSS_DELTA, LOSS_VALUE

cdef enum:  # loss kinds
    LOSS_CROSS_ENTROPY, LOSS_SSE

cdef struct LossParams:
    Py_ssize_t n  # elements
    int kind


cdef void _loss(const floating* pred, const floating* truth, floating* delta, floating* value,
                const LossParams* p) noexcept nogil:
    cdef Py_ssize_t i
    cdef floating t, diff, zero = 0
    for i in range(p.n):
        t = truth[i]
        diff = t - pred[i]
        if p.kind == LOSS_CROSS_ENTROPY:
            value[i] = -flog(pred[i]) if t != zero else zero
        else:
            value[i] = diff * diff
        delta[i] = diff


cdef void _loss_step(const StepData* d) noexcept nogil:
    cdef const LossParams* p = <const LossParams*>d.params
    if d.f32:
        _loss(<const float*>d.buf[LOSS_PRED], <const float*>d.buf[LOSS_TRUTH],
              <float*>d.buf[LOSS_DELTA], <float*>d.buf[LOSS_VALUE], p)
    else:
        _loss(<const double*>d.buf[LOSS_PRED], <const double*>d.buf[LOSS_TRUTH],
              <double*>d.buf[LOSS_DELTA], <double*>d.buf[LOSS_VALUE], p)


cdef NativeStep _loss_new(int kind, str pred_name, pred, truth, delta, str value_name, value):
    check_input(pred_name, pred, (2, 4))
    check_input("truth", truth, (2, 4), pred, like_name=pred_name)
    if truth.shape[0] != pred.shape[0] or truth.size != pred.size:
        raise ArgumentError(f"truth must have the batch and size of {pred_name} "
                            f"{pred.shape}, not {truth.shape}")
    check_shaped_like("delta", delta, pred, pred_name, writable=True)
    check_shaped_like(value_name, value, pred, pred_name, writable=True)
    check_disjoint({"delta": delta, value_name: value}, {pred_name: pred, "truth": truth})
    if np.shares_memory(delta, value):
        raise ArgumentError(f"delta must not share memory with {value_name}")
    kinds = {LOSS_CROSS_ENTROPY: "softmax_cross_entropy", LOSS_SSE: "cost_sse"}
    cdef NativeStep step = new_step(_loss_step, kinds[kind], (pred, truth, delta, value),
                                    pred.dtype == np.float32, sizeof(LossParams))
    cdef LossParams* p = <LossParams*>step.data.params
    p.n = pred.size
    p.kind = kind
    return step


def softmax_cross_entropy_step(p, truth, delta, loss) -> NativeStep:
    """What forward_softmax_layer does given a truth (softmax_x_ent_cpu): per element,
    ``delta = t - p`` and ``loss = -log(p)`` where ``t != 0``, else 0 (both assigned).

    p: (N, F) or (N, C, H, W), the [softmax] output; truth: the batch's truth, as many
    values per sample (one-hot rows for a classifier), p's dtype; delta, loss: p's shape and
    dtype. The layer's cost is ``loss.sum()``.
    """
    return _loss_new(LOSS_CROSS_ENTROPY, "p", p, truth, delta, "loss", loss)


def softmax_cross_entropy(p, truth, delta, loss) -> None:
    """``softmax_cross_entropy_step(p, truth, delta, loss)`` run once."""
    softmax_cross_entropy_step(p, truth, delta, loss).run()


def cost_sse_step(pred, truth, delta, out) -> NativeStep:
    """Darknet ``[cost] type=sse`` forward (l2_cpu): per element ``delta = t - pred`` and
    ``out = (t - pred)^2`` (both assigned).

    pred: (N, F) or (N, C, H, W), the layer's input; truth: as many values per sample, same
    dtype; delta, out: pred's shape and dtype. The layer's cost is ``out.sum()``.
    """
    return _loss_new(LOSS_SSE, "pred", pred, truth, delta, "out", out)


def cost_sse(pred, truth, delta, out) -> None:
    """``cost_sse_step(pred, truth, delta, out)`` run once."""
    cost_sse_step(pred, truth, delta, out).run()


def _add_into(delta, x_grad, double scale) -> NativeStep:
    # x_grad may be shaped otherwise (N, C, H, W) than delta (N, F): same batch and size.
    check_input("delta", delta, (2, 4))
    check_input("x_grad", x_grad, (2, 4), delta, like_name="delta", writable=True)
    if x_grad.shape[0] != delta.shape[0] or x_grad.size != delta.size:
        raise ArgumentError(f"x_grad must have the batch and size of delta {delta.shape}, "
                            f"not {x_grad.shape}")
    if not np.isfinite(scale):
        raise ArgumentError(f"scale must be finite, got {scale}")
    check_disjoint({"x_grad": x_grad}, {"delta": delta})
    # x_grad's values in delta's layout (a view: the step adds into x_grad itself).
    return add_step(delta, x_grad.reshape(delta.shape), scale)


def softmax_backward_step(delta, x_grad) -> NativeStep:
    """Darknet's backward_softmax_layer: ``x_grad += delta``.

    delta: (N, F) or (N, C, H, W), the [softmax] delta (``t - p`` from
    ``softmax_cross_entropy_step`` plus what later layers added); x_grad: the delta of the
    softmax's input, the same number of values per sample (it may be (N, C, H, W) where
    delta is (N, F)) and dtype, added into.
    """
    return _add_into(delta, x_grad, 1.0)


def softmax_backward(delta, x_grad) -> None:
    """``softmax_backward_step(delta, x_grad)`` run once."""
    softmax_backward_step(delta, x_grad).run()


def cost_backward_step(delta, x_grad, double scale=1.0) -> NativeStep:
    """Darknet's backward_cost_layer: ``x_grad += scale * delta`` (``scale``: the [cost]
    key, default 1).

    delta: (N, F) or (N, C, H, W), the [cost] delta from ``cost_sse_step``; x_grad: the
    delta of the cost layer's input, as many values per sample, same dtype, added into.
    """
    return _add_into(delta, x_grad, scale)


def cost_backward(delta, x_grad, double scale=1.0) -> None:
    """``cost_backward_step(delta, x_grad, scale)`` run once."""
    cost_backward_step(delta, x_grad, scale).run()
