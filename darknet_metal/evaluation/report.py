"""The map report: its figures (:class:`MapReport`), Darknet's printed layout, JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from darknet_metal.evaluation.coco import CocoResult

__all__ = ["ClassStats", "MapReport", "format_darknet_report"]


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


@dataclass(frozen=True)
class ClassStats:
    """One class. ``ap`` in [0, 1] (Darknet's rule); at the confidence threshold: ``tp``,
    ``fp``, ``fn`` (= max(0, gt - tp)), ``precision``, ``recall``, ``f1``,
    ``average_iou`` (Darknet's: the TPs' IoUs summed over TP + FP) and ``tp_mean_iou``
    (over the TPs only); ``gt`` truths, ``detections`` entries at any probability."""

    class_id: int
    name: str
    ap: float
    tp: int
    fp: int
    fn: int
    gt: int
    detections: int
    precision: float
    recall: float
    f1: float
    average_iou: float
    tp_mean_iou: float


@dataclass(frozen=True)
class MapReport:
    """What ``detector map`` reports, and COCO's figures.

    ``map``: Darknet's mAP at ``iou_thresh`` by ``points`` (0: area under the curve), the
    mean over all classes; ``thresh``: the confidence threshold of the TP/FP/FN figures;
    ``tp``, ``fp``, ``fn`` (= unique_truth_count - tp), ``precision``, ``recall``, ``f1``,
    ``average_iou`` (Darknet's: sum of the TPs' IoUs / (TP + FP)) and ``tp_mean_iou``
    (over the TPs), all fractions in [0, 1]; ``coco``: None when not computed, and then
    ``coco_note`` says why when COCO's figures were wanted but cannot be computed ("" else).
    """

    classes: list[ClassStats]
    map: float
    iou_thresh: float
    thresh: float
    points: int
    images: int
    detections_count: int
    unique_truth_count: int
    tp: int
    fp: int
    fn: int
    precision: float
    recall: float
    f1: float
    average_iou: float
    tp_mean_iou: float
    coco: CocoResult | None
    coco_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (lists, dicts, numbers, strings, None)."""
        data = asdict(self)
        if self.coco is not None:
            data["coco"]["map_50_95"] = self.coco.map_50_95
            data["coco"]["map_50"] = self.coco.map_50
        return data

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON text (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent)


def format_darknet_report(report: MapReport) -> str:
    """The report in the layout of Darknet's ``detector map`` output (the classic one,
    with FN and GT added per class), then COCO's figures when computed. Ends with a
    newline."""
    lines = [f" detections_count = {report.detections_count}, "
             f"unique_truth_count = {report.unique_truth_count}"]
    for c in report.classes:
        # Darknet's printf formats: "%2.2f%%   \t (TP = %d, FP = %d) ", FN and GT added.
        lines.append(f"class_id = {c.class_id}, name = {c.name}, ap = {c.ap * 100:2.2f}%   \t "
                     f"(TP = {c.tp}, FP = {c.fp}, FN = {c.fn}, GT = {c.gt}) ")
    lines.append("")
    lines.append(f" for conf_thresh = {report.thresh:1.2f}, precision = {report.precision:1.2f}, "
                 f"recall = {report.recall:1.2f}, F1-score = {report.f1:1.2f} ")
    lines.append(f" for conf_thresh = {report.thresh:0.2f}, TP = {report.tp}, FP = {report.fp}, "
                 f"FN = {report.fn}, average IoU = {report.average_iou * 100:2.2f} % ")
    lines.append("")
    how = (f"used {report.points} Recall-points" if report.points
           else "used Area-Under-Curve for each unique Recall")
    lines.append(f" IoU threshold = {report.iou_thresh * 100:2.0f} %, {how} ")
    lines.append(f" mean average precision (mAP@{report.iou_thresh:0.2f}) = {report.map:f}, or "
                 f"{report.map * 100:2.2f} % ")
    if report.coco is None and report.coco_note:
        lines.append("")
        lines.append(f" COCO's mAP@[.50:.95] not computed ({report.coco_note}); Darknet's "
                     "figures above need no COCO library.")
    if report.coco is not None:
        lines.append("")
        lines.append(f" COCO ({report.coco.library}, at most 100 detections per image and "
                     "class):")
        names = {"map_50_95": "mAP@[.50:.95]", "map_50": "mAP@0.50", "map_75": "mAP@0.75",
                 "map_small": "mAP small", "map_medium": "mAP medium", "map_large": "mAP large"}
        for key, label in names.items():
            value = report.coco.stats.get(key)
            shown = "n/a" if value is None else f"{value:f}, or {value * 100:2.2f} %"
            lines.append(f" {label} = {shown}")
    return "\n".join(lines) + "\n"


def build_report(
    darknet: Any,
    names: list[str],
    *,
    iou_thresh: float,
    thresh: float,
    points: int,
    images: int,
    coco: CocoResult | None,
    coco_note: str = "",
) -> MapReport:
    """A :class:`MapReport` from ``darknet_map``'s figures (``darknet_map.DarknetMap``)."""
    classes = []
    for c in darknet.classes:
        precision = _ratio(c.tp, c.tp + c.fp)
        recall = _ratio(c.tp, c.gt)
        classes.append(ClassStats(
            class_id=c.class_id, name=names[c.class_id], ap=c.ap, tp=c.tp, fp=c.fp, fn=c.fn,
            gt=c.gt, detections=c.detections, precision=precision, recall=recall,
            f1=_f1(precision, recall), average_iou=_ratio(c.iou_sum, c.tp + c.fp),
            tp_mean_iou=_ratio(c.iou_sum, c.tp),
        ))
    precision = _ratio(darknet.tp, darknet.tp + darknet.fp)
    recall = _ratio(darknet.tp, darknet.unique_truth_count)
    return MapReport(
        classes=classes, map=darknet.map, iou_thresh=iou_thresh, thresh=thresh, points=points,
        images=images, detections_count=darknet.detections_count,
        unique_truth_count=darknet.unique_truth_count, tp=darknet.tp, fp=darknet.fp,
        fn=darknet.unique_truth_count - darknet.tp, precision=precision, recall=recall,
        f1=_f1(precision, recall), average_iou=_ratio(darknet.iou_sum, darknet.tp + darknet.fp),
        tp_mean_iou=_ratio(darknet.iou_sum, darknet.tp), coco=coco, coco_note=coco_note,
    )
