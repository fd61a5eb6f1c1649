"""A bundled model's cfg derived for other classes (``darknet_metal.model.derive`` and
``darknet-metal cfg``): Darknet's README edits, loaded by our parser (Darknet's rules) and by
OpenCV's importer, equal to the bundled cfg for 80 classes but for the training keys, and one clear
error, with nothing written, for each value Darknet would refuse."""

from __future__ import annotations

import numpy as np
import pytest

from darknet_metal.cli import main
from darknet_metal.datasets import load_dataset, make_shapes
from darknet_metal.errors import ArgumentError, ModelNotFoundError
from darknet_metal.evaluation import calc_anchors
from darknet_metal.model.bundled import get_spec, model_names
from darknet_metal.model.cfg import parse_cfg
from darknet_metal.model.derive import TRAINING_KEYS, darknet_max_batches, derive_cfg


@pytest.mark.parametrize("classes", [1, 3, 80])
@pytest.mark.parametrize("model", model_names())
def test_the_readme_edits_load_here_and_in_opencv(model, classes, tmp_path):
    cv2 = pytest.importorskip("cv2")
    derived = derive_cfg(model, classes)
    heads = [s for s in derived.config.layers if s.kind == "yolo"]
    assert heads
    for head in heads:
        assert head.values["classes"] == classes
        before = derived.config.layers[head.index - 1]
        assert before.kind == "convolutional"
        assert before.values["filters"] == (classes + 5) * len(head.values["mask"])
    net = derived.config.net.values
    assert net["max_batches"] == max(2000 * classes, 6000)
    assert net["steps"] == [int(0.8 * net["max_batches"]), int(0.9 * net["max_batches"])]
    assert net["scales"] == [0.1, 0.1]
    path = tmp_path / f"{model}-{classes}.cfg"
    path.write_text(derived.text)
    assert parse_cfg(path).layers[-1].kind == "yolo"
    cv = cv2.dnn.readNetFromDarknet(str(path))
    assert len(cv.getUnconnectedOutLayersNames()) == len(heads)


@pytest.mark.parametrize("model", model_names())
def test_80_classes_at_the_models_size_is_the_bundled_cfg_but_the_training_keys(model):
    derived = derive_cfg(model, 80)
    bundled = parse_cfg(get_spec(model).cfg)
    mine = derived.config
    for key, value in bundled.net.values.items():
        if key not in TRAINING_KEYS and key != "sgdr_cycle":  # defaults to max_batches
            assert mine.net.values[key] == value, key
    assert len(mine.layers) == len(bundled.layers)
    for a, b in zip(mine.layers, bundled.layers, strict=True):
        assert (a.kind, a.values) == (b.kind, b.values), a.index


@pytest.mark.parametrize(("max_batches", "burn_in", "fitted"), [
    (6000, 1000, False),    # Darknet's recipe: its 1000 of 6000 iterations stays
    (160000, 1000, False),
    (600, 100, True),       # shorter runs warm up over a sixth of themselves
    (40, 6, True),
    (3, 1, True),           # at least one iteration
])
def test_a_short_run_warms_up_over_a_sixth_of_it(max_batches, burn_in, fitted):
    derived = derive_cfg("yolov3-tiny", 3, max_batches=max_batches)
    assert derived.config.net.values["burn_in"] == burn_in
    said = {v.key: v.source for v in derived.values}["burn_in"]
    assert said == ("a sixth of max_batches, as Darknet's 1000 of 6000: yolov3-tiny's 1000 "
                    "would hold the learning rate near 0 for most of the run" if fitted
                    else "yolov3-tiny's")


def test_a_given_burn_in_is_kept_and_a_negative_one_refused():
    derived = derive_cfg("yolov4-tiny", 2, max_batches=40, burn_in=0)
    assert derived.config.net.values["burn_in"] == 0
    assert {v.key: v.source for v in derived.values}["burn_in"] == "given"
    with pytest.raises(ArgumentError, match="burn_in must be a non-negative integer"):
        derive_cfg("yolov4-tiny", 2, burn_in=-1)


def test_darknets_max_batches_rule():
    assert darknet_max_batches(1) == 6000
    assert darknet_max_batches(4) == 8000
    assert darknet_max_batches(2, train_images=640_000, batch=64) == 10_000
    assert darknet_max_batches(2, train_images=640_001, batch=64) == 10_001


def test_sizes_batches_and_anchors_are_set():
    derived = derive_cfg("yolov4-tiny", 3, size=(224, 160), batch=16, subdivisions=4,
                         max_batches=200, anchors=list(range(1, 13)), anchors_source="test")
    net = derived.config.net.values
    assert (net["width"], net["height"], net["batch"], net["subdivisions"]) == (224, 160, 16, 4)
    assert (net["max_batches"], net["steps"]) == (200, [160, 180])
    for head in (s for s in derived.config.layers if s.kind == "yolo"):
        assert head.values["anchors"] == [float(v) for v in range(1, 13)]
    sources = {(v.section, v.key): v.source for v in derived.values}
    assert sources[("yolo 30", "anchors")] == "test"
    assert len(sources) == len(derived.values)  # each value once


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(classes=0), "classes must be a positive integer"),
    (dict(classes=3, size=(200, 224)), "width must be a multiple of 32"),
    (dict(classes=3, batch=64, subdivisions=5), "subdivisions must divide the batch"),
    (dict(classes=3, anchors=[10, 14]), "takes 6 anchors"),
    (dict(classes=3, max_batches=0), "max_batches must be"),
])
def test_what_darknet_would_refuse_is_refused(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        derive_cfg("yolov4-tiny", **kwargs)


def test_an_unbundled_model_is_refused():
    with pytest.raises(ModelNotFoundError, match="known models"):
        derive_cfg("yolov9", 3)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("derive") / "shapes", train=40, valid=8,
                       size=(128, 128), seed=2)


def test_the_cfg_command_writes_what_derive_cfg_gives(shapes, tmp_path, capsys):
    out = tmp_path / "mine.cfg"
    assert main(["cfg", "--model", "yolov3-tiny", "--data", str(shapes), "--size", "224x224",
                 "--anchors", "auto", str(out)]) == 0
    err = capsys.readouterr().err
    dataset = load_dataset(shapes)
    boxes = np.concatenate([b[:, 3:5] for b in map(dataset.read_boxes, dataset.train)
                            if len(b)])
    want = calc_anchors(boxes.astype(np.float32), 6, 224, 224)
    anchors = [round(float(v)) for v in want.anchors.reshape(-1)]
    derived = derive_cfg("yolov3-tiny", 3, size=(224, 224), train_images=40, anchors=anchors,
                         anchors_source="x")
    assert out.read_text() == derived.text
    for v in derived.values:
        assert err.count(f"[{v.section}] {v.key}={v.value} ") == 1, v
    assert "calc_anchors on" in err and "Darknet's rule" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--classes", "5"], "--classes is 5 but"),
    (["--size", "200x224"], "multiple of 32"),
])
def test_the_cfg_command_refuses_and_writes_nothing(shapes, tmp_path, capsys, args, message):
    out = tmp_path / "never.cfg"
    assert main(["cfg", "--model", "yolov4-tiny", "--data", str(shapes), *args, str(out)]) == 1
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_auto_anchors_need_a_dataset(tmp_path, capsys):
    assert main(["cfg", "--model", "yolov4-tiny", "--classes", "2", "--anchors", "auto",
                 str(tmp_path / "x.cfg")]) == 1
    assert "--anchors auto needs --data" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
