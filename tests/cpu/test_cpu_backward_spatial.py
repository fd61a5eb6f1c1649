"""Training forward and backward steps of the spatial layers: [maxpool] (and maxpool_depth),
[avgpool], [upsample] (both modes), [reorg] (both directions) and [route].

Each backward is checked against float64 central finite differences of
``L = sum(forward(x) * R)`` with ``delta = R`` (the maps are linear, or piecewise linear
with inputs chosen away from ties), for accumulation into what x_grad held, for float32
against float64, and for its argument errors.
"""

from __future__ import annotations

import numpy as np
import pytest
from grad_check import assert_raises_naming, distinct, numeric_grad, rel_err

from darknet_metal.cpu import executor, pooling, resample, route
from darknet_metal.errors import ArgumentError, ArgumentTypeError

FLT_MAX = float(np.finfo(np.float32).max)
DTYPES = [np.float32, np.float64]


def _rand(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _check_linear_backward(forward, backward, x, out_shape, seed, tol=1e-6):
    """FD of sum(forward(x) * R) against backward(R, x_grad) added onto a random x_grad."""
    r = _rand(out_shape, seed)

    def loss():
        out = np.zeros(out_shape)
        forward(x, out)
        return float((out * r).sum())

    want = numeric_grad(loss, x)
    start = _rand(x.shape, seed + 1)
    x_grad = start.copy()
    backward(r, x_grad)
    assert rel_err(x_grad - start, want) < tol
    return x_grad - start


# ---------------------------------------------------------------------------------------
# maxpool

GEOMETRIES = [  # size, stride_x, stride_y, padding
    (2, 2, 2, 1), (3, 1, 1, 2), (3, 2, 1, 2), (2, 1, 1, 1), (5, 3, 2, 4), (1, 1, 1, 0),
    (2, 1, 2, 0), (3, 2, 3, 0),
]


def _maxpool_train(x, size, sx, sy, padding):
    oh, ow = pooling.pool_output_hw(x.shape[2], x.shape[3], size, sx, sy, padding)
    out = np.empty(x.shape[:2] + (oh, ow), x.dtype)
    indexes = np.empty(out.shape, np.int32)
    pooling.maxpool_forward_train(x, out, indexes, size, sx, sy, padding)
    return out, indexes


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_maxpool_train_forward_matches_inference_and_records_argmax(geometry, dtype):
    x = _rand((2, 3, 7, 5), 1, dtype)
    out, indexes = _maxpool_train(x, *geometry)
    want = np.empty_like(out)
    pooling.maxpool_forward(x, want, *geometry)
    np.testing.assert_array_equal(out, want)
    valid = indexes >= 0
    np.testing.assert_array_equal(x.reshape(-1)[indexes[valid]], out[valid])
    # Each index lies in its own plane.
    planes = np.arange(6).reshape(2, 3, 1, 1) * 35
    assert np.all((indexes[valid] >= np.broadcast_to(planes, out.shape)[valid])
                  & (indexes[valid] < np.broadcast_to(planes, out.shape)[valid] + 35))


@pytest.mark.parametrize("geometry", GEOMETRIES + [(2, 1, 1, 6)])
def test_maxpool_backward_matches_finite_differences(geometry):
    x = distinct((2, 3, 7, 5), 2)
    out, indexes = _maxpool_train(x, *geometry)
    r = _rand(out.shape, 3)
    r[indexes < 0] = 0  # -FLT_MAX outputs: constant, and too large to difference

    def loss():
        o = np.empty_like(out)
        pooling.maxpool_forward(x, o, *geometry)
        return float((np.where(indexes < 0, 0, o) * r).sum())

    want = numeric_grad(loss, x)
    start = _rand(x.shape, 4)
    x_grad = start.copy()
    pooling.maxpool_backward(r, indexes, x_grad)
    assert rel_err(x_grad - start, want) < 1e-6


def test_maxpool_window_outside_the_image_gets_index_minus_one():
    # padding 6 puts the first three rows and columns of windows wholly outside.
    x = _rand((1, 2, 4, 4), 5)
    out, indexes = _maxpool_train(x, 2, 1, 1, 6)
    outside = np.zeros(out.shape, bool)
    outside[:, :, :2, :] = outside[:, :, :, :2] = True
    outside[:, :, -2:, :] = outside[:, :, :, -2:] = True
    np.testing.assert_array_equal(indexes < 0, outside)
    assert np.all(out[outside] == -FLT_MAX)
    x_grad = np.zeros_like(x)
    pooling.maxpool_backward(np.ones_like(out), indexes, x_grad)
    assert x_grad.sum() == (~outside).sum()


def test_maxpool_ties_take_the_first_element_in_window_order():
    # Darknet's strict ">" keeps the first maximum, rows before columns.
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 0] = x[0, 0, 0, 1] = 1.0  # tie in window (0, 0): (0, 1) comes first
    out, indexes = _maxpool_train(x, 2, 2, 2, 0)
    assert indexes[0, 0, 0, 0] == 1
    assert indexes[0, 0, 0, 1] == 2 and indexes[0, 0, 1, 0] == 8  # all-zero windows
    assert indexes[0, 0, 1, 1] == 10


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_maxpool_float32_agrees_with_float64(geometry):
    x64 = distinct((2, 3, 7, 5), 6, spacing=0.01)
    out64, idx64 = _maxpool_train(x64, *geometry)
    out32, idx32 = _maxpool_train(x64.astype(np.float32), *geometry)
    np.testing.assert_array_equal(idx32, idx64)
    r = _rand(out64.shape, 7)
    g64 = np.zeros_like(x64)
    g32 = np.zeros(x64.shape, np.float32)
    pooling.maxpool_backward(r, idx64, g64)
    pooling.maxpool_backward(r.astype(np.float32), idx32, g32)
    np.testing.assert_allclose(g32, g64, rtol=1e-6, atol=1e-6)


def test_maxpool_backward_skips_indexes_outside_x_grad():
    delta = np.ones((1, 1, 1, 4))
    indexes = np.array([-1, 3, 16, 2**31 - 1], np.int32).reshape(1, 1, 1, 4)
    x_grad = np.zeros((1, 1, 4, 4))
    pooling.maxpool_backward(delta, indexes, x_grad)
    assert x_grad.reshape(-1)[3] == 1 and x_grad.sum() == 1


@pytest.mark.parametrize("out_c", [1, 2, 3, 5])
def test_maxpool_depth_train_and_backward(out_c):
    x = distinct((2, 5, 3, 4), 8)
    out = np.empty((2, out_c, 3, 4))
    indexes = np.empty(out.shape, np.int32)
    pooling.maxpool_depth_forward_train(x, out, indexes)
    want = np.empty_like(out)
    pooling.maxpool_depth_forward(x, want)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(x.reshape(-1)[indexes], out)
    _check_linear_backward(
        lambda a, o: pooling.maxpool_depth_forward(a, o),
        lambda r, g: pooling.maxpool_backward(r, indexes, g), x, out.shape, 9)


# ---------------------------------------------------------------------------------------
# avgpool


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 4, 1, 1), (3, 1, 3, 1)])
def test_avgpool_backward_matches_finite_differences(shape):
    x = _rand(shape, 10)
    _check_linear_backward(pooling.avgpool_forward, pooling.avgpool_backward, x,
                           shape[:2] + (1, 1), 11)


def test_avgpool_backward_float32_is_delta_over_count():
    delta = _rand((2, 3, 1, 1), 12, np.float32)
    x_grad = np.ones((2, 3, 5, 7), np.float32)
    pooling.avgpool_backward(delta, x_grad)
    want = np.float32(1) + np.broadcast_to(delta / np.float32(35), x_grad.shape)
    np.testing.assert_array_equal(x_grad, want)


# ---------------------------------------------------------------------------------------
# upsample


UPSAMPLE_CASES = [  # shape, stride, scale
    ((2, 3, 3, 4), 2, 1.0), ((1, 2, 2, 3), 3, 0.5), ((2, 2, 4, 6), -2, 1.0),
    ((1, 2, 6, 9), -3, 0.25), ((1, 2, 7, 8), -3, 1.0), ((2, 1, 5, 5), -2, 2.0),
]


@pytest.mark.parametrize("shape,stride,scale", UPSAMPLE_CASES)
def test_upsample_backward_matches_finite_differences(shape, stride, scale):
    x = _rand(shape, 13)
    out_shape = resample.upsample_output_shape(shape, stride)
    _check_linear_backward(
        lambda a, o: resample.upsample_forward(a, o, stride, scale),
        lambda r, g: resample.upsample_backward(r, g, stride, scale), x, out_shape, 14)


@pytest.mark.parametrize("shape,stride,scale", UPSAMPLE_CASES)
def test_upsample_backward_float32_agrees_with_float64(shape, stride, scale):
    out_shape = resample.upsample_output_shape(shape, stride)
    delta = _rand(out_shape, 15)
    g64 = np.zeros(shape)
    g32 = np.zeros(shape, np.float32)
    resample.upsample_backward(delta, g64, stride, scale)
    resample.upsample_backward(delta.astype(np.float32), g32, stride, scale)
    np.testing.assert_allclose(g32, g64, rtol=1e-5, atol=1e-5)


def test_upsample_backward_sums_each_block():
    delta = np.arange(16.0).reshape(1, 1, 4, 4)
    x_grad = np.zeros((1, 1, 2, 2))
    resample.upsample_backward(delta, x_grad, 2, 0.5)
    want = 0.5 * delta.reshape(1, 1, 2, 2, 2, 2).sum(axis=(3, 5))
    np.testing.assert_array_equal(x_grad, want)


# ---------------------------------------------------------------------------------------
# reorg


@pytest.mark.parametrize("shape,stride,reverse,layer", [
    ((2, 4, 4, 6), 2, False, "reorg"), ((1, 9, 3, 6), 3, False, "reorg"),
    ((2, 8, 2, 3), 2, True, "reorg"), ((1, 18, 2, 2), 3, True, "reorg"),
    ((1, 4, 3, 5), 2, True, "reorg"), ((2, 3, 4, 6), 2, False, "reorg3d"),
    ((1, 2, 3, 9), 3, False, "reorg3d"), ((2, 16, 2, 3), 2, True, "reorg3d"),
])
def test_reorg_backward_matches_finite_differences(shape, stride, reverse, layer):
    x = _rand(shape, 16)
    out_shape = resample.reorg_output_shape(shape, stride, reverse)
    grad = _check_linear_backward(
        lambda a, o: resample.reorg_forward(a, o, stride, reverse, layer),
        lambda r, g: resample.reorg_backward(r, g, stride, reverse, layer), x, out_shape, 17)
    # A permutation: float32 moves the same values.
    delta = _rand(out_shape, 17).astype(np.float32)
    g32 = np.zeros(shape, np.float32)
    resample.reorg_backward(delta, g32, stride, reverse, layer)
    np.testing.assert_allclose(g32, grad, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# route


@pytest.mark.parametrize("src_start,channels,out_start", [(0, 4, 0), (2, 3, 5), (1, 0, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_backward_is_the_transpose_of_route(src_start, channels, out_start, dtype):
    src = _rand((2, 6, 3, 5), 18)
    _check_linear_backward(
        lambda a, o: route.route_forward(a, o, src_start, channels, out_start),
        lambda r, g: route.route_backward(r, g, src_start, channels, out_start),
        src, (2, 9, 3, 5), 19)
    delta = _rand((2, 9, 3, 5), 20, dtype)
    x_grad = np.ones((2, 6, 3, 5), dtype)
    route.route_backward(delta, x_grad, src_start, channels, out_start)
    want = np.ones_like(x_grad)
    want[:, src_start:src_start + channels] += delta[:, out_start:out_start + channels]
    np.testing.assert_array_equal(x_grad, want)


# ---------------------------------------------------------------------------------------
# all of them through the executor's GIL-free loop, and their argument errors


def test_backward_steps_run_in_a_step_list():
    x = distinct((1, 2, 4, 4), 21)
    out = np.empty((1, 2, 2, 2))
    indexes = np.empty(out.shape, np.int32)
    x_grad = np.zeros_like(x)
    delta = np.ones_like(out)
    steps = [pooling.maxpool_forward_train_step(x, out, indexes, 2, 2, 2, 1),
             pooling.maxpool_backward_step(delta, indexes, x_grad),
             resample.upsample_backward_step(np.ones((1, 2, 8, 8)), x_grad, 2),
             route.route_backward_step(np.ones((1, 3, 4, 4)), x_grad, 1, 1, 2)]
    assert [s.kind for s in steps] == ["maxpool_train", "maxpool_backward",
                                       "upsample_backward", "route_backward"]
    executor.StepList(steps, None).run()
    want = np.full(x.shape, 4.0)
    want[:, 1] += 1
    want.reshape(-1)[indexes.reshape(-1)] += 1
    np.testing.assert_array_equal(x_grad, want)


def _f(shape, dtype=np.float64):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("call, error, words", [
    (lambda: pooling.maxpool_forward_train_step(_f((1, 1, 4, 4)), _f((1, 1, 2, 2)),
                                                np.zeros((1, 1, 2, 2), np.int64), 2, 2, 2, 0),
     ArgumentError, ["indexes", "int32", "int64"]),
    (lambda: pooling.maxpool_forward_train_step(_f((1, 1, 4, 4)), _f((1, 1, 2, 2)),
                                                np.zeros((1, 1, 2, 3), np.int32), 2, 2, 2, 0),
     ArgumentError, ["indexes", "(1, 1, 2, 2)"]),
    (lambda: pooling.maxpool_forward_train_step(_f((1, 1, 4, 4)), _f((1, 1, 2, 2)),
                                                [0], 2, 2, 2, 0),
     ArgumentTypeError, ["indexes", "list"]),
    (lambda: pooling.maxpool_forward_train_step(_f((1, 1, 4, 4)), _f((1, 1, 3, 3)),
                                                np.zeros((1, 1, 3, 3), np.int32), 2, 2, 2, 0),
     ArgumentError, ["out", "(1, 1, 2, 2)"]),
    (lambda: pooling.maxpool_backward_step(_f((1, 1, 2, 2)), np.zeros((1, 1, 2, 2), np.int32),
                                           _f((1, 1, 4, 4), np.float32)),
     ArgumentError, ["x_grad", "float64"]),
    (lambda: pooling.maxpool_backward_step(_f((1, 1, 2, 2)), np.zeros((1, 1, 2, 1), np.int32),
                                           _f((1, 1, 4, 4))),
     ArgumentError, ["indexes", "(1, 1, 2, 2)"]),
    (lambda: pooling.avgpool_backward_step(_f((1, 2, 1, 1)), _f((1, 3, 4, 4))),
     ArgumentError, ["delta", "(1, 3, 1, 1)"]),
    (lambda: pooling.avgpool_backward_step(_f((1, 2, 1, 1)), _f((1, 2, 4, 4)).T),
     ArgumentError, ["x_grad"]),
    (lambda: resample.upsample_backward_step(_f((1, 2, 4, 4)), _f((1, 2, 3, 3)), 2),
     ArgumentError, ["delta", "(1, 2, 6, 6)"]),
    (lambda: resample.upsample_backward_step(_f((1, 2, 4, 4)), _f((1, 2, 2, 2)), 0),
     ArgumentError, ["stride"]),
    (lambda: resample.reorg_backward_step(_f((1, 8, 2, 2)), _f((1, 2, 4, 4)), 2),
     ArgumentError, ["divisible", "x_grad"]),
    (lambda: resample.reorg_backward_step(_f((1, 8, 2, 2)), _f((1, 4, 4, 4)), 2),
     ArgumentError, ["delta", "(1, 16, 2, 2)"]),
    (lambda: route.route_backward_step(_f((1, 3, 2, 2)), _f((1, 2, 2, 2)), 0, 3, 0),
     ArgumentError, ["channels=3", "x_grad has 2"]),
    (lambda: route.route_backward_step(_f((1, 3, 2, 2)), _f((1, 3, 2, 3)), 0, 1, 0),
     ArgumentError, ["delta_out must have shape"]),
])
def test_bad_arguments_are_named(call, error, words):
    assert_raises_naming(call, error, words)


def test_read_only_or_shared_gradients_are_refused():
    delta = _f((1, 2, 4, 4))
    x_grad = _f((1, 2, 2, 2))
    x_grad.flags.writeable = False
    with pytest.raises(ArgumentError, match="x_grad must be writable"):
        resample.upsample_backward_step(delta, x_grad, 2)
    both = _f((2, 2, 4, 4))
    with pytest.raises(ArgumentError, match="x_grad must not share memory with delta"):
        pooling.maxpool_backward_step(both[:1], np.zeros((1, 2, 4, 4), np.int32), both)
    with pytest.raises(ArgumentError, match="delta_out must not share memory with x_grad"):
        route.route_backward_step(both, both, 0, 2, 0)
