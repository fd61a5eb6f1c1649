"""The whole map report (Darknet's figures and COCO's) on 1,000 images with 20 detections
each: ours against pycocotools' COCOeval alone on the same data, in the same run.

Goal: evaluate() under 2 s for this set.
"""

import contextlib
import io

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
    assert benchmark.stats.stats.median < 2.0


@pytest.mark.benchmark(group="map-report-1000-images")
def test_peer_pycocotools(benchmark, dataset):
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    truths, dets, sizes = dataset

    def run():
        images, anns, results = [], [], []
        for i, (t, d, (w, h)) in enumerate(zip(truths, dets, sizes, strict=True)):
            images.append({"id": i + 1, "width": w, "height": h})
            for c, cx, cy, bw, bh in t:
                box = [(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h]
                anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": int(c) + 1,
                             "bbox": box, "area": box[2] * box[3], "iscrowd": 0})
            for cx, cy, bw, bh, c, p in d:
                results.append({"image_id": i + 1, "category_id": int(c) + 1, "score": p,
                                "bbox": [(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h]})
        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO()
            gt.dataset = {"images": images, "annotations": anns,
                          "categories": [{"id": c + 1} for c in range(CLASSES)]}
            gt.createIndex()
            ev = COCOeval(gt, gt.loadRes(results), "bbox")
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        return ev.stats

    benchmark.pedantic(run, rounds=2, warmup_rounds=0)
