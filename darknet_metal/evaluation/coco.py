"""COCO's box mAP of the same detections, computed by faster-coco-eval.

faster-coco-eval is a C++ implementation of pycocotools' ``COCOeval`` with the same
results (the tests compare it with pycocotools itself); it is used because it evaluates
1,000 images of 20 detections in about 0.5 s where pycocotools takes 4-5 s on the
reference machine.

The data go to the library in memory (no files): image ``i`` becomes COCO image ``i + 1``
with its size in pixels, class ``c`` category ``c + 1``; boxes are converted from
normalised centre/size to pixel ``[left, top, width, height]``; every truth is
``iscrowd = 0`` with ``area`` = its pixel width x height. COCO's rules then apply:
IoU thresholds 0.50:0.05:0.95, 101 recall levels, at most ``max_dets`` (100) detections
per image *and class* (the highest scored), categories without truths left out of the
means, and the area ranges small (< 32^2 px), medium (32^2..96^2) and large (> 96^2), which
select truths by their area and ignore detections outside the range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from darknet_metal.errors import DependencyError

__all__ = ["COCO_STAT_NAMES", "CocoResult", "coco_map"]

#: The names of COCOeval's twelve summary figures, in its order.
COCO_STAT_NAMES: tuple[str, ...] = (
    "map_50_95", "map_50", "map_75", "map_small", "map_medium", "map_large",
    "ar_1", "ar_10", "ar_100", "ar_small", "ar_medium", "ar_large",
)


@dataclass(frozen=True)
class CocoResult:
    """COCO's figures, each in [0, 1] or None where COCO has none (-1: no truth in range).

    ``stats``: the twelve summary figures by name (:data:`COCO_STAT_NAMES`);
    ``per_class_50_95`` / ``per_class_50``: AP of each class (None without truths);
    ``library``: the evaluation library and its version.
    """

    stats: dict[str, float | None]
    per_class_50_95: list[float | None]
    per_class_50: list[float | None]
    library: str

    @property
    def map_50_95(self) -> float | None:
        """mAP@[.50:.95]."""
        return self.stats["map_50_95"]

    @property
    def map_50(self) -> float | None:
        """mAP@0.50."""
        return self.stats["map_50"]


def _figure(value: float) -> float | None:
    return None if value < 0 else float(value)


def _pixel_boxes(boxes: np.ndarray, width: int, height: int) -> np.ndarray:
    b = boxes.astype(np.float64)
    out = np.empty_like(b)
    out[:, 0] = (b[:, 0] - b[:, 2] / 2) * width
    out[:, 1] = (b[:, 1] - b[:, 3] / 2) * height
    out[:, 2] = b[:, 2] * width
    out[:, 3] = b[:, 3] * height
    return out


#: What is missing when COCO's figures cannot be computed, and how to get it.
MISSING = "COCO mAP needs faster-coco-eval: pip install 'darknet-metal[eval]'"


def coco_missing() -> str | None:
    """None when faster-coco-eval can be imported, else why COCO's figures cannot be
    computed (:data:`MISSING`)."""
    try:
        import faster_coco_eval  # noqa: F401
    except ImportError:
        return MISSING
    return None


def coco_map(
    truths: Sequence[tuple[np.ndarray, np.ndarray]],
    detections: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    classes: int,
    image_sizes: Sequence[tuple[int, int]],
    *,
    max_dets: int = 100,
) -> CocoResult:
    """COCO box evaluation of checked inputs (see ``detections.check_truths`` /
    ``check_detections``; ``image_sizes`` one (width, height) in pixels per image).

    Raises ``DependencyError`` when faster-coco-eval is not installed (``pip install
    'darknet-metal[eval]'``).
    """
    try:
        import faster_coco_eval
        from faster_coco_eval import COCO, COCOeval_faster
    except ImportError:
        raise DependencyError(f"{MISSING} (or evaluate(..., coco=False))") from None

    def quiet(*_args: object, **_kwargs: object) -> None:
        return None

    images, annotations, results = [], [], []
    for i, ((t_cls, t_box), (d_box, d_cls, d_prob), (w, h)) in enumerate(
        zip(truths, detections, image_sizes, strict=True)
    ):
        images.append({"id": i + 1, "width": w, "height": h})
        for c, box in zip(t_cls.tolist(), _pixel_boxes(t_box, w, h).tolist(), strict=True):
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1,
                                "category_id": c + 1, "bbox": box, "area": box[2] * box[3],
                                "iscrowd": 0})
        for c, p, box in zip(d_cls.tolist(), d_prob.tolist(),
                             _pixel_boxes(d_box, w, h).tolist(), strict=True):
            results.append({"image_id": i + 1, "category_id": c + 1, "bbox": box, "score": p})
    dataset = {"images": images, "annotations": annotations,
               "categories": [{"id": c + 1, "name": str(c)} for c in range(classes)]}

    gt = COCO(dataset, print_function=quiet)
    dt = gt.loadRes(results)
    ev = COCOeval_faster(gt, dt, "bbox", print_function=quiet)
    ev.params.maxDets = [1, 10, max_dets]
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    stats = {name: _figure(v) for name, v in zip(COCO_STAT_NAMES, ev.stats[:12], strict=True)}

    # precision[T, R, K, A, M]: IoU thresholds, recall levels, categories, area ranges
    # (0: all), maxDets (last: max_dets); -1 where a category has no truth.
    precision = np.asarray(ev.eval["precision"])
    per_50_95: list[float | None] = []
    per_50: list[float | None] = []
    for k in range(classes):
        p = precision[:, :, k, 0, -1]
        per_50_95.append(float(np.mean(p)) if np.all(p > -1) else None)
        per_50.append(float(np.mean(p[0])) if np.all(p[0] > -1) else None)
    return CocoResult(stats=stats, per_class_50_95=per_50_95, per_class_50=per_50,
                      library=f"faster-coco-eval {faster_coco_eval.__version__}")
