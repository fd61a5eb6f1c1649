"""Tests of the Cython non-GEMM layers: pooling, resample, combine, heads.

References: NumPy formulas in reference.py (sliding windows over -inf padding, reshapes and
transposes, broadcasting), OpenCV DNN's Darknet importer on tiny cfgs with weights files
written here, hand-computed Darknet values, and the real Darknet's ``[yolo]`` outputs in
../shared/golden.
"""

from __future__ import annotations

import importlib.util
import math
import re

import numpy as np
import pytest
from opencv_ref import opencv_layer_names, opencv_layer_outputs, write_darknet_weights
from reference import (
    np_depth_to_space,
    np_maxpool,
    np_reorg_cpu,
    np_reorg_old,
    np_shortcut,
    np_softmax,
    np_space_to_depth,
    np_upsample_reverse,
    np_yolo,
)
from shared_paths import SHARED

from darknet_metal.cpu import combine, executor, heads, pooling, resample
from darknet_metal.cpu import yolo as cpu_yolo
from darknet_metal.errors import ArgumentError, CfgError
from darknet_metal.model.cfg import parse_cfg_text
from darknet_metal.ops import build_layers

GOLDEN = SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny"
FLT_MAX = float(np.finfo(np.float32).max)
DTYPES = [np.float32, np.float64]


def _have_cv2_darknet() -> bool:
    if importlib.util.find_spec("cv2") is None:
        return False
    import cv2

    return hasattr(cv2, "dnn") and hasattr(cv2.dnn, "readNetFromDarknet")


needs_cv2 = pytest.mark.skipif(
    not _have_cv2_darknet(), reason="needs opencv-python with the Darknet importer"
)


def _rand(shape, seed, dtype=np.float32, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _close_to_opencv(ours, ref):
    tol = 1e-4 * np.abs(ref).max() + 1e-5
    assert np.abs(ours.astype(np.float64) - ref).max() <= tol


class TinyNet:
    """A cfg + weights pair in a temp dir, run by OpenCV."""

    def __init__(self, tmp_path, c, h, w, body, arrays):
        self.cfg = tmp_path / "net.cfg"
        self.weights = tmp_path / "net.weights"
        self.cfg.write_text(f"[net]\nwidth={w}\nheight={h}\nchannels={c}\n\n{body}")
        write_darknet_weights(self.weights, arrays)

    def outputs(self, x, layers):
        return opencv_layer_outputs(self.cfg, self.weights, x, layers)


def _conv1x1(filters, activation="linear"):
    return f"[convolutional]\nfilters={filters}\nsize=1\nstride=1\nactivation={activation}\n\n"


# ---------------------------------------------------------------------------------------
# maxpool / avgpool


POOL_CASES = [
    # size, stride_x, stride_y, padding, input shape
    (2, 2, 2, 1, (2, 3, 13, 13)),  # yolov3-tiny, default padding size-1
    (2, 1, 1, 1, (2, 3, 13, 13)),  # keeps 13x13
    (3, 1, 1, 2, (2, 5, 5, 7)),
    (5, 1, 1, 4, (2, 3, 13, 13)),  # SPP
    (3, 2, 2, 2, (2, 7, 5, 7)),
    (2, 2, 1, 1, (2, 3, 5, 7)),  # unequal strides
    (3, 3, 2, 0, (2, 3, 7, 5)),
    (2, 2, 2, 0, (2, 3, 5, 7)),
    (1, 1, 1, 0, (2, 3, 1, 5)),
    (4, 3, 3, 1, (2, 5, 13, 1)),
    (1, 1, 1, 2, (1, 2, 3, 4)),  # border windows entirely outside the image
]


@pytest.mark.parametrize("size,sx,sy,padding,shape", POOL_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_maxpool_matches_sliding_window(size, sx, sy, padding, shape, dtype):
    x = _rand(shape, size * 10 + sx, dtype)
    ref = np_maxpool(x, size, sx, sy, padding)
    out = np.empty(ref.shape, dtype)
    pooling.maxpool_forward(x, out, size, sx, sy, padding)
    np.testing.assert_array_equal(out, ref.astype(dtype))


def test_maxpool_size2_stride1_keeps_13x13_and_pads_bottom_right():
    x = np.arange(13 * 13, dtype=np.float32).reshape(1, 1, 13, 13)
    out = np.empty((1, 1, 13, 13), np.float32)
    pooling.maxpool_forward(x, out, 2, 1, 1, 1)
    # Increasing values: each window's max is its bottom-right in-image element.
    expected = x[0, 0, np.minimum(np.arange(13) + 1, 12)][:, np.minimum(np.arange(13) + 1, 12)]
    np.testing.assert_array_equal(out[0, 0], expected)


def test_maxpool_window_outside_image_is_minus_flt_max():
    out = np.empty((1, 1, 4, 5), np.float32)
    pooling.maxpool_forward(np.ones((1, 1, 2, 3), np.float32), out, 1, 1, 1, 2)
    assert out[0, 0, 0, 0] == -FLT_MAX and out[0, 0, 1, 1] == 1.0


@needs_cv2
@pytest.mark.parametrize(
    "size,stride,hw", [(2, 2, 13), (2, 1, 13), (3, 1, 7), (5, 1, 13), (3, 2, 9)]
)
def test_maxpool_matches_opencv(tmp_path, size, stride, hw):
    c = 3
    net = TinyNet(tmp_path, c, hw, hw, f"[maxpool]\nsize={size}\nstride={stride}\n\n", [])
    x = _rand((2, c, hw, hw), hw + size)
    (ref,) = net.outputs(x, [0])
    out = np.empty(ref.shape, np.float32)
    pooling.maxpool_forward(x, out, size, stride, stride, size - 1)
    _close_to_opencv(out, ref)


@pytest.mark.parametrize("c,out_c", [(7, 3), (5, 5), (6, 1), (4, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_maxpool_depth(c, out_c, dtype):
    x = _rand((2, c, 5, 7), c, dtype)
    ref = np.stack([x[:, g::out_c].max(axis=1) for g in range(out_c)], axis=1)
    out = np.empty((2, out_c, 5, 7), dtype)
    pooling.maxpool_depth_forward(x, out)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 7, 13, 13), (2, 5, 1, 1), (2, 3, 1, 13)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_avgpool(shape, dtype):
    x = _rand(shape, 4, dtype)
    out = np.empty(shape[:2] + (1, 1), dtype)
    pooling.avgpool_forward(x, out)
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(
        out[:, :, 0, 0], x.astype(np.float64).mean(axis=(2, 3)), rtol=rtol, atol=rtol
    )


@needs_cv2
def test_avgpool_matches_opencv(tmp_path):
    net = TinyNet(tmp_path, 5, 7, 9, "[avgpool]\n\n", [])
    x = _rand((2, 5, 7, 9), 8)
    (ref,) = net.outputs(x, [0])
    out = np.empty((2, 5, 1, 1), np.float32)
    pooling.avgpool_forward(x, out)
    _close_to_opencv(out, ref)


# ---------------------------------------------------------------------------------------
# upsample / reorg


@pytest.mark.parametrize("stride,scale", [(2, 1.0), (3, 0.5), (1, 2.0), (4, -1.5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_upsample(stride, scale, dtype):
    x = _rand((2, 3, 5, 7), stride, dtype)
    ref = x.repeat(stride, axis=2).repeat(stride, axis=3) * dtype(scale)
    out = np.empty(ref.shape, dtype)
    resample.upsample_forward(x, out, stride, scale)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("stride,scale,shape", [(2, 1.0, (2, 3, 6, 8)), (3, 0.25, (2, 5, 9, 3))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_upsample_sums_blocks(stride, scale, shape, dtype):
    n, c, h, w = shape
    x = _rand(shape, 3, dtype)
    ref = (x.astype(np.float64) * scale).reshape(n, c, h // stride, stride, w // stride, stride)
    ref = ref.sum(axis=(3, 5))
    out = np.empty(ref.shape, dtype)
    resample.upsample_forward(x, out, -stride, scale)
    rtol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)


@needs_cv2
def test_upsample_matches_opencv(tmp_path):
    net = TinyNet(tmp_path, 3, 5, 7, "[upsample]\nstride=2\n\n", [])
    x = _rand((2, 3, 5, 7), 1)
    (ref,) = net.outputs(x, [0])
    out = np.empty((2, 3, 10, 14), np.float32)
    resample.upsample_forward(x, out, 2)
    _close_to_opencv(out, ref)


@pytest.mark.parametrize("stride,shape", [(2, (2, 8, 6, 4)), (2, (2, 4, 2, 6)), (3, (2, 9, 6, 3))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reorg_forward(stride, shape, dtype):
    x = _rand(shape, stride, dtype)
    ref = np_reorg_old(x, stride)
    out = np.empty(ref.shape, dtype)
    resample.reorg_forward(x, out, stride)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("stride,shape", [(2, (2, 8, 3, 2)), (2, (2, 4, 1, 3)), (3, (2, 18, 2, 1))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reorg_reverse_is_depth_to_space(stride, shape, dtype):
    # Darknet's reverse [reorg] indexes with the reverse layer's own input dims, so it
    # undoes a plain space-to-depth, not its own forward direction.
    n, c, h, w = shape
    x = _rand(shape, stride + 1, dtype)
    out = np.empty((n, c // stride**2, h * stride, w * stride), dtype)
    resample.reorg_forward(x, out, stride, reverse=True)
    np.testing.assert_array_equal(np_space_to_depth(out, stride), x)


@needs_cv2
@pytest.mark.parametrize("n", [1, 2])
def test_reorg_matches_opencv(tmp_path, n):
    net = TinyNet(tmp_path, 8, 6, 4, "[reorg]\nstride=2\n\n", [])
    x = _rand((n, 8, 6, 4), 5)
    (ref,) = net.outputs(x, [0])
    out = np.empty(ref.shape, np.float32)
    resample.reorg_forward(x, out, 2)
    _close_to_opencv(out, ref)


@pytest.mark.parametrize("stride,shape", [(2, (2, 3, 6, 4)), (3, (1, 2, 9, 6))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reorg3d_is_space_to_depth(stride, shape, dtype):
    x = _rand(shape, stride, dtype)
    ref = np_space_to_depth(x, stride)
    out = np.empty(ref.shape, dtype)
    resample.reorg_forward(x, out, stride, layer="reorg3d")
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("stride,shape", [(2, (2, 16, 3, 2)), (2, (1, 32, 1, 3))])
def test_reorg3d_reverse_is_darknets_index_map(stride, shape):
    # forward_reorg_layer with reverse=1: reorg_cpu(input, out_w, out_h, out_c, ..., 1).
    n, c, h, w = shape
    x = _rand(shape, 4, np.float32)
    out = np.empty((n, c // stride**2, h * stride, w * stride), np.float32)
    resample.reorg_forward(x, out, stride, reverse=True, layer="reorg3d")
    want = np_reorg_cpu(x, w * stride, h * stride, c // stride**2, stride, True)
    np.testing.assert_array_equal(out.ravel(), want)
    with pytest.raises(ArgumentError, match="stride\\^4"):
        resample.reorg_forward(np.zeros((1, 4, 2, 2), np.float32),
                               np.zeros((1, 1, 4, 4), np.float32), 2, True, "reorg3d")


# ---------------------------------------------------------------------------------------
# shortcut / scale_channels / sam


SHORTCUT_CASES = [
    # source channels, weights_type, weights_normalization
    ([5], "none", "none"),
    ([7], "none", "none"),  # source wider: extra channels ignored
    ([3], "none", "none"),  # source narrower: only the first channels get added
    ([5, 2], "none", "none"),
    ([5], "per_feature", "none"),
    ([5, 7], "per_feature", "relu"),
    ([5, 3], "per_feature", "softmax"),
    ([5], "per_channel", "none"),
    ([4, 5], "per_channel", "relu"),
    ([5, 6], "per_channel", "softmax"),
]


@pytest.mark.parametrize("src_channels,wtype,norm", SHORTCUT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shortcut(src_channels, wtype, norm, dtype):
    x = _rand((2, 5, 3, 7), 1, dtype)
    sources = [_rand((2, cs, 3, 7), 10 + i, dtype) for i, cs in enumerate(src_channels)]
    k = len(sources) + 1
    weights = None
    if wtype != "none":
        count = k if wtype == "per_feature" else k * 5
        weights = np.random.default_rng(5).uniform(-1.5, 1.5, count).astype(np.float32)
    ref = np_shortcut(x, sources, weights, wtype, norm)
    out = np.empty_like(x)
    combine.shortcut_forward(x, sources, weights, wtype, norm, out)
    rtol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)
    combine.shortcut_forward(x, sources, weights, wtype, norm, x)  # in place on x
    np.testing.assert_array_equal(x, out)


def test_shortcut_accepts_darknet_aliases():
    x, s = _rand((1, 2, 3, 3), 1), _rand((1, 2, 3, 3), 2)
    w = np.array([0.5, -0.25], np.float32)
    a, b = np.empty_like(x), np.empty_like(x)
    combine.shortcut_forward(x, [s], w, "per_layer", "avg_relu", a)
    combine.shortcut_forward(x, [s], w, "per_feature", "relu", b)
    np.testing.assert_array_equal(a, b)


@needs_cv2
@pytest.mark.parametrize("c2", [4, 6, 2])
def test_shortcut_matches_opencv(tmp_path, c2):
    c, h, w = 4, 5, 7
    w1 = _rand((c2, c), 3)
    body = _conv1x1(c) + _conv1x1(c2) + "[shortcut]\nfrom=-2\nactivation=linear\n\n"
    net = TinyNet(tmp_path, c, h, w, body, [np.zeros(c), np.eye(c), np.zeros(c2), w1])
    l0, l1, l2 = net.outputs(_rand((2, c, h, w), 4), [0, 1, 2])
    out = np.empty_like(l1)
    combine.shortcut_forward(l1, [l0], None, "none", "none", out)
    _close_to_opencv(out, l2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_channels(dtype):
    x = _rand((2, 5, 3, 7), 1, dtype)
    per_channel = _rand((2, 5, 1, 1), 2, dtype)
    out = np.empty_like(x)
    combine.scale_channels_forward(x, per_channel, out)
    np.testing.assert_array_equal(out, per_channel * x)
    per_pixel = _rand((2, 1, 3, 7), 3, dtype)
    combine.scale_channels_forward(x, per_pixel, out, scale_wh=True)
    np.testing.assert_array_equal(out, per_pixel * x)


@needs_cv2
def test_scale_channels_matches_opencv(tmp_path):
    # OpenCV 4.14's Darknet scale_channels only accepts a batch of one.
    c, h, w = 5, 3, 7
    body = _conv1x1(c) + "[avgpool]\n\n[scale_channels]\nfrom=-2\n\n"
    net = TinyNet(tmp_path, c, h, w, body, [np.zeros(c), np.eye(c)])
    l0, l1, l2 = net.outputs(_rand((1, c, h, w), 6), [0, 1, 2])
    out = np.empty_like(l0)
    combine.scale_channels_forward(l0, l1, out)
    _close_to_opencv(out, l2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sam(dtype):
    a, b = _rand((2, 3, 5, 7), 1, dtype), _rand((2, 3, 5, 7), 2, dtype)
    out = np.empty_like(a)
    combine.sam_forward(a, b, out)
    np.testing.assert_array_equal(out, a * b)


@needs_cv2
def test_sam_matches_opencv(tmp_path):
    c, h, w = 3, 5, 7
    body = _conv1x1(c) + _conv1x1(c) + "[sam]\nfrom=-2\n\n"
    net = TinyNet(tmp_path, c, h, w, body, [np.zeros(c), np.eye(c), np.zeros(c), _rand((c, c), 1)])
    l0, l1, l2 = net.outputs(_rand((2, c, h, w), 7), [0, 1, 2])
    out = np.empty_like(l0)
    combine.sam_forward(l0, l1, out)
    _close_to_opencv(out, l2)


# ---------------------------------------------------------------------------------------
# softmax / yolo


@pytest.mark.parametrize(
    "features,groups,temperature", [(7, 1, 1.0), (12, 3, 1.0), (10, 5, 0.5), (9, 1, 2.5)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(features, groups, temperature, dtype):
    x = _rand((2, features), features, dtype, scale=3.0)
    out = np.empty_like(x)
    heads.softmax_forward(x, out, groups, temperature)
    rtol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, np_softmax(x, groups, temperature), rtol=rtol, atol=rtol)
    four_d = np.empty((2, features, 1, 1), dtype)
    heads.softmax_forward(x.reshape(2, features, 1, 1), four_d, groups, temperature)
    np.testing.assert_array_equal(four_d.reshape(2, features), out)


def test_softmax_float32_is_darknets_arithmetic():
    # e = (float) exp((double)(x/T - max/T)), summed in float, then each e / sum.
    x = _rand((1, 9), 1, scale=4.0)
    t = np.float32(0.7)
    m = x.max()
    e = [np.float32(math.exp(float(v / t - m / t))) for v in x[0]]
    total = np.float32(0)
    for v in e:
        total = total + v
    out = np.empty_like(x)
    heads.softmax_forward(x, out, 1, 0.7)
    np.testing.assert_array_equal(out[0], np.array([v / total for v in e], np.float32))


@needs_cv2
def test_softmax_matches_opencv(tmp_path):
    net = TinyNet(tmp_path, 6, 3, 5, "[avgpool]\n\n[softmax]\n\n", [])
    l0, l1 = net.outputs(_rand((2, 6, 3, 5), 3, scale=3.0), [0, 1])
    out = np.empty((2, 6), np.float32)
    heads.softmax_forward(l0.reshape(2, 6), out)
    _close_to_opencv(out, l1.reshape(2, 6))


@pytest.mark.parametrize(
    "n,classes,scale_x_y,new_coords,hw",
    [(3, 80, 1.0, False, (13, 13)), (2, 3, 1.05, False, (5, 7)), (3, 1, 1.2, False, (1, 13)),
     (1, 0, 2.0, True, (7, 1)), (3, 2, 1.1, True, (4, 4))],
)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "vectorised"])
def test_yolo(n, classes, scale_x_y, new_coords, hw, dtype, exact):
    x = _rand((2, n * (5 + classes), *hw), n + classes, dtype, scale=3.0)
    out = np.empty_like(x)
    cpu_yolo.yolo_step(x, out, n, classes, scale_x_y, new_coords, exact=exact).run()
    rtol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(
        out, np_yolo(x, n, classes, scale_x_y, new_coords), rtol=rtol, atol=rtol
    )


@needs_cv2
def test_yolo_matches_opencv_detections(tmp_path):
    # OpenCV's [yolo] emits one row per (sample, y, x, anchor): box centre x, y relative to
    # the map, w, h, objectness, objectness*class (zeroed below thresh, 0 here). The x, y,
    # objectness and class columns follow from Darknet's layer.output.
    import cv2

    n, classes, h, w, sxy = 2, 3, 3, 5, 1.1
    c = n * (5 + classes)
    body = _conv1x1(c) + (
        f"[yolo]\nmask=1,2\nanchors=10,14, 23,27, 37,58\nclasses={classes}\nnum=3\n"
        f"scale_x_y={sxy}\nthresh=0\n"
    )
    net_files = TinyNet(tmp_path, c, h, w, body, [np.zeros(c), np.eye(c)])
    net = cv2.dnn.readNetFromDarknet(str(net_files.cfg), str(net_files.weights))
    x = _rand((2, c, h, w), 12, scale=2.0)
    net.setInput(x)
    rows = net.forward(opencv_layer_names(net)[1]).reshape(2, h, w, n, 5 + classes)
    out = np.empty_like(x)
    cpu_yolo.yolo_forward(x, out, n, classes, sxy)
    v = out.reshape(2, n, 5 + classes, h, w).transpose(0, 3, 4, 1, 2)  # (N, y, x, anchor, k)
    ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    ours = np.concatenate(
        [
            ((xs[None, :, :, None] + v[..., 0]) / w)[..., None],
            ((ys[None, :, :, None] + v[..., 1]) / h)[..., None],
            v[..., 4:5],
            v[..., 4:5] * v[..., 5:],
        ],
        axis=-1,
    )
    theirs = rows[..., [0, 1, 4, *range(5, 5 + classes)]]
    _close_to_opencv(ours, theirs)


@pytest.mark.skipif(not GOLDEN.is_dir(), reason="golden Darknet outputs not available")
@pytest.mark.parametrize("stem", ["dog", "coffee"])
@pytest.mark.parametrize("conv,yolo,hw", [(15, 16, 13), (22, 23, 26)])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "vectorised"])
def test_yolo_matches_darknet_golden(stem, conv, yolo, hw, exact):
    x = np.fromfile(GOLDEN / f"{stem}_layer{conv}.bin", "<f4").reshape(1, 255, hw, hw)
    expected = np.fromfile(GOLDEN / f"{stem}_layer{yolo}.bin", "<f4").reshape(1, 255, hw, hw)
    out = np.empty_like(x)
    # yolov3-tiny: mask of 3 anchors, 80 classes.
    cpu_yolo.yolo_step(x, out, 3, 80, exact=exact).run()
    # w and h are copied untouched; the logistic channels differ by a few ulps at most
    # because the golden binary was built with fast-math, whose vectorised expf rounds
    # differently from the scalar expf used here.
    wh = np.r_[2:4, 87:89, 172:174]
    np.testing.assert_array_equal(out[:, wh], expected[:, wh])
    assert np.abs(out - expected).max() <= 1.2e-7


# ---------------------------------------------------------------------------------------
# Batches are independent: a batch of two equals each sample alone.


def test_batch_items_are_independent():
    x = _rand((2, 8, 6, 4), 1)
    src = _rand((2, 8, 6, 4), 2)
    cases = [
        (x, lambda a, o: pooling.maxpool_forward(a, o, 3, 2, 2, 2), (8, 3, 2)),
        (x, lambda a, o: resample.reorg_forward(a, o, 2), (32, 3, 2)),
        (x, lambda a, o: heads.softmax_forward(a, o, 2, 1.0), (8, 6, 4)),
        (_rand((2, 12, 3, 5), 3), lambda a, o: cpu_yolo.yolo_forward(a, o, 2, 1, 1.1), (12, 3, 5)),
    ]
    for inp, fn, shape in cases:
        both = np.empty((2, *shape), np.float32)
        fn(inp, both)
        for b in range(2):
            one = np.empty((1, *shape), np.float32)
            fn(inp[b : b + 1].copy(), one)
            np.testing.assert_array_equal(both[b : b + 1], one)
    both = np.empty_like(x)
    combine.shortcut_forward(
        x, [src], np.array([0.3, 1.2], np.float32), "per_feature", "softmax", both
    )
    for b in range(2):
        one = np.empty((1, 8, 6, 4), np.float32)
        combine.shortcut_forward(
            x[b : b + 1].copy(), [src[b : b + 1].copy()], np.array([0.3, 1.2], np.float32),
            "per_feature", "softmax", one,
        )  # fmt: skip
        np.testing.assert_array_equal(both[b : b + 1], one)


# ---------------------------------------------------------------------------------------
# Darknet's flat index maps stay inside the buffers, including the odd cases (sizes not
# divisible by the stride, windows outside the image, sources of other widths).

GUARD = 1e30


def _guarded(shape, fill, data=None):
    size = int(np.prod(shape))
    buf = np.full(size + 64, fill, np.float32)
    view = buf[32 : 32 + size].reshape(shape)
    if data is not None:
        view[...] = data
    return buf, view


GUARD_CASES = [
    ((2, 3, 5, 7), (2, 3, 5, 7), lambda x, o: pooling.maxpool_forward(x, o, 2, 1, 1, 1)),
    ((2, 3, 5, 7), (2, 3, 2, 2), lambda x, o: pooling.maxpool_forward(x, o, 3, 3, 2, 0)),
    ((2, 7, 5, 3), (2, 3, 5, 3), pooling.maxpool_depth_forward),
    ((2, 3, 5, 7), (2, 3, 1, 1), pooling.avgpool_forward),
    ((2, 3, 5, 7), (2, 3, 10, 14), lambda x, o: resample.upsample_forward(x, o, 2)),
    ((2, 3, 7, 5), (2, 3, 3, 2), lambda x, o: resample.upsample_forward(x, o, -2)),
    ((2, 8, 6, 4), (2, 32, 3, 2), lambda x, o: resample.reorg_forward(x, o, 2)),
    ((2, 8, 3, 2), (2, 2, 6, 4), lambda x, o: resample.reorg_forward(x, o, 2, True)),
    ((2, 6, 1, 1), (2, 6, 1, 1), lambda x, o: heads.softmax_forward(x, o, 3)),
    ((2, 12, 3, 5), (2, 12, 3, 5), lambda x, o: cpu_yolo.yolo_forward(x, o, 2, 1, 1.1)),
    ((2, 3, 5, 7), (2, 3, 5, 7), lambda x, o: combine.sam_forward(x, x, o)),
]


@pytest.mark.parametrize("in_shape,out_shape,fn", GUARD_CASES)
def test_no_access_outside_buffers(in_shape, out_shape, fn):
    _, x = _guarded(in_shape, GUARD, _rand(in_shape, 1))
    out_buf, out = _guarded(out_shape, 7.0)
    fn(x, out)
    assert np.all(out_buf[:32] == 7.0) and np.all(out_buf[-32:] == 7.0)
    # No guard value was read into a sum or a max (NaN is Darknet's 0/0 for empty windows).
    assert not np.any(np.abs(out) >= GUARD / 10)


def test_shortcut_and_scale_channels_stay_inside_buffers():
    _, x = _guarded((2, 5, 3, 7), GUARD, _rand((2, 5, 3, 7), 1))
    _, wide = _guarded((2, 7, 3, 7), GUARD, _rand((2, 7, 3, 7), 2))
    _, narrow = _guarded((2, 2, 3, 7), GUARD, _rand((2, 2, 3, 7), 3))
    _, per_pixel = _guarded((2, 1, 3, 7), GUARD, _rand((2, 1, 3, 7), 4))
    out_buf, out = _guarded((2, 5, 3, 7), 7.0)
    weights = np.ones(15, np.float32)
    combine.shortcut_forward(x, [wide, narrow], weights, "per_channel", "relu", out)
    combine.scale_channels_forward(x, per_pixel, out, scale_wh=True)
    assert np.all(out_buf[:32] == 7.0) and np.all(out_buf[-32:] == 7.0)
    assert not np.any(np.abs(out) >= GUARD / 10)


# ---------------------------------------------------------------------------------------
# Bad input.


def test_bad_shapes_raise_value_errors_naming_the_expectation():
    x = np.zeros((2, 4, 6, 6), np.float32)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 3, 3\)"):
        pooling.maxpool_forward(x, np.zeros((2, 4, 6, 6), np.float32), 2, 2, 2, 1)
    with pytest.raises(ValueError, match="dtype of x"):
        pooling.maxpool_forward(x, np.zeros((2, 4, 3, 3), np.float64), 2, 2, 2, 1)
    with pytest.raises(ValueError, match="empty output"):
        pooling.maxpool_forward(x, np.zeros((2, 4, 1, 1), np.float32), 9, 1, 1, 0)
    with pytest.raises(ValueError, match="stride"):
        pooling.maxpool_forward(x, np.zeros((2, 4, 6, 6), np.float32), 2, 0, 1, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        pooling.avgpool_forward(x[:, ::2], np.zeros((2, 2, 1, 1), np.float32))
    with pytest.raises(ValueError, match="must not be 0"):
        resample.upsample_forward(x, np.zeros((2, 4, 6, 6), np.float32), 0)
    with pytest.raises(ValueError, match="divisible by stride"):
        resample.reorg_forward(
            np.zeros((2, 3, 6, 6), np.float32), np.zeros((2, 12, 3, 3), np.float32), 2
        )
    with pytest.raises(ValueError, match="must divide"):
        resample.reorg_forward(
            np.zeros((2, 4, 5, 6), np.float32), np.zeros((2, 16, 2, 3), np.float32), 2
        )
    with pytest.raises(ValueError, match="needs 2 weights"):
        combine.shortcut_forward(x, [x.copy()], np.ones(3), "per_feature", "none", np.empty_like(x))
    with pytest.raises(ValueError, match="weights_type must be one of"):
        combine.shortcut_forward(x, [x.copy()], None, "per_pixel", "none", np.empty_like(x))
    with pytest.raises(ValueError, match=r"sources\[0\] must have shape"):
        combine.shortcut_forward(x, [np.zeros((2, 4, 3, 3), np.float32)], None, "none", "none", x)
    with pytest.raises(ValueError, match="at least one source"):
        combine.shortcut_forward(x, [], None, "none", "none", x)
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 4, 1, 1\)"):
        combine.scale_channels_forward(x, np.zeros((2, 4, 6, 6), np.float32), np.empty_like(x))
    with pytest.raises(ValueError, match="divide"):
        heads.softmax_forward(np.zeros((2, 7), np.float32), np.zeros((2, 7), np.float32), 2)
    with pytest.raises(ValueError, match="temperature"):
        heads.softmax_forward(np.zeros((2, 7), np.float32), np.zeros((2, 7), np.float32), 1, 0.0)
    with pytest.raises(ValueError, match="needs 255 input channels"):
        cpu_yolo.yolo_forward(x, np.empty_like(x), 3, 80)


# ---------------------------------------------------------------------------------------
# Native steps: bound once, run any number of times by the executor's GIL-free loop.


STEP_CASES = [
    # name, make_step(x, out), forward(x, out), x shape, out shape, NumPy reference, exact
    (
        "maxpool_2x2s2",
        lambda x, o: pooling.maxpool_step(x, o, 2, 2, 2, 0),
        lambda x, o: pooling.maxpool_forward(x, o, 2, 2, 2, 0),
        (2, 3, 8, 6),
        (2, 3, 4, 3),
        lambda x: np_maxpool(x, 2, 2, 2, 0),
        True,
    ),
    (
        "maxpool_padded",
        lambda x, o: pooling.maxpool_step(x, o, 3, 2, 1, 2),
        lambda x, o: pooling.maxpool_forward(x, o, 3, 2, 1, 2),
        (2, 3, 7, 5),
        (2, 3, 7, 3),
        lambda x: np_maxpool(x, 3, 2, 1, 2),
        True,
    ),
    (
        "maxpool_depth",
        pooling.maxpool_depth_step,
        pooling.maxpool_depth_forward,
        (2, 7, 5, 3),
        (2, 3, 5, 3),
        lambda x: np.stack([x[:, g::3].max(axis=1) for g in range(3)], axis=1),
        True,
    ),
    (
        "avgpool",
        pooling.avgpool_step,
        pooling.avgpool_forward,
        (2, 3, 5, 7),
        (2, 3, 1, 1),
        lambda x: x.astype(np.float64).mean(axis=(2, 3), keepdims=True),
        False,
    ),
    (
        "upsample",
        lambda x, o: resample.upsample_step(x, o, 2, 0.5),
        lambda x, o: resample.upsample_forward(x, o, 2, 0.5),
        (2, 3, 5, 7),
        (2, 3, 10, 14),
        lambda x: x.repeat(2, axis=2).repeat(2, axis=3) * x.dtype.type(0.5),
        True,
    ),
    (
        "upsample_reverse",
        lambda x, o: resample.upsample_step(x, o, -3, 0.25),
        lambda x, o: resample.upsample_forward(x, o, -3, 0.25),
        (2, 5, 9, 3),
        (2, 5, 3, 1),
        lambda x: np_upsample_reverse(x, 3, 0.25),
        False,
    ),
    (
        "reorg",
        lambda x, o: resample.reorg_step(x, o, 2),
        lambda x, o: resample.reorg_forward(x, o, 2),
        (2, 8, 6, 4),
        (2, 32, 3, 2),
        lambda x: np_reorg_old(x, 2),
        True,
    ),
    (
        "reorg_reverse",
        lambda x, o: resample.reorg_step(x, o, 3, True),
        lambda x, o: resample.reorg_forward(x, o, 3, True),
        (2, 18, 2, 1),
        (2, 2, 6, 3),
        lambda x: np_depth_to_space(x, 3),
        True,
    ),
]


@pytest.mark.parametrize(
    "make_step,forward,in_shape,out_shape,reference,exact",
    [case[1:] for case in STEP_CASES],
    ids=[case[0] for case in STEP_CASES],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_rerun_in_a_step_list(
    make_step, forward, in_shape, out_shape, reference, exact, dtype
):
    x = _rand(in_shape, 9, dtype)
    expected = np.empty(out_shape, dtype)
    forward(x, expected)
    ref = reference(x)
    if exact:
        np.testing.assert_array_equal(expected, ref.astype(dtype))
    else:
        rtol = 1e-5 if dtype == np.float32 else 1e-13
        np.testing.assert_allclose(expected, ref, rtol=rtol, atol=rtol)
    out = np.full(out_shape, np.nan, dtype)
    step = make_step(x, out)
    assert step.dtype == dtype
    steps = executor.StepList([step], None)
    for _ in range(2):
        out[...] = np.nan  # each run writes every output
        steps.run()
        np.testing.assert_array_equal(out, expected)
    # Bound to a stand-in for the program input, a step reads each pass's own input.
    standin = np.zeros(in_shape, dtype)
    steps = executor.StepList([make_step(standin, out)], standin)
    for _ in range(2):
        out[...] = np.nan
        steps.run(x)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "body,in_shape,kind,forward",
    [
        ("[maxpool]\nsize=2\nstride=2\n", (3, 8, 6), "maxpool",
         lambda x, o: pooling.maxpool_forward(x, o, 2, 2, 2, 1)),
        ("[maxpool]\nsize=3\nstride=1\n", (3, 5, 7), "maxpool",
         lambda x, o: pooling.maxpool_forward(x, o, 3, 1, 1, 2)),
        ("[maxpool]\nmaxpool_depth=1\nout_channels=2\n", (5, 4, 3), "maxpool_depth",
         pooling.maxpool_depth_forward),
        ("[avgpool]\n", (3, 5, 7), "avgpool", pooling.avgpool_forward),
        ("[upsample]\nstride=2\nscale=0.5\n", (3, 5, 7), "upsample",
         lambda x, o: resample.upsample_forward(x, o, 2, 0.5)),
        ("[upsample]\nstride=-2\n", (3, 6, 4), "upsample_reverse",
         lambda x, o: resample.upsample_forward(x, o, -2)),
        ("[reorg]\nstride=2\n", (8, 6, 4), "reorg",
         lambda x, o: resample.reorg_forward(x, o, 2)),
        ("[reorg]\nstride=2\nreverse=1\n", (8, 3, 2), "reorg_reverse",
         lambda x, o: resample.reorg_forward(x, o, 2, True)),
    ],
)  # fmt: skip
def test_pooling_and_resample_ops_give_native_steps(body, in_shape, kind, forward):
    c, h, w = in_shape
    (spec,) = build_layers(parse_cfg_text(f"[net]\nwidth={w}\nheight={h}\nchannels={c}\n\n{body}"))
    x = _rand((2, *in_shape), 11)
    out = np.full((2, *spec.out_shape), np.nan, np.float32)
    steps = spec.cpu_steps(None, [x], out, None)
    assert [step.kind for step in steps] == [kind]
    steps[0].run()
    expected = np.full_like(out, np.nan)
    forward(x, expected)
    assert not np.isnan(expected).any()
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(("c", "h", "w", "body", "shape"), [
    (3, 6, 4, "[reorg3d]\nstride=2", (12, 3, 2)),
    (16, 3, 2, "[reorg3d]\nstride=2\nreverse=1", (4, 6, 4)),
    (8, 6, 4, "[reorg]\nstride=2", (32, 3, 2)),
])
def test_reorg_layers_shapes(c, h, w, body, shape):
    (spec,) = build_layers(parse_cfg_text(f"[net]\nwidth={w}\nheight={h}\nchannels={c}\n\n{body}"))
    assert spec.out_shape == shape


@pytest.mark.parametrize(("c", "body", "message"), [
    (4, "[reorg3d]\nstride=2\nreverse=1", "stride^4"),
    (3, "[reorg]\nstride=2", "stride^2"),
    (3, "[reorg3d]\nstride=4", "does not divide"),
])
def test_reorg_layers_refuse_shapes_darknet_cannot_index(c, body, message):
    with pytest.raises(CfgError, match=re.escape(message)) as info:
        build_layers(parse_cfg_text(f"[net]\nwidth=6\nheight=6\nchannels={c}\n\n{body}"))
    assert info.value.line is not None and info.value.key == "stride"
