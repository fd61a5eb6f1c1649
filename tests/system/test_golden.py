"""yolov3-tiny on the CPU against outputs of the real Darknet binary (../shared/golden)."""

import numpy as np
import pytest
from shared_paths import GOLDEN, IMAGES

STEMS = {"dog": IMAGES / "dog.jpg", "coffee": IMAGES / "coffee.png"}
SHAPES = {15: (255, 13, 13), 16: (255, 13, 13), 22: (255, 26, 26), 23: (255, 26, 26)}


def read_golden(name, shape):
    return np.fromfile(GOLDEN / name, dtype="<f4").reshape(shape)


@pytest.mark.parametrize("stem", sorted(STEMS))
def test_layer_outputs_match_darknet(yolov3_tiny, stem):
    x = read_golden(f"{stem}_input.bin", (1, 3, 416, 416))
    outs = yolov3_tiny.forward(x, outputs=list(SHAPES))
    for (index, shape), out in zip(SHAPES.items(), outs, strict=True):
        ref = read_golden(f"{stem}_layer{index}.bin", shape)
        assert out.shape == (1, *shape)
        tol = 2e-3 if index in (15, 22) else 1e-4
        diff = np.abs(out[0] - ref).max()
        assert diff <= tol, f"layer {index}: max abs diff {diff:.2e} > {tol}"


def test_default_outputs_are_the_yolo_layers(yolov3_tiny):
    x = read_golden("dog_input.bin", (1, 3, 416, 416))
    yolo = yolov3_tiny.forward(x)
    assert [o.shape for o in yolo] == [(1, 255, 13, 13), (1, 255, 26, 26)]
    np.testing.assert_allclose(yolo[0][0], read_golden("dog_layer16.bin", SHAPES[16]),
                               atol=1e-4)


def _key(d):
    return (d["cls"], round(d["left"]))


@pytest.mark.parametrize("stem", sorted(STEMS))
def test_detections_match_darknet(yolov3_tiny, golden_detections, stem):
    expected = golden_detections[stem]["detections"]
    found = yolov3_tiny.detect(STEMS[stem], thresh=0.25, nms=0.45)
    got = [{"cls": d.name, "conf": d.confidence, "objectness": d.objectness, "left": d.left,
            "top": d.top, "width": d.width, "height": d.height} for d in found]
    assert len(got) == len(expected), (got, expected)
    for g, e in zip(sorted(got, key=_key), sorted(expected, key=_key), strict=True):
        assert g["cls"] == e["cls"]
        assert abs(g["conf"] - e["conf"]) <= 2e-3, (g, e)
        assert abs(g["objectness"] - e["objectness"]) <= 2e-3, (g, e)
        for k in ("left", "top", "width", "height"):
            assert abs(g[k] - e[k]) <= 0.5, (k, g, e)
