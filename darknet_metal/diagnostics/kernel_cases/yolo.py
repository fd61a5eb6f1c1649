"""Cases of ``shaders/yolo.metal``: the [yolo] activation (and its half twin) and Darknet's
[yolo] training loss, four dispatches on shared buffers, under every option against the CPU
loss (float32): the deltas bit for bit, the statistics within 1e-5 (the CPU sums the squares
in double, the kernels in float)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from darknet_metal.cpu import yolo as yl
from darknet_metal.diagnostics.kernel_cases.half import near_half
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    KernelCase,
    RelL2,
    Step,
    Ulps,
    dims,
    nan_filled,
    normal,
)
from darknet_metal.errors import ArgumentError
from darknet_metal.model.cfg_schema import IOU_LOSSES

STATS = len(yl.YOLO_STAT_NAMES)
FLT_MAX = float(np.finfo(np.float32).max)
ANCHORS9 = ((6, 7), (10, 14), (16, 12), (22, 26), (34, 30), (48, 52), (60, 45), (80, 90),
            (110, 100))
#: The loss keywords of ``cpu.yolo.yolo_loss`` besides the head's own, with Darknet's
#: defaults.
LOSS_DEFAULTS: dict[str, Any] = dict(
    ignore_thresh=0.5, truth_thresh=1.0, iou_thresh=1.0, iou_thresh_kind="iou",
    iou_loss="mse", iou_normalizer=0.75, obj_normalizer=1.0, cls_normalizer=1.0,
    max_delta=FLT_MAX, label_smooth_eps=0.0, counters_per_class=None, new_coords=False,
    focal_loss=False, objectness_smooth=False)
#: CIoU's aspect term is rounded through double on the CPU, in float32 here: the ulps its w
#: and h deltas may differ by.
CIOU_ULPS = 0


def _yolo(shape: tuple[int, int, int, int], anchors: int, classes: int, scale_x_y: float,
          new_coords: bool) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0)
        want = np.empty_like(x)
        yl.yolo_forward(x, want, anchors, classes, scale_x_y, new_coords)
        return CaseData({"x": x, "y": nan_filled(shape)}, (Check("y", want, Close(1e-6, 1e-7)),))

    return KernelCase(
        f"yolo_fwd_f32-{dims(shape)}-a{anchors}-c{classes}-xy{scale_x_y:g}"
        + ("-new_coords" if new_coords else ""),
        (Step("yolo_fwd_f32", {"batch": n, "anchors": anchors, "classes": classes,
                               "spatial": h * w, "new_coords": int(new_coords),
                               "scale_x_y": scale_x_y},
              {"spatial": h * w, "channels": c, "batch": n}),), make)


def _yolo_half() -> KernelCase:
    batch, anchors, classes, spatial = 2, 3, 4, 13
    channels = anchors * (5 + classes)

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, (batch, channels, spatial), 4.0).astype(np.float16)
        v = x.astype(np.float64)
        entry = np.arange(channels) % (5 + classes)
        exact = np.where(np.isin(entry, [2, 3])[None, :, None], v, 1 / (1 + np.exp(-v)))
        xy = np.isin(entry, [0, 1])[None, :, None]
        exact = np.where(xy, exact * 1.05 - 0.5 * 0.05, exact)
        return CaseData({"x": x, "y": nan_filled(x.shape, np.float16)},
                        (Check("y", exact, near_half(exact)),))

    return KernelCase(f"yolo_fwd_f16-{batch}x{channels}x{spatial}-xy1.05",
                      (Step("yolo_fwd_f16", {"batch": batch, "anchors": anchors,
                                             "classes": classes, "spatial": spatial,
                                             "new_coords": 0, "scale_x_y": 1.05},
                            {"spatial": spatial, "channels": channels, "batch": batch}),), make)


def _shape_iou(box: np.ndarray, shape: tuple[float, float]) -> float:
    inter = min(box[2], shape[0]) * min(box[3], shape[1])
    return float(inter / (box[2] * box[3] + shape[0] * shape[1] - inter))


@dataclass(frozen=True)
class YoloHead:
    """A [yolo] layer's float32 output and truths for the loss: ``n_img`` images of ``h`` x
    ``w`` cells, the anchors of ``mask`` (of ``anchors``), ``boxes`` truth rows per image.

    Per image: row 2 is padding; rows 5 and 6 repeat the cell (and most likely the anchor) of
    rows 0 and 1 with another class and the same class; ``hits`` cells predict a truth's box
    closely so that the ignore, truth_thresh and recall rules act. Image 1 has no truths at
    all when n_img > 2."""

    n_img: int = 3
    h: int = 5
    w: int = 7
    classes: int = 3
    mask: tuple[int, ...] = (1, 3, 4)
    anchors: tuple[tuple[int, int], ...] = ANCHORS9[:6]
    net: tuple[int, int] = (64, 64)
    new_coords: bool = False
    boxes: int = 7
    hits: int = 5

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return (self.n_img, len(self.mask) * (5 + self.classes), self.h, self.w)

    def options(self, **loss: Any) -> dict[str, Any]:
        """The keywords of ``cpu.yolo.yolo_loss`` for this head, with ``loss``'s."""
        return dict(anchors=list(self.anchors), mask=list(self.mask), classes=self.classes,
                    net_w=self.net[0], net_h=self.net[1], new_coords=self.new_coords, **loss)

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(output, truths) drawn from ``rng``."""
        n, e = len(self.mask), 5 + self.classes
        net, mask, anchors = self.net, self.mask, self.anchors
        x = rng.normal(0, 1.0, (self.n_img, n * e, self.h, self.w)).astype(np.float32)
        out = np.empty_like(x)
        yl.yolo_forward(x, out, n, self.classes, 1.05, self.new_coords)
        o = out.reshape(self.n_img, n, e, self.h, self.w)
        if self.new_coords:
            o[:] = rng.uniform(0.05, 0.95, o.shape)
        truths = np.zeros((self.n_img, self.boxes, 5))
        for b in range(self.n_img):
            for t in range(min(self.boxes, 5)):
                truths[b, t] = [rng.integers(self.classes), rng.uniform(0.02, 0.98),
                                rng.uniform(0.02, 0.98), rng.uniform(0.08, 0.7),
                                rng.uniform(0.08, 0.7)]
            truths[b, 2, 3:] = 0
            for t, source, shift in [(5, 0, 1), (6, 1, 0)]:
                if t < self.boxes:
                    truths[b, t] = truths[b, source]
                    truths[b, t, 0] = (truths[b, source, 0] + shift) % self.classes
                    truths[b, t, 3:] *= rng.uniform(0.95, 1.05, 2)
        if self.n_img > 2:
            truths[1] = 0
        for k in range(self.hits):
            b, t = k % self.n_img, k % 5
            if truths[b, t, 3] == 0:
                continue
            cls, cx, cy, tw, th = truths[b, t]
            i, j = int(cx * self.w), int(cy * self.h)
            # On the anchor the truth picks when the mask has it.
            shapes = [np.array([0, 0, aw / net[0], ah / net[1]]) for aw, ah in anchors]
            best = int(np.argmax([_shape_iou(box, (tw, th)) for box in shapes]))
            a = list(mask).index(best) if best in mask else rng.integers(n)
            anchor = anchors[mask[a]]
            o[b, a, 0, j, i] = cx * self.w - i + rng.normal(0, 0.03)
            o[b, a, 1, j, i] = cy * self.h - j + rng.normal(0, 0.03)
            if self.new_coords:
                o[b, a, 2, j, i] = math.sqrt(tw * net[0] / (4 * anchor[0])) * rng.uniform(0.9,
                                                                                         1.1)
                o[b, a, 3, j, i] = math.sqrt(th * net[1] / (4 * anchor[1])) * rng.uniform(0.9,
                                                                                         1.1)
            else:
                o[b, a, 2, j, i] = math.log(tw * net[0] / anchor[0]) + rng.normal(0, 0.1)
                o[b, a, 3, j, i] = math.log(th * net[1] / anchor[1]) + rng.normal(0, 0.1)
            o[b, a, 5 + int(cls), j, i] = 0.8
        return out, truths.astype(np.float32)


def yolo_loss_args(output_shape: tuple[int, ...], boxes: int, *, anchors: Any, mask: Any,
                   classes: int, net_w: int, net_h: int,
                   **options: Any) -> dict[str, int | float]:
    """dm_yolo_loss_args for the CPU loss's keywords (Darknet's defaults where not given)."""
    o = dict(LOSS_DEFAULTS, **options)
    n, _, h, w = output_shape
    return dict(
        batch=n, anchors=len(mask), classes=classes, height=h, width=w, boxes=boxes,
        total=np.size(anchors) // 2, net_w=net_w, net_h=net_h,
        iou_loss=IOU_LOSSES.index(o["iou_loss"]),
        iou_thresh_kind=IOU_LOSSES.index(o["iou_thresh_kind"]),
        new_coords=int(o["new_coords"]), focal_loss=int(o["focal_loss"]),
        objectness_smooth=int(o["objectness_smooth"]),
        counters=int(o["counters_per_class"] is not None),
        **{key: o[key] for key in ("ignore_thresh", "truth_thresh", "iou_thresh",
                                   "iou_normalizer", "obj_normalizer", "cls_normalizer",
                                   "max_delta", "label_smooth_eps")})


def yolo_loss_steps(output_shape: tuple[int, ...], boxes: int,
                    options: Mapping[str, Any]) -> tuple[Step, ...]:
    """The four dispatches of the loss, on arrays named after their roles: the cells' deltas
    and partial sums, the truths' deltas and per-image sums, the squares, the statistics."""
    args = yolo_loss_args(output_shape, boxes, **options)
    n, a, h, w = args["batch"], args["anchors"], args["height"], args["width"]
    cells = {"spatial": h * w, "anchors": a, "batch": n}
    return (Step("yolo_loss_bwd_cells_f32", args, cells),
            Step("yolo_loss_bwd_truths_f32", args, {"batch": n}),
            Step("yolo_loss_bwd_squares_f32", args, cells),
            Step("yolo_loss_bwd_stats_f32", args, {"one": 1}))


def yolo_loss_arrays(output: np.ndarray, truths: np.ndarray, options: Mapping[str, Any],
                     delta: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``yolo_loss_steps``: the inputs and tables, delta (NaN: it is assigned in
    full, unless given) and NaN scratch and statistics."""
    o = dict(LOSS_DEFAULTS, **options)
    table, mask, multipliers = yl.loss_tables(np.reshape(o["anchors"], (-1, 2)), o["mask"],
                                              o["classes"], o["counters_per_class"],
                                              o["max_delta"])
    n, _, h, w = output.shape
    a = len(mask)
    return {"output": output, "truths": truths, "anchor_table": table, "mask": mask,
            # Bound and never read without counters_per_class.
            "multipliers": nan_filled(o["classes"]) if multipliers is None else multipliers,
            "delta": nan_filled(output.shape) if delta is None else delta,
            "partials": nan_filled(n * a * h * w * 4), "images": nan_filled(n * 10),
            "stats": nan_filled(STATS)}


def yolo_loss_reference(output: np.ndarray, truths: np.ndarray,
                        options: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The CPU's (delta, statistics in float64)."""
    delta = nan_filled(output.shape)
    stats = np.zeros(STATS)
    yl.yolo_loss(output, delta, truths, stats, **options)
    return delta, stats


def yolo_loss_checks(delta: np.ndarray, stats: np.ndarray,
                     max_ulps: int | None = 0) -> tuple[Check, ...]:
    """The CPU's delta within ``max_ulps`` float32 ulps (None: within 1e-6 relative and 1e-7
    of its largest value) and 1e-7 relative L2; every statistic within 1e-5 relative (1e-7
    absolute), but iou_loss_per_image = (total - nobox)/N, a difference of two sums, relative
    to the total; an infinite statistic (squares of deltas beyond 1.8e19) exactly."""
    if max_ulps is None:
        close: Ulps | Close = Close(1e-6, 1e-7 * float(np.abs(delta).max()))
    else:
        close = Ulps(max_ulps)
    scale = np.abs(stats)
    names = yl.YOLO_STAT_NAMES
    scale[names.index("iou_loss_per_image")] = stats[names.index("total_loss_per_image")]
    bound = np.where(np.isfinite(stats), 1e-5 * scale + 1e-7, 0.0)
    # On a GPU the logistic and the exp/log of the box targets round their last bits
    # otherwise; a delta that is a difference of nearby values (truth - logistic) then moves
    # by more ulps than it has, so it is judged by its size.
    gpu_delta = Close(1e-5, 1e-6 * float(np.abs(delta[np.isfinite(delta)]).max(initial=0.0)))
    gpu_bound = np.where(np.isfinite(stats), 1e-4 * scale + 1e-6, 0.0)
    return (Check("delta", delta, close, gpu_math=gpu_delta),
            Check("delta", delta, RelL2(1e-7), gpu_math=RelL2(1e-6)),
            Check("stats", stats, Close(0.0, bound), gpu_math=Close(0.0, gpu_bound)))


def yolo_loss_data(output: np.ndarray, truths: np.ndarray, options: Mapping[str, Any], *,
                   max_ulps: int | None = 0, delta: np.ndarray | None = None,
                   at_least: Mapping[str, int] | None = None) -> CaseData:
    """The arrays of ``yolo_loss_steps`` for these inputs, checked against the CPU's loss
    (``yolo_loss_checks``). ``at_least``: the least each named statistic of the CPU's must
    be, so that the inputs exercise what they are for."""
    ref_delta, ref_stats = yolo_loss_reference(output, truths, options)
    for stat, least in (at_least or {}).items():
        if ref_stats[yl.YOLO_STAT_NAMES.index(stat)] < least:
            raise ArgumentError(f"the CPU's {stat} is {ref_stats[yl.YOLO_STAT_NAMES.index(stat)]}"
                             f", below {least}")
    return CaseData(yolo_loss_arrays(output, truths, options, delta),
                    yolo_loss_checks(ref_delta, ref_stats, max_ulps))


Edit = Callable[[np.random.Generator, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def yolo_loss_case(name: str, head: YoloHead, loss: Mapping[str, Any], *,
                   max_ulps: int | None = 0, boxes: int | None = None,
                   edit: Edit | None = None, held_delta: bool = False,
                   at_least: Mapping[str, int] | None = None) -> KernelCase:
    """The loss of ``head`` with ``loss`` options against the CPU's (``yolo_loss_data``; by
    default some truth must be responsible). ``edit`` changes the drawn (output, truths)
    (``boxes``: the truth rows it leaves); ``held_delta``: delta starts random rather than
    NaN (the kernels assign it whatever it held)."""
    options = head.options(**loss)
    rows = head.boxes if boxes is None else boxes

    def make(rng: np.random.Generator) -> CaseData:
        output, truths = head.draw(rng)
        if edit is not None:
            output, truths = edit(rng, output, truths)
        held = normal(rng, output.shape) if held_delta else None
        return yolo_loss_data(output, truths, options, max_ulps=max_ulps, delta=held,
                              at_least={"responsible": 1} if at_least is None else at_least)

    return KernelCase(f"yolo_loss_bwd_f32-{name}",
                      yolo_loss_steps(head.output_shape, rows, options), make)


#: name -> (head, loss options, ulps allowed): every option of the loss.
LOSSES: dict[str, tuple[YoloHead, dict[str, Any], int]] = {
    "mse": (YoloHead(), {}, 0),
    "iou": (YoloHead(h=7, w=5, mask=(0, 1, 2)), dict(iou_loss="iou", iou_normalizer=0.5), 0),
    "giou_iou_thresh": (YoloHead(mask=(2, 4), anchors=ANCHORS9[:8]),
                        dict(iou_loss="giou", iou_thresh=0.2, iou_thresh_kind="giou"), 0),
    "diou": (YoloHead(h=13, w=13, n_img=2, classes=5), dict(iou_loss="diou", iou_thresh=0.2),
             0),
    "ciou": (YoloHead(mask=(6, 7, 8), anchors=ANCHORS9, net=(96, 128), h=3, w=9),
             dict(iou_loss="ciou", iou_normalizer=0.07, iou_thresh=0.3), CIOU_ULPS),
    "mse_iou_thresh_ciou_kind": (YoloHead(), dict(iou_thresh=0.15, iou_thresh_kind="ciou"), 0),
    "iou_iou_thresh_diou_kind": (YoloHead(classes=2), dict(iou_loss="iou", iou_thresh=0.25,
                                                           iou_thresh_kind="diou"), 0),
    "label_smooth_truth_thresh": (YoloHead(), dict(label_smooth_eps=0.1, truth_thresh=0.55,
                                                   ignore_thresh=0.3), 0),
    "max_delta": (YoloHead(), dict(iou_loss="iou", max_delta=0.02, iou_normalizer=2.0), 0),
    "counters_per_class": (YoloHead(), dict(iou_loss="iou", counters_per_class=[5, 0, 20],
                                            cls_normalizer=0.5, max_delta=3.0), 0),
    "counters_mse_truth_thresh": (YoloHead(), dict(counters_per_class=[1, 4, 2],
                                                   truth_thresh=0.5, obj_normalizer=0.7), 0),
    "new_coords_mse": (YoloHead(new_coords=True, mask=(2,), anchors=ANCHORS9[:7]), {}, 0),
    "new_coords_ciou": (YoloHead(new_coords=True, h=1, w=1, boxes=6, hits=2),
                        dict(iou_loss="ciou", ignore_thresh=0.2, iou_thresh=0.2), CIOU_ULPS),
    "focal_loss": (YoloHead(classes=4), dict(focal_loss=True, truth_thresh=0.5,
                                             label_smooth_eps=0.2), 0),
    "objectness_smooth": (YoloHead(), dict(objectness_smooth=True, ignore_thresh=0.3,
                                           truth_thresh=0.6, iou_thresh=0.2, iou_loss="giou"),
                          0),
    "one_class_one_anchor": (YoloHead(classes=1, mask=(3,), n_img=1, h=7, w=7),
                             dict(iou_loss="ciou", truth_thresh=0.6, ignore_thresh=0.4),
                             CIOU_ULPS),
}


def _many_truths(rng: np.random.Generator, output: np.ndarray,
                 truths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """40 rows per image, several per cell: rows 30 to 34 repeat rows 10 to 14 (same cells
    and anchors, same classes)."""
    for b in range(2):
        for t in range(7, 40):
            truths[b, t] = [rng.integers(80), rng.uniform(0, 1), rng.uniform(0, 1),
                            rng.uniform(0.05, 0.9), rng.uniform(0.05, 0.9)]
        truths[b, 30:35] = truths[b, 10:15]
    return output, truths


def _edges_and_padding(rows: str) -> Edit:
    """No truths at all (``none``), no rows (``empty``), or (``edges``) three boxes centred
    on the edges (the last cell row) with padding (zero width) between them."""

    def edit(rng: np.random.Generator, output: np.ndarray,
             truths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        truths[:] = 0
        if rows == "edges":
            truths[0, 4] = [1, 0.0, 1.0, 0.3, 0.2]
            truths[0, 5] = [0, 0.5, 0.5, 0.0, 0.3]
            truths[0, 6] = [2, 1.0, 0.0, 0.2, 0.4]
        return output, truths[:, :0] if rows == "empty" else truths

    return edit


#: 2 x 3*(5+80) x 13 x 13 = 86190 elements.
LARGE = YoloHead(n_img=2, h=13, w=13, classes=80, boxes=40, mask=(3, 4, 5), hits=12)

CASES: tuple[KernelCase, ...] = (
    *(_yolo(*case) for case in (
        ((1, 255, 13, 13), 3, 80, 1.0, False),
        ((2, 3 * 7, 7, 5), 3, 2, 1.05, False),
        ((1, 2 * 8, 1, 1), 2, 3, 2.0, True),
        ((1, 5, 7, 7), 1, 0, 1.2, False),
    )),
    _yolo_half(),
    *(yolo_loss_case(name, head, loss, max_ulps=ulps)
      for name, (head, loss, ulps) in LOSSES.items()),
    *(yolo_loss_case(f"large-{name}", LARGE, loss, edit=_many_truths, max_ulps=CIOU_ULPS,
                     at_least={"responsible": 1, "rewritten_bbox": 5})
      for name, loss in (("ciou", dict(iou_loss="ciou", iou_normalizer=0.07, iou_thresh=0.213)),
                         ("mse", dict(truth_thresh=0.7, ignore_thresh=0.5)))),
    *(yolo_loss_case(f"truths_{rows}", YoloHead(n_img=2), {}, edit=_edges_and_padding(rows),
                     boxes=0 if rows == "empty" else None, at_least={})
      for rows in ("edges", "none", "empty")),
    yolo_loss_case("delta_held", YoloHead(), dict(iou_loss="giou", iou_thresh=0.3),
                   held_delta=True),
)
