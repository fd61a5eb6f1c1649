"""Evaluation of a detector on a labelled set: Darknet's ``detector map`` figures, COCO's
mAP through faster-coco-eval, and Darknet's ``calc_anchors``.

- :func:`detect_dataset` runs a network over image files as Darknet's map run does;
- :func:`evaluate` turns truths and detections into a :class:`MapReport`
  (:func:`format_darknet_report`, :meth:`MapReport.to_json`);
- :func:`calc_anchors` finds anchors by k-means (:func:`format_anchors`).

Owns: scoring detections against truths. May import: ``errors``, ``files``, ``arguments``,
``inference``, ``datasets``; a network only to run it over a dataset (``dataset_detect``).
"""

from darknet_metal.evaluation.anchors import (
    AnchorsReport,
    calc_anchors,
    dataset_anchors,
    format_anchors,
)
from darknet_metal.evaluation.coco import COCO_STAT_NAMES, CocoResult, coco_map
from darknet_metal.evaluation.darknet_map import average_precision, darknet_map
from darknet_metal.evaluation.dataset_detect import DatasetDetections, detect_dataset
from darknet_metal.evaluation.detections import detections_to_array
from darknet_metal.evaluation.evaluate import evaluate, evaluate_dataset
from darknet_metal.evaluation.report import ClassStats, MapReport, format_darknet_report

__all__ = [
    "COCO_STAT_NAMES",
    "AnchorsReport",
    "ClassStats",
    "CocoResult",
    "DatasetDetections",
    "MapReport",
    "average_precision",
    "calc_anchors",
    "dataset_anchors",
    "coco_map",
    "darknet_map",
    "detect_dataset",
    "detections_to_array",
    "evaluate",
    "evaluate_dataset",
    "format_anchors",
    "format_darknet_report",
]
