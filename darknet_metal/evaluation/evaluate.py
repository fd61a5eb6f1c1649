"""``evaluate``: Darknet's map figures and COCO's from one set of truths and detections;
``evaluate_dataset``: a network on a dataset's valid set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from darknet_metal import arguments
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.evaluation.coco import coco_map, coco_missing
from darknet_metal.evaluation.darknet_map import darknet_map
from darknet_metal.evaluation.dataset_detect import detect_dataset
from darknet_metal.evaluation.detections import (
    check_detections,
    check_image_sizes,
    check_truths,
)
from darknet_metal.evaluation.report import MapReport, build_report

if TYPE_CHECKING:
    from darknet_metal.network import Network

__all__ = ["evaluate", "evaluate_dataset"]


def _check_names(names: Any) -> list[str]:
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise ArgumentTypeError(f"names must be a sequence of class names, not "
                                f"{type(names).__name__}")
    if len(names) == 0:
        raise ArgumentError("names must hold at least one class name, got none")
    return [str(n) for n in names]


def evaluate(
    truths: Sequence[Any],
    detections: Sequence[Any],
    names: Sequence[str],
    *,
    iou_thresh: float = 0.5,
    thresh: float = 0.25,
    points: int = 0,
    image_sizes: Sequence[tuple[int, int]] | None = None,
    coco: bool | None = None,
) -> MapReport:
    """Darknet's ``detector map`` figures, and COCO's, for a set of images.

    ``truths``: per image a (k, 5) array ``class, cx, cy, w, h`` (normalised; k may be 0).
    ``detections``: per image a (m, 6) array ``cx, cy, w, h, class, probability``
    (normalised), or a list of ``Detection`` (pixel boxes; needs ``image_sizes``), as
    Darknet's map collects them: detector threshold 0.005 and NMS 0.45
    (:func:`detect_dataset`). ``names``: the class names (their count is the number of
    classes). ``iou_thresh``: the IoU a detection needs (strictly above) to match a truth;
    ``thresh``: the confidence threshold of the TP/FP/FN figures (strictly above);
    ``points``: 0 (area under the curve), or N >= 2 recall levels (11: VOC2007, 101:
    COCO). ``image_sizes``: (width, height) in pixels per image; with them COCO's area
    ranges are in pixels (without, COCO's overall figures are computed, those IoU-based
    figures not depending on the scale, and the small/medium/large ones are left out).
    ``coco``: None (default) for COCO's figures when faster-coco-eval is installed and
    Darknet's alone otherwise (the report's ``coco_note`` says why), True to require them
    (``DependencyError`` without the library), False to skip them.

    Raises ``ArgumentError`` / ``ArgumentTypeError`` naming the argument, image, row and
    value at fault.
    """
    class_names = _check_names(names)
    classes = len(class_names)
    iou_thresh = arguments.number("iou_thresh", iou_thresh, 0.0, 1.0)
    thresh = arguments.number("thresh", thresh, 0.0, 1.0)
    points = arguments.non_negative_int("points", points)
    if points == 1:
        raise ArgumentError("points must be 0 (area under the curve) or at least 2 recall "
                            "levels (11: VOC2007, 101: COCO), not 1")
    if isinstance(detections, Sequence) and isinstance(truths, Sequence) and len(
        detections
    ) != len(truths):
        raise ArgumentError(f"got truths for {len(truths)} images and detections for "
                            f"{len(detections)}")
    sizes = None if image_sizes is None else check_image_sizes(image_sizes, len(truths))
    checked_truths = check_truths(truths, classes)
    checked_dets = check_detections(detections, classes, sizes)
    figures = darknet_map(checked_truths, checked_dets, classes, iou_thresh=iou_thresh,
                          thresh=thresh, points=points)
    coco_result, note = None, ""
    if coco is None:
        missing = coco_missing()
        coco = missing is None
        note = missing or ""
    if coco:
        coco_sizes = sizes if sizes is not None else [(1000, 1000)] * len(checked_truths)
        coco_result = coco_map(checked_truths, checked_dets, classes, coco_sizes)
        if sizes is None:
            for key in ("map_small", "map_medium", "map_large", "ar_small", "ar_medium",
                        "ar_large"):
                coco_result.stats[key] = None
    return build_report(figures, class_names, iou_thresh=iou_thresh, thresh=thresh,
                        points=points, images=len(checked_truths), coco=coco_result,
                        coco_note=note)


def evaluate_dataset(net: Network, dataset: Any, *, thresh: float = 0.25,
                     iou_thresh: float = 0.5, points: int = 0, batch: int = 4,
                     progress: bool = True, coco: bool | None = None) -> MapReport:
    """``darknet detector map``: ``net`` over the valid set of ``dataset`` (a
    ``darknet_metal.datasets.Dataset``), its detections (``detect_dataset``, Darknet's
    threshold 0.005 and NMS 0.45) against the set's labels (``evaluate``). Raises
    ``ArgumentError`` when the network's classes and the dataset's differ."""
    heads = [net.layers[i].values["classes"] for i in net.yolo_layers]
    if heads and any(c != dataset.classes for c in heads):
        raise ArgumentError(f"the network detects {heads[0]} classes, the dataset "
                            f"{dataset.path} has {dataset.classes}")
    samples = list(dataset.valid)
    if not samples:
        raise ArgumentError(f"{dataset.path}: the valid set is empty")
    truths = [dataset.read_boxes(sample) for sample in samples]
    found = detect_dataset(net, [sample.image for sample in samples], batch=batch,
                           progress=progress)
    return evaluate(truths, found.detections, dataset.names, iou_thresh=iou_thresh,
                    thresh=thresh, points=points, image_sizes=found.image_sizes, coco=coco)
