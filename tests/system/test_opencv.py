"""Whole networks against OpenCV DNN's Darknet importer, fed the same input and weights."""

import numpy as np
import pytest
from shared_paths import CFG_DIR, GOLDEN, YOLOV3_TINY

import darknet_metal as dm
from darknet_metal.model.weights import stored_params

cv2 = pytest.importorskip("cv2")
from opencv_ref import opencv_layer_names, write_darknet_weights  # noqa: E402


def close(ours, ref):
    """The agreement asked of every layer: max abs diff <= 1e-4 * max|ref| + 1e-5."""
    diff = float(np.abs(ours - ref).max())
    bound = 1e-4 * float(np.abs(ref).max()) + 1e-5
    return diff <= bound, diff, bound


def opencv_all_outputs(cfg, weights, x):
    net = cv2.dnn.readNetFromDarknet(str(cfg), str(weights))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    names = opencv_layer_names(net)
    order = sorted(names)
    net.setInput(x)
    outs = net.forward([names[i] for i in order])
    return {i: (names[i], out) for i, out in zip(order, outs, strict=True)}


def yolo_as_opencv_rows(out, anchors, net_w, net_h):
    """Darknet's [yolo] layer.output -> OpenCV's rows (cell row, cell col, anchor):
    x, y, w, h relative to the image, objectness, objectness x class probability."""
    n = len(anchors)
    _, h, w = out.shape
    y = out.reshape(n, -1, h, w)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    bx = (cols[None] + y[:, 0]) / w
    by = (rows[None] + y[:, 1]) / h
    bw = np.exp(y[:, 2]) * anchors[:, 0, None, None] / net_w
    bh = np.exp(y[:, 3]) * anchors[:, 1, None, None] / net_h
    obj = y[:, 4]
    probs = y[:, 5:] * obj[:, None]
    table = np.concatenate([np.stack([bx, by, bw, bh, obj], 1), probs], 1)  # (n, 5+C, h, w)
    return table.transpose(2, 3, 0, 1).reshape(h * w * n, -1)


#: Darknet normalises with sqrt(var + 1e-5); OpenCV's Darknet importer with sqrt(var + 1e-6).
DARKNET_BN_EPS, OPENCV_BN_EPS = 1e-5, 1e-6


def opencv_compensated_weights(net, path):
    """The network's weights for OpenCV, with the rolling variances raised by the epsilon
    difference so that both libraries divide by the same standard deviation."""
    arrays = []
    for spec in net.layers:
        for name, _ in stored_params(spec):
            array = net.params[spec.index][name].astype(np.float64)
            if name == "rolling_variance":
                array = array + (DARKNET_BN_EPS - OPENCV_BN_EPS)
            arrays.append(array)
    write_darknet_weights(path, arrays)
    return path


def compare_network(net, cfg, scratch, x):
    """Compare every layer OpenCV exposes; ``scratch`` is a path for OpenCV's weights file."""
    ref = opencv_all_outputs(cfg, opencv_compensated_weights(net, scratch), x)
    ours = net.forward(x, outputs=list(range(len(net.layers))))
    checked = 0
    for index, (name, ref_out) in ref.items():
        spec = net.layers[index]
        if spec.kind == "yolo":
            v = spec.values
            anchors = np.asarray(v["anchors"], np.float64).reshape(-1, 2)[v["mask"]]
            rows = yolo_as_opencv_rows(ours[index][0], anchors, net.input_shape[2],
                                       net.input_shape[1])
            ok, diff, bound = close(rows[:, :5], ref_out[:, :5])
            assert ok, f"layer {index} ({name}) boxes: diff {diff:.3g} > {bound:.3g}"
            # OpenCV zeroes class scores under its own threshold; compare the rest.
            kept = ref_out[:, 5:] > 0
            assert np.all(rows[:, 5:][~kept] < 0.3)
            if kept.any():
                ok, diff, bound = close(rows[:, 5:][kept], ref_out[:, 5:][kept])
                assert ok, f"layer {index} ({name}) classes: diff {diff:.3g} > {bound:.3g}"
        else:
            ok, diff, bound = close(ours[index], ref_out.reshape(ours[index].shape))
            assert ok, f"layer {index} {spec.kind} ({name}): diff {diff:.3g} > {bound:.3g}"
        checked += 1
    return checked


def test_yolov3_tiny_real_weights_every_layer(tmp_path):
    cfg, weights = YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights"
    net = dm.load(cfg, weights)
    x = np.fromfile(GOLDEN / "coffee_input.bin", "<f4").reshape(1, 3, 416, 416)
    assert compare_network(net, cfg, tmp_path / "w", x) == len(net.layers)


def random_darknet_weights(net, rng):
    """Arrays in .weights order with batch-norm statistics that are far from identity."""
    arrays = []
    for spec in net.layers:
        for name, shape in stored_params(spec):
            if name == "weights" and spec.kind == "convolutional":
                fan_in = shape[1]
                arrays.append(rng.uniform(-1, 1, shape) * np.sqrt(3.0 / fan_in))
            elif name == "rolling_variance":
                arrays.append(rng.uniform(0.5, 2.0, shape))
            elif name == "scales":
                arrays.append(rng.uniform(0.5, 1.5, shape))
            else:
                arrays.append(rng.normal(0.0, 0.1, shape))
    return arrays


def test_yolov4_tiny_random_weights_every_layer(tmp_path):
    cfg = CFG_DIR / "yolov4-tiny.cfg"
    rng = np.random.default_rng(4)
    weights = tmp_path / "random.weights"
    write_darknet_weights(weights, random_darknet_weights(dm.load(cfg), rng))
    net = dm.load(cfg, weights)
    x = rng.uniform(0, 1, (1, 3, 416, 416)).astype(np.float32)
    assert compare_network(net, cfg, tmp_path / "w", x) == len(net.layers)
    # Weights written back are the same bytes, and OpenCV reads them with identical results.
    saved = tmp_path / "saved.weights"
    net.save_weights(saved)
    assert saved.read_bytes() == weights.read_bytes()
    again = dm.load(cfg, saved)
    for a, b in zip(again.forward(x), net.forward(x), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_weights_roundtrip_real_yolov3_tiny(tmp_path):
    cfg, weights = YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights"
    net = dm.load(cfg, weights)
    saved = tmp_path / "copy.weights"
    net.save_weights(saved)
    assert saved.read_bytes() == weights.read_bytes()
    x = np.fromfile(GOLDEN / "dog_input.bin", "<f4").reshape(1, 3, 416, 416)
    a = cv2.dnn.readNetFromDarknet(str(cfg), str(saved))
    a.setInput(x)
    b = cv2.dnn.readNetFromDarknet(str(cfg), str(weights))
    b.setInput(x)
    for oa, ob in zip(a.forward(a.getUnconnectedOutLayersNames()),
                      b.forward(b.getUnconnectedOutLayersNames()), strict=True):
        np.testing.assert_array_equal(oa, ob)


def test_saved_random_init_loads_in_opencv(tmp_path):
    cfg = CFG_DIR / "yolov4-tiny.cfg"
    net = dm.load(cfg, seed=11)
    path = tmp_path / "init.weights"
    net.save_weights(path)
    x = np.random.default_rng(0).uniform(0, 1, (1, 3, 416, 416)).astype(np.float32)
    assert compare_network(net, cfg, tmp_path / "w", x) == len(net.layers)


def test_trained_weights_load_in_opencv_with_the_same_outputs(tmp_path):
    # yolov3-tiny from the real weights, three training steps at 96x96 (every array moves,
    # batch-norm statistics included), saved; OpenCV reads the file and every layer agrees
    # with ours.
    text = (YOLOV3_TINY / "yolov3-tiny.cfg").read_text()
    text = text.replace("width=416", "width=96").replace("height=416", "height=96")
    cfg = tmp_path / "yolov3-tiny-96.cfg"
    cfg.write_text(text)
    net = dm.load(cfg, YOLOV3_TINY / "yolov3-tiny.weights", batch=2, subdivisions=1)
    net.config.net.values.update(burn_in=0, learning_rate=1e-3, policy="constant")
    rng = np.random.default_rng(5)
    x = rng.uniform(0, 1, (2, 3, 96, 96)).astype(np.float32)
    truths = [np.array([[16, 0.4, 0.5, 0.3, 0.4]], np.float32)] * 2
    before = dm.load(cfg, YOLOV3_TINY / "yolov3-tiny.weights")
    for _ in range(3):
        net.train_step(x, truths)
    saved = tmp_path / "trained.weights"
    net.save_weights(saved)
    trained = dm.load(cfg, saved)
    moved = [np.abs(trained.params[0][n] - before.params[0][n]).max() for n in
             ("weights", "rolling_mean")]
    assert min(moved) > 1e-6, moved
    assert compare_network(trained, cfg, tmp_path / "w", x[:1]) == len(trained.layers)
    # The file itself, as OpenCV reads it (its batch-norm epsilon differs: 1e-6 vs 1e-5).
    direct = cv2.dnn.readNetFromDarknet(str(cfg), str(saved))
    direct.setInput(x[:1])
    ref = opencv_all_outputs(cfg, opencv_compensated_weights(trained, tmp_path / "c"), x[:1])
    name, want = ref[max(ref)]
    got = direct.forward(name)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
