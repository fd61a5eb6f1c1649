"""The Cython convolution and connected layers against NumPy formulas."""

import numpy as np
import pytest
from reference import np_conv

from darknet_metal.cpu import conv, im2col, winograd
from darknet_metal.errors import ArgumentError
from darknet_metal.model.activations import ACTIVATION_ID

LINEAR = ACTIVATION_ID["linear"]
LEAKY = ACTIVATION_ID["leaky"]


CASES = [
    # n, c, h, w, f, size, sx, sy, pad, dilation, groups
    (1, 3, 13, 13, 5, 3, 1, 1, 1, 1, 1),
    (2, 5, 7, 9, 4, 3, 2, 2, 1, 1, 1),
    (1, 4, 8, 5, 6, 1, 1, 1, 0, 1, 2),
    (2, 6, 11, 7, 9, 3, 1, 1, 1, 1, 3),
    (1, 3, 10, 10, 2, 5, 2, 1, 2, 1, 1),
    (1, 2, 9, 12, 3, 3, 1, 1, 1, 2, 1),
    (1, 7, 6, 6, 7, 3, 1, 2, 0, 1, 7),
    (1, 3, 5, 5, 4, 1, 2, 2, 0, 1, 1),
    (3, 1, 1, 1, 3, 1, 1, 1, 0, 1, 1),
    # Wide enough that im2col unfolds blocks of 1 and of 2 output rows (last block partial).
    (1, 64, 5, 120, 3, 3, 1, 1, 1, 1, 1),
    (2, 16, 5, 200, 4, 3, 1, 1, 1, 1, 2),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_conv2d_matches_direct_convolution(case, dtype):
    n, c, h, w, f, size, sx, sy, pad, dilation, groups = case
    rng = np.random.default_rng(sum(case))
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((f, c // groups * size * size)).astype(dtype)
    b = rng.standard_normal(f).astype(dtype)
    ref = np_conv(x, wt, b, size, sx, sy, pad, dilation, groups)
    out = np.full((n, f, *ref.shape[2:]), np.nan, dtype)
    ws = np.empty(conv.workspace_size(c, size, groups, *ref.shape[2:]), dtype)
    conv.conv2d_forward(x, wt, b, out, ws, size, sx, sy, pad, dilation, groups, LINEAR)
    tol = 1e-4 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    out_leaky = np.empty_like(out)
    conv.conv2d_forward(x, wt, b, out_leaky, ws, size, sx, sy, pad, dilation, groups, LEAKY)
    np.testing.assert_allclose(out_leaky, np.where(ref > 0, ref, 0.1 * ref), rtol=tol, atol=tol)


def test_conv2d_rejects_mismatched_shapes():
    x = np.zeros((1, 4, 6, 6), np.float32)
    wt = np.zeros((2, 4 * 9), np.float32)
    b = np.zeros(2, np.float32)
    ws = np.zeros(4 * 9 * 36, np.float32)
    with pytest.raises(ValueError, match="out spatial size"):
        conv.conv2d_forward(x, wt, b, np.zeros((1, 2, 5, 6), np.float32), ws, 3, 1, 1, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="weights shape"):
        narrow = np.ascontiguousarray(wt[:, :9])
        conv.conv2d_forward(
            x, narrow, b, np.zeros((1, 2, 6, 6), np.float32), ws, 3, 1, 1, 1, 1, 1, 0
        )
    with pytest.raises(ValueError, match="groups"):
        conv.conv2d_forward(x, wt, b, np.zeros((1, 2, 6, 6), np.float32), ws, 3, 1, 1, 1, 1, 3, 0)
    with pytest.raises(ValueError, match="workspace"):
        conv.conv2d_forward(
            x, wt, b, np.zeros((1, 2, 6, 6), np.float32), ws[:10], 3, 1, 1, 1, 1, 1, 0
        )


@pytest.mark.parametrize("size, sx, sy, pad, dilation", [
    (3, 0, 1, 1, 1), (3, 1, 0, 1, 1), (3, 1, 1, 1, 0), (0, 1, 1, 1, 1), (3, 1, 1, -1, 1),
    (3, -2, 1, 1, 1),
])
def test_conv2d_rejects_bad_geometry_without_crashing(size, sx, sy, pad, dilation):
    # A zero stride once divided by zero in C and killed the process.
    x = np.zeros((1, 4, 6, 6), np.float32)
    wt = np.zeros((2, 4 * max(size, 1) ** 2), np.float32)
    out = np.zeros((1, 2, 6, 6), np.float32)
    ws = np.zeros(4 * 9 * 36, np.float32)
    with pytest.raises(ValueError, match="must be >= 1"):
        conv.conv2d_forward(x, wt, np.zeros(2, np.float32), out, ws, size, sx, sy, pad,
                            dilation, 1, 0)


def test_im2col_layout_matches_weight_order():
    x = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4)
    col = im2col.im2col_forward(x, 3, 1, 1, 1, 1, 3, 4)
    # Row (c, ky, kx) = (1, 0, 2), output pixel (oy, ox) = (1, 1) reads x[1, 0, 2].
    assert col[(1 * 3 + 0) * 3 + 2, 1 * 4 + 1] == x[1, 0, 2]
    # Row (0, 0, 0) at output (0, 0) is in the zero padding.
    assert col[0, 0] == 0.0
    assert col.shape == (2 * 9, 12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_connected_matches_matmul(dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 17)).astype(dtype)
    wt = rng.standard_normal((5, 17)).astype(dtype)
    b = rng.standard_normal(5).astype(dtype)
    out = np.empty((3, 5), dtype)
    conv.connected_forward(x, wt, b, out, LEAKY)
    ref = x.astype(np.float64) @ wt.T.astype(np.float64) + b
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, np.where(ref > 0, ref, 0.1 * ref), rtol=tol, atol=tol)


@pytest.mark.parametrize("tile", winograd.TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "shape",
    [(1, 16, 13, 13, 8), (2, 5, 7, 10, 3), (1, 3, 1, 1, 2), (1, 17, 26, 9, 33), (1, 8, 2, 3, 4)],
)
def test_winograd_matches_direct_convolution(shape, dtype, tile):
    n, c, h, w, f = shape
    rng = np.random.default_rng(h * w + c)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((f, c * 9)).astype(dtype)
    b = rng.standard_normal(f).astype(dtype)
    ref = np_conv(x, wt, b, 3, 1, 1, 1, 1, 1)
    out = np.full((n, f, h, w), np.nan, dtype)
    ws = np.empty(winograd.workspace_size(c, f, h, w, tile), dtype)
    winograd.winograd_forward(x, winograd.transform_filters(wt, c, tile), b, out, ws, LEAKY)
    scale = np.abs(ref).max()
    # F(4x4, 3x3)'s transforms scale by up to 8 and 1/24: about 10x F(2x2)'s rounding.
    tol = (2e-6 if tile == 2 else 1e-5) * scale if dtype == np.float32 else 1e-12 * scale
    np.testing.assert_allclose(out, np.where(ref > 0, ref, 0.1 * ref), rtol=0, atol=tol)


def test_winograd_refuses_unknown_tiles_and_filter_shapes():
    x = np.zeros((1, 4, 8, 8), np.float32)
    with pytest.raises(ArgumentError, match="tile=3"):
        winograd.transform_filters(np.zeros((2, 36), np.float32), 4, 3)
    with pytest.raises(ArgumentError, match="tile=5"):
        winograd.workspace_size(4, 2, 8, 8, 5)
    out = np.zeros((1, 2, 8, 8), np.float32)
    ws = np.zeros(winograd.workspace_size(4, 2, 8, 8, 4), np.float32)
    # float32 filters are packed ((16 or 36, packed_size(F, C))), float64 ones are not.
    packed = winograd.packed_size(2, 4)
    with pytest.raises(ArgumentError, match=rf"\(16, {packed}\) or \(36, {packed}\)"):
        winograd.winograd_forward(x, np.zeros((25, 2, 4), np.float32), np.zeros(2, np.float32),
                                  out, ws, LEAKY)
    with pytest.raises(ArgumentError, match=rf"\(16, {packed}\) or \(36, {packed}\)"):
        winograd.winograd_forward(x, np.zeros((36, 2, 4), np.float32), np.zeros(2, np.float32),
                                  out, ws, LEAKY)
    with pytest.raises(ArgumentError, match=r"\(16, 2, 4\) or \(36, 2, 4\)"):
        winograd.winograd_forward(x.astype(np.float64), np.zeros((36, packed)),
                                  np.zeros(2), out.astype(np.float64), ws.astype(np.float64),
                                  LEAKY)
    small = np.zeros(winograd.workspace_size(4, 2, 8, 8, 4) - 1, np.float32)
    filters = winograd.transform_filters(np.zeros((2, 36), np.float32), 4, 4)
    with pytest.raises(ArgumentError, match="workspace"):
        winograd.winograd_forward(x, filters, np.zeros(2, np.float32), out, small, LEAKY)


@pytest.mark.parametrize("c, h, w, f, stride", [(3, 37, 45, 16, 1), (16, 24, 33, 20, 1),
                                                (3, 41, 50, 32, 2), (16, 22, 31, 12, 2)])
def test_fused_direct_convolution_within_one_rounding_a_multiply_add(c, h, w, f, stride):
    """The direct 3x3 kernel with ``fused`` (inference) against float64: each of its
    9c fused multiply-adds and the bias rounds once, so every output is within (9c + 1)
    roundings of its partial sums; and it is not Darknet's arithmetic (the unfused kernel's
    bits differ somewhere)."""
    rng = np.random.default_rng(c * 100 + f + stride)
    x = rng.standard_normal((2, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((f, c * 9)) / np.sqrt(c * 9)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    direct = conv.direct_workspace_size(c, f, h, w, 3, stride, stride, 1, 1, 1)
    assert direct > 0  # the direct kernel takes this case
    ws = np.empty(max(direct, conv.workspace_size(c, 3, 1, oh, ow)), np.float32)
    linear = ACTIVATION_ID["linear"]
    fused = np.full((2, f, oh, ow), np.nan, np.float32)
    conv.conv2d_forward(x, wt, b, fused, ws, 3, stride, stride, 1, 1, 1, linear, fused=True)
    darknet = np.full_like(fused, np.nan)
    conv.conv2d_forward(x, wt, b, darknet, ws, 3, stride, stride, 1, 1, 1, linear)
    x64, w64, b64 = x.astype(np.float64), wt.astype(np.float64), b.astype(np.float64)
    ref = np_conv(x64, w64, b64, 3, stride, stride, 1, 1, 1)
    mag = np_conv(np.abs(x64), np.abs(w64), np.abs(b64), 3, stride, stride, 1, 1, 1)
    assert np.all(np.abs(fused - ref) <= (9 * c + 1) * 2.0**-24 * mag)
    assert np.any(fused != darknet)
