"""From ``[yolo]`` layer outputs to detections, as ``darknet detector test`` computes them.

Decoding follows Darknet V5's ``get_network_boxes`` (``get_yolo_box`` then
``correct_yolo_boxes`` with relative coordinates), NMS its ``do_nms_sort`` and
``diounms_sort``. Arithmetic is float32 in Darknet's operation order, so threshold
decisions fall the same way.

Order matters to users who compare outputs line by line, so it is reproduced too:

- candidates come per ``[yolo]`` layer in network order, then anchor, then row, then
  column (V5's cached scan; older Darknet scanned cells first, then anchors);
- NMS sorts the candidates once per class with C++ ``std::sort``, which is not stable, so
  boxes with equal scores (most often 0 for that class) end up in an order that only the
  algorithm itself determines. This module replays libstdc++'s introsort step for step
  (:func:`_introsort`): the order matches Darknet built with GCC on Linux, which produced
  the reference outputs. (A build against libc++, as on macOS, can order ties differently;
  which (box, class) pairs survive does not depend on it.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.fp32 import fma32
from darknet_metal.inference.image import letterbox_geometry

__all__ = [
    "NMS_KINDS",
    "Detection",
    "YoloHead",
    "correct_boxes",
    "decode_yolo",
    "detect_boxes",
    "detections_from_candidates",
    "diou_nms",
    "nms_sort",
    "shown",
]

#: ``nms_kind`` values of a ``[yolo]`` section that Darknet understands.
NMS_KINDS: tuple[str, ...] = ("default", "greedynms", "diounms", "cornersnms")

_F32 = np.float32


@dataclass(frozen=True)
class Detection:
    """One reported (box, class) pair.

    ``confidence`` is objectness x class probability, ``objectness`` the box's objectness,
    both in [0, 1]. ``left``, ``top``, ``width``, ``height`` are in pixels of the original
    image, computed as Darknet prints them ((x - w/2) * image width, ...), not clipped:
    left and top may be negative.
    """

    class_id: int
    name: str
    confidence: float
    objectness: float
    left: float
    top: float
    width: float
    height: float


@dataclass(frozen=True, eq=False)
class YoloHead:
    """What the decoder needs of one ``[yolo]`` layer.

    ``anchors`` is (n, 2): width and height of the layer's masked anchors, in
    network-input pixels (stored as float32, like Darknet's biases). ``classes`` is the
    number of classes; ``new_coords`` selects the ``new_coords=1`` box parametrisation.
    """

    anchors: np.ndarray
    classes: int
    new_coords: bool = False

    def __post_init__(self) -> None:
        anchors = np.array(self.anchors, dtype=np.float32)
        if anchors.ndim != 2 or anchors.shape[1] != 2 or anchors.shape[0] < 1:
            raise ArgumentError(
                f"YoloHead anchors must have shape (n, 2) with n >= 1, got {anchors.shape}"
            )
        if not np.all(np.isfinite(anchors)):
            raise ArgumentError(f"YoloHead anchors must be finite, got {anchors.tolist()}")
        if isinstance(self.classes, bool) or int(self.classes) != self.classes:
            raise ArgumentTypeError(f"YoloHead classes must be an integer, got {self.classes!r}")
        if self.classes < 1:
            raise ArgumentError(f"YoloHead classes must be >= 1, got {self.classes}")
        anchors.setflags(write=False)
        object.__setattr__(self, "anchors", anchors)
        object.__setattr__(self, "classes", int(self.classes))
        object.__setattr__(self, "new_coords", bool(self.new_coords))

    @property
    def channels(self) -> int:
        """Channels of the layer's output: n * (5 + classes)."""
        return self.anchors.shape[0] * (5 + self.classes)


# ---------------------------------------------------------------------------------------
# Decoding


def _check_positive_ints(**values: int) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ArgumentError(f"{key} must be a positive integer, got {value!r}")


def _check_threshold(name: str, value: float) -> None:
    if not isinstance(value, int | float | np.floating) or not math.isfinite(value):
        raise ArgumentError(f"{name} must be a finite number, got {value!r}")


def decode_yolo(
    output: np.ndarray,
    head: YoloHead,
    net_w: int,
    net_h: int,
    image_w: int,
    image_h: int,
    thresh: float,
    letterbox: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate boxes of one image's ``[yolo]`` layer output (Darknet's get_yolo_detections).

    ``output`` is the layer's ``output`` for one image, shape (n * (5 + classes), H, W),
    in Darknet's layout and already activated by the layer (logistic on x, y, objectness
    and classes; scale_x_y applied). ``net_w``/``net_h`` are the network input size and
    ``image_w``/``image_h`` the original image size in pixels; ``letterbox`` undoes
    Darknet's letterbox placement.

    Returns float32 arrays for the cells with objectness > ``thresh``, in V5's order
    (anchor, then row, then column):

    - boxes (k, 4): centre x, centre y, width, height relative to the image (0..1);
    - objectness (k,);
    - probs (k, classes): objectness x class probability, 0 where not > ``thresh``.
    """
    if not isinstance(head, YoloHead):
        raise ArgumentTypeError(f"head must be a YoloHead, got {type(head).__name__}")
    _check_positive_ints(net_w=net_w, net_h=net_h, image_w=image_w, image_h=image_h)
    _check_threshold("thresh", thresh)
    out = np.asarray(output)
    n = head.anchors.shape[0]
    if out.ndim != 3 or out.shape[0] != head.channels or out.shape[1] < 1 or out.shape[2] < 1:
        raise ArgumentError(
            f"yolo output of shape {out.shape} does not match the head: expected "
            f"({head.channels}, H, W) for {n} anchors and {head.classes} classes"
        )
    lh, lw = out.shape[1], out.shape[2]
    x = out.astype(np.float32, copy=False).reshape(n, 5 + head.classes, lh, lw)
    t = _F32(thresh)

    anchor, row, col = np.nonzero(x[:, 4] > t)
    cell = x[anchor, :, row, col]  # (k, 5 + classes)
    objectness = cell[:, 4].copy()

    boxes = np.empty((len(anchor), 4), dtype=np.float32)
    boxes[:, 0] = (col.astype(np.float32) + cell[:, 0]) / _F32(lw)
    boxes[:, 1] = (row.astype(np.float32) + cell[:, 1]) / _F32(lh)
    aw = head.anchors[anchor, 0]
    ah = head.anchors[anchor, 1]
    if head.new_coords:
        boxes[:, 2] = cell[:, 2] * cell[:, 2] * _F32(4) * aw / _F32(net_w)
        boxes[:, 3] = cell[:, 3] * cell[:, 3] * _F32(4) * ah / _F32(net_h)
    else:
        with np.errstate(over="ignore"):
            boxes[:, 2] = np.exp(cell[:, 2]) * aw / _F32(net_w)
            boxes[:, 3] = np.exp(cell[:, 3]) * ah / _F32(net_h)

    probs = objectness[:, None] * cell[:, 5:]
    probs[~(probs > t)] = 0
    correct_boxes(boxes, net_w, net_h, image_w, image_h, letterbox)
    return boxes, objectness, np.ascontiguousarray(probs, dtype=np.float32)


def correct_boxes(
    boxes: np.ndarray, net_w: int, net_h: int, image_w: int, image_h: int, letterbox: bool
) -> None:
    """Darknet's correct_yolo_boxes (relative=1), in place on (k, 4) float32 boxes: centre
    and size relative to the network input become relative to a ``image_w`` x ``image_h``
    image, undoing the letterbox placement when ``letterbox``."""
    if letterbox:
        new_w, new_h, _, _ = letterbox_geometry(image_w, image_h, net_w, net_h)
    else:
        new_w, new_h = net_w, net_h
    ratio_w = _F32(new_w) / _F32(net_w)
    ratio_h = _F32(new_h) / _F32(net_h)
    # Darknet subtracts a double here ("deltaw / 2. / netw"), so this step runs in float64.
    shift_x = float(net_w - new_w) / 2.0 / net_w
    shift_y = float(net_h - new_h) / 2.0 / net_h
    boxes[:, 0] = ((boxes[:, 0].astype(np.float64) - shift_x) / float(ratio_w)).astype(_F32)
    boxes[:, 1] = ((boxes[:, 1].astype(np.float64) - shift_y) / float(ratio_h)).astype(_F32)
    boxes[:, 2] *= _F32(1) / ratio_w
    boxes[:, 3] *= _F32(1) / ratio_h


# ---------------------------------------------------------------------------------------
# Overlap measures, float32 in Darknet's operation order. ``a`` and ``b`` are (..., 4)
# boxes that broadcast against each other (one box against many, or a grid of pairs).
# Darknet's reference build fuses ``p * q + r * s`` into fma(p, q, r * s) (observed bit for
# bit on its resize_image), so sums of products here are fused the same way.


def _edges(box: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    half = _F32(2)
    x, y, w, h = box[..., 0], box[..., 1], box[..., 2], box[..., 3]
    return x - w / half, x + w / half, y - h / half, y + h / half


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Darknet's ``box_iou`` in float32 of boxes (..., 4) as (cx, cy, w, h), broadcast
    against each other."""
    al, ar, at, ab = _edges(a)
    bl, br, bt, bb = _edges(b)
    w = np.minimum(ar, br) - np.maximum(al, bl)
    h = np.minimum(ab, bb) - np.maximum(at, bt)
    inter = np.where((w > 0) & (h > 0), w * h, _F32(0))
    union = fma32(a[..., 2], a[..., 3], b[..., 2] * b[..., 3]) - inter
    out = np.zeros(inter.shape, dtype=np.float32)
    nz = inter != 0
    out[nz] = inter[nz] / union[nz]
    return out


def _diou(a: np.ndarray, b: np.ndarray, exponent: float) -> np.ndarray:
    """IoU minus (centre distance^2 / enclosing diagonal^2) ** exponent."""
    al, ar, at, ab = _edges(a)
    bl, br, bt, bb = _edges(b)
    cw = np.maximum(ar, br) - np.minimum(al, bl)
    ch = np.maximum(ab, bb) - np.minimum(at, bt)
    c = fma32(cw, cw, ch * ch)
    iou = box_iou(a, b)
    dx = a[..., 0] - b[..., 0]
    dy = a[..., 1] - b[..., 1]
    d = fma32(dx, dx, dy * dy)
    out = iou.copy()
    nz = c != 0
    ratio = (d[nz] / c[nz]).astype(np.float64)
    out[nz] = iou[nz] - np.power(ratio, exponent).astype(_F32)
    return out


_Overlaps = Callable[[np.ndarray, np.ndarray], np.ndarray]


class _OverlapTable:
    """Whether box a's overlap with box b exceeds the threshold, for boxes that take part.

    Up to a few thousand boxes, every pair is computed at once (vectorised, in row blocks
    to bound memory); beyond that, one row per suppressing box, on demand.
    """

    _FULL_LIMIT = 4096
    _BLOCK_ELEMENTS = 1 << 20

    def __init__(self, boxes: np.ndarray, members: np.ndarray, overlaps: _Overlaps, t: float):
        self._boxes = boxes
        self._members = members
        self._overlaps = overlaps
        self._t = t
        self._pos = np.full(len(boxes), -1, dtype=np.int64)
        self._pos[members] = np.arange(len(members))
        self._rows: dict[int, np.ndarray] = {}
        self._full: np.ndarray | None = None
        m = len(members)
        if 0 < m <= self._FULL_LIMIT:
            others = boxes[members][None, :, :]
            full = np.empty((m, m), dtype=bool)
            step = max(1, self._BLOCK_ELEMENTS // m)
            for r0 in range(0, m, step):
                block = boxes[members[r0 : r0 + step]][:, None, :]
                full[r0 : r0 + step] = overlaps(block, others) > t
            self._full = full

    def hits(self, a: int, others: np.ndarray) -> np.ndarray:
        """Boolean (len(others),): overlap(box a, box o) > thresh, by original box index."""
        row = self._pos[a]
        if self._full is not None:
            return self._full[row, self._pos[others]]
        cached = self._rows.get(row)
        if cached is None:
            cached = self._overlaps(self._boxes[a], self._boxes[self._members]) > self._t
            self._rows[row] = cached
        return cached[self._pos[others]]


# ---------------------------------------------------------------------------------------
# libstdc++ std::sort, replayed. ``s`` holds indices into ``key``; x goes before y when
# key[x] > key[y] (Darknet sorts by decreasing probability). Comparisons involving NaN are
# false, as in C.

_STD_SORT_THRESHOLD = 16


def _introsort(s: list[int], key: list[float]) -> None:
    """Sort ``s`` in place exactly as libstdc++'s ``std::sort`` orders equal keys."""
    n = len(s)
    if n < 2:
        return
    _introsort_loop(s, key, 0, n, 2 * (n.bit_length() - 1))
    if n > _STD_SORT_THRESHOLD:
        _insertion_sort(s, key, 0, _STD_SORT_THRESHOLD)
        for i in range(_STD_SORT_THRESHOLD, n):
            _linear_insert(s, key, i)
    else:
        _insertion_sort(s, key, 0, n)


def _introsort_loop(s: list[int], key: list[float], first: int, last: int, depth: int) -> None:
    while last - first > _STD_SORT_THRESHOLD:
        if depth == 0:
            _heap_sort(s, key, first, last)
            return
        depth -= 1
        cut = _partition_pivot(s, key, first, last)
        _introsort_loop(s, key, cut, last, depth)
        last = cut


def _partition_pivot(s: list[int], key: list[float], first: int, last: int) -> int:
    # Median of (first + 1, middle, last - 1) moved to ``first``, then an unguarded
    # Hoare partition of [first + 1, last) around it.
    a, b, c = first + 1, first + (last - first) // 2, last - 1
    ka, kb, kc = key[s[a]], key[s[b]], key[s[c]]
    if ka > kb:
        m = b if kb > kc else (c if ka > kc else a)
    elif ka > kc:
        m = a
    elif kb > kc:
        m = c
    else:
        m = b
    s[first], s[m] = s[m], s[first]
    pivot = key[s[first]]
    lo, hi = first + 1, last
    while True:
        while key[s[lo]] > pivot:
            lo += 1
        hi -= 1
        while pivot > key[s[hi]]:
            hi -= 1
        if lo >= hi:
            return lo
        s[lo], s[hi] = s[hi], s[lo]
        lo += 1


def _insertion_sort(s: list[int], key: list[float], first: int, last: int) -> None:
    for i in range(first + 1, last):
        v = s[i]
        if key[v] > key[s[first]]:
            s[first + 1 : i + 1] = s[first:i]
            s[first] = v
        else:
            _linear_insert(s, key, i)


def _linear_insert(s: list[int], key: list[float], pos: int) -> None:
    v = s[pos]
    kv = key[v]
    j = pos - 1
    while kv > key[s[j]]:
        s[j + 1] = s[j]
        j -= 1
    s[j + 1] = v


def _heap_sort(s: list[int], key: list[float], first: int, last: int) -> None:
    """libstdc++'s make_heap then sort_heap on [first, last) (its introsort fallback)."""
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(s, key, first, parent, length, s[first + parent])
        if parent == 0:
            break
        parent -= 1
    while last - first > 1:
        last -= 1
        v = s[last]
        s[last] = s[first]
        _adjust_heap(s, key, first, 0, last - first, v)


def _adjust_heap(
    s: list[int], key: list[float], first: int, hole: int, length: int, value: int
) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if key[s[first + child]] > key[s[first + child - 1]]:
            child -= 1
        s[first + hole] = s[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        s[first + hole] = s[first + child - 1]
        hole = child - 1
    kv = key[value]
    parent = (hole - 1) // 2
    while hole > top and key[s[first + parent]] > kv:
        s[first + hole] = s[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    s[first + hole] = value


@lru_cache(maxsize=64)
def _equal_keys_order(n: int) -> tuple[int, ...]:
    # std::sort still moves elements when every key is equal; the result depends only on n.
    s = list(range(n))
    _introsort(s, [0.0] * n)
    return tuple(s)


def _std_sort_order(keys: np.ndarray) -> list[int]:
    """Positions 0..len-1 in the order libstdc++ std::sort leaves them, by decreasing key."""
    n = len(keys)
    if n > 1 and keys[0] == keys[-1] and np.all(keys == keys[0]):
        return list(_equal_keys_order(n))
    s = list(range(n))
    _introsort(s, keys.tolist())
    return s


# ---------------------------------------------------------------------------------------
# NMS


def _check_candidates(boxes: np.ndarray, objectness: np.ndarray, probs: np.ndarray) -> None:
    for name, arr in (("boxes", boxes), ("objectness", objectness), ("probs", probs)):
        if not isinstance(arr, np.ndarray):
            raise ArgumentTypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
        if not arr.flags.writeable:
            raise ArgumentError(f"{name} must be writeable: NMS works in place")
    k = len(boxes)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ArgumentError(f"boxes must have shape (k, 4), got {boxes.shape}")
    if objectness.shape != (k,):
        raise ArgumentError(f"objectness must have shape ({k},), got {objectness.shape}")
    if probs.ndim != 2 or probs.shape[0] != k:
        raise ArgumentError(f"probs must have shape ({k}, classes), got {probs.shape}")


def _suppress(
    boxes: np.ndarray,
    objectness: np.ndarray,
    probs: np.ndarray,
    overlaps: _Overlaps,
    thresh: float,
) -> None:
    """The body shared by do_nms_sort and diounms_sort, in place."""
    _check_candidates(boxes, objectness, probs)
    total = len(boxes)
    perm = list(range(total))
    # Candidates with zero objectness are swapped to the end and take no further part.
    last = total - 1
    i = 0
    while i <= last:
        if objectness[perm[i]] == 0:
            perm[i], perm[last] = perm[last], perm[i]
            last -= 1
        else:
            i += 1
    live = last + 1

    work = probs.astype(np.float32)  # copy: columns are zeroed as classes are processed
    order = np.array(perm[:live], dtype=np.int64)
    scoring = work[order] != 0
    # Probabilities only ever drop to zero, so boxes and classes with no score now never
    # take part; a class with no score still gets its (tie-only) sort.
    table = _OverlapTable(
        boxes.astype(np.float32), order[scoring.any(axis=1)], overlaps, _F32(thresh)
    )
    active_classes = scoring.any(axis=0)
    tie_order = np.array(_equal_keys_order(live), dtype=np.int64) if live > 1 else None
    for k in range(work.shape[1]):
        if not active_classes[k]:
            if tie_order is not None:
                order = order[tie_order]
            continue
        if live > 1:
            order = order[_std_sort_order(work[order, k])]
        col = work[order, k]
        ranked = np.flatnonzero(col)
        for n, i in enumerate(ranked):
            if col[i] == 0:
                continue
            later = ranked[n + 1 :]
            later = later[col[later] != 0]
            if len(later):
                col[later[table.hits(order[i], order[later])]] = 0
        work[order, k] = col

    final = np.concatenate([order, np.array(perm[live:], dtype=np.int64)])
    boxes[...] = boxes[final]
    objectness[...] = objectness[final]
    probs[...] = work[final]


def nms_sort(boxes: np.ndarray, objectness: np.ndarray, probs: np.ndarray, thresh: float) -> None:
    """Darknet's ``do_nms_sort``, in place.

    ``boxes`` (k, 4) centre/size, ``objectness`` (k,), ``probs`` (k, classes). For each
    class, candidates are sorted by decreasing probability and a candidate's probability
    is zeroed when a better one of the same class overlaps it with IoU > ``thresh``.
    Candidates with zero objectness are moved to the end, untouched. The three arrays
    are reordered in place into Darknet's final order (see the module docstring).
    """
    _check_threshold("thresh", thresh)
    _suppress(boxes, objectness, probs, box_iou, thresh)


def diou_nms(
    boxes: np.ndarray, objectness: np.ndarray, probs: np.ndarray, thresh: float, beta: float
) -> None:
    """Darknet's ``diounms_sort`` with ``nms_kind=diounms``, in place.

    As :func:`nms_sort`, but a candidate is suppressed when IoU - (d^2 / c^2) ** ``beta``
    > ``thresh``, with d the distance between the centres and c the diagonal of the
    smallest box enclosing both (``beta`` is the cfg's ``beta_nms``, 0.6 by default).
    """
    _check_threshold("thresh", thresh)
    _check_threshold("beta", beta)
    exponent = float(_F32(beta))  # beta_nms is a float field in Darknet
    _suppress(boxes, objectness, probs, lambda a, b: _diou(a, b, exponent), thresh)


def _greedy_diou_nms(
    boxes: np.ndarray, objectness: np.ndarray, probs: np.ndarray, thresh: float
) -> None:
    # nms_kind=greedynms: Darknet measures with box_diou, whose exponent is a fixed 0.6.
    _suppress(boxes, objectness, probs, lambda a, b: _diou(a, b, 0.6), thresh)


# ---------------------------------------------------------------------------------------
# The whole post-processing of one image


def detect_boxes(
    outputs: Sequence[np.ndarray],
    heads: Sequence[YoloHead],
    net_w: int,
    net_h: int,
    image_w: int,
    image_h: int,
    *,
    thresh: float = 0.25,
    nms: float = 0.45,
    nms_kind: str = "default",
    beta_nms: float = 0.6,
    letterbox: bool = False,
    names: Sequence[str] | None = None,
) -> list[Detection]:
    """Detections of one image from its ``[yolo]`` outputs, as ``darknet detector test``.

    ``outputs[i]`` is the (n * (5 + classes), H, W) output of the ``[yolo]`` layer
    described by ``heads[i]``, in network order. ``net_w``/``net_h``: network input size;
    ``image_w``/``image_h``: original image size, in pixels.

    Steps: candidates with objectness > ``thresh`` from every head (see
    :func:`decode_yolo`); NMS unless ``nms`` is 0, chosen by ``nms_kind`` as Darknet does
    from the last ``[yolo]`` layer: ``default`` -> do_nms_sort (IoU); ``greedynms`` ->
    DIoU with exponent 0.6; ``diounms`` -> DIoU with exponent ``beta_nms``;
    ``cornersnms`` -> IoU. Then one :class:`Detection` per (box, class) with probability
    > ``thresh``, in Darknet's ``-out`` JSON order: boxes in their post-NMS order, classes
    by increasing id within a box. Names default to ``class_<id>``; names starting with
    ``dont_show`` are reported (Darknet's printers hide them; the caller decides).

    Raises ValueError for empty or mismatched inputs.
    """
    if len(outputs) == 0:
        raise ArgumentError("detect_boxes needs at least one [yolo] output")
    if len(outputs) != len(heads):
        raise ArgumentError(f"got {len(outputs)} yolo outputs for {len(heads)} heads")
    classes = heads[0].classes
    for i, head in enumerate(heads):
        if not isinstance(head, YoloHead):
            raise ArgumentTypeError(f"heads[{i}] must be a YoloHead, got {type(head).__name__}")
        if head.classes != classes:
            raise ArgumentError(
                f"[yolo] heads disagree on the number of classes ({classes} and {head.classes})"
            )
    _check_settings(nms, nms_kind, beta_nms, names, classes)
    parts = [
        decode_yolo(out, head, net_w, net_h, image_w, image_h, thresh, letterbox)
        for out, head in zip(outputs, heads, strict=True)
    ]
    return detections_from_candidates(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]), image_w, image_h, thresh=thresh, nms=nms,
        nms_kind=nms_kind, beta_nms=beta_nms, names=names)


def _check_settings(nms: float, nms_kind: str, beta_nms: float,
                    names: Sequence[str] | None, classes: int) -> None:
    if nms_kind not in NMS_KINDS:
        raise ArgumentError(
            f"unknown nms_kind {nms_kind!r}; expected one of {', '.join(NMS_KINDS)}"
        )
    _check_threshold("nms", nms)
    _check_threshold("beta_nms", beta_nms)
    if names is not None and len(names) < classes:
        raise ArgumentError(f"{len(names)} class names given for {classes} classes")


def detections_from_candidates(
    boxes: np.ndarray,
    objectness: np.ndarray,
    probs: np.ndarray,
    image_w: int,
    image_h: int,
    *,
    thresh: float = 0.25,
    nms: float = 0.45,
    nms_kind: str = "default",
    beta_nms: float = 0.6,
    names: Sequence[str] | None = None,
) -> list[Detection]:
    """The end of :func:`detect_boxes`: NMS over one image's candidates, then one
    :class:`Detection` per (box, class) with probability > ``thresh``.

    ``boxes`` (k, 4) centre x, centre y, width, height relative to the image, as
    :func:`correct_boxes` leaves them; ``objectness`` (k,); ``probs`` (k, classes),
    objectness x class probability, 0 where not > ``thresh``: what :func:`decode_yolo`
    returns, float32, concatenated over the heads in network order. The arrays are
    reordered in place. ``nms``, ``nms_kind``, ``beta_nms`` and ``names`` as
    :func:`detect_boxes` documents them.
    """
    _check_threshold("thresh", thresh)
    _check_positive_ints(image_w=image_w, image_h=image_h)
    _check_candidates(boxes, objectness, probs)
    _check_settings(nms, nms_kind, beta_nms, names, probs.shape[1])
    if nms != 0:
        if nms_kind in ("default", "cornersnms"):
            nms_sort(boxes, objectness, probs, nms)
        elif nms_kind == "greedynms":
            _greedy_diou_nms(boxes, objectness, probs, nms)
        else:
            diou_nms(boxes, objectness, probs, nms, beta_nms)
    return _to_detections(boxes, objectness, probs, image_w, image_h, thresh, names)


def shown(detections: Iterable[Detection]) -> list[Detection]:
    """The detections Darknet reports: those of classes whose name does not start with
    ``dont_show`` (its way to hide classes from printed, drawn and JSON output)."""
    return [d for d in detections if not d.name.startswith("dont_show")]


def _to_detections(
    boxes: np.ndarray,
    objectness: np.ndarray,
    probs: np.ndarray,
    image_w: int,
    image_h: int,
    thresh: float,
    names: Sequence[str] | None,
) -> list[Detection]:
    half = _F32(2)
    iw, ih = _F32(image_w), _F32(image_h)
    left = (boxes[:, 0] - boxes[:, 2] / half) * iw
    top = (boxes[:, 1] - boxes[:, 3] / half) * ih
    width = boxes[:, 2] * iw
    height = boxes[:, 3] * ih
    result = []
    for i, j in zip(*np.nonzero(probs > _F32(thresh)), strict=True):
        result.append(
            Detection(
                class_id=int(j),
                name=str(names[j]) if names is not None else f"class_{j}",
                confidence=float(probs[i, j]),
                objectness=float(objectness[i]),
                left=float(left[i]),
                top=float(top[i]),
                width=float(width[i]),
                height=float(height[i]),
            )
        )
    return result
