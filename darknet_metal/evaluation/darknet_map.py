"""Mean average precision by the rules of Darknet's ``detector map``.

Darknet V5's ``validate_detector_map`` (``src-lib/detector_map.cpp``), step by step:

1. Each (box, class) with probability > 0 of every image is one entry (the detector ran
   at thresh 0.005 with NMS 0.45, so only those survive).
2. An entry's truth is, among the truths of its image and class, the one with the highest
   IoU that is above ``iou_thresh`` (the first on equal IoUs); taken or not by another
   entry. IoU is Darknet's ``box_iou`` in float32 on normalised boxes.
3. All entries are ranked by decreasing probability across the whole set. Walking the
   ranks, an entry is a true positive when its truth exists and no earlier entry claimed
   it; otherwise (no truth, or a truth matched twice) a false positive.
4. Per class, precision = TP / (TP + FP) and recall = TP / GT after each rank (0 when the
   denominator is 0), and AP by ``points``: 0 is the area under the precision envelope at
   every recall step (VOC2010+); N >= 2 averages, over recall levels p / (N - 1), the
   highest precision at any rank whose recall reaches the level (11: VOC2007, 101: COCO).
5. mAP is the mean over *all* classes: a class without truths has recall 0 everywhere, so
   its AP is 0 and it lowers the mean (Darknet's behaviour, kept).

Equal probabilities: Darknet's ``std::sort`` is not stable, so ties fall in an order only
its implementation decides. Here ties keep the input order (image by image, then row by row
within an image), which is also what pycocotools' stable sort does.

The statistics at the confidence threshold (entries with probability > ``thresh``) are the
ranked pass's verdicts of those entries; see the README for how this differs from Darknet's
per-image bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from darknet_metal.inference.boxes import box_iou

__all__ = ["ClassResult", "DarknetMap", "average_precision", "darknet_map"]

_F32 = np.float32


@dataclass(frozen=True)
class ClassResult:
    """One class's figures. ``ap`` in [0, 1]; counts at the confidence threshold: ``tp``,
    ``fp``, ``fn`` = max(0, gt - tp); ``gt`` truths; ``detections`` entries at any
    probability; ``iou_sum``: the IoUs of the TPs at the threshold, summed."""

    class_id: int
    ap: float
    tp: int
    fp: int
    fn: int
    gt: int
    detections: int
    iou_sum: float


@dataclass(frozen=True)
class DarknetMap:
    """The whole set's figures (see :class:`ClassResult` for the per-class ones)."""

    classes: list[ClassResult]
    map: float
    detections_count: int
    unique_truth_count: int
    tp: int
    fp: int
    iou_sum: float


def average_precision(precision: np.ndarray, recall: np.ndarray, points: int) -> float:
    """AP of one class's curve by Darknet's rule for ``points``.

    ``precision``, ``recall``: float64 (n,), the class's values after each of its ranked
    entries (recall non-decreasing). ``points`` 0: area under the precision envelope over
    each recall step; N >= 2: mean over recall levels p / (N - 1), p = 0..N-1, of the
    highest precision at a rank whose recall is >= the level (0 where none is).
    """
    n = len(precision)
    if n == 0:
        return 0.0
    envelope = np.maximum.accumulate(precision[::-1])[::-1]
    if points == 0:
        # Each recall step (r[i] - r[i-1]) is weighted by the best precision at rank >= i-1,
        # which equals the best at rank >= i because precision cannot drop on a TP.
        steps = np.diff(recall, prepend=0.0)
        weights = np.concatenate([envelope[:1], envelope[:-1]])
        return float(np.sum(steps * weights))
    levels = np.arange(points, dtype=np.float64) / (points - 1)
    first = np.searchsorted(recall, levels, side="left")
    reached = first < n
    best = np.zeros(points, dtype=np.float64)
    best[reached] = envelope[first[reached]]
    return float(np.sum(best) / points)


def darknet_map(
    truths: Sequence[tuple[np.ndarray, np.ndarray]],
    detections: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    classes: int,
    *,
    iou_thresh: float,
    thresh: float,
    points: int,
) -> DarknetMap:
    """Darknet's map figures from checked inputs (``detections.check_truths`` /
    ``check_detections``): per image (truth class ids (k,), truth boxes (k, 4)) and
    (detection boxes (m, 4), class ids (m,), probabilities (m,)), boxes normalised cx, cy,
    w, h. See the module docstring for the rules."""
    iou_t = _F32(iou_thresh)
    probs, cls, truth_id, ious = [], [], [], []
    gt_counts = np.zeros(classes, dtype=np.int64)
    offset = 0
    for (t_cls, t_box), (d_box, d_cls, d_prob) in zip(truths, detections, strict=True):
        gt_counts += np.bincount(t_cls, minlength=classes)
        m, k = len(d_cls), len(t_cls)
        best_truth = np.full(m, -1, dtype=np.int64)
        best_iou = np.zeros(m, dtype=np.float32)
        if m and k:
            iou = box_iou(d_box[:, None, :], t_box[None, :, :])
            valid = (d_cls[:, None] == t_cls[None, :]) & (iou > iou_t)
            masked = np.where(valid, iou, _F32(-1))
            pick = np.argmax(masked, axis=1)  # the first of equal maxima, as Darknet's ">"
            hit = valid[np.arange(m), pick]
            best_truth[hit] = offset + pick[hit]
            best_iou[hit] = masked[np.arange(m), pick][hit]
        probs.append(d_prob)
        cls.append(d_cls)
        truth_id.append(best_truth)
        ious.append(best_iou)
        offset += k

    prob = np.concatenate(probs) if probs else np.zeros(0, np.float32)
    d_cls = np.concatenate(cls) if cls else np.zeros(0, np.int64)
    t_id = np.concatenate(truth_id) if truth_id else np.zeros(0, np.int64)
    iou = np.concatenate(ious) if ious else np.zeros(0, np.float32)

    order = np.argsort(-prob, kind="stable")
    prob, d_cls, t_id, iou = prob[order], d_cls[order], t_id[order], iou[order]
    tp = np.zeros(len(prob), dtype=bool)
    matched = np.flatnonzero(t_id >= 0)
    if len(matched):
        # The first rank to claim each truth is its TP; later claims are FPs.
        _, first = np.unique(t_id[matched], return_index=True)
        tp[matched[first]] = True

    above = prob > _F32(thresh)
    results = []
    ap_sum = 0.0
    for c in range(classes):
        mine = d_cls == c
        c_tp = tp[mine]
        gt = int(gt_counts[c])
        cum_tp = np.cumsum(c_tp, dtype=np.float64)
        cum_fp = np.cumsum(~c_tp, dtype=np.float64)
        precision = cum_tp / np.maximum(cum_tp + cum_fp, 1.0)
        recall = cum_tp / gt if gt > 0 else np.zeros_like(cum_tp)
        ap = average_precision(precision, recall, points) if len(prob) else 0.0
        ap_sum += ap
        c_above = above[mine]
        n_tp = int(np.count_nonzero(c_tp & c_above))
        n_fp = int(np.count_nonzero(~c_tp & c_above))
        results.append(ClassResult(
            class_id=c, ap=ap, tp=n_tp, fp=n_fp, fn=max(0, gt - n_tp), gt=gt,
            detections=int(np.count_nonzero(mine)),
            iou_sum=float(np.sum(iou[mine][c_tp & c_above], dtype=np.float64)),
        ))
    return DarknetMap(
        classes=results,
        map=ap_sum / classes if classes else 0.0,
        detections_count=len(prob),
        unique_truth_count=int(offset),
        tp=int(np.count_nonzero(tp & above)),
        fp=int(np.count_nonzero(~tp & above)),
        iou_sum=float(np.sum(iou[tp & above], dtype=np.float64)),
    )
