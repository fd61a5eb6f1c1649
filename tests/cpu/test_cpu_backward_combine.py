"""Backward steps of [shortcut], [scale_channels] and [sam].

Every gradient (into x, each source, the weights) is checked against float64 central finite
differences of ``L = sum(forward(...) * R)`` with ``delta = R``, added onto random contents
(the kernels accumulate). The relu and softmax weight normalisations get their exact
derivative, which Darknet's CPU backward leaves out; the finite differences are what tells.
"""

from __future__ import annotations

import numpy as np
import pytest
from grad_check import assert_raises_naming, numeric_grad, rel_err

from darknet_metal.cpu import combine
from darknet_metal.errors import ArgumentError, ArgumentTypeError

DTYPES = [np.float32, np.float64]


def _rand(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _weights(wtype, norm, n_inputs, c, seed, dtype=np.float64):
    if wtype == "none":
        return None
    size = n_inputs * (c if wtype == "per_channel" else 1)
    w = np.random.default_rng(seed).uniform(0.2, 1.5, size)
    if norm == "relu":
        # Some below zero (no gradient), none near the kink.
        w *= np.where(np.arange(size) % 3 == 2, -1, 1)
    elif norm == "softmax":
        w = w * 2 - 1.5  # distinct values, so the maximum does not switch
    return w.astype(dtype)


class Shortcut:
    """A shortcut's inputs, its forward as a function of them, and its backward."""

    def __init__(self, wtype, norm, source_channels, seed=0, dtype=np.float64, c=4):
        self.wtype, self.norm = wtype, norm
        self.x = _rand((2, c, 3, 5), seed, dtype)
        self.sources = [_rand((2, ck, 3, 5), seed + 1 + k, dtype)
                        for k, ck in enumerate(source_channels)]
        self.weights = _weights(wtype, norm, len(source_channels) + 1, c, seed + 50, dtype)
        self.r = _rand(self.x.shape, seed + 60, dtype)

    def loss(self):
        out = np.empty_like(self.x)
        combine.shortcut_forward(self.x, self.sources, self.weights, self.wtype, self.norm, out)
        return float((out * self.r).sum())

    def backward(self, seed=70):
        """(x_grad, source_grads, weight_grad) increments over random starting contents."""
        starts = [_rand(a.shape, seed + i, self.x.dtype)
                  for i, a in enumerate([self.x, *self.sources])]
        grads = [s.copy() for s in starts]
        w_start = None if self.weights is None else _rand(self.weights.shape, seed - 1,
                                                          self.x.dtype)
        w_grad = None if w_start is None else w_start.copy()
        steps = combine.shortcut_backward_step(self.r, self.x, self.sources, self.weights,
                                               self.wtype, self.norm, grads[0], grads[1:],
                                               w_grad)
        for step in steps:
            step.run()
        d = [g - s for g, s in zip(grads, starts, strict=True)]
        return d[0], d[1:], None if w_grad is None else w_grad - w_start, steps


CONFIGS = [("none", "none")] + [(t, n) for t in ("per_feature", "per_channel")
                                for n in ("none", "relu", "softmax")]
SOURCE_CHANNELS = [[4], [2, 6], [4, 3, 5, 1, 4]]


@pytest.mark.parametrize("channels", SOURCE_CHANNELS, ids=["one", "two_mixed", "five"])
@pytest.mark.parametrize("wtype,norm", CONFIGS)
def test_shortcut_backward_matches_finite_differences(wtype, norm, channels):
    s = Shortcut(wtype, norm, channels)
    x_grad, source_grads, weight_grad, steps = s.backward()
    assert rel_err(x_grad, numeric_grad(s.loss, s.x)) < 1e-6
    for src, grad in zip(s.sources, source_grads, strict=True):
        assert rel_err(grad, numeric_grad(s.loss, src)) < 1e-6
    if wtype != "none":
        assert rel_err(weight_grad, numeric_grad(s.loss, s.weights)) < 1e-6
    # Weighted, the first step has room for one source (and its delta), the others for
    # two; unweighted, six deltas fit the first.
    n = len(channels)
    assert len(steps) == (1 + n // 2 if wtype != "none" else 1)


@pytest.mark.parametrize("wtype,norm", CONFIGS)
def test_shortcut_backward_darknet_formulas(wtype, norm):
    # delta * w_k into each input's first min(C, C_k) channels; without normalisation the
    # weight gradient is Darknet's sum(delta * input_k).
    s = Shortcut(wtype, norm, [2, 6])
    x_grad, (g1, g2), weight_grad, _ = s.backward()
    n_inputs, c = 3, 4
    if wtype == "none":
        w = np.ones((n_inputs, c))
    else:
        raw = s.weights.reshape(n_inputs, -1) * np.ones((1, c))
        if norm == "relu":
            w = np.maximum(raw, 0) / (1e-4 + np.maximum(raw, 0).sum(0))
        elif norm == "softmax":
            e = np.exp(raw - raw.max(0))
            w = e / (1e-4 + e.sum(0))
        else:
            w = raw
    col = (slice(None), slice(None), None, None)
    np.testing.assert_allclose(x_grad, s.r * w[0][col[1:]], rtol=1e-12)
    np.testing.assert_allclose(g1, s.r[:, :2] * w[1, :2][col[1:]], rtol=1e-12)
    np.testing.assert_allclose(g2[:, :4], s.r * w[2][col[1:]], rtol=1e-12)
    assert not g2[:, 4:].any()
    if norm == "none" and wtype != "none":
        sums = np.stack([(s.r * s.x).sum((0, 2, 3)),
                         np.pad((s.r[:, :2] * s.sources[0]).sum((0, 2, 3)), (0, 2)),
                         (s.r * s.sources[1][:, :4]).sum((0, 2, 3))])
        want = sums if wtype == "per_channel" else sums.sum(1)
        np.testing.assert_allclose(weight_grad, want.reshape(-1), rtol=1e-12)


@pytest.mark.parametrize("wtype,norm", CONFIGS)
def test_shortcut_backward_float32_agrees_with_float64(wtype, norm):
    g64 = Shortcut(wtype, norm, [2, 6, 4]).backward()
    g32 = Shortcut(wtype, norm, [2, 6, 4], dtype=np.float32).backward()
    for a64, a32 in zip([g64[0], *g64[1], g64[2]], [g32[0], *g32[1], g32[2]], strict=True):
        if a64 is not None:
            assert a32.dtype == np.float32
            assert rel_err(a32, a64) < 1e-5


@pytest.mark.parametrize("wtype,norm", [("none", "none"), ("per_channel", "none")])
def test_shortcut_backward_with_x_also_a_source(wtype, norm):
    # [shortcut] from=-1: x feeds the layer twice and both deltas are one array.
    s = Shortcut(wtype, norm, [4])
    s.sources = [s.x]
    x_grad = np.zeros_like(s.x)
    w_grad = None if s.weights is None else np.zeros_like(s.weights)
    combine.shortcut_backward(s.r, s.x, s.sources, s.weights, wtype, norm, x_grad, [x_grad],
                              w_grad)
    assert rel_err(x_grad, numeric_grad(s.loss, s.x)) < 1e-6
    if w_grad is not None:
        assert rel_err(w_grad, numeric_grad(s.loss, s.weights)) < 1e-6


def test_shortcut_backward_step_kinds_and_weight_changes():
    s = Shortcut("per_feature", "softmax", [4, 4, 4])
    *_, steps = s.backward()
    assert [st.kind for st in steps] == ["shortcut_backward", "shortcut_backward_add"]
    # The steps read the weights on every run.
    s.weights[:] = [0.3, -0.2, 0.9, 0.1]
    again = s.backward()
    assert rel_err(again[2], numeric_grad(s.loss, s.weights)) < 1e-6


def _sc_args(**change):
    x = np.zeros((1, 2, 3, 3))
    args = {"delta": np.zeros_like(x), "x": x, "sources": [np.zeros((1, 3, 3, 3))],
            "weights": np.ones(2), "weights_type": "per_feature",
            "weights_normalization": "relu", "x_grad": np.zeros_like(x),
            "source_grads": [np.zeros((1, 3, 3, 3))], "weight_grad": np.zeros(2)}
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, words", [
    ({"source_grads": np.zeros((1, 3, 3, 3))}, ArgumentTypeError, ["source_grads", "list"]),
    ({"source_grads": []}, ArgumentError, ["source_grads", "one array per source (1)"]),
    ({"source_grads": [np.zeros((1, 2, 3, 3))]}, ArgumentError,
     ["source_grads[0]", "sources[0]"]),
    ({"weight_grad": None}, ArgumentTypeError, ["weight_grad", "per_feature"]),
    ({"weight_grad": np.zeros(3)}, ArgumentError, ["weight_grad", "2 elements"]),
    ({"weights_type": "none", "weights": None}, ArgumentError, ["weight_grad must be None"]),
    ({"delta": np.zeros((1, 2, 3, 4))}, ArgumentError, ["delta", "x"]),
    ({"x_grad": np.zeros((1, 2, 3, 3), np.float32)}, ArgumentError, ["x_grad", "float32"]),
    ({"weights_normalization": "tanh"}, ArgumentError, ["weights_normalization", "tanh"]),
])
def test_shortcut_backward_bad_arguments(change, error, words):
    assert_raises_naming(lambda: combine.shortcut_backward_step(**_sc_args(**change)), error,
                         words)


def test_shortcut_backward_refuses_shared_memory():
    args = _sc_args()
    args["x_grad"] = args["delta"]
    with pytest.raises(ArgumentError, match="x_grad must not share memory with delta"):
        combine.shortcut_backward_step(**args)
    args = _sc_args()
    args["weight_grad"] = args["weights"]
    with pytest.raises(ArgumentError, match="weight_grad must not share memory with weights"):
        combine.shortcut_backward_step(**args)
    args = _sc_args()
    args["source_grads"] = args["sources"]
    with pytest.raises(ArgumentError,
                       match=r"source_grads\[0\] must not share memory with sources\[0\]"):
        combine.shortcut_backward_step(**args)


# ---------------------------------------------------------------------------------------
# scale_channels and sam


@pytest.mark.parametrize("scale_wh", [False, True])
def test_scale_channels_backward_matches_finite_differences(scale_wh):
    x_from = _rand((2, 3, 4, 5), 1)
    scale = _rand((2, 1, 4, 5) if scale_wh else (2, 3, 1, 1), 2)
    r = _rand(x_from.shape, 3)

    def loss():
        out = np.empty_like(x_from)
        combine.scale_channels_forward(x_from, scale, out, scale_wh)
        return float((out * r).sum())

    from_start, scale_start = _rand(x_from.shape, 4), _rand(scale.shape, 5)
    from_grad, scale_grad = from_start.copy(), scale_start.copy()
    combine.scale_channels_backward(r, x_from, scale, from_grad, scale_grad, scale_wh)
    assert rel_err(from_grad - from_start, numeric_grad(loss, x_from)) < 1e-6
    assert rel_err(scale_grad - scale_start, numeric_grad(loss, scale)) < 1e-6

    g32 = [np.zeros(from_grad.shape, np.float32), np.zeros(scale.shape, np.float32)]
    combine.scale_channels_backward(r.astype(np.float32), x_from.astype(np.float32),
                                    scale.astype(np.float32), *g32, scale_wh)
    assert rel_err(g32[0], from_grad - from_start) < 1e-6
    assert rel_err(g32[1], scale_grad - scale_start) < 1e-5


def test_sam_backward_matches_finite_differences():
    x_from, x, r = _rand((2, 3, 4, 5), 6), _rand((2, 3, 4, 5), 7), _rand((2, 3, 4, 5), 8)

    def loss():
        out = np.empty_like(x)
        combine.sam_forward(x_from, x, out)
        return float((out * r).sum())

    from_start, x_start = _rand(x.shape, 9), _rand(x.shape, 10)
    from_grad, x_grad = from_start.copy(), x_start.copy()
    combine.sam_backward(r, x_from, x, from_grad, x_grad)
    assert rel_err(from_grad - from_start, numeric_grad(loss, x_from)) < 1e-6
    assert rel_err(x_grad - x_start, numeric_grad(loss, x)) < 1e-6
    # float32: Darknet's products, exactly.
    f = [a.astype(np.float32) for a in (r, x_from, x)]
    g = [np.zeros(x.shape, np.float32) for _ in range(2)]
    combine.sam_backward(*f, *g)
    np.testing.assert_array_equal(g[0], f[2] * f[0])
    np.testing.assert_array_equal(g[1], f[0] * f[1])


def test_sam_backward_with_one_input_twice():
    # [sam] whose from= layer is the previous one: out = x*x, both deltas one array.
    x, r = _rand((1, 2, 3, 3), 11), _rand((1, 2, 3, 3), 12)
    grad = np.zeros_like(x)
    combine.sam_backward(r, x, x, grad, grad)
    np.testing.assert_allclose(grad, 2 * x * r, rtol=1e-14)


@pytest.mark.parametrize("call, error, words", [
    (lambda z: combine.scale_channels_backward_step(z(2, 3, 4, 4), z(2, 3, 4, 4), z(2, 3, 1, 1),
                                                    z(2, 3, 4, 4), z(2, 1, 4, 4)),
     ArgumentError, ["scale_grad", "(2, 3, 1, 1)"]),
    (lambda z: combine.scale_channels_backward_step(z(2, 3, 4, 4), z(2, 3, 4, 4), z(2, 3, 1, 1),
                                                    z(2, 3, 4, 4), z(2, 3, 1, 1), True),
     ArgumentError, ["scale", "(2, 1, 4, 4)", "scale_wh"]),
    (lambda z: combine.scale_channels_backward_step(z(2, 3, 4, 5), z(2, 3, 4, 4), z(2, 3, 1, 1),
                                                    z(2, 3, 4, 4), z(2, 3, 1, 1)),
     ArgumentError, ["delta", "x_from"]),
    (lambda z: combine.sam_backward_step(z(2, 3, 4, 4), z(2, 3, 4, 4), z(2, 3, 4, 4),
                                         z(2, 3, 4, 4), [1.0]),
     ArgumentTypeError, ["x_grad", "list"]),
    (lambda z: combine.sam_backward_step(z(2, 3, 4, 4), z(2, 3, 4, 4), z(2, 3, 4, 4),
                                         z(2, 3, 4, 3), z(2, 3, 4, 4)),
     ArgumentError, ["x_from_grad", "x_from"]),
])
def test_scale_channels_and_sam_bad_arguments(call, error, words):
    assert_raises_naming(lambda: call(lambda *shape: np.zeros(shape)), error, words)


def test_sam_backward_refuses_a_gradient_sharing_an_input():
    x = np.zeros((1, 2, 3, 3))
    with pytest.raises(ArgumentError, match="x_grad must not share memory with x"):
        combine.sam_backward_step(np.zeros_like(x), np.zeros_like(x), x, np.zeros_like(x), x)
