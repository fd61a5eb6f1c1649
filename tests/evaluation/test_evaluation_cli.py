"""The map and anchors commands on a generated dataset, against the evaluation functions fed
by an independent reading of the same files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from shared_paths import YOLOV3_TINY

import darknet_metal as dm
from darknet_metal.cli import main
from darknet_metal.datasets import make_shapes
from darknet_metal.evaluation import calc_anchors, detections_to_array, evaluate


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("map") / "shapes", train=24, valid=6,
                       size=(96, 80), seed=5)


@pytest.fixture(scope="module")
def network(tmp_path_factory, shapes):
    # yolov3-tiny for the 3 shape classes at 96x96, the real backbone, the rest seeded.
    text = (YOLOV3_TINY / "yolov3-tiny.cfg").read_text()
    text = re.sub(r"(?m)^(width|height)=416", r"\1=96", text)
    text = re.sub(r"(?m)^classes=80", "classes=3", text)
    text = re.sub(r"(?m)^filters=255", "filters=24", text)
    folder = tmp_path_factory.mktemp("net")
    cfg = folder / "shapes.cfg"
    cfg.write_text(text)
    weights = folder / "shapes.weights"
    backbone = folder / "yolov3-tiny.conv.15"
    assert main(["partial", str(YOLOV3_TINY / "yolov3-tiny.cfg"),
                 str(YOLOV3_TINY / "yolov3-tiny.weights"), str(backbone), "15"]) == 0
    net = dm.load(cfg, backbone, partial=True, seed=1)
    net.save_weights(weights)
    return cfg, weights


def _valid(shapes):
    lines = (shapes.parent / "valid.txt").read_text().split()
    return [p for p in lines if p]


def test_map_command_equals_evaluate_on_independently_read_files(shapes, network, capsys):
    cfg, weights = network
    assert main(["map", str(shapes), str(cfg), str(weights), "--json", "-q",
                 "--points", "101"]) == 0
    report = json.loads(capsys.readouterr().out)
    net = dm.load(cfg, weights)
    images = _valid(shapes)
    truths, detections = [], []
    for image in images:
        label = image.rsplit(".", 1)[0] + ".txt"
        truths.append(np.loadtxt(label, ndmin=2).reshape(-1, 5))
        found = net.detect(image, thresh=0.005, nms=0.45)
        from PIL import Image

        with Image.open(image) as im:
            detections.append(detections_to_array(found, *im.size))
    want = evaluate(truths, detections, ["circle", "square", "triangle"], points=101,
                    coco=False)
    assert report["map"] == pytest.approx(want.map, abs=1e-12)
    assert (report["tp"], report["fp"], report["fn"]) == (want.tp, want.fp, want.fn)
    assert report["images"] == len(images) == 6
    assert report["coco"] is not None and 0 <= report["coco"]["map_50_95"] <= 1


def test_map_command_prints_darknets_report_and_refuses_a_class_mismatch(shapes, network,
                                                                          capsys, tmp_path):
    cfg, weights = network
    assert main(["map", str(shapes), str(cfg), str(weights), "-q"]) == 0
    out = capsys.readouterr().out
    assert "class_id = 0, name = circle" in out and "mean average precision (mAP@0.50)" in out
    other = tmp_path / "two.cfg"
    other.write_text(cfg.read_text().replace("classes=3", "classes=2")
                     .replace("filters=24", "filters=21"))
    weights2 = tmp_path / "two.weights"
    dm.load(other, seed=0).save_weights(weights2)
    assert main(["map", str(shapes), str(other), str(weights2), "-q"]) == 1
    assert "detects 2 classes" in capsys.readouterr().err


def test_map_without_the_coco_library_prints_darknets_figures(shapes, network, capsys,
                                                               monkeypatch):
    # As with the 'train' extra alone: no faster-coco-eval.
    import sys

    cfg, weights = network
    monkeypatch.setitem(sys.modules, "faster_coco_eval", None)
    assert main(["map", str(shapes), str(cfg), str(weights), "-q"]) == 0
    out = capsys.readouterr().out
    assert "mean average precision (mAP@0.50)" in out
    assert "COCO's mAP@[.50:.95] not computed" in out and "darknet-metal[eval]" in out
    assert main(["map", str(shapes), str(cfg), str(weights), "-q", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["coco"] is None and "faster-coco-eval" in report["coco_note"]


def test_anchors_command_clusters_the_training_boxes(shapes, capsys):
    assert main(["anchors", str(shapes), "--clusters", "4", "--width", "96", "--height", "96",
                 "--seed", "2"]) == 0
    out = capsys.readouterr().out
    lines = (shapes.parent / "train.txt").read_text().split()
    boxes = np.concatenate([np.loadtxt(p.rsplit(".", 1)[0] + ".txt", ndmin=2).reshape(-1, 5)
                            for p in lines])
    want = calc_anchors(boxes[:, 3:5].astype(np.float32), 4, 96, 96, seed=2)
    assert f"{want.avg_iou:.2f}" in out or f"{100 * want.avg_iou:.2f}" in out
    assert "anchors" in out
