"""detect_dataset: batched passes give each image exactly what Network.detect gives it."""

import pathlib

import numpy as np
import pytest
from PIL import Image

import darknet_metal as dm
from darknet_metal.evaluation import detect_dataset, detections_to_array, evaluate

CFG = pathlib.Path(dm.__file__).parent / "data" / "cfg" / "yolov3-tiny.cfg"


@pytest.fixture(scope="module")
def net():
    # Darknet's random initialisation: objectness near 0.5 everywhere, so many boxes pass
    # the map run's 0.005 threshold and NMS has work to do.
    return dm.load(CFG, seed=1, input_size=(64, 64), names=[f"c{i}" for i in range(80)])


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(80, 60), (50, 90), (64, 64)]):
        path = root / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_batched_equals_detect_per_image(net, images):
    result = detect_dataset(net, images, batch=2, progress=False)
    assert result.image_sizes == [(80, 60), (50, 90), (64, 64)]
    total = 0
    for path, (w, h), got in zip(images, result.image_sizes, result.detections, strict=True):
        expected = detections_to_array(net.detect(path, thresh=0.005, nms=0.45), w, h)
        np.testing.assert_array_equal(got, expected)
        assert np.all(got[:, 5] > 0.005)
        total += len(got)
    assert total > 10
    # The output feeds evaluate directly.
    truths = [np.array([[0, 0.5, 0.5, 0.3, 0.3]])] * 3
    report = evaluate(truths, result.detections, net.names, image_sizes=result.image_sizes)
    assert report.detections_count == total


def test_missing_image_is_reported_before_any_pass(net, images, tmp_path):
    with pytest.raises(dm.ImageError, match=r"nothing\.png.*images\[1\]"):
        detect_dataset(net, [images[0], tmp_path / "nothing.png"], progress=False)


def test_bad_arguments(net, images):
    with pytest.raises(dm.ArgumentError, match="batch"):
        detect_dataset(net, images, batch=0, progress=False)
    with pytest.raises(dm.ArgumentError, match="thresh"):
        detect_dataset(net, images, thresh=2.0, progress=False)
    with pytest.raises(dm.ArgumentTypeError, match="images"):
        detect_dataset(net, str(images[0]), progress=False)
