"""COCO figures against pycocotools itself, and Darknet's 101-point AP against COCO's AP@0.50
where the two rules coincide.

The reference here is pycocotools' COCOeval fed from a COCO JSON structure the test builds
itself from the normalised boxes and the image sizes (list of dicts, pixel xywh).
"""

import contextlib
import io

import numpy as np
import pytest

from darknet_metal.evaluation import evaluate

pycocotools = pytest.importorskip("pycocotools")
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

CLASSES = 6  # class 4 never detected, class 5 never in the truths


def _random_set(seed, images=60, grid=6):
    """Truths placed one per cell of a grid x grid layout, smaller than a cell, so no two
    truths of an image intersect (then a detection overlaps at most one truth above IoU
    0.5, and Darknet's matching and COCO's agree). Some images are crowded (up to 30
    truths), some have none. Detections: jittered copies (some twice: duplicates), class
    confusions and random boxes, with distinct probabilities."""
    rng = np.random.default_rng(seed)
    truths, dets, sizes = [], [], []
    for i in range(images):
        w_px, h_px = int(rng.integers(200, 1300)), int(rng.integers(200, 1000))
        sizes.append((w_px, h_px))
        k = 0 if i % 7 == 3 else int(rng.integers(1, 31 if i % 5 == 0 else 6))
        cells = rng.choice(grid * grid, size=k, replace=False)
        cell = 1.0 / grid
        t = np.zeros((k, 5))
        t[:, 0] = rng.integers(0, 5, k)  # class 5 never has a truth
        t[:, 3] = rng.uniform(0.2, 0.9, k) * cell
        t[:, 4] = rng.uniform(0.2, 0.9, k) * cell
        t[:, 1] = (cells % grid + 0.5) * cell
        t[:, 2] = (cells // grid + 0.5) * cell
        rows = []
        for cls, cx, cy, w, h in t:
            copies = 0 if cls == 4 else int(rng.choice([0, 1, 1, 1, 2]))
            for _ in range(copies):
                jitter = rng.normal(0, 0.12, 4) * np.array([w, h, w, h])
                c = cls if rng.uniform() > 0.1 else rng.integers(0, 4)
                rows.append([cx + jitter[0], cy + jitter[1], w * np.exp(jitter[2] / w / 4),
                             h * np.exp(jitter[3] / h / 4), c])
        for _ in range(int(rng.integers(0, 8))):
            rows.append([*rng.uniform(0.05, 0.95, 2), *rng.uniform(0.02, 0.3, 2),
                         rng.choice([0, 1, 2, 3, 5])])  # class 4: no detection anywhere
        d = np.zeros((len(rows), 6))
        if rows:
            d[:, :5] = rows
        d[:, 2:4] = np.abs(d[:, 2:4])
        truths.append(t)
        dets.append(d)
    total = sum(len(d) for d in dets)
    probs = rng.permutation(np.linspace(0.01, 0.99, total)).astype(np.float32)
    start = 0
    for d in dets:
        d[:, 5] = probs[start:start + len(d)]
        start += len(d)
    return truths, dets, sizes


def pycocotools_eval(truths, dets, sizes, classes=CLASSES):
    """pycocotools' COCOeval of the data (the oracle here; the benchmark's peer too)."""
    images, anns, results = [], [], []
    for i, (t, d, (w, h)) in enumerate(zip(truths, dets, sizes, strict=True)):
        images.append({"id": i + 1, "width": w, "height": h})
        for cls, cx, cy, bw, bh in t:
            box = [(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h]
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": int(cls) + 1,
                         "bbox": box, "area": box[2] * box[3], "iscrowd": 0})
        for cx, cy, bw, bh, cls, p in d:
            results.append({"image_id": i + 1, "category_id": int(cls) + 1, "score": float(p),
                            "bbox": [(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h]})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": anns,
                      "categories": [{"id": c + 1} for c in range(classes)]}
        gt.createIndex()
        ev = COCOeval(gt, gt.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


@pytest.fixture(scope="module", params=[0, 1])
def case(request):
    truths, dets, sizes = _random_set(request.param)
    report = evaluate(truths, dets, [f"c{c}" for c in range(CLASSES)], points=101,
                      image_sizes=sizes)
    return truths, dets, sizes, report, pycocotools_eval(truths, dets, sizes)


def test_set_has_what_the_comparison_needs(case):
    truths, dets, _, report, _ = case
    assert any(len(t) >= 20 for t in truths)  # crowded
    assert any(len(t) == 0 for t in truths)  # images without truths
    assert report.classes[4].detections == 0 and report.classes[4].gt > 0
    assert report.classes[5].gt == 0 and report.classes[5].detections > 0
    assert max(len(d) for d in dets) <= 100  # COCO's maxDets never cuts


def test_coco_figures_equalpycocotools_eval(case):
    *_, report, ev = case
    names = ["map_50_95", "map_50", "map_75", "map_small", "map_medium", "map_large",
             "ar_1", "ar_10", "ar_100", "ar_small", "ar_medium", "ar_large"]
    for name, expected in zip(names, ev.stats, strict=True):
        ours = report.coco.stats[name]
        if expected < 0:
            assert ours is None, name
        else:
            assert ours == pytest.approx(expected, abs=1e-4), name
    assert report.coco.map_50_95 == pytest.approx(ev.stats[0], abs=1e-4)
    assert report.coco.map_50 == pytest.approx(ev.stats[1], abs=1e-4)
    assert 0.1 < report.coco.map_50 < 0.95  # a set where the figures mean something


def test_coco_per_class_equalpycocotools_eval(case):
    *_, report, ev = case
    precision = ev.eval["precision"]  # [T, R, K, A, M]
    for k in range(CLASSES):
        p = precision[:, :, k, 0, -1]
        if np.all(p < 0):
            assert report.coco.per_class_50_95[k] is None
            assert report.coco.per_class_50[k] is None
        else:
            assert report.coco.per_class_50_95[k] == pytest.approx(p.mean(), abs=1e-4)
            assert report.coco.per_class_50[k] == pytest.approx(p[0].mean(), abs=1e-4)


def test_darknet_101_points_equal_coco_ap50_where_rules_coincide(case):
    """Here the rules coincide: no detection overlaps two truths above 0.5 (Darknet keeps a
    detection's best truth even when taken, COCO moves on to the next), at most 100
    detections per image and class (COCO's maxDets), no IoU at exactly 0.5 (Darknet needs
    > 0.5, COCO >= 0.5), distinct probabilities, and both sample recall at 101 levels
    taking the best precision at recall >= the level. Classes without truths differ by
    rule: Darknet counts AP 0 in its mean, COCO leaves them out."""
    *_, report, ev = case
    precision = ev.eval["precision"][0, :, :, 0, -1]  # IoU 0.50, all areas, maxDets 100
    with_truths = [c for c in report.classes if c.gt > 0]
    for c in with_truths:
        assert c.ap == pytest.approx(precision[:, c.class_id].mean(), abs=1e-6), c.name
    assert np.mean([c.ap for c in with_truths]) == pytest.approx(ev.stats[1], abs=1e-6)
    # Darknet's mean includes class 5 (no truths) as 0.
    assert report.classes[5].ap == 0
    assert report.map == pytest.approx(sum(c.ap for c in report.classes) / CLASSES, abs=1e-12)
    assert report.map < ev.stats[1]


def test_a_detection_overlapping_two_truths_is_where_the_rules_differ():
    # Two truths of class 0, side by side and overlapping; two detections, both closest to
    # truth A but also above 0.5 with truth B. Darknet: the second detection's truth is A
    # (its best), already taken -> FP; AP = recall 0.5 at precision 1 = 0.5.
    # COCO: the second takes the best *unmatched* truth, B -> TP; AP50 = 1.
    truths = [np.array([[0, 0.50, 0.5, 0.2, 0.2], [0, 0.54, 0.5, 0.2, 0.2]])]
    dets = [np.array([[0.505, 0.5, 0.2, 0.2, 0, 0.9], [0.51, 0.5, 0.2, 0.2, 0, 0.8]])]
    report = evaluate(truths, dets, ["a"], points=101, image_sizes=[(100, 100)])
    ev = pycocotools_eval(truths, dets, [(100, 100)])
    assert report.classes[0].ap == pytest.approx(51 / 101)  # levels 0..0.5 at precision 1
    assert report.map == pytest.approx(51 / 101)
    assert ev.stats[1] == pytest.approx(1.0)
    assert report.coco.map_50 == pytest.approx(1.0)


def test_coco_without_image_sizes_keeps_the_overall_figures(case):
    truths, dets, sizes, report, _ = case
    unsized = evaluate(truths, dets, [f"c{c}" for c in range(CLASSES)], points=101)
    # IoU does not change when both axes are scaled: the overall figures stay.
    assert unsized.coco.map_50_95 == pytest.approx(report.coco.map_50_95, abs=1e-9)
    assert unsized.coco.map_50 == pytest.approx(report.coco.map_50, abs=1e-9)
    assert unsized.coco.stats["map_small"] is None
