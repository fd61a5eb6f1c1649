"""GEMM kernels (tiled and simdgroup_matrix) and whole convolution / connected layers
(im2col + GEMM + fused bias and activation) in the emulator, against NumPy and the CPU
reference ``conv2d_forward`` / ``connected_forward``."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS

from darknet_metal.cpu import activations as cpu_act
from darknet_metal.cpu import conv, im2col
from darknet_metal.metal.dispatch import gemm_args
from darknet_metal.metal.registry import BIAS_COLS, BIAS_NONE, BIAS_ROWS
from darknet_metal.model.activations import ACTIVATION_ID

GEMMS = [
    "gemm_nn_f32",
    "gemm_nn_simd_f32",
    "gemm_nt_f32",
    "gemm_nt_simd_f32",
    "gemm_tn_f32",
    "gemm_tn_simd_f32",
]


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _gemm_args(
    m, n, k, lda, ldb, ldc, *, groups=1, bias_mode=BIAS_NONE, act=0, beta=0.0, **strides
):
    args, _ = gemm_args(M=m, N=n, K=k, lda=lda, ldb=ldb, ldc=ldc, groups=groups,
                        bias_mode=bias_mode, act=act, beta=beta, **strides)
    return args


def _activated(v, act):
    out = np.ascontiguousarray(v, np.float32).reshape(1, -1).copy()
    cpu_act.activate(out, act)
    return out.reshape(np.shape(v))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", GEMMS)
@pytest.mark.parametrize("mnk", [(17, 33, 29), (1, 1, 1), (32, 32, 16), (40, 7, 70)])
def test_gemm(emu_runner, order, name, mnk):
    m, n, k = mnk
    trans = name.split("_")[1]
    a_op, b_op = _rand((m, k), 1), _rand((k, n), 2)
    a = np.ascontiguousarray(a_op.T) if trans[0] == "t" else a_op
    b = np.ascontiguousarray(b_op.T) if trans[1] == "t" else b_op
    lda, ldb = a.shape[1], b.shape[1]
    bias = _rand(m, 3)
    c = np.full((m, n + 3), 55.0, np.float32)  # ldc > N: the pad columns must stay untouched
    emu_runner.run(
        name,
        _gemm_args(m, n, k, lda, ldb, n + 3, bias_mode=BIAS_ROWS, act=ACTIVATION_ID["leaky"]),
        {"a": a, "b": b, "bias": bias, "c": c},
        {"N": n, "M": m, "slices": 1},
        order=order,
        seed=m + n,
    )
    ref = a_op.astype(np.float64) @ b_op.astype(np.float64) + bias[:, None]
    want = _activated(ref.astype(np.float32), "leaky")
    np.testing.assert_allclose(c[:, :n], want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    assert (c[:, n:] == 55.0).all()


def _operands(name, m, n, k, seed):
    """op(A) (m x k) and op(B) (k x n), and the arrays stored for kernel ``name``."""
    trans = name.split("_")[1]
    a_op, b_op = _rand((m, k), seed), _rand((k, n), seed + 1)
    a = np.ascontiguousarray(a_op.T) if trans[0] == "t" else a_op
    b = np.ascontiguousarray(b_op.T) if trans[1] == "t" else b_op
    return a_op, b_op, a, b


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", GEMMS)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("mnk", [(37, 45, 21), (5, 3, 70), (33, 1, 17)])
def test_gemm_accumulates_beta_times_c(emu_runner, order, name, beta, mnk):
    """c = act(op(A) @ op(B) + bias + beta * c_old), sizes not multiples of the 32x32x16 tile."""
    m, n, k = mnk
    a_op, b_op, a, b = _operands(name, m, n, k, 20)
    bias = _rand(m, 22)
    c_old = _rand((m, n + 2), 23)
    c = c_old.copy()
    emu_runner.run(
        name,
        _gemm_args(
            m,
            n,
            k,
            a.shape[1],
            b.shape[1],
            n + 2,
            bias_mode=BIAS_ROWS,
            act=ACTIVATION_ID["leaky"],
            beta=beta,
        ),
        {"a": a, "b": b, "bias": bias, "c": c},
        {"N": n, "M": m, "slices": 1},
        order=order,
        seed=m + k,
    )
    ref = a_op.astype(np.float64) @ b_op.astype(np.float64) + bias[:, None]
    ref += beta * c_old[:, :n].astype(np.float64)
    want = _activated(ref.astype(np.float32), "leaky")
    np.testing.assert_allclose(c[:, :n], want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    np.testing.assert_array_equal(c[:, n:], c_old[:, n:])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", GEMMS)
def test_gemm_beta_zero_never_reads_c(emu_runner, order, name):
    """An uninitialised output (here NaN and infinities) cannot leak into beta = 0 results."""
    m, n, k = 19, 35, 9
    a_op, b_op, a, b = _operands(name, m, n, k, 24)
    c = np.full((m, n), np.nan, np.float32)
    c[::3] = np.inf
    emu_runner.run(
        name,
        _gemm_args(m, n, k, a.shape[1], b.shape[1], n, beta=0.0),
        {"a": a, "b": b, "bias": None, "c": c},
        {"N": n, "M": m, "slices": 1},
        order=order,
    )
    assert np.isfinite(c).all()
    want = a_op.astype(np.float64) @ b_op.astype(np.float64)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemm_nn_f32", "gemm_nn_simd_f32"])
def test_gemm_accumulates_into_each_slice(emu_runner, name):
    """beta reads C through the same batch and group offsets as the write."""
    batch, groups, m, n, k = 2, 3, 5, 11, 7
    a = _rand((groups, m, k), 25)
    b = _rand((batch, groups, k, n), 26)
    c_old = _rand((batch, groups, m, n), 27)
    c = c_old.copy()
    args = _gemm_args(
        m,
        n,
        k,
        k,
        n,
        n,
        groups=groups,
        beta=1.0,
        a_group_stride=m * k,
        b_batch_stride=groups * k * n,
        b_group_stride=k * n,
        c_batch_stride=groups * m * n,
        c_group_stride=m * n,
    )
    emu_runner.run(
        name,
        args,
        {"a": a, "b": b, "bias": None, "c": c},
        {"N": n, "M": m, "slices": batch * groups},
        order="random",
    )
    want = np.einsum("gmk,bgkn->bgmn", a.astype(np.float64), b.astype(np.float64)) + c_old
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemm_nt_f32", "gemm_nt_simd_f32"])
def test_gemm_bias_per_column_no_activation(emu_runner, name):
    m, n, k = 3, 37, 19
    a, b, bias = _rand((m, k), 4), _rand((n, k), 5), _rand(n, 6)
    c = np.full((m, n), np.nan, np.float32)
    emu_runner.run(
        name,
        _gemm_args(m, n, k, k, k, n, bias_mode=BIAS_COLS),
        {"a": a, "b": b, "bias": bias, "c": c},
        {"N": n, "M": m, "slices": 1},
    )
    want = a.astype(np.float64) @ b.T.astype(np.float64) + bias[None, :]
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemm_nn_f32", "gemm_nn_simd_f32"])
def test_gemm_slices_batch_and_groups(emu_runner, name):
    """z = image*groups + group: each slice offsets A by group, B and C by image and group."""
    batch, groups, m, n, k = 2, 3, 5, 11, 7
    a = _rand((groups, m, k), 7)
    b = _rand((batch, groups, k, n), 8)
    bias = _rand((groups, m), 9)
    c = np.full((batch, groups, m, n), np.nan, np.float32)
    args = _gemm_args(
        m,
        n,
        k,
        k,
        n,
        n,
        groups=groups,
        bias_mode=BIAS_ROWS,
        act=ACTIVATION_ID["logistic"],
        a_group_stride=m * k,
        b_batch_stride=groups * k * n,
        b_group_stride=k * n,
        c_batch_stride=groups * m * n,
        c_group_stride=m * n,
        bias_group_stride=m,
    )
    emu_runner.run(
        name,
        args,
        {"a": a, "b": b, "bias": bias, "c": c},
        {"N": n, "M": m, "slices": batch * groups},
        order="random",
    )
    want = np.einsum("gmk,bgkn->bgmn", a.astype(np.float64), b.astype(np.float64))
    want = 1.0 / (1.0 + np.exp(-(want + bias[None, :, :, None])))
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-6)


CONVS = [  # (N, C, H, W, filters, ksize, stride_x, stride_y, pad, dilation, groups, act)
    (1, 3, 13, 13, 16, 3, 1, 1, 1, 1, 1, "leaky"),  # yolo-tiny's first layer, scaled down
    (2, 5, 7, 7, 7, 3, 2, 2, 1, 1, 1, "mish"),
    (1, 6, 7, 5, 4, 3, 1, 2, 1, 2, 2, "logistic"),
    (1, 7, 13, 13, 9, 1, 1, 1, 0, 1, 1, "linear"),  # 1x1: the GEMM reads the input directly
    (1, 4, 1, 1, 5, 3, 1, 1, 1, 1, 1, "leaky"),
    (2, 4, 7, 7, 4, 3, 1, 1, 1, 1, 4, "relu"),  # depthwise
]


def _conv_on_emu(runner, x, w, bias, out_shape, ksize, sx, sy, pad, dil, groups, act, gemm, order):
    n, c, h, wd = x.shape
    f = w.shape[0]
    oh, ow = out_shape[2:]
    cg, fg = c // groups, f // groups
    k, spatial = cg * ksize * ksize, oh * ow
    direct = ksize == 1 and sx == 1 and sy == 1 and pad == 0
    if direct:
        operand = x
    else:
        operand = np.full((n * groups, k, spatial), np.nan, np.float32)
        runner.run(
            "im2col_fwd_f32",
            {
                "channels": cg,
                "height": h,
                "width": wd,
                "ksize": ksize,
                "stride_x": sx,
                "stride_y": sy,
                "pad": pad,
                "dilation": dil,
                "out_h": oh,
                "out_w": ow,
            },
            {"image": x, "col": operand},
            {"spatial": spatial, "rows": k, "slices": n * groups},
            order=order,
        )
    y = np.full(out_shape, np.nan, np.float32)
    args = _gemm_args(
        fg,
        spatial,
        k,
        k,
        spatial,
        spatial,
        groups=groups,
        bias_mode=BIAS_ROWS,
        act=ACTIVATION_ID[act],
        a_group_stride=fg * k,
        b_batch_stride=groups * k * spatial if not direct else c * h * wd,
        b_group_stride=k * spatial if not direct else cg * h * wd,
        c_batch_stride=f * spatial,
        c_group_stride=fg * spatial,
        bias_group_stride=fg,
    )
    runner.run(
        gemm,
        args,
        {"a": w, "b": operand, "bias": bias, "c": y},
        {"N": spatial, "M": fg, "slices": n * groups},
        order=order,
    )
    return y


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("gemm", ["gemm_nn_f32", "gemm_nn_simd_f32"])
@pytest.mark.parametrize("case", CONVS)
def test_conv_layer(emu_runner, order, gemm, case):
    n, c, h, wd, f, ksize, sx, sy, pad, dil, groups, act = case
    x = _rand((n, c, h, wd), 10)
    w = _rand((f, c // groups * ksize * ksize), 11) * np.float32(0.3)
    bias = _rand(f, 12)
    oh = (h + 2 * pad * dil - dil * (ksize - 1) - 1) // sy + 1
    ow = (wd + 2 * pad * dil - dil * (ksize - 1) - 1) // sx + 1
    want = np.empty((n, f, oh, ow), np.float32)
    ws = np.empty(max(1, conv.workspace_size(c, ksize, groups, oh, ow)), np.float32)
    conv.conv2d_forward(x, w, bias, want, ws, ksize, sx, sy, pad, dil, groups, ACTIVATION_ID[act])
    y = _conv_on_emu(
        emu_runner, x, w, bias, want.shape, ksize, sx, sy, pad, dil, groups, act, gemm, order
    )
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "case",
    [
        (3, 13, 13, 3, 1, 1, 1, 1),
        (5, 7, 7, 3, 2, 2, 1, 1),
        (7, 7, 5, 3, 2, 1, 2, 2),
        (3, 1, 1, 3, 1, 1, 1, 1),
        (5, 13, 7, 1, 2, 3, 0, 1),
    ],
)
def test_im2col_matches_reference(emu_runner, case):
    c, h, w, ksize, sx, sy, pad, dil = case
    x = _rand((c, h, w), 13)
    oh = (h + 2 * pad * dil - dil * (ksize - 1) - 1) // sy + 1
    ow = (w + 2 * pad * dil - dil * (ksize - 1) - 1) // sx + 1
    want = im2col.im2col_forward(x, ksize, sx, sy, pad * dil, dil, oh, ow)
    col = np.full(want.shape, np.nan, np.float32)
    emu_runner.run(
        "im2col_fwd_f32",
        {
            "channels": c,
            "height": h,
            "width": w,
            "ksize": ksize,
            "stride_x": sx,
            "stride_y": sy,
            "pad": pad,
            "dilation": dil,
            "out_h": oh,
            "out_w": ow,
        },
        {"image": x, "col": col},
        {"spatial": oh * ow, "rows": want.shape[0], "slices": 1},
        order="reverse",
    )
    np.testing.assert_array_equal(col, want)


@pytest.mark.parametrize("name", ["gemm_nt_f32", "gemm_nt_simd_f32"])
@pytest.mark.parametrize("batch,inputs,outputs", [(1, 29, 17), (3, 64, 33), (2, 5, 1)])
def test_connected_layer(emu_runner, name, batch, inputs, outputs):
    x = _rand((batch, inputs), 14)
    w = _rand((outputs, inputs), 15)
    bias = _rand(outputs, 16)
    act = ACTIVATION_ID["logistic"]
    want = np.empty((batch, outputs), np.float32)
    conv.connected_forward(x, w, bias, want, act)
    y = np.full_like(want, np.nan)
    emu_runner.run(
        name,
        _gemm_args(batch, outputs, inputs, inputs, inputs, outputs, bias_mode=BIAS_COLS, act=act),
        {"a": x, "b": w, "bias": bias, "c": y},
        {"N": outputs, "M": batch, "slices": 1},
        order="random",
    )
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_gemm_detects_missing_barrier_sensitivity(emu_runner):
    """Sanity check of the test itself: a wrong operand gives a visible mismatch."""
    m, n, k = 9, 10, 11
    a, b, bias = _rand((m, k), 17), _rand((k, n), 18), np.zeros(m, np.float32)
    c = np.zeros((m, n), np.float32)
    emu_runner.run(
        "gemm_nn_f32",
        _gemm_args(m, n, k, k, n, n),
        {"a": a, "b": b, "bias": bias, "c": c},
        {"N": n, "M": m, "slices": 1},
    )
    assert not np.allclose(c, a @ b[::-1])
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
