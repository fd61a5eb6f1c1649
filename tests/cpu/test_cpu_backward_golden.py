"""The training steps against Darknet's own training passes (../shared/golden/darknet-v5-train).

Each test feeds dumped layer outputs and deltas to the package's steps and compares with
what Darknet dumped next: a layer's training output, or the delta its input had before its
own backward (``conv_delta_in`` and friends), which is the sum over all the input's
consumers, so those get every consumer's step. Relative L2 error at most 1e-4; most agree
bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
from grad_check import rel_l2
from shared_paths import SHARED

from darknet_metal.cpu import combine, dropout, heads, pooling, resample, route

ROOT = SHARED / "golden" / "darknet-v5-train"
TOL = 1e-4

pytestmark = pytest.mark.skipif(not (ROOT / "read_golden.py").exists(),
                                reason="no darknet-v5-train golden data")


@functools.cache
def _case(name):
    spec = importlib.util.spec_from_file_location("read_golden", ROOT / "read_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_case(str(ROOT / name))["arrays"]


def _passes(name, *needed):
    """(step, prefix) of every pass of the case that dumped all of ``needed`` in full."""
    arrays = _case(name)
    found = []
    for key in arrays:
        if key.endswith("_" + needed[0]) and "_sub" in key:
            prefix = key[: -len(needed[0])]
            if all(prefix + n in arrays for n in needed):
                found.append((int(prefix[1]), prefix))
    assert found, f"{name}: no pass dumps {needed}"
    return sorted(found)


def _get(name, key, dtype=np.float32):
    return np.ascontiguousarray(_case(name)[key], dtype)


def _maxpool_train(x, out_shape):
    out = np.empty(out_shape, x.dtype)
    indexes = np.empty(out_shape, np.int32)
    pooling.maxpool_forward_train(x, out, indexes, 2, 2, 2, 1)  # [maxpool] size=2 stride=2
    return out, indexes


# ---------------------------------------------------------------------------------------
# micro-v4-sgd: maxpool 2/2, route (groups, concat), upsample, plain shortcut

V4 = "micro-v4-sgd"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_v4_maxpool_upsample_route_shortcut(dtype):
    for _, p in _passes(V4, "L07_conv_output", "L08_max_delta", "L09_conv_output"):
        g = functools.partial(_get, V4, dtype=dtype)
        out, indexes = _maxpool_train(g(p + "L07_conv_output"), (2, 8, 16, 16))
        assert rel_l2(out, g(p + "L08_max_output")) <= TOL
        grad = np.zeros((2, 8, 32, 32), dtype)
        pooling.maxpool_backward(g(p + "L08_max_delta"), indexes, grad)
        assert rel_l2(grad, g(p + "L07_conv_delta_in")) <= TOL

        # Layer 9 feeds maxpool 10 and route 17 (layers=-1,9: its channels 8..23).
        _, indexes = _maxpool_train(g(p + "L09_conv_output"), (2, 16, 8, 8))
        grad = np.zeros((2, 16, 16, 16), dtype)
        pooling.maxpool_backward(g(p + "L10_max_delta"), indexes, grad)
        route.route_backward(g(p + "L17_route_delta"), grad, 0, 16, 8)
        assert rel_l2(grad, g(p + "L09_conv_delta_in")) <= TOL

        grad = np.zeros((2, 8, 8, 8), dtype)
        resample.upsample_backward(g(p + "L16_upsample_delta"), grad, 2)
        assert rel_l2(grad, g(p + "L15_conv_delta_in")) <= TOL

        # Layer 2 feeds route 3 (groups=2 group_id=1: its channels 4..7) and route 6
        # (layers=-1,-4: route channels 4..11).
        grad = np.zeros((2, 8, 32, 32), dtype)
        route.route_backward(g(p + "L06_route_delta"), grad, 0, 8, 4)
        route.route_backward(g(p + "L03_route_delta"), grad, 4, 4, 0)
        assert rel_l2(grad, g(p + "L02_conv_delta_in")) <= TOL

        # Shortcut 5 (from=-2, linear): layer 4 is its only consumer's input.
        x, src = g(p + "L04_conv_output"), g(p + "L03_route_output")
        out = np.empty_like(x)
        combine.shortcut_forward(x, [src], None, "none", "none", out)
        assert rel_l2(out, g(p + "L05_shortcut_output")) <= TOL
        x_grad, src_grad = np.zeros_like(x), np.zeros_like(src)
        combine.shortcut_backward(g(p + "L05_shortcut_delta"), x, [src], None, "none", "none",
                                  x_grad, [src_grad])
        assert rel_l2(x_grad, g(p + "L04_conv_delta_in")) <= TOL


# ---------------------------------------------------------------------------------------
# micro-v3-adam: maxpool size=2 stride=1 (overlapping windows, the last ones cut by the
# edge), maxpool 2/2 beside a route

V3 = "micro-v3-adam"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_v3_maxpool_stride_one_and_route(dtype):
    g = functools.partial(_get, V3, dtype=dtype)
    for _, p in _passes(V3, "L08_conv_output", "L09_max_delta", "L06_conv_output"):
        x = g(p + "L08_conv_output")
        out = np.empty(x.shape, dtype)
        indexes = np.empty(x.shape, np.int32)
        pooling.maxpool_forward_train(x, out, indexes, 2, 1, 1, 1)
        assert rel_l2(out, g(p + "L09_max_output")) <= TOL
        grad = np.zeros_like(x)
        pooling.maxpool_backward(g(p + "L09_max_delta"), indexes, grad)
        if dtype == np.float32:
            # An input can be the maximum of up to four windows: the sums, added in output
            # order, round as Darknet's.
            np.testing.assert_array_equal(grad, g(p + "L08_conv_delta_in"))
        assert rel_l2(grad, g(p + "L08_conv_delta_in")) <= TOL

        # Layer 6 feeds maxpool 7 and route 18 (layers=-1,6: its channels 16..47).
        x = g(p + "L06_conv_output")
        _, indexes = _maxpool_train(x, g(p + "L07_max_output").shape)
        grad = np.zeros_like(x)
        pooling.maxpool_backward(g(p + "L07_max_delta"), indexes, grad)
        route.route_backward(g(p + "L18_route_delta"), grad, 0, 32, 16)
        assert rel_l2(grad, g(p + "L06_conv_delta_in")) <= TOL


# ---------------------------------------------------------------------------------------
# micro-layers: reorg3d, route groups, scale_channels, sam, avgpool, maxpool, upsample,
# weighted shortcut and its weight gradient

LAYERS = "micro-layers"


def test_layers_reorg3d():
    for _, p in _passes(LAYERS, "L05_route_output", "L06_reorg3d_delta"):
        g = functools.partial(_get, LAYERS)
        out = np.zeros((2, 32, 24, 24), np.float32)
        resample.reorg_forward(g(p + "L05_route_output"), out, 2, layer="reorg3d")
        assert rel_l2(out, g(p + "L06_reorg3d_output")) <= TOL
        back = np.zeros((2, 8, 48, 48), np.float32)
        resample.reorg_backward(g(p + "L06_reorg3d_delta"), back, 2, layer="reorg3d")
        assert rel_l2(back, g(p + "L05_route_delta")) <= TOL
        # Route 5 (groups=2 group_id=1) sends it to the shortcut's channels 8..15.
        grad = np.zeros((2, 16, 48, 48), np.float32)
        route.route_backward(g(p + "L05_route_delta"), grad, 8, 8, 0)
        assert rel_l2(grad, g(p + "L04_shortcut_delta")) <= TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layers_scale_channels_sam_avgpool_route(dtype):
    for _, p in _passes(LAYERS, "L07_conv_output", "L11_scale_channels_delta"):
        g = functools.partial(_get, LAYERS, dtype=dtype)
        x_from, scale = g(p + "L07_conv_output"), g(p + "L10_conv_output")
        out = np.empty_like(x_from)
        combine.scale_channels_forward(x_from, scale, out)
        assert rel_l2(out, g(p + "L11_scale_channels_output")) <= TOL
        # Layer 7 feeds avgpool 8, scale_channels 11 (from=-4), route 12 and route 19's
        # channels 16..31.
        from_grad, scale_grad = np.zeros_like(x_from), np.zeros_like(scale)
        combine.scale_channels_backward(g(p + "L11_scale_channels_delta"), x_from, scale,
                                        from_grad, scale_grad)
        assert rel_l2(scale_grad, g(p + "L10_conv_delta_in")) <= TOL
        pooling.avgpool_backward(g(p + "L08_avg_delta"), from_grad)
        route.route_backward(g(p + "L12_route_delta"), from_grad, 0, 16, 0)
        route.route_backward(g(p + "L19_route_delta"), from_grad, 0, 16, 16)
        assert rel_l2(from_grad, g(p + "L07_conv_delta_in")) <= TOL
        pooled = np.empty((2, 16, 1, 1), dtype)
        pooling.avgpool_forward(x_from, pooled)
        assert rel_l2(pooled, g(p + "L08_avg_output")) <= TOL

        # Sam 14: from=-3 (layer 11), previous layer 13; each has only the sam downstream.
        sam_from, sam_x = g(p + "L11_scale_channels_output"), g(p + "L13_conv_output")
        out = np.empty_like(sam_x)
        combine.sam_forward(sam_from, sam_x, out)
        assert rel_l2(out, g(p + "L14_sam_output")) <= TOL
        from_grad, x_grad = np.zeros_like(sam_x), np.zeros_like(sam_x)
        combine.sam_backward(g(p + "L14_sam_delta"), sam_from, sam_x, from_grad, x_grad)
        assert rel_l2(x_grad, g(p + "L13_conv_delta_in")) <= TOL
        assert rel_l2(from_grad, g(p + "L11_scale_channels_delta")) <= TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layers_maxpool_upsample_weighted_shortcut(dtype):
    g = functools.partial(_get, LAYERS, dtype=dtype)
    for _, p in _passes(LAYERS, "L14_sam_output", "L15_max_delta", "L17_upsample_output"):
        weights = np.ascontiguousarray(
            _case(LAYERS)[f"{'init' if p[1] == '1' else 'step1'}.weights"]["L18"]["weights"],
            dtype)
        sam_out, up_out = g(p + "L14_sam_output"), g(p + "L17_upsample_output")
        out, indexes = _maxpool_train(sam_out, (2, 16, 12, 12))
        assert rel_l2(out, g(p + "L15_max_output")) <= TOL
        # Layer 14 feeds maxpool 15 and shortcut 18 (from=-4, per_feature); upsample 17
        # only the shortcut.
        sam_grad, up_grad = np.zeros_like(sam_out), np.zeros_like(up_out)
        pooling.maxpool_backward(g(p + "L15_max_delta"), indexes, sam_grad)
        weight_grad = np.zeros(2, dtype)
        combine.shortcut_backward(g(p + "L18_shortcut_delta"), up_out, [sam_out], weights,
                                  "per_feature", "none", up_grad, [sam_grad], weight_grad)
        assert rel_l2(sam_grad, g(p + "L14_sam_delta")) <= TOL
        assert rel_l2(up_grad, g(p + "L17_upsample_delta")) <= TOL
        shortcut = np.empty_like(up_out)
        combine.shortcut_forward(up_out, [sam_out], weights, "per_feature", "none", shortcut)
        assert rel_l2(shortcut, g(p + "L18_shortcut_output")) <= TOL

        grad = np.zeros((2, 16, 12, 12), dtype)
        resample.upsample_backward(g(p + "L17_upsample_delta"), grad, 2)
        assert rel_l2(grad, g(p + "L16_conv_delta_in")) <= TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layers_shortcut_weight_updates(dtype):
    # Step 1's weight_updates: the sum over both subdivisions of sum(delta * input_k), from
    # zero (the case was run on one thread, so Darknet's sums are not racy). Step 2 kept
    # only the [yolo] arrays.
    g = functools.partial(_get, LAYERS, dtype=dtype)
    passes = [p for s, p in _passes(LAYERS, "L18_shortcut_delta", "L14_sam_output",
                                    "L17_upsample_output") if s == 1]
    assert len(passes) == 2
    weights = np.ascontiguousarray(_case(LAYERS)["init.weights"]["L18"]["weights"], dtype)
    weight_grad = np.zeros(2, dtype)
    for p in passes:
        sam_out, up_out = g(p + "L14_sam_output"), g(p + "L17_upsample_output")
        combine.shortcut_backward(g(p + "L18_shortcut_delta"), up_out, [sam_out], weights,
                                  "per_feature", "none", np.zeros_like(up_out),
                                  [np.zeros_like(sam_out)], weight_grad)
    assert rel_l2(weight_grad, g("s1_L18_weight_updates")) <= TOL


# ---------------------------------------------------------------------------------------
# micro-classifier: maxpool (ties among relu zeros), avgpool, dropout, softmax, cost

CLS = "micro-classifier"


def _weights(step):
    return _case(CLS)["init.weights" if step == 1 else f"step{step - 1}.weights"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_classifier_maxpool_and_avgpool(dtype):
    g = functools.partial(_get, CLS, dtype=dtype)
    for _, p in _passes(CLS, "L02_conv_output", "L03_max_delta"):
        for src, pool, shape in (("L00_conv", "L01_max", (4, 8, 16, 16)),
                                 ("L02_conv", "L03_max", (4, 16, 8, 8))):
            x = g(p + src + "_output")
            out, indexes = _maxpool_train(x, shape)
            assert rel_l2(out, g(p + pool + "_output")) <= TOL
            grad = np.zeros_like(x)
            pooling.maxpool_backward(g(p + pool + "_delta"), indexes, grad)
            # Layer 2 is relu: half its outputs are 0, and ties go to the same element
            # as in Darknet, so the routed deltas are equal.
            np.testing.assert_array_equal(grad, g(p + src + "_delta_in"))
        grad = np.zeros((4, 16, 8, 8), dtype)
        pooling.avgpool_backward(g(p + "L05_avg_delta"), grad)
        assert rel_l2(grad, g(p + "L04_conv_delta_in")) <= TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_classifier_dropout_with_darknets_draws(dtype):
    g = functools.partial(_get, CLS, dtype=dtype)
    for step, p in _passes(CLS, "L07_dropout_rand", "L06_conn_output", "L06_conn_delta_in"):
        rand = g(p + "L07_dropout_rand")
        # Connected 6 before the dropout, recomputed in float64 from its dumped input and
        # batch statistics (Darknet dumps it only after the dropout scaled it in place).
        conn = _weights(step)["L06"]
        z = _get(CLS, p + "L05_avg_output", np.float64).reshape(4, 16) @ conn["weights"].T
        z = ((z - _case(CLS)[p + "L06_bn_mean"])
             / np.sqrt(_case(CLS)[p + "L06_bn_variance"].astype(float) + 1e-5)
             * conn["scales"] + conn["biases"])
        x = np.ascontiguousarray(np.where(z > 0, z, 0.1 * z), dtype)
        dropout.dropout_forward_train(x, rand, 0.25)
        want = g(p + "L06_conn_output").reshape(4, 12)
        assert rel_l2(x, want) <= TOL
        np.testing.assert_array_equal(x == 0, rand < 0.25)
        # Backward: what connected 8 sent (delta @ W) dropped by the same draws.
        w8 = _weights(step)["L08"]["weights"]
        delta = np.ascontiguousarray(g(p + "L08_conn_delta").reshape(4, 5) @ w8, dtype)
        dropout.dropout_backward(delta, rand, 0.25)
        assert rel_l2(delta, g(p + "L06_conn_delta_in").reshape(4, 12)) <= TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_classifier_softmax_and_cost(dtype):
    g = functools.partial(_get, CLS, dtype=dtype)
    truth = g("truth")
    for _, p in _passes(CLS, "L09_soft_output", "L09_soft_delta", "L10_cost_delta"):
        probs = np.empty((4, 5), dtype)
        heads.softmax_forward(g(p + "L08_conn_output").reshape(4, 5), probs)
        assert rel_l2(probs, g(p + "L09_soft_output")) <= TOL
        p_dumped = g(p + "L09_soft_output")
        delta, loss = np.empty_like(p_dumped), np.empty_like(p_dumped)
        heads.softmax_cross_entropy(p_dumped, truth, delta, loss)
        assert rel_l2(loss, g(p + "L09_softmax_loss")) <= TOL
        cost_delta, cost_out = np.empty_like(p_dumped), np.empty_like(p_dumped)
        heads.cost_sse(p_dumped, truth, cost_delta, cost_out)
        assert rel_l2(cost_delta, g(p + "L10_cost_delta")) <= TOL
        assert rel_l2(cost_out, g(p + "L10_cost_output")) <= TOL
        # [cost] adds scale*delta into the [softmax] delta; [softmax] adds that into
        # connected 8's delta (linear, no batch norm: its delta is unchanged by its backward).
        heads.cost_backward(cost_delta, delta, 1.0)
        assert rel_l2(delta, g(p + "L09_soft_delta")) <= TOL
        conn_delta = np.zeros((4, 5, 1, 1), dtype)
        heads.softmax_backward(delta, conn_delta)
        assert rel_l2(conn_delta, g(p + "L08_conn_delta")) <= TOL
