"""The public Network API: shapes, outputs, batches, dtypes, devices and input errors."""

import numpy as np
import pytest
from PIL import Image
from shared_paths import CFG_DIR, GOLDEN, IMAGES

import darknet_metal as dm


@pytest.fixture(scope="module")
def x():
    return np.fromfile(GOLDEN / "dog_input.bin", "<f4").reshape(1, 3, 416, 416)


def test_layers_describe_shapes(yolov3_tiny):
    layers = yolov3_tiny.layers
    assert len(layers) == 24
    assert layers[0].kind == "convolutional" and layers[0].in_shape == (3, 416, 416)
    assert layers[0].out_shape == (16, 416, 416)
    assert layers[11].kind == "maxpool" and layers[11].out_shape == (512, 13, 13)  # size=2 stride=1
    assert layers[20].kind == "route" and layers[20].out_shape == (384, 26, 26)
    assert [i for i, s in enumerate(layers) if s.kind == "yolo"] == [16, 23]


def test_yolov4_tiny_route_groups_shapes():
    net = dm.load(CFG_DIR / "yolov4-tiny.cfg")
    # [route] layers=-1 groups=2 group_id=1 takes the second half of 64 channels.
    assert net.layers[3].kind == "route" and net.layers[3].out_shape == (32, 104, 104)
    assert net.layers[-1].kind == "yolo" and net.layers[-1].out_shape == (255, 26, 26)


def test_summary_reports_darknet_bflops(yolov3_tiny):
    text = yolov3_tiny.summary()
    assert text.count("\n") >= 25
    # Darknet prints "Total BFLOPS 5.571" for yolov3-tiny at 416 (convolutions 5.565 +
    # maxpools); computed by hand from the layer table.
    assert "Total BFLOPS 5.571" in text


def test_outputs_selection_and_copies(yolov3_tiny, x):
    a, b = yolov3_tiny.forward(x, outputs=[0, -1])
    assert a.shape == (1, 16, 416, 416) and b.shape == (1, 255, 26, 26)
    np.testing.assert_array_equal(b, yolov3_tiny.forward(x)[1])
    a[...] = 0  # a copy: the next pass is unaffected
    assert yolov3_tiny.forward(x, outputs=[0])[0].any()
    with pytest.raises(IndexError, match="out of range"):
        yolov3_tiny.forward(x, outputs=[24])


def test_batch_of_two_equals_two_singles(yolov3_tiny, x):
    x2 = np.concatenate([x, x[:, :, ::-1].copy()])
    both = yolov3_tiny.forward(x2)
    one = yolov3_tiny.forward(x2[1:])
    np.testing.assert_allclose(both[1][1], one[1][0], rtol=1e-5, atol=1e-5)


def test_float64_agrees_with_float32(x):
    cfg = CFG_DIR / "yolov4-tiny.cfg"
    small = np.random.default_rng(0).uniform(0, 1, (1, 3, 416, 416)).astype(np.float32)
    net = dm.load(cfg, seed=3)
    # Both Winograd variants are in this pass: F(4x4, 3x3) at 104 and 52, F(2x2, 3x3) at 26.
    tiles = {op.index: op.winograd_tile for op in net.layers
             if op.kind == "convolutional" and op.uses_winograd}
    assert tiles[2] == 4 and tiles[10] == 4 and tiles[18] == 2, tiles
    a = net.forward(small)
    b = dm.load(cfg, seed=3, dtype=np.float64).forward(small)
    assert b[0].dtype == np.float64
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-3, atol=1e-4)


def test_bad_inputs_raise_clear_errors(yolov3_tiny, x):
    with pytest.raises(ValueError, match=r"expected \(N, C, H, W\)"):
        yolov3_tiny.forward(x[0])
    with pytest.raises(ValueError, match="this network takes"):
        yolov3_tiny.forward(np.zeros((1, 3, 32, 32), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        yolov3_tiny.forward(x.astype(np.int32))
    with pytest.raises(dm.ImageError):
        yolov3_tiny.detect(IMAGES / "missing.jpg")
    with pytest.raises(ValueError, match="thresh"):
        yolov3_tiny.detect(IMAGES / "dog.jpg", thresh=2.0)


def test_detect_accepts_an_rgb_array(yolov3_tiny):
    rgb = np.asarray(Image.open(IMAGES / "coffee.png").convert("RGB"))
    from_path = yolov3_tiny.detect(IMAGES / "coffee.png")
    from_array = yolov3_tiny.detect(rgb)
    assert from_path == from_array and len(from_path) == 1 and from_path[0].name == "toilet"


def test_devices_and_arguments():
    cfg = CFG_DIR / "yolov3-tiny.cfg"
    with pytest.raises(dm.DeviceError, match="use 'cpu'"):
        dm.load(cfg, device="metal")
    with pytest.raises(ValueError, match="unknown device"):
        dm.load(cfg, device="tpu")
    with pytest.raises(ValueError, match="batch"):
        dm.load(cfg, batch=0)
    with pytest.raises(dm.CfgError, match="cannot read class names"):
        dm.load(cfg, names="/nonexistent.names")
    with pytest.raises(dm.CfgError):
        dm.load("/nonexistent.cfg")


def test_names_default_and_list(x):
    net = dm.load(CFG_DIR / "yolov3-tiny.cfg", seed=0, names=["a"] * 80)
    assert net.names[0] == "a"


def test_input_size_replaces_the_cfg_size():
    net = dm.load(CFG_DIR / "yolov4-tiny.cfg", seed=0, input_size=(64, 96))
    assert net.input_shape == (3, 96, 64)
    outs = net.forward(np.zeros((1, 3, 96, 64), np.float32))
    assert [o.shape for o in outs] == [(1, 255, 3, 2), (1, 255, 6, 4)]
    with pytest.raises(ValueError, match="input_size"):
        dm.load(CFG_DIR / "yolov4-tiny.cfg", input_size=(0, 32))


def test_forward_of_a_classifier_gives_its_last_layers_output(tmp_path):
    cfg = tmp_path / "classifier.cfg"
    cfg.write_text("[net]\nwidth=8\nheight=8\nchannels=3\n[convolutional]\nfilters=4\nsize=3\n"
                   "stride=1\npad=1\nactivation=leaky\n[avgpool]\n[softmax]\n")
    net = dm.load(cfg, seed=1)
    x = np.random.default_rng(0).random((2, 3, 8, 8), dtype=np.float32)
    (probs,) = net.forward(x)
    assert probs.shape == (2, 4, 1, 1)
    np.testing.assert_array_equal(probs, net.forward(x, outputs=[-1])[0])
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
