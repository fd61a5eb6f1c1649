"""Every forward kernel run in the Metal emulator and compared with the CPU reference
(``darknet_metal.cpu``), under forward, reverse and random thread order, at shapes that leave
partial threadgroups (odd channel counts, 1x1, 7x7 and 13x13 maps)."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS

from darknet_metal.cpu import activations as cpu_act
from darknet_metal.cpu import combine, heads, pooling, resample
from darknet_metal.model.activations import ACTIVATION_ID, ACTIVATIONS, CHANNEL_ACTIVATIONS

RTOL, ATOL = 2e-6, 1e-6


def _rand(shape, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _empty(shape):
    # Poisoned so an output element the kernel forgets to write cannot pass.
    return np.full(shape, np.nan, np.float32)


# ---- activations -----------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_activation_elementwise(emu_runner, order):
    x = _rand(1001, 0)
    x[:9] = [0.0, -0.0, 1.0, -1.0, 20.5, -20.5, 4.0, -4.0, 2.5]
    for name in ACTIVATIONS:
        if name in CHANNEL_ACTIVATIONS:
            continue
        act = ACTIVATION_ID[name]
        want = x.copy().reshape(1, -1)
        cpu_act.activate(want, act)
        y = _empty(x.shape)
        emu_runner.run(
            "activation_fwd_f32",
            {"n": x.size, "act": act},
            {"x": x, "y": y},
            {"n": x.size},
            order=order,
        )
        rtol = 2e-5 if name == "gelu" else RTOL  # the reference computes parts in double
        np.testing.assert_allclose(y, want.reshape(-1), rtol=rtol, atol=ATOL, err_msg=name)


def test_activation_in_place_and_tail_untouched(emu_runner):
    x = _rand(300, 1)
    buf = np.concatenate([x, np.full(5, 123.0, np.float32)])
    emu_runner.run(
        "activation_fwd_f32",
        {"n": 300, "act": ACTIVATION_ID["leaky"]},
        {"x": buf, "y": buf},
        {"n": 300},
    )
    np.testing.assert_array_equal(buf[:300], np.where(x > 0, x, np.float32(0.1) * x))
    assert (buf[300:] == 123.0).all()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", [(2, 7, 5, 3), (1, 3, 13, 13), (3, 5, 1, 1)])
def test_normalize_channels(emu_runner, order, shape):
    x = _rand(shape, 2)
    n, c, h, w = shape
    for name in sorted(CHANNEL_ACTIVATIONS):
        want = x.copy()
        cpu_act.activate(want, name)
        y = _empty(shape)
        emu_runner.run(
            f"{name}_fwd_f32",
            {"batch": n, "channels": c, "spatial": h * w},
            {"x": x, "y": y},
            {"spatial": h * w, "batch": n},
            order=order,
        )
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-7, err_msg=name)


# ---- pooling -------------------------------------------------------------------------------

POOLS = [  # (shape, size, stride_x, stride_y, padding)
    ((1, 3, 13, 13), 2, 1, 1, 1),  # yolov3-tiny's last maxpool: 13x13 stays 13x13
    ((2, 5, 7, 7), 2, 2, 2, 1),
    ((1, 7, 13, 13), 3, 2, 2, 2),
    ((1, 3, 7, 1), 2, 1, 2, 1),
    ((1, 5, 1, 1), 3, 1, 1, 2),
    ((1, 3, 7, 7), 5, 3, 1, 0),
    ((1, 3, 4, 4), 2, 1, 1, 6),  # windows wholly outside the image
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", POOLS)
def test_window_pools(emu_runner, order, case):
    shape, size, sx, sy, padding = case
    x = _rand(shape, 3)
    n, c, h, w = shape
    oh, ow = pooling.pool_output_hw(h, w, size, sx, sy, padding)
    args = {
        "planes": n * c,
        "height": h,
        "width": w,
        "out_h": oh,
        "out_w": ow,
        "size": size,
        "stride_x": sx,
        "stride_y": sy,
        "padding": padding,
    }
    grid = {"out_w": ow, "out_h": oh, "planes": n * c}
    kernel = "maxpool_fwd_f32"
    want = np.empty((n, c, oh, ow), np.float32)
    pooling.maxpool_forward(x, want, size, sx, sy, padding)
    y = np.full_like(want, 77.0)
    emu_runner.run(kernel, args, {"x": x, "y": y}, grid, order=order)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7, err_msg=kernel)


def test_maxpool_nan_and_ties(emu_runner):
    x = np.array([[[[np.nan, 1.0], [1.0, np.nan]]]], np.float32)
    y = _empty((1, 1, 1, 1))
    emu_runner.run(
        "maxpool_fwd_f32",
        {
            "planes": 1,
            "height": 2,
            "width": 2,
            "out_h": 1,
            "out_w": 1,
            "size": 2,
            "stride_x": 2,
            "stride_y": 2,
            "padding": 0,
        },
        {"x": x, "y": y},
        {"out_w": 1, "out_h": 1, "planes": 1},
    )
    assert y[0, 0, 0, 0] == 1.0  # Darknet's strict ">" never picks NaN


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape,out_c", [((2, 7, 5, 3), 3), ((1, 6, 13, 13), 2), ((1, 5, 1, 1), 5)])
def test_maxpool_depth(emu_runner, order, shape, out_c):
    x = _rand(shape, 4)
    n, c, h, w = shape
    want = np.empty((n, out_c, h, w), np.float32)
    pooling.maxpool_depth_forward(x, want)
    y = _empty(want.shape)
    emu_runner.run(
        "maxpool_depth_fwd_f32",
        {"batch": n, "channels": c, "spatial": h * w, "out_channels": out_c},
        {"x": x, "y": y},
        {"spatial": h * w, "out_channels": out_c, "batch": n},
        order=order,
    )
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", [(2, 7, 7, 7), (1, 65, 1, 1), (1, 3, 13, 13)])
def test_avgpool(emu_runner, order, shape):
    x = _rand(shape, 5)
    n, c, h, w = shape
    want = np.empty((n, c, 1, 1), np.float32)
    pooling.avgpool_forward(x, want)
    y = _empty(want.shape)
    emu_runner.run(
        "avgpool_fwd_f32",
        {"planes": n * c, "spatial": h * w},
        {"x": x, "y": y},
        {"planes": n * c},
        order=order,
    )
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)


# ---- route ---------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("groups,group_id", [(1, 0), (2, 1), (2, 0)])
def test_route(emu_runner, order, groups, group_id):
    n, h, w = 2, 7, 5
    parts = [_rand((n, 6, h, w), 6), _rand((n, 10, h, w), 7)]
    widths = [p.shape[1] // groups for p in parts]
    # Darknet's route: each source's channel slice group_id of groups, concatenated.
    want = np.concatenate(
        [p[:, group_id * wd : (group_id + 1) * wd] for p, wd in zip(parts, widths, strict=True)],
        axis=1,
    )
    y = _empty(want.shape)
    offset = 0
    for p, wd in zip(parts, widths, strict=True):
        emu_runner.run(
            "route_fwd_f32",
            {
                "batch": n,
                "spatial": h * w,
                "channels": wd,
                "src_channels": p.shape[1],
                "src_offset": group_id * wd,
                "dst_channels": y.shape[1],
                "dst_offset": offset,
            },
            {"x": p, "y": y},
            {"spatial": h * w, "channels": wd, "batch": n},
            order=order,
        )
        offset += wd
    np.testing.assert_array_equal(y, want)


# ---- shortcut, scale_channels, sam ---------------------------------------------------------


def _shortcut_on_emu(runner, x, sources, weights, wtype, norm, order):
    n, c, h, w = x.shape
    n_inputs = len(sources) + 1
    weighted = wtype != "none"
    table = _empty((n_inputs, c))
    if weighted:
        runner.run(
            "shortcut_weights_fwd_f32",
            {
                "n_inputs": n_inputs,
                "channels": c,
                "per_channel": int(wtype == "per_channel"),
                "normalization": ["none", "relu", "softmax"].index(norm),
            },
            {"weights": np.ascontiguousarray(weights, np.float32).reshape(-1), "table": table},
            {"channels": c},
            order=order,
        )
    y = _empty(x.shape)
    for i, s in enumerate(sources):
        runner.run(
            "shortcut_fwd_f32",
            {
                "batch": n,
                "channels": c,
                "spatial": h * w,
                "src_channels": s.shape[1],
                "source": i + 1,
                "first": int(i == 0),
                "weighted": int(weighted),
            },
            {"x": x if i == 0 else y, "source": s, "table": table, "y": y},
            {"spatial": h * w, "channels": c, "batch": n},
            order=order,
        )
    return y


SHORTCUT_WEIGHTS = [("none", "none")] + [
    (t, n) for t in ("per_feature", "per_channel") for n in ("none", "relu", "softmax")
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("wtype,norm", SHORTCUT_WEIGHTS)
def test_shortcut(emu_runner, order, wtype, norm):
    n, c, h, w = 2, 5, 7, 3
    x = _rand((n, c, h, w), 8)
    sources = [_rand((n, 3, h, w), 9), _rand((n, 7, h, w), 10)]  # fewer and more channels
    weights = None
    if wtype != "none":
        count = 3 * (c if wtype == "per_channel" else 1)
        weights = _rand(count, 11, 1.0)
    want = np.empty_like(x)
    combine.shortcut_forward(x, sources, weights, wtype, norm, want)
    y = _shortcut_on_emu(emu_runner, x, sources, weights, wtype, norm, order)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_shortcut_yolo_case_exact(emu_runner):
    x, s = _rand((1, 7, 13, 13), 12), _rand((1, 7, 13, 13), 13)
    y = _shortcut_on_emu(emu_runner, x, [s], None, "none", "none", "forward")
    np.testing.assert_array_equal(y, x + s)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("scale_wh", [False, True])
def test_scale_channels(emu_runner, order, scale_wh):
    n, c, h, w = 2, 7, 5, 3
    x_from = _rand((n, c, h, w), 14)
    scale = _rand((n, 1, h, w) if scale_wh else (n, c, 1, 1), 15)
    want = np.empty_like(x_from)
    combine.scale_channels_forward(x_from, scale, want, scale_wh)
    y = _empty(x_from.shape)
    emu_runner.run(
        "scale_channels_fwd_f32",
        {"batch": n, "channels": c, "spatial": h * w, "scale_wh": int(scale_wh)},
        {"x_from": x_from, "scale": scale, "y": y},
        {"spatial": h * w, "channels": c, "batch": n},
        order=order,
    )
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("order", ORDERS)
def test_sam(emu_runner, order):
    x_from, x = _rand((1, 5, 7, 7), 16), _rand((1, 5, 7, 7), 17)
    want = np.empty_like(x)
    combine.sam_forward(x_from, x, want)
    y = _empty(x.shape)
    emu_runner.run(
        "sam_fwd_f32", {"n": x.size}, {"x_from": x_from, "x": x, "y": y}, {"n": x.size}, order=order
    )
    np.testing.assert_array_equal(y, want)


# ---- upsample, reorg -----------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "shape,stride,scale",
    [
        ((1, 3, 13, 13), 2, 1.0),
        ((2, 5, 7, 1), 3, 0.5),
        ((1, 7, 1, 1), 2, 1.0),
        ((1, 3, 6, 4), -2, 1.0),
        ((2, 5, 7, 5), -2, 0.25),
        ((1, 3, 9, 9), -3, 2.0),
    ],
)
def test_upsample(emu_runner, order, shape, stride, scale):
    x = _rand(shape, 18)
    out_shape = resample.upsample_output_shape(shape, stride)
    want = np.empty(out_shape, np.float32)
    resample.upsample_forward(x, want, stride, scale)
    y = _empty(out_shape)
    n, c, h, w = shape
    oh, ow = out_shape[2:]
    emu_runner.run(
        "upsample_fwd_f32",
        {
            "planes": n * c,
            "height": h,
            "width": w,
            "out_h": oh,
            "out_w": ow,
            "stride": stride,
            "scale": scale,
        },
        {"x": x, "y": y},
        {"out_w": ow, "out_h": oh, "planes": n * c},
        order=order,
    )
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "shape,stride,reverse,layer",
    [
        ((1, 4, 6, 6), 2, False, "reorg"),
        ((2, 9, 6, 3), 3, False, "reorg"),
        ((1, 8, 3, 5), 2, True, "reorg"),
        ((2, 4, 1, 1), 2, True, "reorg"),
        ((1, 3, 6, 10), 2, False, "reorg3d"),
        ((2, 2, 9, 3), 3, False, "reorg3d"),
        ((1, 16, 3, 5), 2, True, "reorg3d"),
    ],
)
def test_reorg(emu_runner, order, shape, stride, reverse, layer):
    x = _rand(shape, 19)
    out_shape = resample.reorg_output_shape(shape, stride, reverse)
    want = np.empty(out_shape, np.float32)
    resample.reorg_forward(x, want, stride, reverse, layer)
    y = _empty(out_shape)
    # Both layers are reorg_cpu with forward=reverse: [reorg] (Darknet's reorg_old) on the
    # input's own (w, h, c), [reorg3d] on the output's.
    n, sc, sh, sw = out_shape if layer == "reorg3d" else shape
    emu_runner.run(
        "reorg_fwd_f32",
        {
            "batch": n,
            "width": sw,
            "height": sh,
            "channels": sc,
            "stride": stride,
            "reverse": int(reverse),
        },
        {"x": x, "y": y},
        {"width": sw, "height": sh, "slices": n * sc},
        order=order,
    )
    np.testing.assert_array_equal(y, want)


# ---- softmax, yolo -------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "shape,groups,temperature",
    [
        ((2, 1000), 1, 1.0),
        ((3, 35), 5, 0.5),
        ((1, 7), 7, 2.0),
        ((2, 3, 5, 7), 3, 1.0),
    ],
)
def test_softmax(emu_runner, order, shape, groups, temperature):
    x = _rand(shape, 20)
    want = np.empty_like(x)
    heads.softmax_forward(x, want, groups, temperature)
    y = _empty(shape)
    features = x.size // shape[0]
    rows = shape[0] * groups
    emu_runner.run(
        "softmax_fwd_f32",
        {"rows": rows, "n": features // groups, "temperature": temperature},
        {"x": x, "y": y},
        {"rows": rows},
        order=order,
    )
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "shape,anchors,classes,scale_x_y,new_coords",
    [
        ((1, 255, 13, 13), 3, 80, 1.0, False),
        ((2, 3 * 7, 7, 5), 3, 2, 1.05, False),
        ((1, 2 * 8, 1, 1), 2, 3, 2.0, True),
        ((1, 5, 7, 7), 1, 0, 1.2, False),
    ],
)
def test_yolo(emu_runner, order, shape, anchors, classes, scale_x_y, new_coords):
    x = _rand(shape, 21)
    want = np.empty_like(x)
    heads.yolo_forward(x, want, anchors, classes, scale_x_y, new_coords)
    y = _empty(shape)
    n, c, h, w = shape
    emu_runner.run(
        "yolo_fwd_f32",
        {
            "batch": n,
            "anchors": anchors,
            "classes": classes,
            "spatial": h * w,
            "new_coords": int(new_coords),
            "scale_x_y": scale_x_y,
        },
        {"x": x, "y": y},
        {"spatial": h * w, "channels": c, "batch": n},
        order=order,
    )
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)


def test_activations_stay_finite_on_saturating_inputs(any_math_runner):
    # Both builds (IEEE and -ffast-math): exp overflow must not turn into NaN.
    x = np.array([1e4, -1e4, 88.8, -88.8, 100.0, -100.0, 0.0, 30.0, -30.0], np.float32)
    for name in ACTIVATIONS:
        if name in CHANNEL_ACTIVATIONS:
            continue
        y = _empty(x.shape)
        any_math_runner.run("activation_fwd_f32", {"n": x.size, "act": ACTIVATION_ID[name]},
                            {"x": x, "y": y}, {"n": x.size})
        want = x.copy().reshape(1, -1)
        cpu_act.activate(want, ACTIVATION_ID[name])
        assert np.isfinite(y).all(), (name, y)
        np.testing.assert_allclose(y, want.reshape(-1), rtol=2e-5, atol=1e-6, err_msg=name)


def test_the_fast_math_build_leaves_subnormals_alone(fast_math_runner):
    # Loading it must not switch the process to flush-to-zero (the CPU reference would change).
    tiny = np.array([1e-40], np.float32)
    assert (tiny * np.float32(1.0))[0] != 0.0
    assert fast_math_runner is not None
