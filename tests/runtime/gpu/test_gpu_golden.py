"""yolov3-tiny on each Metal device (the emulator, and 'cuda' where there is one) against the
real Darknet's outputs (golden files), at the full 416x416 size. One forward pass takes about
15 s in the emulator on 2 cores."""

import json

import numpy as np
import pytest
from devices import GPU_DEVICES, require
from shared_paths import GOLDEN, IMAGES, YOLOV3_TINY

import darknet_metal as dm


@pytest.fixture(scope="module", params=GPU_DEVICES)
def gpu_net(request):
    require(request.param)
    return dm.load(
        YOLOV3_TINY / "yolov3-tiny.cfg",
        YOLOV3_TINY / "yolov3-tiny.weights",
        names=YOLOV3_TINY / "coco.names",
        device=request.param,
    )


def test_golden_layers_on_a_gpu(gpu_net):
    x = np.fromfile(GOLDEN / "dog_input.bin", np.float32).reshape(1, 3, 416, 416)
    outs = gpu_net.forward(x, outputs=[15, 16, 22, 23])
    for index, out, tol in zip((15, 16, 22, 23), outs, (2e-3, 1e-4, 2e-3, 1e-4), strict=True):
        ref = np.fromfile(GOLDEN / f"dog_layer{index}.bin", np.float32).reshape(out.shape)
        assert np.abs(out - ref).max() <= tol, index


def test_golden_detections_on_a_gpu(gpu_net):
    with open(GOLDEN / "detections.json") as f:
        expected = json.load(f)["dog"]["detections"]
    found = gpu_net.detect(IMAGES / "dog.jpg", thresh=0.25, nms=0.45)

    def key(d):
        return (d["cls"], round(d["left"]), round(d["top"]))

    got = [
        {
            "cls": d.name,
            "conf": d.confidence,
            "left": d.left,
            "top": d.top,
            "width": d.width,
            "height": d.height,
        }
        for d in found
    ]
    assert len(got) == len(expected), (got, expected)
    for g, e in zip(sorted(got, key=key), sorted(expected, key=key), strict=True):
        assert g["cls"] == e["cls"]
        assert abs(g["conf"] - e["conf"]) <= 2e-3, (g, e)
        for k in ("left", "top", "width", "height"):
            assert abs(g[k] - e[k]) <= 0.5, (k, g, e)
