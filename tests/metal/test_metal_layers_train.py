"""The training kernels of the pooling, resampling, route, combining and head shaders run in
the Metal emulator against the CPU reference (``darknet_metal.cpu``): max pooling with its
argmax and every backward of the pooling, resampling, route, shortcut, scale_channels and sam
layers, and the loss heads.

Each runs under forward, reverse and random thread order at shapes leaving partial
threadgroups. Assigned outputs start as NaN; gradients start from random values (every
backward adds). Where the kernel sums in the CPU's order the results are bit-identical to
it; the shortcut weight gradient sums in two stages (pixels, then images and channels) and
agrees within ``WGRAD_RTOL`` relative L2 (``WGRAD_TERMS_RTOL`` of the sum of the products'
magnitudes where many products cancel), bit-identical across thread orders."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS

from darknet_metal.cpu import combine, heads, pooling, resample, route

#: Tolerances of the shortcut's weight gradient (summed in another order than the CPU's):
#: relative L2 on small cases, and per weight relative to the sum of its products' magnitudes.
WGRAD_RTOL = 1e-5
WGRAD_TERMS_RTOL = 2e-7


def _rand(shape, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _empty(shape):
    return np.full(shape, np.nan, np.float32)


def _rel_l2(got, want):
    return float(np.linalg.norm((got - want).ravel()) / max(np.linalg.norm(want.ravel()), 1e-30))


# ---- max pooling ---------------------------------------------------------------------------

POOLS = [  # (shape, size, stride_x, stride_y, padding, values)
    ((1, 3, 13, 13), 2, 1, 1, 1, "normal"),
    ((2, 5, 7, 7), 2, 2, 2, 1, "ties"),
    ((1, 7, 13, 13), 3, 1, 1, 2, "ties"),  # overlapping windows, many equal maxima
    ((1, 3, 13, 13), 3, 2, 2, 2, "negative"),  # padding never wins over negatives
    ((1, 3, 7, 1), 2, 1, 2, 1, "normal"),
    ((1, 5, 1, 1), 3, 1, 1, 2, "negative"),
    ((1, 3, 7, 7), 5, 3, 1, 0, "ties"),
    ((1, 3, 4, 4), 2, 1, 1, 6, "normal"),  # windows wholly outside: index -1
    ((2, 9, 61, 61), 3, 1, 1, 2, "ties"),  # 66978 inputs
]


def _pool_input(shape, values, seed):
    rng = np.random.default_rng(seed)
    if values == "ties":
        return rng.integers(-2, 2, shape).astype(np.float32)
    x = _rand(shape, seed)
    return -np.abs(x) - 0.5 if values == "negative" else x


def _pool_args(shape, size, sx, sy, padding):
    n, c, h, w = shape
    oh, ow = pooling.pool_output_hw(h, w, size, sx, sy, padding)
    return {"planes": n * c, "height": h, "width": w, "out_h": oh, "out_w": ow, "size": size,
            "stride_x": sx, "stride_y": sy, "padding": padding}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", POOLS, ids=lambda c: f"{c[0]}-s{c[1]}-{c[2]}x{c[3]}-p{c[4]}")
def test_maxpool_train_forward_and_backward(emu_runner, order, case):
    shape, size, sx, sy, padding, values = case
    x = _pool_input(shape, values, 1)
    args = _pool_args(shape, size, sx, sy, padding)
    n, c = shape[:2]
    oh, ow = args["out_h"], args["out_w"]
    want_y = np.empty((n, c, oh, ow), np.float32)
    want_idx = np.empty(want_y.shape, np.int32)
    pooling.maxpool_forward_train(x, want_y, want_idx, size, sx, sy, padding)
    y, idx = _empty(want_y.shape), np.full(want_y.shape, 12345, np.int32)
    emu_runner.run("maxpool_fwd_train_f32", args, {"x": x, "y": y, "indexes": idx},
                   {"out_w": ow, "out_h": oh, "planes": n * c}, order=order)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(idx, want_idx)
    if padding == 6:
        assert (idx == -1).any()

    delta = _rand(want_y.shape, 2)
    x_grad = _rand(shape, 3)
    want = x_grad.copy()
    pooling.maxpool_backward(delta, want_idx, want)
    emu_runner.run("maxpool_bwd_f32", args, {"delta": delta, "indexes": idx, "x_grad": x_grad},
                   {"width": shape[3], "height": shape[2], "planes": n * c}, order=order)
    np.testing.assert_array_equal(x_grad, want)


def test_maxpool_backward_gathers_overlapping_windows(emu_runner):
    # One maximum shared by all nine 3x3 stride-1 windows around it: nine deltas summed.
    x = np.zeros((1, 1, 5, 5), np.float32)
    x[0, 0, 2, 2] = 5.0
    args = _pool_args(x.shape, 3, 1, 1, 2)
    y, idx = _empty((1, 1, 5, 5)), np.zeros((1, 1, 5, 5), np.int32)
    emu_runner.run("maxpool_fwd_train_f32", args, {"x": x, "y": y, "indexes": idx},
                   {"out_w": 5, "out_h": 5, "planes": 1})
    delta = np.arange(25, dtype=np.float32).reshape(1, 1, 5, 5)
    x_grad = np.ones_like(x)
    emu_runner.run("maxpool_bwd_f32", args, {"delta": delta, "indexes": idx, "x_grad": x_grad},
                   {"width": 5, "height": 5, "planes": 1})
    assert x_grad[0, 0, 2, 2] == 1.0 + delta[0, 0, 1:4, 1:4].sum()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape,out_c,values", [
    ((2, 7, 5, 3), 3, "ties"),
    ((1, 6, 13, 13), 2, "normal"),
    ((1, 5, 1, 1), 5, "negative"),
    ((1, 3, 3, 3), 5, "normal"),  # more output channels than input: index -1
    ((2, 33, 33, 33), 11, "ties"),  # 71874 inputs
])
def test_maxpool_depth_train_forward_and_backward(emu_runner, order, shape, out_c, values):
    x = _pool_input(shape, values, 4)
    n, c, h, w = shape
    args = {"batch": n, "channels": c, "spatial": h * w, "out_channels": out_c}
    want_y = np.empty((n, out_c, h, w), np.float32)
    want_idx = np.empty(want_y.shape, np.int32)
    pooling.maxpool_depth_forward_train(x, want_y, want_idx)
    y, idx = _empty(want_y.shape), np.full(want_y.shape, 12345, np.int32)
    emu_runner.run("maxpool_depth_fwd_train_f32", args, {"x": x, "y": y, "indexes": idx},
                   {"spatial": h * w, "out_channels": out_c, "batch": n}, order=order)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(idx, want_idx)

    delta = _rand(want_y.shape, 5)
    x_grad = _rand(shape, 6)
    want = x_grad.copy()
    pooling.maxpool_backward(delta, want_idx, want)
    emu_runner.run("maxpool_depth_bwd_f32", args,
                   {"delta": delta, "indexes": idx, "x_grad": x_grad},
                   {"spatial": h * w, "channels": c, "batch": n}, order=order)
    np.testing.assert_array_equal(x_grad, want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", [(2, 7, 7, 7), (1, 65, 1, 1), (1, 3, 13, 13), (2, 35, 31, 31)])
def test_avgpool_backward(emu_runner, order, shape):
    n, c, h, w = shape
    delta = _rand((n, c, 1, 1), 7)
    x_grad = _rand(shape, 8)
    want = x_grad.copy()
    pooling.avgpool_backward(delta, want)
    emu_runner.run("avgpool_bwd_f32", {"planes": n * c, "spatial": h * w},
                   {"delta": delta, "x_grad": x_grad}, {"spatial": h * w, "planes": n * c},
                   order=order)
    np.testing.assert_array_equal(x_grad, want)


# ---- upsample, reorg, route ----------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape,stride,scale", [
    ((1, 3, 13, 13), 2, 1.0),
    ((2, 5, 7, 1), 3, 0.5),
    ((1, 7, 1, 1), 2, 1.0),
    ((2, 9, 61, 61), 2, 0.75),  # 66978 inputs
    ((1, 3, 6, 4), -2, 1.0),
    ((2, 5, 7, 5), -2, 0.25),  # sizes s does not divide: the flat-index reads
    ((1, 3, 9, 9), -3, 2.0),
])
def test_upsample_backward(emu_runner, order, shape, stride, scale):
    n, c, h, w = shape
    out_shape = resample.upsample_output_shape(shape, stride)
    oh, ow = out_shape[2:]
    delta = _rand(out_shape, 9)
    x_grad = _rand(shape, 10)
    want = x_grad.copy()
    resample.upsample_backward(delta, want, stride, scale)
    cols, rows = (w, h) if stride > 0 else (ow, oh)
    emu_runner.run(
        "upsample_bwd_f32",
        {"planes": n * c, "height": h, "width": w, "out_h": oh, "out_w": ow, "stride": stride,
         "scale": scale},
        {"delta": delta, "x_grad": x_grad},
        {"cols": cols, "rows": rows, "planes": n * c},
        order=order,
    )
    np.testing.assert_array_equal(x_grad, want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape,stride,reverse,layer", [
    ((1, 4, 6, 6), 2, False, "reorg"),
    ((2, 9, 6, 3), 3, False, "reorg"),
    ((1, 8, 3, 5), 2, True, "reorg"),
    ((2, 4, 1, 1), 2, True, "reorg"),
    ((1, 3, 6, 10), 2, False, "reorg3d"),
    ((2, 2, 9, 3), 3, False, "reorg3d"),
    ((1, 16, 3, 5), 2, True, "reorg3d"),
    ((2, 16, 46, 46), 2, False, "reorg"),  # 67712 elements
])
def test_reorg_backward(emu_runner, order, shape, stride, reverse, layer):
    out_shape = resample.reorg_output_shape(shape, stride, reverse)
    delta = _rand(out_shape, 11)
    x_grad = _rand(shape, 12)
    want = x_grad.copy()
    resample.reorg_backward(delta, want, stride, reverse, layer)
    # The forward's dims: the input's for [reorg], the output's for [reorg3d].
    n, sc, sh, sw = out_shape if layer == "reorg3d" else shape
    emu_runner.run(
        "reorg_bwd_f32",
        {"batch": n, "width": sw, "height": sh, "channels": sc, "stride": stride,
         "reverse": int(reverse)},
        {"delta": delta, "x_grad": x_grad},
        {"width": sw, "height": sh, "slices": n * sc},
        order=order,
    )
    np.testing.assert_array_equal(x_grad, want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("groups,group_id", [(1, 0), (2, 1), (2, 0)])
def test_route_backward(emu_runner, order, groups, group_id):
    n, h, w = 2, 7, 5
    grads = [_rand((n, 6, h, w), 13), _rand((n, 10, h, w), 14)]
    widths = [g.shape[1] // groups for g in grads]
    delta = _rand((n, sum(widths), h, w), 15)
    offset = 0
    for g, wd in zip(grads, widths, strict=True):
        want = g.copy()
        route.route_backward(delta, want, group_id * wd, wd, offset)
        emu_runner.run(
            "route_bwd_f32",
            {"batch": n, "spatial": h * w, "channels": wd, "src_channels": g.shape[1],
             "src_offset": group_id * wd, "dst_channels": delta.shape[1], "dst_offset": offset},
            {"delta": delta, "x_grad": g},
            {"spatial": h * w, "channels": wd, "batch": n},
            order=order,
        )
        np.testing.assert_array_equal(g, want)
        offset += wd


# ---- shortcut ------------------------------------------------------------------------------

NORMS = ("none", "relu", "softmax")


def _shortcut_backward_on_emu(runner, delta, x, sources, weights, wtype, norm, x_grad,
                              source_grads, weight_grad, order):
    """The host sequence of a shortcut backward: the table, each input's delta (x first),
    then, weighted, each input's weight gradient and the normalisation's derivative."""
    n, c, h, w = x.shape
    n_inputs = len(sources) + 1
    weighted = wtype != "none"
    per_channel = int(wtype == "per_channel")
    table = _empty((n_inputs, c))
    if weighted:
        runner.run("shortcut_weights_fwd_f32",
                   {"n_inputs": n_inputs, "channels": c, "per_channel": per_channel,
                    "normalization": NORMS.index(norm)},
                   {"weights": weights, "table": table}, {"channels": c}, order=order)
    inputs = [(x, x_grad), *zip(sources, source_grads, strict=True)]
    for row, (inp, grad) in enumerate(inputs):
        runner.run("shortcut_bwd_f32",
                   {"batch": n, "channels": c, "spatial": h * w, "src_channels": inp.shape[1],
                    "row": row, "weighted": int(weighted)},
                   {"delta": delta, "table": table if weighted else None, "grad": grad},
                   {"spatial": h * w, "channels": min(c, inp.shape[1]), "batch": n},
                   order=order)
    if not weighted:
        return
    # Normalised, the gradient of the normalised weights goes to a scratch (assigned, row
    # by row), then through the normalisation into weight_grad.
    acc = weight_grad if norm == "none" else _empty(weights.shape)
    partial = _empty(n * c)
    for row, (inp, _) in enumerate(inputs):
        bwd = {"batch": n, "channels": c, "spatial": h * w, "src_channels": inp.shape[1],
               "row": row, "weighted": 1}
        runner.run("shortcut_bwd_dot_f32", bwd,
                   {"delta": delta, "input": inp, "partial": partial},
                   {"channels": min(c, inp.shape[1]), "batch": n}, order=order)
        runner.run("shortcut_bwd_weights_f32",
                   {"batch": n, "channels": c, "src_channels": inp.shape[1], "row": row,
                    "per_channel": per_channel, "accumulate": int(norm == "none")},
                   {"partial": partial, "acc": acc}, {"columns": c if per_channel else 1},
                   order=order)
    if norm != "none":
        runner.run("shortcut_bwd_norm_f32",
                   {"n_inputs": n_inputs, "channels": c, "per_channel": per_channel,
                    "normalization": NORMS.index(norm)},
                   {"weights": weights, "g": acc, "weight_grad": weight_grad},
                   {"columns": c if per_channel else 1}, order=order)


SHORTCUT_WEIGHTS = [("none", "none")] + [
    (t, nm) for t in ("per_feature", "per_channel") for nm in NORMS
]


def _shortcut_case(runner, wtype, norm, order, *, shape=(2, 5, 7, 3), twice=False,
                   weight_scale=1.0, seed=20):
    n, c, h, w = shape
    x = _rand(shape, seed)
    # Fewer and more channels than x; `twice`: x's producer is also the first source.
    sources = [x if twice else _rand((n, 3, h, w), seed + 1), _rand((n, 7, h, w), seed + 2)]
    delta = _rand(shape, seed + 3)
    weights = weight_grad = None
    if wtype != "none":
        count = 3 * (c if wtype == "per_channel" else 1)
        weights = _rand(count, seed + 4, weight_scale)
        weight_grad = _rand(count, seed + 5)
    x_grad = _rand(shape, seed + 6)
    source_grads = [x_grad if twice else _rand(sources[0].shape, seed + 7),
                    _rand(sources[1].shape, seed + 8)]
    want_x = x_grad.copy()
    want_src = [want_x if twice else source_grads[0].copy(), source_grads[1].copy()]
    want_w = None if weight_grad is None else weight_grad.copy()
    combine.shortcut_backward(delta, x, sources, weights, wtype, norm, want_x, want_src, want_w)
    _shortcut_backward_on_emu(runner, delta, x, sources, weights, wtype, norm, x_grad,
                              source_grads, weight_grad, order)
    return (x_grad, source_grads, weight_grad), (want_x, want_src, want_w)


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("wtype,norm", SHORTCUT_WEIGHTS)
def test_shortcut_backward(emu_runner, wtype, norm, twice):
    results = []
    for order in ORDERS:
        got, want = _shortcut_case(emu_runner, wtype, norm, order, twice=twice)
        (x_grad, source_grads, weight_grad), (want_x, want_src, want_w) = got, want
        if wtype == "none":
            np.testing.assert_array_equal(x_grad, want_x)
            for g, wg in zip(source_grads, want_src, strict=True):
                np.testing.assert_array_equal(g, wg)
        else:
            # The table's exp may differ from the CPU's by an ulp.
            np.testing.assert_allclose(x_grad, want_x, rtol=1e-5, atol=1e-5)
            for g, wg in zip(source_grads, want_src, strict=True):
                np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-5)
            assert _rel_l2(weight_grad, want_w) < WGRAD_RTOL, (weight_grad, want_w)
        results.append((x_grad, *source_grads, weight_grad))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a, b)


def test_shortcut_weight_gradient_large(emu_runner):
    # 2 x 9 x 61 x 61 = 66978 products per input summed into one weight each: with that much
    # cancellation the CPU's serial sum and the two-stage one differ by ~1e-4 relative to the
    # result, but both stay within 1e-7 of the sum of the products' magnitudes.
    shape, seed = (2, 9, 61, 61), 20
    got, want = _shortcut_case(emu_runner, "per_feature", "none", "random", shape=shape,
                               seed=seed)
    n, c, h, w = shape
    delta = _rand(shape, seed + 3).astype(np.float64)
    inputs = (_rand(shape, seed), _rand((n, 3, h, w), seed + 1), _rand((n, 7, h, w), seed + 2))
    magnitude = np.abs(_rand(3, seed + 5)) + [
        np.abs(delta[:, : v.shape[1]] * v[:, :c]).sum() for v in inputs
    ]
    assert (np.abs(got[2] - want[2]) < WGRAD_TERMS_RTOL * magnitude).all()
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("norm", ["relu", "softmax"])
def test_shortcut_saturating_weights(any_math_runner, norm):
    # Weights of +-1e4: softmax's exp underflows to 0 without overflowing anywhere.
    got, want = _shortcut_case(any_math_runner, "per_channel", norm, "forward",
                               weight_scale=1e4, seed=40)
    for g, wg in ((got[0], want[0]), *zip(got[1], want[1], strict=True), (got[2], want[2])):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-4)


# ---- scale_channels, sam -------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("scale_wh", [False, True])
@pytest.mark.parametrize("shape", [(2, 7, 5, 3), (1, 5, 1, 1), (2, 37, 31, 31)])
def test_scale_channels_backward(emu_runner, order, scale_wh, shape):
    n, c, h, w = shape
    x_from = _rand(shape, 30)
    scale = _rand((n, 1, h, w) if scale_wh else (n, c, 1, 1), 31)
    delta = _rand(shape, 32)
    x_from_grad, scale_grad = _rand(shape, 33), _rand(scale.shape, 34)
    want_x, want_s = x_from_grad.copy(), scale_grad.copy()
    combine.scale_channels_backward(delta, x_from, scale, want_x, want_s, scale_wh)
    args = {"batch": n, "channels": c, "spatial": h * w, "scale_wh": int(scale_wh)}
    emu_runner.run("scale_channels_bwd_f32", args,
                   {"delta": delta, "scale": scale, "x_from_grad": x_from_grad},
                   {"spatial": h * w, "channels": c, "batch": n}, order=order)
    emu_runner.run("scale_channels_bwd_scale_f32", args,
                   {"delta": delta, "x_from": x_from, "scale_grad": scale_grad},
                   {"factors": scale.size}, order=order)
    np.testing.assert_array_equal(x_from_grad, want_x)
    np.testing.assert_array_equal(scale_grad, want_s)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", [(1, 5, 7, 7), (2, 35, 31, 31)])
@pytest.mark.parametrize("same_grad", [False, True])
def test_sam_backward(emu_runner, order, shape, same_grad):
    x_from, x, delta = _rand(shape, 35), _rand(shape, 36), _rand(shape, 37)
    x_grad = _rand(shape, 38)
    x_from_grad = x_grad if same_grad else _rand(shape, 39)
    want_x = x_grad.copy()
    want_from = want_x if same_grad else x_from_grad.copy()
    combine.sam_backward(delta, x_from, x, want_from, want_x)
    emu_runner.run("sam_bwd_f32", {"n": x.size},
                   {"delta": delta, "x_from": x_from, "x": x, "x_from_grad": x_from_grad,
                    "x_grad": x_grad}, {"n": x.size}, order=order)
    np.testing.assert_array_equal(x_grad, want_x)
    np.testing.assert_array_equal(x_from_grad, want_from)


# ---- loss heads ----------------------------------------------------------------------------


def _loss_inputs(n, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n // 10, 10)).astype(np.float32)
    p = np.empty_like(logits)
    heads.softmax_forward(logits, p)
    truth = np.zeros_like(p)
    truth[np.arange(len(p)), rng.integers(0, 10, len(p))] = 1.0
    truth[::7] *= 0.5  # soft labels too
    return p, truth


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n", [7 * 10, 6571 * 10])
def test_loss_heads(emu_runner, order, n):
    p, truth = _loss_inputs(n, 50)
    for name, cpu in (("softmax_fwd_xent_f32", heads.softmax_cross_entropy),
                      ("cost_fwd_sse_f32", heads.cost_sse)):
        want_d, want_l = np.empty_like(p), np.empty_like(p)
        cpu(p, truth, want_d, want_l)
        delta, loss = _empty(p.shape), _empty(p.shape)
        emu_runner.run(name, {"n": p.size},
                       {"pred": p, "truth": truth, "delta": delta, "loss": loss},
                       {"n": p.size}, order=order)
        np.testing.assert_array_equal(delta, want_d, err_msg=name)
        np.testing.assert_allclose(loss, want_l, rtol=1e-6, atol=0, err_msg=name)


def test_loss_heads_extreme_inputs(any_math_runner):
    # Cross-entropy on probabilities down to 1e-30; squared error on values of +-1e4.
    cases = (
        ("softmax_fwd_xent_f32", heads.softmax_cross_entropy,
         [1e-30, 1.0, 0.5, 3e-8, 0.25, 1e-37], [1.0, 1.0, 0.0, 1.0, 0.0, 0.5]),
        ("cost_fwd_sse_f32", heads.cost_sse,
         [1e4, -1e4, 0.5, 3e-8, -0.0, 1e4], [-1e4, 1e4, 0.0, 1.0, 0.0, 1e4]),
    )
    for name, cpu, pred, truth in cases:
        pred = np.array([pred], np.float32)
        truth = np.array([truth], np.float32)
        want_d, want_l = np.empty_like(pred), np.empty_like(pred)
        cpu(pred, truth, want_d, want_l)
        delta, loss = _empty(pred.shape), _empty(pred.shape)
        any_math_runner.run(name, {"n": pred.size},
                            {"pred": pred, "truth": truth, "delta": delta, "loss": loss},
                            {"n": pred.size})
        assert np.isfinite(loss).all() and np.isfinite(delta).all(), name
        np.testing.assert_array_equal(delta, want_d, err_msg=name)
        np.testing.assert_allclose(loss, want_l, rtol=1e-6, err_msg=name)
