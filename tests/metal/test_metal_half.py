"""The half-storage (``_f16``) forward kernels in the emulator, under three thread orders.

Data movement (im2col, route, upsample, maxpool, copy) must equal the float32 result exactly
(half inputs are exact in float). Arithmetic (GEMM with its bias and activation epilogue,
activations, the [yolo] activation) is checked against float64 NumPy formulas on the same
half-rounded inputs: the kernels sum in float and round once to half on the store, so each
output is within one half ulp (2^-10 relative) of the exact value plus float rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from darknet_metal.metal import registry
from darknet_metal.model.activations import ACTIVATIONS

ORDERS = ["forward", "reverse", "random"]
HALF_EPS = 2.0**-10


def _half(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def _near_half(got, exact, what):
    """``got`` (float16) is ``exact`` (float64) rounded to half, within one half ulp."""
    got = got.astype(np.float64)
    tol = HALF_EPS * np.maximum(np.abs(exact), 2.0**-14) + 1e-6
    bad = np.abs(got - exact) > tol
    assert not bad.any(), (what, np.argwhere(bad)[:5], got[bad][:5], exact[bad][:5])


def test_every_twin_is_declared_from_its_float_kernel():
    for name in registry.HALF_TWINS:
        f32, f16 = registry.KERNELS[name], registry.KERNELS[registry.half_name(name)]
        assert (f16.source, f16.args, f16.grid, f16.roles) == (f32.source, f32.args, f32.grid,
                                                               f32.roles)
        for a, b in zip(f32.bindings, f16.bindings, strict=True):
            assert b.dtype == ("f16" if a.dtype == "f32" else a.dtype)
            assert b.itemsize == (2 if a.dtype == "f32" else 4)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("variant", ["gemm_nn", "gemm_nt", "gemm_nn_simd", "gemm_nt_simd"])
def test_gemm_half_against_numpy(emu_runner, order, variant):
    rng = np.random.default_rng(3)
    m, n, k, slices = 37, 45, 70, 2
    nt = "_nt" in variant
    a = _half(rng, slices, m, k, scale=0.3)
    b = _half(rng, slices, n, k) if nt else _half(rng, slices, k, n)
    bias = _half(rng, m)
    c = np.zeros((slices, m, n), np.float16)
    leaky = ACTIVATIONS.index("leaky")
    args = dict(M=m, N=n, K=k, lda=k, ldb=k if nt else n, ldc=n, groups=1,
                a_batch_stride=m * k, a_group_stride=0, b_batch_stride=n * k,
                b_group_stride=0, c_batch_stride=m * n, c_group_stride=0,
                bias_group_stride=0, bias_mode=registry.BIAS_ROWS, act=leaky, beta=0.0)
    emu_runner.run(f"{variant}_f16", args, {"a": a.reshape(-1), "b": b.reshape(-1),
                                            "bias": bias, "c": c.reshape(-1)},
                   {"N": n, "M": m, "slices": slices}, order=order)
    bb = b.astype(np.float64).transpose(0, 2, 1) if nt else b.astype(np.float64)
    exact = a.astype(np.float64) @ bb + bias.astype(np.float64)[None, :, None]
    exact = np.where(exact > 0, exact, 0.1 * exact)
    # The float sum of 70 products adds ~70 float ulps at most: far below half's.
    _near_half(c, exact, variant)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("act", ["linear", "leaky", "logistic", "mish", "swish", "relu"])
def test_activation_half_against_numpy(emu_runner, order, act):
    rng = np.random.default_rng(4)
    x = _half(rng, 1000, scale=3.0)
    y = np.zeros_like(x)
    emu_runner.run("activation_fwd_f16", {"n": x.size, "act": ACTIVATIONS.index(act)},
                   {"x": x, "y": y}, {"n": x.size}, order=order)
    v = x.astype(np.float64)
    exact = {
        "linear": v,
        "leaky": np.where(v > 0, v, 0.1 * v),
        "logistic": 1 / (1 + np.exp(-v)),
        "mish": v * np.tanh(np.log1p(np.exp(v))),
        "swish": v / (1 + np.exp(-v)),
        "relu": np.maximum(v, 0),
    }[act]
    # float32 activations agree with float64 to a few float ulps; half's rounding dominates.
    _near_half(y, exact, act)


@pytest.mark.parametrize("order", ORDERS)
def test_yolo_half_against_numpy(emu_runner, order):
    rng = np.random.default_rng(5)
    batch, anchors, classes, spatial = 2, 3, 4, 13
    channels = anchors * (5 + classes)
    x = _half(rng, batch, channels, spatial, scale=4.0)
    y = np.zeros_like(x)
    args = dict(batch=batch, anchors=anchors, classes=classes, spatial=spatial, new_coords=0,
                scale_x_y=1.05)
    emu_runner.run("yolo_fwd_f16", args, {"x": x.reshape(-1), "y": y.reshape(-1)},
                   {"spatial": spatial, "channels": channels, "batch": batch}, order=order)
    v = x.astype(np.float64)
    entry = np.arange(channels) % (5 + classes)
    logistic = 1 / (1 + np.exp(-v))
    exact = np.where(np.isin(entry, [2, 3])[None, :, None], v, logistic)
    xy = np.isin(entry, [0, 1])[None, :, None]
    exact = np.where(xy, exact * 1.05 - 0.5 * 0.05, exact)
    _near_half(y, exact, "yolo")


@pytest.mark.parametrize("order", ORDERS)
def test_data_movement_half_equals_float(emu_runner, order):
    rng = np.random.default_rng(6)
    x = _half(rng, 2, 5, 9, 11)  # batch 2, 5 channels, 9 x 11
    # im2col, 3x3 stride 2 pad 1.
    oh, ow = 5, 6
    im = dict(channels=5, height=9, width=11, ksize=3, stride_x=2, stride_y=2, pad=1,
              dilation=1, out_h=oh, out_w=ow)
    sizes = {"spatial": oh * ow, "rows": 5 * 9, "slices": 2}
    outs = {}
    for dtype, name in ((np.float16, "im2col_fwd_f16"), (np.float32, "im2col_fwd_f32")):
        col = np.zeros(2 * 45 * oh * ow, dtype)
        emu_runner.run(name, im, {"image": x.astype(dtype).reshape(-1), "col": col}, sizes,
                       order=order)
        outs[dtype] = col
    np.testing.assert_array_equal(outs[np.float16].astype(np.float32), outs[np.float32])
    assert np.count_nonzero(outs[np.float16]) > outs[np.float16].size // 2

    # maxpool 2x2 stride 2 (every window holds a pixel), upsample x2, route, copy.
    cases = [
        ("maxpool_fwd", dict(planes=10, height=9, width=11, out_h=5, out_w=6, size=2,
                             stride_x=2, stride_y=2, padding=1),
         {"out_w": 6, "out_h": 5, "planes": 10}, 10 * 5 * 6),
        ("upsample_fwd", dict(planes=10, height=9, width=11, out_h=18, out_w=22, stride=2,
                              scale=1.0), {"out_w": 22, "out_h": 18, "planes": 10},
         10 * 18 * 22),
        ("route_fwd", dict(batch=2, spatial=99, channels=2, src_channels=5, src_offset=3,
                           dst_channels=4, dst_offset=1),
         {"spatial": 99, "channels": 2, "batch": 2}, 2 * 4 * 99),
        ("copy_buf", dict(n=x.size), {"n": x.size}, x.size),
    ]
    for base, args, sizes, n_out in cases:
        results = {}
        for dtype, suffix in ((np.float16, "f16"), (np.float32, "f32")):
            src = x.astype(dtype).reshape(-1)
            dst = np.full(n_out, 7, dtype)
            roles = ("src", "dst") if base == "copy_buf" else ("x", "y")
            emu_runner.run(f"{base}_{suffix}", args, dict(zip(roles, (src, dst), strict=True)),
                           sizes, order=order)
            results[suffix] = dst
        assert (results["f16"] != 7).sum() >= n_out // 2, base  # the kernel wrote
        np.testing.assert_array_equal(results["f16"].astype(np.float32), results["f32"],
                                      err_msg=base)
        if base == "copy_buf":
            np.testing.assert_array_equal(results["f16"], x.reshape(-1))


# (kernel, args, grid sizes): the other half-storage twins, each compared with its float
# kernel (checked against the CPU reference in the other kernel tests) on the same half
# inputs. Every role is filled from the arguments' extents.
_TWIN_CASES = [
    ("shortcut_weights_fwd", dict(n_inputs=3, channels=6, per_channel=1, normalization=2),
     {"channels": 6}),
    ("shortcut_weights_fwd", dict(n_inputs=3, channels=6, per_channel=0, normalization=1),
     {"channels": 6}),
    ("shortcut_fwd", dict(batch=2, channels=6, spatial=35, src_channels=4, source=1, first=1,
                          weighted=1), {"spatial": 35, "channels": 6, "batch": 2}),
    ("scale_channels_fwd", dict(batch=2, channels=5, spatial=21, scale_wh=0),
     {"spatial": 21, "channels": 5, "batch": 2}),
    ("scale_channels_fwd", dict(batch=2, channels=5, spatial=21, scale_wh=1),
     {"spatial": 21, "channels": 5, "batch": 2}),
    ("sam_fwd", dict(n=300), {"n": 300}),
    ("maxpool_depth_fwd", dict(batch=2, channels=6, spatial=20, out_channels=2),
     {"spatial": 20, "out_channels": 2, "batch": 2}),
    ("avgpool_fwd", dict(planes=12, spatial=49), {"planes": 12}),
    ("softmax_fwd", dict(rows=6, n=10, temperature=0.5), {"rows": 6}),
    ("reorg_fwd", dict(batch=2, width=4, height=3, channels=8, stride=2, reverse=0),
     {"width": 4, "height": 3, "slices": 16}),
    ("reorg_fwd", dict(batch=2, width=4, height=3, channels=8, stride=2, reverse=1),
     {"width": 4, "height": 3, "slices": 16}),
    *((f"{variant}_fwd", dict(batch=2, channels=7, spatial=15), {"spatial": 15, "batch": 2})
      for variant in ("normalize_channels", "normalize_channels_softmax",
                      "normalize_channels_softmax_maxval")),
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", range(len(_TWIN_CASES)))
def test_other_twins_equal_their_float_kernels_within_half(emu_runner, order, case):
    base, args, sizes = _TWIN_CASES[case]
    k32 = registry.kernel(f"{base}_f32")
    extents = k32.extents(args, sizes)
    rng = np.random.default_rng(10 + case)
    inputs = {role: _half(rng, extents[role], scale=2.0) for role in k32.inputs}
    results = {}
    for dtype, suffix in ((np.float16, "f16"), (np.float32, "f32")):
        buffers = {role: a.astype(dtype) for role, a in inputs.items()}
        buffers.update({role: np.zeros(extents[role], dtype) for role in k32.outputs
                        if role not in inputs})
        emu_runner.run(f"{base}_{suffix}", args, buffers, sizes, order=order)
        results[suffix] = {role: buffers[role] for role in k32.outputs}
    for role in k32.outputs:
        full = results["f32"][role].astype(np.float64)
        assert np.count_nonzero(full) > full.size // 3, (base, role)  # the kernel wrote
        _near_half(results["f16"][role], full, f"{base}.{role}")
