"""Batch norm in training mode (darknet_metal.cpu.batchnorm): NumPy versions of Darknet's
CPU formulas, finite differences of the exact gradient, accumulation, dtypes, threads and
argument checks."""

import numpy as np
import pytest
from grad_check import numeric_grad, rel_err
from reference import np_batchnorm_backward, np_batchnorm_forward, per_channel

from darknet_metal.cpu import batchnorm as bn
from darknet_metal.errors import ArgumentError

SHAPES = [(3, 4, 3, 5), (5, 6)]  # a convolution's (N, C, H, W), a connected layer's (N, C)


def make(shape, dtype, seed=0):
    rng = np.random.default_rng(seed + sum(shape))
    channels = shape[1]
    # Channels of different means and spreads, none near constant.
    x = (rng.standard_normal(shape) * per_channel(rng.uniform(0.5, 3, channels), np.empty(shape))
         + per_channel(rng.uniform(-2, 2, channels), np.empty(shape))).astype(dtype)
    scale = rng.uniform(0.5, 1.5, channels).astype(dtype)
    bias = rng.standard_normal(channels).astype(dtype)
    return x, scale, bias


def run_forward(x, scale, bias, eps=bn.EPS, momentum=bn.MOMENTUM_CONV, rolling=None):
    channels = x.shape[1]
    mean, var = np.empty(channels, x.dtype), np.empty(channels, x.dtype)
    x_norm, out = np.empty_like(x), np.empty_like(x)
    if rolling is None:
        rolling = (np.zeros(channels, x.dtype), np.zeros(channels, x.dtype))
    bn.batchnorm_forward_train(x, mean, var, x_norm, out, scale, bias, *rolling, momentum, eps)
    return mean, var, x_norm, out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum", [bn.MOMENTUM_CONV, bn.MOMENTUM_CONNECTED])
def test_forward_matches_numpy(shape, dtype, momentum):
    x, scale, bias = make(shape, dtype)
    rng = np.random.default_rng(1)
    r_mean0 = rng.standard_normal(shape[1]).astype(dtype)
    r_var0 = rng.uniform(0, 2, shape[1]).astype(dtype)
    rolling = (r_mean0.copy(), r_var0.copy())
    got = run_forward(x, scale, bias, momentum=momentum, rolling=rolling)
    want = np_batchnorm_forward(x, scale, bias, bn.EPS)
    tol = 2e-6 if dtype == np.float32 else 1e-13
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert rel_err(g, w) < tol
    assert rel_err(rolling[0], momentum * r_mean0 + (1 - momentum) * want[0]) < tol
    assert rel_err(rolling[1], momentum * r_var0 + (1 - momentum) * want[1]) < tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_in_place(dtype):
    x, scale, bias = make(SHAPES[0], dtype)
    want = run_forward(x, scale, bias)
    channels = x.shape[1]
    mean, var, x_norm = np.empty(channels, dtype), np.empty(channels, dtype), np.empty_like(x)
    steps = bn.batchnorm_forward_train_step(x, mean, var, x_norm, x, scale, bias,
                                            np.zeros(channels, dtype), np.zeros(channels, dtype))
    assert [s.kind for s in steps] == ["batchnorm_stats", "batchnorm_normalize"]
    for s in steps:
        s.run()
    for g, w in zip((mean, var, x_norm, x), want, strict=True):
        assert np.array_equal(g, w)


def backward(delta, x, mean, var, x_norm, scale, eps, exact, grads=None):
    """Run the kernel on a copy of delta; returns (delta, scale_grad, bias_grad)."""
    delta = delta.copy()
    if grads is None:
        grads = np.zeros(x.shape[1], x.dtype), np.zeros(x.shape[1], x.dtype)
    bn.batchnorm_backward(delta, x, mean, var, x_norm, scale, *grads, eps, exact)
    return delta, *grads


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [bn.EPS, 0.0])
def test_exact_backward_matches_finite_differences(shape, eps):
    x, scale, bias = make(shape, np.float64)
    r = np.random.default_rng(9).standard_normal(shape)

    def loss():
        return float(np.sum(run_forward(x, scale, bias, eps=eps)[3] * r))

    mean, var, x_norm, _ = run_forward(x, scale, bias, eps=eps)
    dx, dscale, dbias = backward(r, x, mean, var, x_norm, scale, eps, True)
    assert rel_err(dx, numeric_grad(loss, x, 1e-5)) < 1e-6
    assert rel_err(dscale, numeric_grad(loss, scale, 1e-5)) < 1e-6
    assert rel_err(dbias, numeric_grad(loss, bias, 1e-5)) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_darknet_formulas_match_numpy_and_accumulate(shape, dtype):
    x, scale, bias = make(shape, dtype)
    mean, var, x_norm, _ = run_forward(x, scale, bias)
    rng = np.random.default_rng(4)
    delta = rng.standard_normal(shape).astype(dtype)
    start = rng.standard_normal((2, shape[1])).astype(dtype)
    grads = start[0].copy(), start[1].copy()
    got = backward(delta, x, mean, var, x_norm, scale, bn.EPS, False, grads)
    want = np_batchnorm_backward(delta, x, mean.astype(np.float64), var.astype(np.float64),
                          x_norm.astype(np.float64), scale.astype(np.float64), bn.EPS)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(got[0], want[0]) < tol
    assert rel_err(got[1] - start[0], want[1]) < tol
    assert rel_err(got[2] - start[1], want[2]) < tol


def test_darknet_formulas_differ_from_the_exact_gradient():
    # eps = 0 removes the eps placement, but the variance term still divides by N where
    # the forward's variance divides by N - 1: for a connected layer's N = batch the
    # difference is large, for a convolution's batch*H*W small.
    for shape, low, high in (((5, 6), 1e-2, 1.0), ((3, 4, 9, 9), 1e-5, 1e-2)):
        x, scale, bias = make(shape, np.float64)
        mean, var, x_norm, _ = run_forward(x, scale, bias, eps=0.0)
        r = np.random.default_rng(2).standard_normal(shape)
        darknet = backward(r, x, mean, var, x_norm, scale, 0.0, False)[0]
        exact = backward(r, x, mean, var, x_norm, scale, 0.0, True)[0]
        assert low < rel_err(darknet, exact) < high
        want = np_batchnorm_backward(r, x, mean, var, x_norm, scale, 0.0)[0]
        assert rel_err(darknet, want) < 1e-12


def test_float32_agrees_with_float64():
    x64, scale64, bias64 = make(SHAPES[0], np.float64)
    delta64 = np.random.default_rng(6).standard_normal(SHAPES[0])
    results = []
    for dtype in (np.float32, np.float64):
        x, scale, bias = (a.astype(dtype) for a in (x64, scale64, bias64))
        mean, var, x_norm, out = run_forward(x, scale, bias)
        results.append((mean, var, x_norm, out,
                        *backward(delta64.astype(dtype), x, mean, var, x_norm, scale, bn.EPS,
                                  False)))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-5


def test_channels_are_independent_of_the_threads():
    # Big enough to be shared among the threads: the same bits as channel by channel.
    x, scale, bias = make((4, 6, 48, 40), np.float32)
    delta = np.random.default_rng(8).standard_normal(x.shape).astype(np.float32)
    whole = run_forward(x, scale, bias)
    whole_back = backward(delta, x, *whole[:3], scale, bn.EPS, False)
    for c in range(x.shape[1]):
        one = (np.ascontiguousarray(x[:, c:c + 1]), scale[c:c + 1], bias[c:c + 1])
        part = run_forward(*one)
        part_back = backward(np.ascontiguousarray(delta[:, c:c + 1]), one[0], *part[:3],
                             one[1], bn.EPS, False)
        for w, p in zip(whole, part, strict=True):
            assert np.array_equal(w[:, c:c + 1] if w.ndim == 4 else w[c:c + 1], p)
        for w, p in zip(whole_back, part_back, strict=True):
            assert np.array_equal(w[:, c:c + 1] if w.ndim == 4 else w[c:c + 1], p)


def test_forward_rejects_bad_arguments():
    x, scale, bias = make(SHAPES[0], np.float32)
    c = x.shape[1]
    vec = lambda: np.zeros(c, np.float32)  # noqa: E731
    args = lambda **kw: {**dict(x=x, mean=vec(), variance=vec(), x_norm=np.empty_like(x),  # noqa: E731
                                out=np.empty_like(x), scale=scale, bias=bias,
                                rolling_mean=vec(), rolling_variance=vec()), **kw}
    step = bn.batchnorm_forward_train_step
    with pytest.raises(ArgumentError, match="two values a channel"):
        step(**args(x=np.zeros((1, c, 1, 1), np.float32)))
    with pytest.raises(ArgumentError, match="mean has 3 entries"):
        step(**args(mean=np.zeros(3, np.float32)))
    with pytest.raises(ArgumentError, match="bias must have the dtype of x"):
        step(**args(bias=bias.astype(np.float64)))
    with pytest.raises(ArgumentError, match="x_norm must have the shape and dtype of x"):
        step(**args(x_norm=np.empty((3, 4, 5, 3), np.float32)))
    with pytest.raises(ArgumentError, match="x_norm and x must not share memory"):
        step(**args(x_norm=x))
    with pytest.raises(ArgumentError, match="out and x_norm must not share memory"):
        shared = np.empty_like(x)
        step(**args(out=shared, x_norm=shared))
    buf = np.zeros(x.size + 1, np.float32)
    with pytest.raises(ArgumentError, match="out and x must not share memory"):
        step(**args(x=buf[:-1].reshape(x.shape), out=buf[1:].reshape(x.shape)))
    with pytest.raises(ArgumentError, match="rolling_mean must be writable"):
        ro = vec()
        ro.flags.writeable = False
        step(**args(rolling_mean=ro))
    with pytest.raises(ArgumentError, match="momentum must be in"):
        step(**args(), momentum=1.5)
    with pytest.raises(ArgumentError, match="eps must be finite"):
        step(**args(), eps=-1e-5)


def test_backward_rejects_bad_arguments():
    x, scale, bias = make(SHAPES[1], np.float32)
    mean, var, x_norm, _ = run_forward(x, scale, bias)
    c = x.shape[1]
    vec = lambda: np.zeros(c, np.float32)  # noqa: E731
    step = bn.batchnorm_backward_step
    delta = np.zeros_like(x)
    with pytest.raises(ArgumentError, match="x_raw must have the shape and dtype of delta"):
        step(delta, x[:4].copy(), mean, var, x_norm, scale, vec(), vec())
    with pytest.raises(ArgumentError, match="scale_grad has 5 entries"):
        step(delta, x, mean, var, x_norm, scale, np.zeros(5, np.float32), vec())
    with pytest.raises(ArgumentError, match="delta must be writable"):
        ro = delta.copy()
        ro.flags.writeable = False
        step(ro, x, mean, var, x_norm, scale, vec(), vec())
    with pytest.raises(ArgumentError, match="delta and x_norm must not share memory"):
        step(x_norm, x, mean, var, x_norm, scale, vec(), vec())
    with pytest.raises(ArgumentError, match="two values a channel"):
        step(np.zeros((1, c), np.float32), x[:1].copy(), mean, var, x_norm[:1].copy(), scale,
             vec(), vec())
    with pytest.raises(ArgumentError, match="eps must be finite"):
        step(delta, x, mean, var, x_norm, scale, vec(), vec(), float("nan"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_recomputed_normalisation_is_the_forwards_bit_for_bit(dtype):
    x, scale, bias = make(SHAPES[0], dtype)
    mean, var, x_norm, _ = run_forward(x, scale, bias)
    again = np.full_like(x_norm, np.nan)
    bn.batchnorm_normalized_step(x, mean, var, again).run()
    assert np.array_equal(again, x_norm)
    with pytest.raises(ArgumentError, match="x_norm"):
        bn.batchnorm_normalized_step(x, mean, var, x)
