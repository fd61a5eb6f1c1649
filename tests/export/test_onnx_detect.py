"""From an exported model to ``detect``'s detections: ``preprocess`` is the input ``detect``
builds, ``postprocess`` over the ``boxes``/``confs``/``objectness`` outputs is ``detect``'s
decoding and NMS, and docs/export.md's ONNX Runtime example, run as written, reports what
``Network.detect`` reports."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
import shutil

import numpy as np
import pytest
from PIL import Image
from shared_paths import IMAGES, ROOT, YOLOV3_TINY

import darknet_metal as dm
from darknet_metal.errors import ArgumentError, ImageError
from darknet_metal.inference.boxes import detect_boxes
from darknet_metal.inference.detector import Detector

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def documented_example() -> str:
    text = (ROOT / "docs" / "export.md").read_text()
    found = re.search(r"<!-- example: onnx-detect -->\n```python\n(.*?)\n```", text, re.S)
    assert found, "docs/export.md lost its ONNX Runtime example"
    return found.group(1)


def assert_same_detections(got, want, box_tolerance: float, conf_tolerance: float) -> None:
    assert [(d.class_id, d.name) for d in got] == [(d.class_id, d.name) for d in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g.confidence - w.confidence) <= conf_tolerance, (g, w)
        assert abs(g.objectness - w.objectness) <= conf_tolerance, (g, w)
        for side in ("left", "top", "width", "height"):
            assert abs(getattr(g, side) - getattr(w, side)) <= box_tolerance, (side, g, w)


@pytest.fixture(scope="module")
def yolov3_tiny_net():
    return dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                   names=YOLOV3_TINY / "coco.names")


def test_the_documented_example_reports_what_detect_reports(yolov3_tiny_net, model_cache,
                                                            tmp_path, monkeypatch, capsys):
    from darknet_metal.cli import main

    monkeypatch.chdir(tmp_path)
    shutil.copy(IMAGES / "dog.jpg", tmp_path / "dog.jpg")
    # The export command the docs give, as a user types it.
    assert main(["export", "--model", "yolov3-tiny", "yolov3-tiny.onnx", "--boxes"]) == 0
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(documented_example(), "docs/export.md", "exec"), namespace)
    got = namespace["detections"]
    want = yolov3_tiny_net.detect(str(tmp_path / "dog.jpg"))
    assert len(want) == 6
    # ONNX Runtime's float32 arithmetic is not ours: the raw outputs differ by ~1e-6.
    assert_same_detections(got, want, box_tolerance=0.01, conf_tolerance=1e-4)
    lines = printed.getvalue().splitlines()
    assert len(lines) == len(want) and lines[0].startswith("dog 81%")


def letterboxed_yolov3_tiny(tmp_path):
    """yolov3-tiny with its real weights, its cfg given ``letter_box=1``."""
    cfg = (YOLOV3_TINY / "yolov3-tiny.cfg").read_text().replace("[net]", "[net]\nletter_box=1", 1)
    path = tmp_path / "yolov3-tiny-letterbox.cfg"
    path.write_text(cfg)
    return dm.load(path, YOLOV3_TINY / "yolov3-tiny.weights", names=YOLOV3_TINY / "coco.names")


@pytest.mark.parametrize("nms_kind", ["default", "greedynms", "diounms", "cornersnms"])
def test_postprocess_equals_detects_decoder_on_the_same_outputs(tmp_path, nms_kind):
    net = letterboxed_yolov3_tiny(tmp_path)
    path = tmp_path / "boxes.onnx"
    net.export_onnx(path, outputs="boxes")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    settings = json.loads(
        session.get_modelmeta().custom_metadata_map["darknet_metal.postprocess"])
    assert settings["letterbox"] is True
    settings["nms_kind"] = nms_kind
    image = np.asarray(Image.open(IMAGES / "dog.jpg").convert("RGB"))  # 768 x 576
    x = dm.preprocess(image, settings["input_size"], letterbox=settings["letterbox"])
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, {"input": x[None]}), strict=True))
    raw = [out[f"yolo_{i}"][0] for i in net.yolo_layers]
    # A low threshold: many candidates, so NMS and the order of its ties matter.
    want = detect_boxes(raw, net.yolo_heads(), 416, 416, 768, 576, thresh=0.02,
                        nms_kind=nms_kind, beta_nms=settings["beta_nms"], letterbox=True,
                        names=net.names)
    got = dm.postprocess(out["boxes"][0], out["confs"][0], out["objectness"][0], (768, 576),
                         thresh=0.02, **settings)
    assert len(want) > 20, len(want)
    # Objectness and confidences are the same float32 values in both; only the exp in the
    # box sides may round differently in ONNX Runtime.
    assert_same_detections(got, want, box_tolerance=1e-3, conf_tolerance=0.0)


def test_postprocess_settings_are_its_keyword_arguments(yolov3_tiny_net, tmp_path):
    import onnx

    path = tmp_path / "meta.onnx"
    yolov3_tiny_net.export_onnx(path, outputs="boxes")
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    settings = json.loads(props["darknet_metal.postprocess"])
    keyword_only = {name for name, p in inspect.signature(dm.postprocess).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(settings) <= keyword_only
    assert settings == {"input_size": [416, 416], "letterbox": False, "nms_kind": "default",
                        "beta_nms": 0.6, "names": list(yolov3_tiny_net.names)}
    raw = onnx.load(str(tmp_path / "meta.onnx"))
    assert [o.name for o in raw.graph.output] == ["yolo_16", "yolo_23", "boxes", "confs",
                                                  "objectness"]


@pytest.mark.parametrize("letterbox", [False, True])
def test_preprocess_is_the_input_detect_builds(tmp_path, letterbox):
    cfg = (YOLOV3_TINY / "yolov3-tiny.cfg").read_text()
    if letterbox:
        cfg = cfg.replace("[net]", "[net]\nletter_box=1", 1)
    path = tmp_path / "net.cfg"
    path.write_text(cfg)
    net = dm.load(path, seed=1, input_size=(320, 224))
    detector = Detector(net)
    dog = IMAGES / "dog.jpg"
    want = detector.prepare(dog).x
    got = dm.preprocess(dog, (320, 224), letterbox=letterbox)
    assert got.dtype == np.float32 and got.shape == (3, 224, 320)
    assert np.array_equal(got, want)
    array = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    assert np.array_equal(dm.preprocess(array, [320, 224], letterbox=letterbox),
                          detector.prepare(array).x)


def test_preprocess_takes_one_int_for_a_square():
    dog = IMAGES / "dog.jpg"
    assert np.array_equal(dm.preprocess(dog, 96), dm.preprocess(dog, (96, 96)))


@pytest.mark.parametrize("size", [0, (96,), (96, 0), "96", (96.0, 96), True])
def test_preprocess_refuses_a_bad_size(size):
    with pytest.raises(ArgumentError, match="size"):
        dm.preprocess(IMAGES / "dog.jpg", size)


def test_preprocess_names_an_unreadable_image(tmp_path):
    bad = tmp_path / "not-an-image.jpg"
    bad.write_bytes(b"text, not pixels")
    with pytest.raises(ImageError, match="not-an-image.jpg"):
        dm.preprocess(bad, 96)


def test_postprocess_refuses_mismatched_arrays():
    boxes = np.zeros((5, 4), np.float32)
    confs = np.zeros((5, 3), np.float32)
    objectness = np.zeros(5, np.float32)
    with pytest.raises(ArgumentError, match="index the batch first"):
        dm.postprocess(boxes[None], confs, objectness, (10, 10), input_size=(32, 32))
    with pytest.raises(ArgumentError, match=r"same K"):
        dm.postprocess(boxes, confs[:4], objectness, (10, 10), input_size=(32, 32))
    with pytest.raises(ArgumentError, match="image_size"):
        dm.postprocess(boxes, confs, objectness, (10, 0), input_size=(32, 32))
    with pytest.raises(ArgumentError, match="thresh"):
        dm.postprocess(boxes, confs, objectness, (10, 10), input_size=(32, 32), thresh=2)
    with pytest.raises(ArgumentError, match="nms_kind"):
        dm.postprocess(boxes, confs, objectness, (10, 10), input_size=(32, 32),
                       nms_kind="fast")
    with pytest.raises(ArgumentError, match="class names"):
        dm.postprocess(boxes, confs, objectness, (10, 10), input_size=(32, 32), names=["a"])


def test_postprocess_of_no_candidates_is_no_detections():
    boxes = np.full((4, 4), 0.5, np.float32)
    confs = np.full((4, 2), 0.2, np.float32)
    objectness = np.full(4, 0.2, np.float32)
    assert dm.postprocess(boxes, confs, objectness, (10, 10), input_size=(32, 32)) == []
