"""Training steps of the loss layers ([softmax] with a truth, [cost] type=sse), [dropout],
the uniform draws dropout uses, and the activation-gradient step.

Darknet's sign throughout: a delta is the NEGATIVE gradient of the loss (truth minus
prediction); finite differences of the loss check it.
"""

from __future__ import annotations

import numpy as np
import pytest
from grad_check import assert_raises_naming, numeric_grad, rel_err

from darknet_metal.cpu import activation as cpu_activation
from darknet_metal.cpu import dropout, executor, heads
from darknet_metal.errors import ArgumentError, ArgumentTypeError

DTYPES = [np.float32, np.float64]


def _rand(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _one_hot(n, classes, seed, dtype=np.float64):
    t = np.zeros((n, classes), dtype)
    t[np.arange(n), np.random.default_rng(seed).integers(0, classes, n)] = 1
    return t


# ---------------------------------------------------------------------------------------
# [softmax] cross-entropy and [cost] sse


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_cross_entropy_values(dtype):
    p = np.random.default_rng(1).uniform(0.05, 1, (3, 5)).astype(dtype)
    t = _one_hot(3, 5, 2, dtype)
    t[0, 4] = 0.5  # a soft truth: loss where t != 0, whatever its value
    delta, loss = np.full_like(p, 9), np.full_like(p, 9)
    heads.softmax_cross_entropy(p, t, delta, loss)
    np.testing.assert_array_equal(delta, t - p)
    np.testing.assert_allclose(loss, np.where(t != 0, -np.log(p), 0),
                               rtol=2e-7 if dtype == np.float32 else 1e-15)


def test_softmax_cross_entropy_delta_is_the_negative_gradient_of_the_logits():
    # With one-hot truth, t - p = -d(sum loss)/d(logits) through the softmax.
    z, t = _rand((3, 5), 3), _one_hot(3, 5, 4)

    def total_loss():
        p = np.empty_like(z)
        heads.softmax_forward(z, p)
        delta, loss = np.empty_like(z), np.empty_like(z)
        heads.softmax_cross_entropy(p, t, delta, loss)
        return float(loss.sum())

    p = np.empty_like(z)
    heads.softmax_forward(z, p)
    delta, loss = np.empty_like(z), np.empty_like(z)
    heads.softmax_cross_entropy(p, t, delta, loss)
    assert rel_err(delta, -numeric_grad(total_loss, z)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_cost_sse_values_and_gradient(dtype):
    pred, t = _rand((4, 3, 2, 2), 5, dtype), _rand((4, 12), 6, dtype)
    delta, out = np.empty_like(pred), np.empty_like(pred)
    heads.cost_sse(pred, t, delta, out)
    diff = t.reshape(pred.shape) - pred
    np.testing.assert_array_equal(delta, diff)
    np.testing.assert_array_equal(out, diff * diff)
    if dtype == np.float64:
        def cost():
            d, o = np.empty_like(pred), np.empty_like(pred)
            heads.cost_sse(pred, t, d, o)
            return float(o.sum())
        # Darknet's delta is minus half the gradient of sum (t - p)^2.
        assert rel_err(delta, -0.5 * numeric_grad(cost, pred)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_cost_backward_add(dtype):
    delta = _rand((2, 5), 7, dtype)
    start = _rand((2, 5, 1, 1), 8, dtype)
    x_grad = start.copy()
    heads.softmax_backward(delta, x_grad)
    np.testing.assert_array_equal(x_grad, start + delta.reshape(start.shape))
    heads.cost_backward(delta, x_grad, 0.5)
    np.testing.assert_array_equal(x_grad, (start + delta.reshape(start.shape))
                                  + dtype(0.5) * delta.reshape(start.shape))


@pytest.mark.parametrize("call, error, words", [
    (lambda: heads.softmax_cross_entropy_step(np.ones((2, 5)), np.ones((2, 4)),
                                              np.ones((2, 5)), np.ones((2, 5))),
     ArgumentError, ["truth", "(2, 5)"]),
    (lambda: heads.softmax_cross_entropy_step(np.ones((2, 5)), np.ones((2, 5), np.float32),
                                              np.ones((2, 5)), np.ones((2, 5))),
     ArgumentError, ["truth", "float32"]),
    (lambda: heads.cost_sse_step(np.ones((2, 5)), np.ones((2, 5)), np.ones((2, 5)),
                                 np.ones((2, 4))),
     ArgumentError, ["out", "pred"]),
    (lambda: heads.cost_sse_step(np.ones((2, 5)), np.ones((2, 5)), "delta", np.ones((2, 5))),
     ArgumentTypeError, ["delta", "str"]),
    (lambda: heads.softmax_backward_step(np.ones((2, 5)), np.ones((3, 5))),
     ArgumentError, ["x_grad", "(2, 5)"]),
    (lambda: heads.cost_backward_step(np.ones((2, 5)), np.ones((2, 5)), float("nan")),
     ArgumentError, ["scale", "nan"]),
])
def test_loss_steps_bad_arguments(call, error, words):
    assert_raises_naming(call, error, words)


def test_loss_steps_refuse_shared_memory():
    a = np.ones((2, 5))
    with pytest.raises(ArgumentError, match="delta must not share memory with p"):
        heads.softmax_cross_entropy_step(a, np.ones((2, 5)), a, np.ones((2, 5)))
    with pytest.raises(ArgumentError, match="delta must not share memory with out"):
        heads.cost_sse_step(np.ones((2, 5)), np.ones((2, 5)), a, a)
    with pytest.raises(ArgumentError, match="x_grad must not share memory with delta"):
        heads.softmax_backward_step(a, a)


# ---------------------------------------------------------------------------------------
# dropout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("probability", [0.0, 0.25, 0.5, 0.9])
def test_dropout_forward_and_backward(dtype, probability):
    x = _rand((3, 4, 2, 2), 9, dtype)
    rand = np.random.default_rng(10).uniform(0, 1, 48).astype(dtype)
    keep = (rand >= dtype(probability)).reshape(x.shape)
    scale = dtype(1 / (1 - float(dtype(probability))))
    want = np.where(keep, x * scale, 0)
    got = x.copy()
    dropout.dropout_forward_train(got, rand, probability)
    np.testing.assert_array_equal(got, want)
    got = x.copy()
    dropout.dropout_backward(got, rand, probability)
    np.testing.assert_array_equal(got, want)


def test_dropout_backward_matches_finite_differences():
    x, r = _rand((2, 7), 11), _rand((2, 7), 12)
    rand = np.random.default_rng(13).uniform(0, 1, (2, 7))

    def loss():
        y = x.copy()
        dropout.dropout_forward_train(y, rand, 0.3)
        return float((y * r).sum())

    delta = r.copy()
    dropout.dropout_backward(delta, rand, 0.3)
    assert rel_err(delta, numeric_grad(loss, x)) < 1e-6


def test_dropout_scale_is_darknets_float_reciprocal():
    # Darknet multiplies by (float)(1./(1. - p)) for the float p; for p = 0.1 that differs
    # from dividing by 0.9f for some inputs.
    x = np.linspace(1, 2, 1001, dtype=np.float32)
    got = x.copy()
    dropout.dropout_forward_train(got, np.ones_like(x), 0.1)
    scale = np.float32(1.0 / (1.0 - float(np.float32(0.1))))
    np.testing.assert_array_equal(got, x * scale)


@pytest.mark.parametrize("call, error, words", [
    (lambda: dropout.dropout_forward_train_step(np.ones((2, 3)), np.ones(5), 0.5),
     ArgumentError, ["rand", "x_inplace", "(6)"]),
    (lambda: dropout.dropout_forward_train_step(np.ones((2, 3)), np.ones(6), 1.0),
     ArgumentError, ["probability", "1.0"]),
    (lambda: dropout.dropout_backward_step(np.ones((2, 3)), np.ones(6, np.float32), 0.5),
     ArgumentError, ["rand", "float32"]),
    (lambda: dropout.dropout_backward_step(np.ones((2, 3)).T, np.ones(6), 0.5),
     ArgumentError, ["delta_inplace", "C-contiguous"]),
    (lambda: dropout.uniform_fill_step(np.ones(4), -1, np.zeros(1, np.int64)),
     ArgumentError, ["seed", "-1"]),
    (lambda: dropout.uniform_fill_step(np.ones(4), 1.5, np.zeros(1, np.int64)),
     ArgumentTypeError, ["seed", "1.5"]),
    (lambda: dropout.uniform_fill_step(np.ones(4), 1, np.zeros(2, np.int64)),
     ArgumentError, ["counter", "(2,)"]),
    (lambda: dropout.uniform_fill_step(np.ones(4), 1, np.zeros(1, np.int32)),
     ArgumentError, ["counter", "int32"]),
    (lambda: dropout.uniform_fill_step(np.ones(4), 1, 0),
     ArgumentTypeError, ["counter", "int"]),
])
def test_dropout_bad_arguments(call, error, words):
    assert_raises_naming(call, error, words)


@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_fill_is_reproducible_and_advances(dtype):
    a, b = np.empty(1000, dtype), np.empty(1000, dtype)
    c1, c2 = np.zeros(1, np.int64), np.zeros(1, np.uint64)
    step = dropout.uniform_fill_step(a, 12345, c1)
    step.run()
    dropout.uniform_fill(b, 12345, c2)
    np.testing.assert_array_equal(a, b)
    assert c1[0] == 1 and c2[0] == 1
    first = a.copy()
    step.run()  # the next pass draws anew
    assert c1[0] == 2 and not np.array_equal(a, first)
    c2[0] = 1
    dropout.uniform_fill(b, 12345, c2)
    np.testing.assert_array_equal(a, b)
    dropout.uniform_fill(b, 12346, np.zeros(1, np.int64))
    assert not np.array_equal(b, first)


@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_fill_looks_uniform(dtype):
    a = np.empty((4, 25, 10, 10), dtype)
    dropout.uniform_fill(a, 7, np.array([3], np.int64))
    assert a.min() >= 0 and a.max() < 1
    counts = np.histogram(a, bins=10, range=(0, 1))[0]
    # 10000 draws: each bin 1000 +- 3.5 sigma (sigma = 30).
    assert np.all(np.abs(counts - 1000) < 105)
    assert abs(np.corrcoef(a.reshape(-1)[:-1], a.reshape(-1)[1:])[0, 1]) < 0.04
    assert len(np.unique(a)) > 9990


def test_uniform_fill_and_dropout_in_a_step_list():
    # One pass of the executor's loop: draw, then drop; the next pass draws anew.
    rand = np.empty(100_000, np.float32)
    x = np.ones_like(rand)
    counter = np.zeros(1, np.int64)
    steps = executor.StepList([dropout.uniform_fill_step(rand, 1, counter),
                               dropout.dropout_forward_train_step(x, rand, 0.5)], None)
    steps.run()
    assert counter[0] == 1
    np.testing.assert_array_equal(x, np.where(rand < 0.5, 0, 2))
    assert abs((x == 0).mean() - 0.5) < 0.01
    first = rand.copy()
    steps.run()
    assert counter[0] == 2 and not np.array_equal(rand, first)


# ---------------------------------------------------------------------------------------
# activation gradient


@pytest.mark.parametrize("act", ["logistic", "tanh", "mish", "swish", "elu", "leaky", "selu",
                                 "loggy", "linear"])
def test_activation_gradient_step_matches_finite_differences(act):
    x = _rand((2, 3, 4, 5), 14)
    x[np.abs(x) < 0.05] += 0.2  # away from the kinks of leaky and elu
    r = _rand(x.shape, 15)

    def loss():
        y = x.copy()
        cpu_activation.activate(y, act)
        return float((y * r).sum())

    y = x.copy()
    cpu_activation.activate(y, act)
    delta = r.copy()
    by_input = act in ("mish", "swish")
    step = cpu_activation.activation_gradient_step(x if by_input else y, delta, act)
    assert step.kind == f"activation_gradient_{act}"
    step.run()
    assert rel_err(delta, numeric_grad(loss, x)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_gradient_step_channel_rule(dtype):
    # normalize_channels_softmax: per pixel, every delta times sum_k y_k * delta_k.
    y = np.random.default_rng(16).uniform(0.01, 1, (2, 4, 3, 3)).astype(dtype)
    delta = _rand(y.shape, 17, dtype)
    want = delta * (y * delta).sum(axis=1, keepdims=True)
    steps = executor.StepList(
        [cpu_activation.activation_gradient_step(y, delta, "normalize_channels_softmax")], None)
    steps.run()
    np.testing.assert_allclose(delta, want, rtol=1e-5 if dtype == np.float32 else 1e-13)


def test_activation_gradient_step_bad_arguments():
    with pytest.raises(ArgumentError, match="delta must have the shape and dtype of y_or_x"):
        cpu_activation.activation_gradient_step(np.ones((2, 3)), np.ones((2, 4)), "relu")
    with pytest.raises(ArgumentError, match="unknown activation 'nope'"):
        cpu_activation.activation_gradient_step(np.ones((2, 3)), np.ones((2, 3)), "nope")
    frozen = np.ones((2, 3))
    frozen.flags.writeable = False
    with pytest.raises(ArgumentError, match="delta must be writable"):
        cpu_activation.activation_gradient_step(np.ones((2, 3)), frozen, "relu")
