"""The whole map report (Darknet's figures and COCO's) on 1,000 images with 20 detections
each: ours against pycocotools' COCOeval alone on the same data, in the same run.

Goal: evaluate() under 2 s for this set.
"""

import numpy as np
import pytest

from darknet_metal.evaluation import evaluate, format_darknet_report

IMAGES, PER_IMAGE, CLASSES = 1000, 20, 20


@pytest.fixture(scope="module")
def dataset():
    rng = np.random.default_rng(0)
    truths, dets = [], []
    for _ in range(IMAGES):
        k = int(rng.integers(0, 8))
        t = np.column_stack([rng.integers(0, CLASSES, k), rng.uniform(0.1, 0.9, (k, 2)),
                             rng.uniform(0.02, 0.3, (k, 2))])
        near = np.column_stack([t[:, 1:3] + rng.normal(0, 0.01, (k, 2)), t[:, 3:5], t[:, 0],
                                rng.uniform(size=k)])
        m = PER_IMAGE - k
        far = np.column_stack([rng.uniform(0.1, 0.9, (m, 2)), rng.uniform(0.02, 0.3, (m, 2)),
                               rng.integers(0, CLASSES, m), rng.uniform(size=m)])
        truths.append(t)
        dets.append(np.vstack([near, far]))
    return truths, dets, [(640, 480)] * IMAGES


@pytest.mark.benchmark(group="map-report-1000-images")
def test_ours_evaluate(benchmark, dataset):
    truths, dets, sizes = dataset
    names = [f"c{i}" for i in range(CLASSES)]

    def run():
        return format_darknet_report(evaluate(truths, dets, names, image_sizes=sizes))

    text = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert "mAP@[.50:.95]" in text
    benchmark.extra_info["goal_seconds"] = 2.0


@pytest.mark.benchmark(group="map-report-1000-images")
def test_peer_pycocotools(benchmark, dataset):
    pytest.importorskip("pycocotools")
    from test_evaluation_coco import pycocotools_eval

    truths, dets, sizes = dataset
    benchmark.pedantic(pycocotools_eval, args=(truths, dets, sizes, CLASSES), rounds=2,
                       warmup_rounds=0)
