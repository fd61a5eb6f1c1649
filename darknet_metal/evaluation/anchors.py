"""Anchors from the truth boxes' sizes, as Darknet's ``detector calc_anchors`` finds them.

Darknet's ``calc_anchors`` (``src-lib/detector.cpp``) with ``do_kmeans``
(``src-lib/matrix.cpp``), in float32:

- every truth's (w * width, h * height): its size in network pixels;
- initial centres: the first k entries of a Fisher-Yates shuffle of the box indices run
  from the last position down (``sample``), each swap index drawn uniformly from 0..i; here
  drawn from ``numpy.random.default_rng(seed)`` (Darknet uses ``rand()`` seeded by the
  clock, so its anchors change from run to run);
- distance 1 - IoU of the two sizes placed at a common corner; a box goes to the first
  closest centre;
- with k = 1 one update first; then, up to 1000 times: assign every box, stop when no
  assignment changed, else move each centre to the mean of its boxes (summed in box order)
  and keep the old value of a centre with no box;
- the centres sorted by area, increasing (equal areas keep their order: Darknet's qsort
  leaves that open); the average over boxes of the best IoU with a sorted centre, in %.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from darknet_metal import arguments
from darknet_metal.errors import ArgumentError, ArgumentTypeError

__all__ = ["MAX_ITERATIONS", "AnchorsReport", "calc_anchors", "dataset_anchors",
           "format_anchors"]

#: Darknet's cap on k-means rounds.
MAX_ITERATIONS = 1000

_F32 = np.float32


@dataclass(frozen=True)
class AnchorsReport:
    """``anchors``: (k, 2) float32 width, height in network pixels, by increasing area;
    ``avg_iou``: mean best IoU of a box with an anchor, in percent (float32 as Darknet);
    ``iterations``: k-means rounds run (Darknet's ``iterations=``); ``counts``: (k,) boxes
    closest to each anchor; ``width``, ``height``: the network size; ``boxes``: how many."""

    anchors: np.ndarray
    avg_iou: float
    iterations: int
    counts: np.ndarray
    width: int
    height: int
    boxes: int


def _ious(sizes: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """(n, k) float32 IoU of sizes placed at a common corner, in Darknet's operation order
    (``dist`` returns 1 minus it)."""
    w, h = sizes[:, 0:1], sizes[:, 1:2]
    cw, ch = centres[None, :, 0], centres[None, :, 1]
    inter = np.minimum(w, cw) * np.minimum(h, ch)
    union = (w * h + cw * ch) - inter
    return inter / union


def _closest(sizes: np.ndarray, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per box the first centre at the smallest distance 1 - IoU, and that IoU."""
    iou = _ious(sizes, centres)
    best = np.argmin(_F32(1) - iou, axis=1)
    return best, iou[np.arange(len(sizes)), best]


def _update(sizes: np.ndarray, assign: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Darknet's ``kmeans_maximization``: float32 sums in box order, divided by the count;
    a coordinate that ends at 0 (a centre with no box) keeps its old value."""
    new = np.zeros_like(centres)
    for j in range(len(centres)):
        members = sizes[assign == j]
        if len(members):
            # cumsum adds one element after another, as Darknet's loop does.
            new[j] = np.cumsum(members, axis=0, dtype=np.float32)[-1] / _F32(len(members))
    return np.where(new == 0, centres, new)


def _check_boxes(boxes_wh: np.ndarray) -> np.ndarray:
    if not isinstance(boxes_wh, np.ndarray):
        raise ArgumentTypeError(f"boxes_wh must be a NumPy array (n, 2), not "
                                f"{type(boxes_wh).__name__}")
    if boxes_wh.ndim != 2 or boxes_wh.shape[1] != 2:
        raise ArgumentError(f"boxes_wh must have shape (n, 2): w, h normalised, not "
                            f"{boxes_wh.shape}")
    if not np.issubdtype(boxes_wh.dtype, np.number):
        raise ArgumentTypeError(f"boxes_wh must hold numbers, not {boxes_wh.dtype}")
    wh = boxes_wh.astype(np.float32)
    bad = np.argwhere(~(np.isfinite(wh) & (wh > 0) & (wh <= 1)))
    if len(bad):
        row, col = (int(i) for i in bad[0])
        value = float(boxes_wh[row, col])
        raise ArgumentError(f"boxes_wh row {row + 1}: {'wh'[col]} is {value!r}; a normalised "
                            "size must be in (0, 1]")
    return wh


def calc_anchors(
    boxes_wh: np.ndarray, clusters: int, width: int, height: int, *, seed: int = 0
) -> AnchorsReport:
    """k-means anchors of truth sizes, as Darknet's ``calc_anchors`` (see the module).

    ``boxes_wh``: (n, 2) truth widths and heights normalised to the image, each in (0, 1]
    (the w, h columns of the label files). ``clusters``: k, the anchors wanted.
    ``width``, ``height``: the network size in pixels (multiples of 32, as Darknet
    requires). ``seed``: the initial centres' draw; the same seed gives the same anchors.

    Raises ``ArgumentError`` naming the argument (or the row of ``boxes_wh``) and value,
    including fewer boxes than clusters.
    """
    wh = _check_boxes(boxes_wh)
    k = arguments.positive_int("clusters", clusters)
    for name, value in (("width", width), ("height", height)):
        v = arguments.positive_int(name, value)
        if v < 32 or v % 32:
            raise ArgumentError(f"{name} must be a multiple of 32 (the network size), not {v}")
    seed = arguments.non_negative_int("seed", seed)
    n = len(wh)
    if n < k:
        raise ArgumentError(f"clusters is {k} but there are only {n} boxes: k-means needs at "
                            "least one box per cluster")

    sizes = np.empty_like(wh)
    sizes[:, 0] = wh[:, 0] * _F32(width)
    sizes[:, 1] = wh[:, 1] * _F32(height)

    rng = np.random.default_rng(seed)
    # Swap position i (n-1 down to 0) with a position drawn from 0..i.
    draws = rng.integers(0, np.arange(n, 0, -1)).tolist()
    perm = list(range(n))
    for i, j in zip(range(n - 1, -1, -1), draws, strict=True):
        perm[i], perm[j] = perm[j], perm[i]
    centres = sizes[perm[:k]].copy()

    assign = np.zeros(n, dtype=np.int64)
    if k == 1:
        centres = _update(sizes, assign, centres)
    iterations = 0
    while iterations < MAX_ITERATIONS:
        closest, _ = _closest(sizes, centres)
        if np.array_equal(closest, assign):
            break
        assign = closest
        centres = _update(sizes, assign, centres)
        iterations += 1

    areas = centres[:, 0] * centres[:, 1]
    centres = centres[np.argsort(areas, kind="stable")]
    best, best_iou = _closest(sizes, centres)
    total = np.cumsum(best_iou, dtype=np.float32)[-1]
    avg_iou = _F32(100) * total / _F32(n)
    counts = np.bincount(best, minlength=k)
    centres.setflags(write=False)
    return AnchorsReport(anchors=centres, avg_iou=float(avg_iou), iterations=iterations,
                         counts=counts, width=int(width), height=int(height), boxes=n)


def dataset_anchors(dataset: Any, clusters: int, width: int, height: int, *,
                    seed: int = 0) -> AnchorsReport:
    """:func:`calc_anchors` of the boxes of ``dataset``'s training set (a
    ``darknet_metal.datasets.Dataset``), as ``darknet detector calc_anchors DATA`` reads
    them."""
    boxes = [dataset.read_boxes(sample) for sample in dataset.train]
    sizes = np.concatenate([b[:, 3:5] for b in boxes if len(b)] or [np.zeros((0, 2))])
    return calc_anchors(sizes, clusters, width, height, seed=seed)


def format_anchors(report: AnchorsReport) -> str:
    """Darknet's ``calc_anchors`` summary: the iterations, ``avg IoU``, and the
    ``anchors = ...`` line to paste into the cfg, each anchor written as Darknet V5 writes
    it (``%d`` of the value truncated toward zero; ``%2.4f`` when width is 32). Ends with
    a newline."""
    if report.width > 32:
        parts = [f"{int(w)}, {int(h)}" for w, h in report.anchors.tolist()]
    else:
        parts = [f"{w:2.4f},{h:2.4f}" for w, h in report.anchors.tolist()]
    return (
        f"num_of_clusters = {len(report.anchors)}, width = {report.width}, "
        f"height = {report.height}, boxes = {report.boxes}\n"
        f"iterations = {report.iterations}\n"
        f"avg IoU = {report.avg_iou:.2f} %\n"
        f"anchors = {', '.join(parts)}\n"
    )
