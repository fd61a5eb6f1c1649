"""Darknet's map rules on hand-made sets, every expected value worked out by hand.

The rules are those of Darknet V5's validate_detector_map (src-lib/detector_map.cpp): the
detection's truth is its best-IoU truth of the class above iou_thresh; ranks by decreasing
probability; the first rank to claim a truth is a TP, later ones FPs; per class precision
TP/(TP+FP) and recall TP/GT; AP by area under the envelope (points=0) or sampled at
p/(N-1); mAP over all classes.
"""

import json

import numpy as np
import pytest

from darknet_metal import ArgumentError, ArgumentTypeError, Detection
from darknet_metal.evaluation import (
    average_precision,
    detections_to_array,
    evaluate,
    format_darknet_report,
)

# A truth 0.2 x 0.2 at (0.5, 0.5); a detection of the same size shifted by 0.05 in x
# overlaps it by 0.15 x 0.2 = 0.03, union 0.04 + 0.04 - 0.03 = 0.05: IoU 0.6.
TRUTH_A = [0, 0.5, 0.5, 0.2, 0.2]
TRUTH_B = [0, 0.2, 0.2, 0.1, 0.1]


def det(cx, cy, w, h, cls, p):
    return [cx, cy, w, h, cls, p]


def _case_three_ranks():
    # Ranks: 0.9 hits A (IoU 0.6) -> TP; 0.8 hits nothing -> FP; 0.7 hits B exactly -> TP.
    # precision 1, 1/2, 2/3; recall 1/2, 1/2, 1.
    truths = [np.array([TRUTH_A, TRUTH_B])]
    dets = [np.array([det(0.55, 0.5, 0.2, 0.2, 0, 0.9), det(0.8, 0.8, 0.1, 0.1, 0, 0.8),
                      det(0.2, 0.2, 0.1, 0.1, 0, 0.7)])]
    return truths, dets


def test_area_under_curve_by_hand():
    truths, dets = _case_three_ranks()
    report = evaluate(truths, dets, ["a"], coco=False)
    # Envelope (best precision at this rank or later): 1, 2/3, 2/3.
    # Area: recall 0 -> 1/2 at 1, then 1/2 -> 1 at 2/3: 0.5 + 0.5 * 2/3 = 5/6.
    assert report.classes[0].ap == pytest.approx(5 / 6, abs=1e-12)
    assert report.map == pytest.approx(5 / 6, abs=1e-12)


def test_11_and_101_points_by_hand():
    truths, dets = _case_three_ranks()
    r11 = evaluate(truths, dets, ["a"], points=11, coco=False)
    # Levels 0, .1, ..., .5 (6 levels) reach precision 1; .6 ... 1 (5 levels) only 2/3.
    assert r11.map == pytest.approx((6 * 1 + 5 * 2 / 3) / 11, abs=1e-12)
    r101 = evaluate(truths, dets, ["a"], points=101, coco=False)
    # Levels 0 .. 0.50 (51) at 1, 0.51 .. 1 (50) at 2/3.
    assert r101.map == pytest.approx((51 + 50 * 2 / 3) / 101, abs=1e-12)
    # The three rules differ on this curve: 0.8333, 0.8485, 0.8350.
    assert len({round(r.map, 6) for r in (r11, r101, evaluate(truths, dets, ["a"],
                                                                coco=False))}) == 3


def test_average_precision_rules_directly():
    # One class: TP, TP, FP, TP against 4 truths. precision 1, 1, 2/3, 3/4;
    # recall .25, .5, .5, .75. Envelope 1, 1, 3/4, 3/4.
    precision = np.array([1, 1, 2 / 3, 3 / 4])
    recall = np.array([0.25, 0.5, 0.5, 0.75])
    # Area: .25*1 + .25*1 + 0 + .25*(3/4) = 0.6875
    assert average_precision(precision, recall, 0) == pytest.approx(0.6875, abs=1e-12)
    # 11 points: levels 0..0.5 (6) at 1, 0.6, 0.7 at 3/4, 0.8..1 (3) at 0 -> 7.5 / 11
    assert average_precision(precision, recall, 11) == pytest.approx(7.5 / 11, abs=1e-12)
    assert average_precision(np.zeros(0), np.zeros(0), 0) == 0


def test_threshold_figures_by_hand():
    truths, dets = _case_three_ranks()
    report = evaluate(truths, dets, ["a"], thresh=0.75, coco=False)
    # Above 0.75: the 0.9 (TP, IoU 0.6) and the 0.8 (FP). FN = 2 truths - 1.
    assert (report.tp, report.fp, report.fn) == (1, 1, 1)
    assert report.precision == pytest.approx(0.5)
    assert report.recall == pytest.approx(0.5)
    assert report.f1 == pytest.approx(0.5)
    # Darknet's average IoU: TP IoUs summed over TP + FP = 0.6 / 2; over the TPs: 0.6.
    assert report.average_iou == pytest.approx(0.3, abs=1e-6)
    assert report.tp_mean_iou == pytest.approx(0.6, abs=1e-6)
    c = report.classes[0]
    assert (c.tp, c.fp, c.fn, c.gt, c.detections) == (1, 1, 1, 2, 3)


def test_a_truth_matched_twice_makes_the_second_a_false_positive():
    # Truth C is A shifted 0.1 in x. The 0.9 detection is A exactly (IoU 1). The 0.8
    # detection, A shifted 0.04, overlaps A by 0.16 x 0.2: IoU 0.032 / 0.048 = 2/3, and C
    # by 0.14 x 0.2: IoU 0.028 / 0.052 = 0.538. Its truth is its best, A, already claimed:
    # FP (COCO would give it C). C stays unmatched.
    truth_c = [0, 0.6, 0.5, 0.2, 0.2]
    truths = [np.array([TRUTH_A, truth_c])]
    dets = [np.array([det(0.5, 0.5, 0.2, 0.2, 0, 0.9), det(0.54, 0.5, 0.2, 0.2, 0, 0.8)])]
    report = evaluate(truths, dets, ["a"], coco=False)
    # precision 1, 1/2; recall 1/2, 1/2 -> area 1/2 * 1.
    assert report.classes[0].ap == pytest.approx(0.5, abs=1e-12)
    assert (report.tp, report.fp, report.fn) == (1, 1, 1)


def test_a_class_without_truths_counts_zero_in_the_mean():
    truths, dets = _case_three_ranks()
    extra = np.vstack([dets[0], det(0.3, 0.3, 0.1, 0.1, 1, 0.95)])  # class 1, no truth
    report = evaluate(truths, [extra], ["a", "b"], coco=False)
    assert report.classes[1].gt == 0 and report.classes[1].ap == 0
    assert report.classes[1].fp == 1 and report.classes[1].fn == 0
    # Class a is as before (its own ranks do not change): (5/6 + 0) / 2.
    assert report.classes[0].ap == pytest.approx(5 / 6, abs=1e-12)
    assert report.map == pytest.approx(5 / 12, abs=1e-12)


def test_an_image_without_detections_adds_its_truths_as_misses():
    truths, dets = _case_three_ranks()
    truths = truths + [np.array([TRUTH_A])]
    dets = dets + [np.zeros((0, 6))]
    report = evaluate(truths, dets, ["a"], coco=False)
    # 3 truths now: recall 1/3, 1/3, 2/3 with precision 1, 1/2, 2/3.
    # Area: 1/3 * 1 + 1/3 * 2/3 = 5/9.
    assert report.classes[0].ap == pytest.approx(5 / 9, abs=1e-12)
    assert report.unique_truth_count == 3 and report.fn == 1  # thresh 0.25: 2 TPs


def test_no_detections_at_all():
    report = evaluate([np.array([TRUTH_A])], [np.zeros((0, 6))], ["a"], coco=True,
                      image_sizes=[(10, 10)])
    assert report.map == 0 and report.detections_count == 0
    assert (report.tp, report.fp, report.fn) == (0, 0, 1)
    assert report.coco.map_50 == 0


def test_ties_keep_the_input_order():
    # Two detections at probability 0.5: image 0's is a FP, image 1's a TP (1 truth).
    truths = [np.zeros((0, 5)), np.array([TRUTH_A])]
    dets = [np.array([det(0.5, 0.5, 0.2, 0.2, 0, 0.5)]),
            np.array([det(0.5, 0.5, 0.2, 0.2, 0, 0.5)])]
    first = evaluate(truths, dets, ["a"], coco=False)
    # Ranked FP then TP: precision 0, 1/2; recall 0, 1 -> area 1 * 1/2.
    assert first.map == pytest.approx(0.5, abs=1e-12)
    # Images swapped: TP then FP: precision 1, 1/2; recall 1, 1 -> area 1 * 1.
    swapped = evaluate(truths[::-1], dets[::-1], ["a"], coco=False)
    assert swapped.map == pytest.approx(1.0, abs=1e-12)


def test_without_ties_the_image_order_does_not_matter():
    rng = np.random.default_rng(3)
    truths, dets = [], []
    for _ in range(12):
        t = np.column_stack([rng.integers(0, 3, 4), rng.uniform(0.2, 0.8, (4, 2)),
                             rng.uniform(0.1, 0.3, (4, 2))])
        d = np.column_stack([t[:, 1:5] + rng.normal(0, 0.02, (4, 4)), t[:, 0],
                             rng.uniform(0.01, 1, 4)])
        truths.append(t)
        dets.append(d)
    a = evaluate(truths, dets, ["a", "b", "c"], coco=False)
    order = rng.permutation(12)
    b = evaluate([truths[i] for i in order], [dets[i] for i in order], ["a", "b", "c"],
                 coco=False)
    assert a.to_dict() == b.to_dict()
    assert 0 < a.map < 1


def test_iou_threshold_is_strict():
    # IoU 0.6 (see TRUTH_A) at iou_thresh 0.6 does not match (Darknet needs > thresh).
    truths = [np.array([TRUTH_A])]
    dets = [np.array([det(0.55, 0.5, 0.2, 0.2, 0, 0.9)])]
    assert evaluate(truths, dets, ["a"], iou_thresh=0.59, coco=False).map == 1
    assert evaluate(truths, dets, ["a"], iou_thresh=0.61, coco=False).map == 0


def test_darknet_layout():
    truths, dets = _case_three_ranks()
    report = evaluate(truths, dets, ["apple"], coco=False)
    text = format_darknet_report(report)
    lines = text.splitlines()
    assert lines[0] == " detections_count = 3, unique_truth_count = 2"
    assert lines[1] == ("class_id = 0, name = apple, ap = 83.33%   \t "
                        "(TP = 2, FP = 1, FN = 0, GT = 2) ")
    assert " for conf_thresh = 0.25, precision = 0.67, recall = 1.00, F1-score = 0.80 " in lines
    # average IoU: (0.6 + 1.0) / 3 = 53.33 %
    assert " for conf_thresh = 0.25, TP = 2, FP = 1, FN = 0, average IoU = 53.33 % " in lines
    assert " IoU threshold = 50 %, used Area-Under-Curve for each unique Recall " in lines
    assert " mean average precision (mAP@0.50) = 0.833333, or 83.33 % " in lines
    r101 = format_darknet_report(evaluate(truths, dets, ["apple"], points=101, coco=False))
    assert " IoU threshold = 50 %, used 101 Recall-points " in r101.splitlines()


def test_report_with_coco_and_json():
    truths, dets = _case_three_ranks()
    report = evaluate(truths, dets, ["apple"], image_sizes=[(640, 480)])
    text = format_darknet_report(report)
    assert " mAP@[.50:.95] = " in text and " mAP@0.50 = " in text
    data = json.loads(report.to_json())
    assert data["map"] == pytest.approx(5 / 6)
    assert data["classes"][0]["name"] == "apple" and data["classes"][0]["gt"] == 2
    assert data["coco"]["map_50"] == pytest.approx(report.coco.map_50)
    assert set(data["coco"]["stats"]) >= {"map_50_95", "map_50", "map_small"}


def test_detection_objects_equal_arrays():
    truths, dets = _case_three_ranks()
    w, h = 640, 480
    objects = [Detection(class_id=int(c), name="a", confidence=float(p), objectness=float(p),
                         left=(cx - bw / 2) * w, top=(cy - bh / 2) * h, width=bw * w,
                         height=bh * h) for cx, cy, bw, bh, c, p in dets[0]]
    arr = detections_to_array(objects, w, h)
    np.testing.assert_allclose(arr, dets[0], atol=1e-7)
    a = evaluate(truths, [objects], ["a"], image_sizes=[(w, h)], coco=False)
    b = evaluate(truths, dets, ["a"], coco=False)
    assert a.map == b.map and a.tp == b.tp
    with pytest.raises(ArgumentError, match="image_sizes"):
        evaluate(truths, [objects], ["a"], coco=False)


@pytest.mark.parametrize("truths, dets, kwargs, match", [
    ([np.array([[2, 0.5, 0.5, 0.1, 0.1]])], [np.zeros((0, 6))], {},
     r"truths of image 0 row 1: class 2 is not an integer in 0..1"),
    ([np.array([[0.5, 0.5, 0.5, 0.1, 0.1]])], [np.zeros((0, 6))], {},
     r"truths of image 0 row 1: class 0.5"),
    ([np.zeros((0, 5)), np.array([[0, 0.5, np.nan, 0.1, 0.1]])], [np.zeros((0, 6))] * 2, {},
     r"truths of image 1 row 1: cy is nan"),
    ([np.zeros((0, 5))], [np.array([[0.5, 0.5, 0.1, 0.1, 0, 1.5]])], {},
     r"detections of image 0 row 1: probability 1.5"),
    ([np.zeros((0, 5))], [np.array([[0.5, 0.5, -0.1, 0.1, 0, 0.5]])], {},
     r"detections of image 0 row 1: w is -0.1"),
    ([np.zeros((0, 5))], [np.zeros((0, 6))] * 2, {}, r"truths for 1 images and detections for 2"),
    ([np.zeros((0, 5))], [np.zeros((0, 4))], {}, r"detections of image 0 must have shape"),
    ([np.zeros((0, 5))], [np.zeros((0, 6))], {"points": 1}, r"points must be 0"),
    ([np.zeros((0, 5))], [np.zeros((0, 6))], {"iou_thresh": 1.5}, r"iou_thresh"),
    ([np.zeros((0, 5))], [np.zeros((0, 6))], {"image_sizes": [(0, 5)]}, r"image_sizes\[0\]"),
])
def test_bad_input_names_the_place(truths, dets, kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        evaluate(truths, dets, ["a", "b"], coco=False, **kwargs)


def test_bad_types():
    with pytest.raises(ArgumentTypeError, match="names"):
        evaluate([np.zeros((0, 5))], [np.zeros((0, 6))], "ab", coco=False)
    with pytest.raises(ArgumentTypeError, match="truths"):
        evaluate(np.zeros((1, 0, 5)), [np.zeros((0, 6))], ["a"], coco=False)
    with pytest.raises(ArgumentTypeError, match="thresh"):
        evaluate([np.zeros((0, 5))], [np.zeros((0, 6))], ["a"], thresh="0.25", coco=False)


def test_missing_coco_library_is_named(monkeypatch):
    import sys

    from darknet_metal.errors import DependencyError

    monkeypatch.setitem(sys.modules, "faster_coco_eval", None)  # import now fails
    truths, dets = _case_three_ranks()
    with pytest.raises(DependencyError, match=r"faster-coco-eval.*darknet-metal\[eval\]"):
        evaluate(truths, dets, ["a"], image_sizes=[(10, 10)], coco=True)
    assert evaluate(truths, dets, ["a"], coco=False).coco is None


def test_darknets_figures_need_no_coco_library(monkeypatch):
    import sys

    truths, dets = _case_three_ranks()
    with_coco = evaluate(truths, dets, ["a"], image_sizes=[(10, 10)])
    assert with_coco.coco is not None and with_coco.coco_note == ""
    monkeypatch.setitem(sys.modules, "faster_coco_eval", None)  # import now fails
    alone = evaluate(truths, dets, ["a"], image_sizes=[(10, 10)])
    assert alone.coco is None and "pip install 'darknet-metal[eval]'" in alone.coco_note
    assert (alone.map, alone.tp, alone.fp, alone.fn) == (with_coco.map, with_coco.tp,
                                                        with_coco.fp, with_coco.fn)
    text = format_darknet_report(alone)
    assert "mean average precision (mAP@0.50)" in text
    assert "COCO's mAP@[.50:.95] not computed (COCO mAP needs faster-coco-eval" in text
    assert "not computed" not in format_darknet_report(with_coco)
