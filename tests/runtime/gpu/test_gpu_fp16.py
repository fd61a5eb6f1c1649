"""precision="fp16" on emu: weights and activations held as half, arithmetic in float.

Against the real Darknet's golden detections (classes equal, confidence within 1e-2, boxes
within 2 px), against float32 layer by layer (relative L2 within 1e-2) for yolov3-tiny and
yolov4-tiny, device memory of a pass at most 55% of float32, streams, and the refusals."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
from devices import GPU_DEVICES, require
from shared_paths import CFG_DIR, GOLDEN, IMAGES, YOLOV3_TINY

import darknet_metal as dm
from darknet_metal import metal
from darknet_metal.errors import ArgumentError, DeviceError
from darknet_metal.inference.image import load_image, resize_image


@pytest.fixture(scope="module", params=GPU_DEVICES)
def tiny_fp16(request):
    require(request.param)
    return dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                   names=YOLOV3_TINY / "coco.names", device=request.param, precision="fp16")


def test_fp16_detections_are_the_golden_darknet_detections(tiny_fp16):
    golden = json.loads((GOLDEN / "detections.json").read_text())
    for stem, path in (("dog", IMAGES / "dog.jpg"), ("coffee", IMAGES / "coffee.png")):
        want = sorted(golden[stem]["detections"], key=lambda d: (d["cls"], d["left"]))
        got = sorted(tiny_fp16.detect(path), key=lambda d: (d.name, d.left))
        assert [d.name for d in got] == [d["cls"] for d in want], stem
        for g, w in zip(got, want, strict=True):
            assert abs(g.confidence - w["conf"]) <= 1e-2, (stem, g, w)
            for ours, theirs in ((g.left, w["left"]), (g.top, w["top"]),
                                 (g.width, w["width"]), (g.height, w["height"])):
                assert abs(ours - theirs) <= 2.0, (stem, g, w)


@pytest.mark.parametrize("cfg,weights", [
    (YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights"),
    (CFG_DIR / "yolov4-tiny.cfg", None),
])
def test_every_layer_within_1e_2_of_float32(cfg, weights):
    # The dog image at 224x224 keeps the test quick; every layer kind runs.
    x = resize_image(load_image(IMAGES / "dog.jpg"), 224, 224)[None]
    nets = {p: dm.load(cfg, weights, seed=3, device="emu", precision=p, input_size=(224, 224))
            for p in ("fp32", "fp16")}
    every = list(range(len(nets["fp32"].layers)))
    full, half = (nets[p].forward(x, outputs=every) for p in ("fp32", "fp16"))
    for i, (a, b) in enumerate(zip(full, half, strict=True)):
        assert b.dtype == np.float32 and b.shape == a.shape
        error = np.linalg.norm(b - a) / np.linalg.norm(a)
        assert error <= 1e-2, (cfg.name, i, nets["fp32"].layers[i].kind, error)


def test_fp16_pass_needs_at_most_55_percent_of_the_device_memory():
    used = {}
    x = np.zeros((1, 3, 224, 224), np.float32)
    for precision in ("fp32", "fp16"):
        gc.collect()  # networks of earlier tests release their buffers now, not mid-measure
        metal.empty_cache("emu")
        before = metal.memory_allocated("emu")
        net = dm.load(CFG_DIR / "yolov4-tiny.cfg", seed=1, device="emu", precision=precision,
                      input_size=(224, 224))
        net.forward(x)
        used[precision] = metal.memory_allocated("emu") - before
        net.to("emu")  # keep the net alive until measured
        del net
    assert used["fp16"] <= 0.55 * used["fp32"], used


def test_fp16_streams_and_batches_equal_fp16_detect():
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names", device="emu", precision="fp16",
                  input_size=(160, 160), batch=2)
    frames = [IMAGES / "dog.jpg", IMAGES / "coffee.png", IMAGES / "dog.jpg"]
    alone = [net.detect(f) for f in frames]
    assert alone[0]
    assert list(net.stream(frames, depth=2)) == alone  # passes of 2, the last padded
    assert net.detect(frames) == alone


def test_fp16_refusals(tmp_path, tiny_fp16):
    cfg = YOLOV3_TINY / "yolov3-tiny.cfg"
    with pytest.raises(ArgumentError, match="Metal devices"):
        dm.load(cfg, device="cpu", precision="fp16")
    with pytest.raises(ArgumentError, match="precision must be"):
        dm.load(cfg, device="emu", precision="bf16")
    kind = tiny_fp16.device
    with pytest.raises(ArgumentError, match="Metal devices"):
        tiny_fp16.to("cpu")
    assert tiny_fp16.device == kind
    x = np.zeros((1, 3, 416, 416), np.float32)
    with pytest.raises(ArgumentError, match="training runs in float32"):
        tiny_fp16.train_step(x, [np.zeros((0, 5), np.float32)])
    # A layer that would run on the CPU (here forced) cannot take half tensors: named.
    from darknet_metal.runtime.gpu_backend import GpuBackend

    small = tmp_path / "small.cfg"
    small.write_text("[net]\nwidth=8\nheight=8\nchannels=3\n\n"
                     "[convolutional]\nfilters=4\nsize=1\nactivation=leaky\n\n"
                     "[convolutional]\nfilters=4\nsize=1\nactivation=normalize_channels\n")
    net = dm.load(small, seed=1)
    with pytest.raises(DeviceError, match=r"layer 1 \(convolutional\): CPU fallback"):
        GpuBackend(net.layers, net.params, device="emu", precision="fp16", fallback={1})
    # Every inference kernel has its half twin: the channel-normalising activation runs.
    half = dm.load(small, seed=1, device="emu", precision="fp16")
    full = dm.load(small, seed=1, device="emu")
    x = np.random.default_rng(1).random((1, 3, 8, 8), dtype=np.float32)
    a, b = half.forward(x, outputs=[1])[0], full.forward(x, outputs=[1])[0]
    assert np.linalg.norm(a - b) / np.linalg.norm(b) <= 1e-2
