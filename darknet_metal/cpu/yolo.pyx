# cython: language_level=3
"""Darknet's ``[yolo]`` head: its forward output, and its training loss (the layer delta, its
cost and its statistics).

``yolo_step(x, out, n, classes, ...)`` produces Darknet's ``[yolo]`` ``layer.output``
(forward_yolo_layer at inference): box decoding and NMS are separate.

``yolo_loss_step(output, delta, truths, stats, ...)`` computes what ``forward_yolo_layer``
(hank-ai/darknet V5, ``yolo_layer.cpp``; box maths from ``box.cpp``) computes when training:

* ``output``: the layer's forward output (N, n*(5+classes), H, W), as ``yolo_step``
  leaves it: per anchor of the mask the channels x, y, w, h, objectness, classes; the
  logistic applied to x, y, objectness and classes (but with new_coords) and ``scale_x_y``
  to x, y. The loss reads these values as they are, so it takes no ``scale_x_y``: Darknet
  applies no derivative of the logistic or of the scaling to the delta, which is the BCE
  gradient w.r.t. the logits for objectness and classes and the gradient w.r.t. the stored
  x, y for the box.
* ``delta`` (same shape and dtype) is ASSIGNED Darknet's ``l.delta``, Darknet-signed
  (target - prediction, a negative gradient), what ``backward_yolo_layer`` adds into the
  previous layer's delta.
* ``truths``: (N, boxes, 5) rows ``(class, cx, cy, w, h)`` with normalised centre and size.
  A row is a box when w > 0 and h > 0; others are padding and are skipped wherever they
  are. Darknet instead reads (x, y, w, h, class, track) rows and stops at the first row with
  x == 0, so a box centred exactly on the left edge would end its list: here it counts. The
  track id has no part in Darknet's CPU loss and has no column here.
* ``stats``: (YOLO_STATS,) float64, overwritten; ``yolo_loss_stats`` names its entries.

The loss, per image (Darknet runs one thread per image; so does this, on the executor's
threads when there are several images):

1. Every cell and anchor of the mask: ``delta_obj = obj_normalizer * (0 - obj)``, set to 0
   (objectness_smooth: raised to ``obj_normalizer * (iou - obj)``) when the predicted box's
   best IoU with a truth is > ignore_thresh and any class probability of the cell is > 0.25
   (compare_yolo_class: any class, not the truth's). If the best IoU is > truth_thresh, the
   cell gets that (first best) truth's objectness, class and box deltas as in step 2.
2. Every truth, in row order: its cell is ``(int)(cx*W), (int)(cy*H)`` (clamped to the grid:
   Darknet would index past it for cx or cy == 1), its anchor the best IoU of the truth's
   shape with ALL anchors (first best wins). If that anchor is in the mask, the cell gets
   the box delta (added: a later truth on the same cell accumulates), ``delta_obj =
   obj_normalizer * (1 - obj)`` and the class delta (``y - p`` with ``y`` smoothed to
   ``y*(1-eps) + 0.5*eps``; a class already holding a delta keeps the others). With
   iou_thresh < 1, every other anchor of the mask whose IoU (of kind iou_thresh_kind) with
   the truth's shape is > iou_thresh gets the same, and then the box deltas of every cell are
   divided by its number of classes with a positive delta (averages_yolo_deltas).
   Box delta: mse: ``(2 - w*h) * iou_normalizer * (t - x)`` for tx = cx*W - i, ty,
   tw = log(w*net_w/anchor_w), th (new_coords: sqrt(w*net_w/(4*anchor_w))); iou, giou, diou,
   ciou: dx_box_iou's derivatives, w, h times exp(raw) (not with new_coords), times
   iou_normalizer, non-finite values zeroed, clipped to +-max_delta.
   With counters_per_class, class c weighs box and objectness deltas by ``m_c = max(counts)
   / counts[c]`` (counts below 1 count as 1, m_c at most max_delta) and its class delta by
   ``m_c * cls_normalizer`` (cls_normalizer has no effect otherwise).
   focal_loss: class deltas ``(y - p) * 0.5 * g`` with ``g = -(1 - p_t)(2 p_t log p_t + p_t
   - 1)`` for the truth's probability p_t.

Statistics (``stats``, by ``YOLO_STAT_NAMES``), with ``responsible`` = the (truth, anchor)
pairs of step 2, ``count = max(responsible, 1)`` (what Darknet divides by and prints) and N
images:

* ``cost``: Darknet's ``l.cost``. mse: ``S_all``; others: ``iou_normalizer *
  iou_loss_sum / count + S_nobox`` with ``giou_loss_sum`` for giou, where ``S_all
  = sum(delta**2)`` over the whole array and ``S_nobox = obj_normalizer * sum(delta**2)``
  over the objectness and class channels.
* Darknet V5's verbose line: ``avg_iou = iou_sum / count``, ``count``,
  ``class_loss_per_image = S_nobox / N``, ``iou_loss_per_image = (S_all - S_nobox) / N``,
  ``total_loss_per_image = S_all / N``.
* The classic line of earlier Darknet: ``avg_obj = sum(obj) / count`` and
  ``avg_class_prob = sum(p_truth_class) / count`` over the responsible pairs (the output's
  values, before this loss), ``avg_noobj = sum(obj) / (W*H*n*N)`` over every cell of the
  mask's anchors, ``recall50`` / ``recall75`` = (the number of responsible pairs whose
  predicted box has IoU > 0.5 / > 0.75 with its truth) / count.
* ``responsible``, ``total_bbox`` (box deltas given, truth_thresh ones included),
  ``rewritten_bbox`` (of those, the ones on a cell that already had a box delta: Darknet's
  net-wide counters, which its threads update without synchronisation), ``iou_sum``,
  ``iou_loss_sum`` (sum of 1 - IoU), ``giou_loss_sum`` (sum of 1 - GIoU).

Rounding follows Darknet's float32 code for float32 arrays: float arithmetic, the float libm
(expf, logf, atanf: the C++ overloads its float arguments select), double only where its
expressions promote (the CIoU aspect term, DIoU's pow, the cost's pow), the per-image sums in
its order; float64 arrays are the same formulas in double. Darknet's own build (g++ -Ofast,
FMA contraction and reassociation) rounds dx_box_iou differently: its IoU-family box deltas
differ from these by a few float32 ulps (MSE box deltas, objectness and classes are
bit-exact).

Two departures keep everything finite for finite inputs: a non-finite IoU (an infinite
predicted size, exp of a huge raw w or h) counts as 0 and a non-finite GIoU as -1, where
Darknet's statistics and cost would turn NaN. Darknet's net-wide options (adversarial,
bad-label rejection, equidistant point) and the class ``map=`` file are not part of this
loss; remap classes before.

Contract: the package's (``darknet_metal.cpu``). ``yolo_loss_step`` checks every argument and
the truths it is given; a step re-run after the caller refilled ``truths`` in place skips
rows it cannot use (a class outside [0, classes), a non-finite value, a centre outside
[0, 1]) rather than fail: ``check_truths`` raises for them.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.math cimport M_PI, fmax, fmin, isfinite, pow

from darknet_metal.cpu.blas cimport run_parts
from darknet_metal.cpu.fmath cimport fatan, fexp, flog, fsqrt, logistic
from darknet_metal.cpu.kernels cimport DM_ACT_LOGISTIC, dm_act_f32
from darknet_metal.cpu.step cimport NativeStep, StepData, new_step

import numpy as np

from darknet_metal.arguments import is_integer, number, positive_int
from darknet_metal.model.cfg_schema import IOU_LOSSES
from darknet_metal.cpu.checks import check_input, check_out
from darknet_metal.errors import ArgumentError, ArgumentTypeError


cdef enum:  # buffer roles
    LOSS_OUT, LOSS_DELTA, LOSS_TRUTH, LOSS_ANCHORS, LOSS_MASK, LOSS_MULT, LOSS_STATS, LOSS_IMAGES

cdef enum:  # IoU kinds, in cfg_schema.IOU_LOSSES order
    KIND_MSE, KIND_IOU, KIND_GIOU, KIND_DIOU, KIND_CIOU

cdef enum:  # stats entries, in YOLO_STAT_NAMES order
    ST_COST, ST_AVG_IOU, ST_COUNT, ST_CLASS_LOSS, ST_IOU_LOSS, ST_TOTAL_LOSS, ST_AVG_OBJ,
    ST_AVG_NOOBJ, ST_AVG_CLASS_PROB, ST_RECALL50, ST_RECALL75, ST_RESPONSIBLE, ST_TOTAL_BBOX,
    ST_REWRITTEN_BBOX, ST_IOU_SUM, ST_IOU_LOSS_SUM, ST_GIOU_LOSS_SUM, YOLO_STATS

cdef enum:  # one image's sums: the first entries of its row of the step's own float64
            # (N, IMG_SLOTS + boxes) array, whose other entries list its usable truth rows
    IMG_IOU, IMG_IOU_LOSS, IMG_GIOU_LOSS, IMG_COUNT, IMG_OBJ, IMG_ANYOBJ,
    IMG_CLASS_PROB, IMG_RECALL50, IMG_RECALL75, IMG_TOTAL_BBOX, IMG_REWRITTEN, IMG_SQUARES,
    IMG_NOBOX_SQUARES, IMG_SLOTS

#: The entries of a stats array, by index (see the module docstring).
YOLO_STAT_NAMES = (
    "cost", "avg_iou", "count", "class_loss_per_image", "iou_loss_per_image",
    "total_loss_per_image", "avg_obj", "avg_noobj", "avg_class_prob", "recall50", "recall75",
    "responsible", "total_bbox", "rewritten_bbox", "iou_sum", "iou_loss_sum", "giou_loss_sum",
)
assert len(YOLO_STAT_NAMES) == YOLO_STATS

cdef enum:
    TRUTH_COLUMNS = 5  # class, cx, cy, w, h

cdef struct YoloLossParams:
    Py_ssize_t batch, n, total, classes, h, w, boxes, net_w, net_h
    int iou_loss, iou_thresh_kind
    bint new_coords, focal_loss, objectness_smooth, clip
    double ignore_thresh, truth_thresh, iou_thresh, iou_normalizer, obj_normalizer
    double cls_normalizer, max_delta, label_smooth_eps

# Darknet's (4 / pi^2), computed in double as its expressions are.
cdef double AR_SCALE = 4.0 / (M_PI * M_PI)


# ----------------------------------------------------------------------------------------
# box.cpp: boxes are 4 values x, y, w, h (centre and size)

cdef inline floating _larger(floating a, floating b) noexcept nogil:
    # std::max: the first argument unless the second compares larger.
    return b if a < b else a


cdef inline floating _smaller(floating a, floating b) noexcept nogil:
    return b if b < a else a


@cython.cdivision(True)
cdef inline floating _overlap(floating x1, floating w1, floating x2, floating w2) noexcept nogil:
    cdef floating two = 2
    return (_smaller(x1 + w1 / two, x2 + w2 / two)
            - _larger(x1 - w1 / two, x2 - w2 / two))


cdef inline floating _intersection(const floating* a, const floating* b) noexcept nogil:
    cdef floating w = _overlap(a[0], a[2], b[0], b[2])
    if w <= 0:
        return 0
    cdef floating h = _overlap(a[1], a[3], b[1], b[3])
    if h <= 0:
        return 0
    return w * h


@cython.cdivision(True)
cdef inline floating _iou(const floating* a, const floating* b) noexcept nogil:
    cdef floating inter = _intersection(a, b)
    if inter == 0:
        return 0
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


@cython.cdivision(True)
cdef inline void _enclosing(const floating* a, const floating* b, floating* wh) noexcept nogil:
    """Width and height of the smallest box holding a and b (box_c)."""
    cdef floating two = 2
    wh[0] = (<floating>fmax(a[0] + a[2] / two, b[0] + b[2] / two)
             - <floating>fmin(a[0] - a[2] / two, b[0] - b[2] / two))
    wh[1] = (<floating>fmax(a[1] + a[3] / two, b[1] + b[3] / two)
             - <floating>fmin(a[1] - a[3] / two, b[1] - b[3] / two))


@cython.cdivision(True)
cdef floating _giou(const floating* a, const floating* b) noexcept nogil:
    cdef floating wh[2]
    _enclosing(a, b, wh)
    cdef floating c = wh[0] * wh[1]
    cdef floating iou = _iou(a, b)
    if c == 0:
        return iou
    cdef floating union = a[2] * a[3] + b[2] * b[3] - _intersection(a, b)
    return iou - (c - union) / c


cdef inline floating _distance2(const floating* a, const floating* b) noexcept nogil:
    return (a[0] - b[0]) * (a[0] - b[0]) + (a[1] - b[1]) * (a[1] - b[1])


@cython.cdivision(True)
cdef inline floating _atan_gap(const floating* truth, const floating* pred) noexcept nogil:
    """The aspect-ratio angle gap of CIoU (Darknet squares it in double)."""
    return fatan(truth[2] / truth[3]) - fatan(pred[2] / pred[3])


@cython.cdivision(True)
cdef inline floating _ciou_alpha(floating iou, floating ar_loss) noexcept nogil:
    cdef floating one = 1
    return <floating>(<double>ar_loss / (<double>(one - iou + ar_loss) + 0.000001))


@cython.cdivision(True)
cdef floating _diou_or_ciou(const floating* a, const floating* b, bint ciou) noexcept nogil:
    cdef floating wh[2]
    _enclosing(a, b, wh)
    cdef floating c = wh[0] * wh[0] + wh[1] * wh[1]
    cdef floating iou = _iou(a, b)
    if c == 0:
        return iou
    cdef floating d = _distance2(a, b) / c
    if not ciou:
        return <floating>(<double>iou - pow(<double>d, 0.6))
    cdef double gap = _atan_gap(b, a)
    cdef floating ar_loss = <floating>(AR_SCALE * gap * gap)
    return iou - (d + _ciou_alpha(iou, ar_loss) * ar_loss)


cdef floating _iou_of_kind(const floating* a, const floating* b, int kind) noexcept nogil:
    if kind == KIND_GIOU:
        return _giou(a, b)
    if kind == KIND_DIOU or kind == KIND_CIOU:
        return _diou_or_ciou(a, b, kind == KIND_CIOU)
    return _iou(a, b)


@cython.cdivision(True)
cdef inline floating _quotient_gradient(floating den, floating d_num, floating num,
                                        floating d_den) noexcept nogil:
    """d(num/den) = (den*d_num - num*d_den) / den^2."""
    return (den * d_num - num * d_den) / (den * den)


@cython.cdivision(True)
cdef void _dx_box_iou(const floating* pred, const floating* truth, int kind,
                      floating* grad) noexcept nogil:
    """box.cpp's dx_box_iou: grad = (dx, dy, dw, dh) of IoU (or GIoU, DIoU, CIoU by
    ``kind``) at pred, the box-edge gradients combined as Darknet combines them (dw and dh
    not halved)."""
    cdef floating one = 1, half = 0.5, two = 2
    cdef floating ptop = pred[1] - pred[3] / two, pbot = pred[1] + pred[3] / two
    cdef floating pleft = pred[0] - pred[2] / two, pright = pred[0] + pred[2] / two
    # Edges ordered, for a negative size.
    cdef floating pt = <floating>fmin(ptop, pbot), pb = <floating>fmax(ptop, pbot)
    cdef floating pl = <floating>fmin(pleft, pright), pr = <floating>fmax(pleft, pright)
    cdef floating tt = truth[1] - truth[3] / two, tb = truth[1] + truth[3] / two
    cdef floating tl = truth[0] - truth[2] / two, tr = truth[0] + truth[2] / two

    cdef floating area = (pb - pt) * (pr - pl)
    cdef floating truth_area = (tb - tt) * (tr - tl)
    cdef floating ih = <floating>fmin(pb, tb) - <floating>fmax(pt, tt)
    cdef floating iw = <floating>fmin(pr, tr) - <floating>fmax(pl, tl)
    cdef floating inter = iw * ih
    cdef floating union = area + truth_area - inter
    cdef floating s = _distance2(pred, truth)
    cdef floating gcw = <floating>fmax(pr, tr) - <floating>fmin(pl, tl)
    cdef floating gch = <floating>fmax(pb, tb) - <floating>fmin(pt, tt)
    cdef floating gc = gcw * gch

    # Derivatives by the edges top, bottom, left, right of the prediction's area, of the
    # intersection, of the union and of the enclosing box.
    cdef floating zero = 0
    cdef floating dx_t = -(pr - pl), dx_b = pr - pl
    cdef floating dx_l = -(pb - pt), dx_r = pb - pt
    cdef floating di_t = -iw if pt > tt else zero
    cdef floating di_b = iw if pb < tb else zero
    cdef floating di_l = -ih if pl > tl else zero
    cdef floating di_r = ih if pr < tr else zero
    cdef floating du_t = dx_t - di_t, du_b = dx_b - di_b
    cdef floating du_l = dx_l - di_l, du_r = dx_r - di_r
    cdef floating dc_t = -gcw if pt < tt else zero
    cdef floating dc_b = gcw if pb > tb else zero
    cdef floating dc_l = -gch if pl < tl else zero
    cdef floating dc_r = gch if pr > tr else zero

    cdef floating g_t = zero, g_b = zero, g_l = zero, g_r = zero
    if union > 0:
        g_t = _quotient_gradient(union, di_t, inter, du_t)
        g_b = _quotient_gradient(union, di_b, inter, du_b)
        g_l = _quotient_gradient(union, di_l, inter, du_l)
        g_r = _quotient_gradient(union, di_r, inter, du_r)
    # A flipped box takes the gradient of the edge that is really on that side (in this
    # order: the second assignment reads the first's result).
    if not ptop < pbot:
        g_t = g_b
    if not pleft < pright:
        g_l = g_r

    if kind == KIND_GIOU:
        if gc > 0:
            g_t = g_t + _quotient_gradient(gc, du_t, union, dc_t)
            g_b = g_b + _quotient_gradient(gc, du_b, union, dc_b)
            g_l = g_l + _quotient_gradient(gc, du_l, union, dc_l)
            g_r = g_r + _quotient_gradient(gc, du_r, union, dc_r)
        if iw <= 0 or ih <= 0:
            g_t = _quotient_gradient(gc, du_t, union, dc_t)
            g_b = _quotient_gradient(gc, du_b, union, dc_b)
            g_l = _quotient_gradient(gc, du_l, union, dc_l)
            g_r = _quotient_gradient(gc, du_r, union, dc_r)

    grad[0] = g_l + g_r
    grad[1] = g_t + g_b
    grad[2] = g_r - g_l
    grad[3] = g_b - g_t
    if kind != KIND_DIOU and kind != KIND_CIOU:
        return

    # The centre-distance term over the enclosing box's squared diagonal (from the
    # unordered edges, as Darknet takes them).
    cdef floating ct = <floating>fmin(pred[1] - pred[3] / two, truth[1] - truth[3] / two)
    cdef floating cb = <floating>fmax(pred[1] + pred[3] / two, truth[1] + truth[3] / two)
    cdef floating cl = <floating>fmin(pred[0] - pred[2] / two, truth[0] - truth[2] / two)
    cdef floating cr = <floating>fmax(pred[0] + pred[2] / two, truth[0] + truth[2] / two)
    cdef floating cw = cr - cl, ch = cb - ct
    cdef floating c = cw * cw + ch * ch
    cdef floating dcw_dx = (one if pr > tr else zero) - (one if pl < tl else zero)
    cdef floating dcw_dw = (half if pr > tr else zero) - (-half if pl < tl else zero)
    cdef floating dch_dy = (one if pb > tb else zero) - (one if pt < tt else zero)
    cdef floating dch_dh = (half if pb > tb else zero) - (-half if pt < tt else zero)
    # dC by x, y, w, h; the products with a zero are kept (an infinite side makes them NaN,
    # as in Darknet, whose caller then zeroes that delta).
    cdef floating dc_x = two * cw * dcw_dx + two * ch * zero
    cdef floating dc_y = two * cw * zero + two * ch * dch_dy
    cdef floating dc_w = two * cw * dcw_dw + two * ch * zero
    cdef floating dc_h = two * cw * zero + two * ch * dch_dh
    # Darknet's terms: x and y take -S*dC where the derivative of -S/C has +S*dC.
    cdef floating ex = (two * (truth[0] - pred[0]) * c - dc_x * s) / (c * c)
    cdef floating ey = (two * (truth[1] - pred[1]) * c - dc_y * s) / (c * c)
    cdef floating ew = dc_w * s / (c * c)
    cdef floating eh = dc_h * s / (c * c)
    cdef double gap
    cdef floating ar_loss, alpha, ar_dw = zero, ar_dh = zero
    if kind == KIND_CIOU:
        gap = _atan_gap(truth, pred)
        ar_loss = <floating>(AR_SCALE * gap * gap)
        alpha = _ciou_alpha(inter / union, ar_loss)
        ar_dw = <floating>(2 * AR_SCALE * gap * pred[3])
        ar_dh = <floating>(-2 * AR_SCALE * gap * pred[2])
        ew = ew + alpha * ar_dw
        eh = eh + alpha * ar_dh
    if c > 0:
        grad[0] = grad[0] + ex
        grad[1] = grad[1] + ey
        grad[2] = grad[2] + ew
        grad[3] = grad[3] + eh
    if iw <= 0 or ih <= 0:
        grad[0], grad[1], grad[2], grad[3] = ex, ey, ew, eh


# ----------------------------------------------------------------------------------------
# yolo_layer.cpp

cdef inline bint _usable(const floating* row, Py_ssize_t classes) noexcept nogil:
    """A truth row (class, cx, cy, w, h) the loss takes: a box (w, h > 0) that the checks of
    ``check_truths`` accept (NaN fails every comparison)."""
    if not (row[3] > 0 and row[4] > 0 and isfinite(row[3]) and isfinite(row[4])):
        return False
    if not (row[0] >= 0 and row[0] < classes):
        return False
    return row[1] >= 0 and row[1] <= 1 and row[2] >= 0 and row[2] <= 1


cdef inline Py_ssize_t _mask_position(const Py_ssize_t* mask, Py_ssize_t n,
                                      Py_ssize_t anchor) noexcept nogil:
    """int_index: the first position of ``anchor`` in the mask, or -1."""
    cdef Py_ssize_t k
    for k in range(n):
        if mask[k] == anchor:
            return k
    return -1


@cython.cdivision(True)
cdef inline void _pred_box(const floating* out, const floating* anchor, Py_ssize_t index,
                           Py_ssize_t i, Py_ssize_t j, const YoloLossParams* p,
                           floating* box) noexcept nogil:
    """get_yolo_box: the predicted box of the cell (i, j) whose x channel is at ``index``,
    normalised to the network size."""
    cdef Py_ssize_t stride = p.h * p.w
    cdef floating tw = out[index + 2 * stride], th = out[index + 3 * stride], four = 4
    box[0] = (i + out[index]) / p.w
    box[1] = (j + out[index + stride]) / p.h
    if p.new_coords:
        box[2] = tw * tw * four * anchor[0] / p.net_w
        box[3] = th * th * four * anchor[1] / p.net_h
    else:
        box[2] = fexp(tw) * anchor[0] / p.net_w
        box[3] = fexp(th) * anchor[1] / p.net_h


cdef inline void _anchor_box(const floating* anchors, Py_ssize_t k, const YoloLossParams* p,
                             floating* box) noexcept nogil:
    """Anchor k's shape, centred on 0, normalised to the network size."""
    box[0] = 0
    box[1] = 0
    box[2] = anchors[2 * k] / p.net_w
    box[3] = anchors[2 * k + 1] / p.net_h


@cython.cdivision(True)
cdef void _delta_box(const floating* truth, const floating* out, const floating* anchor,
                     Py_ssize_t index, Py_ssize_t i, Py_ssize_t j, floating scale,
                     floating iou_normalizer, floating* delta, const YoloLossParams* p,
                     floating* ious, double* acc) noexcept nogil:
    """delta_yolo_box: adds the box delta of ``truth`` (x, y, w, h) into the cell (i, j)
    whose x channel is at ``index`` and whose anchor is ``anchor``; ious = the (IoU, GIoU)
    of the prediction with the truth."""
    cdef Py_ssize_t stride = p.h * p.w, k
    cdef floating pred[4]
    cdef floating grad[4]
    cdef floating one = 1, four = 4, limit = <floating>p.max_delta, weight
    for k in range(4):
        if delta[index + k * stride] != 0:
            acc[IMG_REWRITTEN] += 1
            break
    _pred_box(out, anchor, index, i, j, p, pred)
    ious[0] = _iou(pred, truth)
    ious[1] = _giou(pred, truth)
    # Darknet's guard against 0/0 in the derivatives of a collapsed prediction.
    if pred[2] == 0:
        pred[2] = one
    if pred[3] == 0:
        pred[3] = one
    if p.iou_loss == KIND_MSE:
        grad[0] = truth[0] * p.w - i
        grad[1] = truth[1] * p.h - j
        if p.new_coords:
            grad[2] = fsqrt(truth[2] * p.net_w / (four * anchor[0]))
            grad[3] = fsqrt(truth[3] * p.net_h / (four * anchor[1]))
        else:
            grad[2] = flog(truth[2] * p.net_w / anchor[0])
            grad[3] = flog(truth[3] * p.net_h / anchor[1])
        # Darknet's build (-Ofast) multiplies scale by iou_normalizer first: this order
        # reproduces its deltas bit for bit.
        weight = scale * iou_normalizer
        for k in range(4):
            delta[index + k * stride] += weight * (grad[k] - out[index + k * stride])
        return
    _dx_box_iou(pred, truth, p.iou_loss, grad)
    if not p.new_coords:
        # The size is exp(raw): its chain-rule factor (none for new_coords' squares).
        grad[2] = grad[2] * fexp(out[index + 2 * stride])
        grad[3] = grad[3] * fexp(out[index + 3 * stride])
    for k in range(4):
        grad[k] = grad[k] * iou_normalizer
        if not isfinite(grad[k]):
            grad[k] = 0
        if p.clip:
            if grad[k] > limit:
                grad[k] = limit
            elif grad[k] < -limit:
                grad[k] = -limit
        delta[index + k * stride] += grad[k]


@cython.cdivision(True)
cdef void _delta_class(const floating* out, floating* delta, Py_ssize_t index,
                       Py_ssize_t class_id, const floating* mult, const YoloLossParams* p,
                       double* class_prob) noexcept nogil:
    """delta_yolo_class: the class deltas of the cell whose first class channel is at
    ``index`` for a truth of class ``class_id``; adds the truth class's probability into
    ``class_prob`` (if not NULL)."""
    cdef Py_ssize_t stride = p.h * p.w, c
    cdef Py_ssize_t at = index + stride * class_id
    cdef floating one = 1, zero = 0, half = 0.5, two = 2, y, r, pt, scale
    cdef floating eps = <floating>p.label_smooth_eps
    if delta[at] != 0:
        # A second truth of the same class on this cell: only that class is redone.
        y = one
        if eps != 0:
            y = <floating>(<double>(y * (one - eps)) + 0.5 * <double>eps)
        r = y - out[at]
        if isfinite(r):
            delta[at] = r
        if mult != NULL:
            delta[at] = delta[at] * mult[class_id]
        if class_prob != NULL:
            class_prob[0] += out[at]
        return
    if p.focal_loss:
        pt = out[at] + <floating>1e-15
        scale = half * (-(one - pt) * (two * pt * flog(pt) + pt - one))
        for c in range(p.classes):
            delta[index + stride * c] = ((one if c == class_id else zero)
                                         - out[index + stride * c]) * scale
    else:
        for c in range(p.classes):
            y = one if c == class_id else zero
            if eps != 0:
                y = y * (one - eps) + half * eps
            r = y - out[index + stride * c]
            if isfinite(r):
                delta[index + stride * c] = r
        if mult != NULL:
            delta[at] = delta[at] * (mult[class_id] * <floating>p.cls_normalizer)
    if class_prob != NULL:
        class_prob[0] += out[at]


@cython.cdivision(True)
cdef void _responsible(const floating* out, floating* delta, const floating* row,
                       const floating* anchors, Py_ssize_t anchor, Py_ssize_t position,
                       Py_ssize_t i, Py_ssize_t j, const floating* mult, bint fix_obj,
                       const YoloLossParams* p, floating* sums, double* acc) noexcept nogil:
    """The deltas of a truth row (class, cx, cy, w, h) on the cell (i, j) of the mask's
    ``position``-th anchor (anchor index ``anchor``); sums += (IoU, 1 - IoU, 1 - GIoU)."""
    cdef Py_ssize_t stride = p.h * p.w
    cdef Py_ssize_t cell = position * (5 + p.classes) * stride + j * p.w + i
    cdef Py_ssize_t obj_index = cell + 4 * stride
    cdef Py_ssize_t class_id = <Py_ssize_t>row[0]
    cdef floating ious[2]
    cdef floating one = 1, two = 2, obj, weight
    cdef floating multiplier = mult[class_id] if mult != NULL else one
    _delta_box(row + 1, out, anchors + 2 * anchor, cell, i, j, two - row[3] * row[4],
               <floating>p.iou_normalizer * multiplier, delta, p, ious, acc)
    acc[IMG_TOTAL_BBOX] += 1
    # Only an infinite predicted size makes these non-finite (Darknet's sums turn NaN).
    if not isfinite(ious[0]):
        ious[0] = 0
    if not isfinite(ious[1]):
        ious[1] = -1
    sums[0] = sums[0] + ious[0]
    sums[1] = sums[1] + (one - ious[0])
    sums[2] = sums[2] + (one - ious[1])
    obj = out[obj_index]
    if fix_obj and not isfinite(obj):
        obj = 0
    weight = multiplier * <floating>p.obj_normalizer * (one - obj)
    if not p.objectness_smooth or delta[obj_index] == 0:
        delta[obj_index] = weight
    acc[IMG_OBJ] += obj
    acc[IMG_RECALL50] += ious[0] > 0.5
    acc[IMG_RECALL75] += ious[0] > 0.75
    _delta_class(out, delta, cell + 5 * stride, class_id, mult, p, &acc[IMG_CLASS_PROB])
    acc[IMG_COUNT] += 1


cdef inline bint _any_class_above(const floating* out, Py_ssize_t index, Py_ssize_t stride,
                                  Py_ssize_t classes) noexcept nogil:
    """compare_yolo_class: some class probability of the cell is > 0.25."""
    cdef Py_ssize_t c
    cdef floating thresh = 0.25
    for c in range(classes):
        if out[index + stride * c] > thresh:
            return True
    return False


@cython.cdivision(True)
cdef void _image(const floating* out, floating* delta, const floating* truths,
                 const floating* anchors, const Py_ssize_t* mask, const floating* mult,
                 double* acc, const YoloLossParams* p, Py_ssize_t b) noexcept nogil:
    """process_batch for image b: its delta (assigned) and its row of ``acc``."""
    cdef Py_ssize_t stride = p.h * p.w, entries = 5 + p.classes
    cdef Py_ssize_t outputs = p.n * entries * stride
    cdef Py_ssize_t i, j, a, t, k, cell, obj_index, class_index, class_id, best_t, best_n
    cdef Py_ssize_t position, positives, u, used = 0
    cdef double* rows
    cdef floating pred[4]
    cdef floating shape[4]
    cdef floating anchor[4]
    cdef floating sums[3]
    cdef floating ious[2]
    cdef floating zero = 0, one = 1, two = 2, iou, best_iou, best_match, obj, multiplier, square
    cdef double square_sum
    cdef floating obj_norm = <floating>p.obj_normalizer
    cdef const floating* row
    cdef bint class_match, fix_obj
    out += b * outputs
    delta += b * outputs
    truths += b * p.boxes * TRUTH_COLUMNS
    acc += b * (IMG_SLOTS + p.boxes)
    rows = acc + IMG_SLOTS
    for k in range(IMG_SLOTS):
        acc[k] = 0
    for k in range(outputs):
        delta[k] = 0
    sums[0] = sums[1] = sums[2] = 0
    # The usable rows, in order, so that the cells do not scan the padding (Darknet's list
    # ends at its first empty row).
    for t in range(p.boxes):
        if _usable(truths + t * TRUTH_COLUMNS, p.classes):
            rows[used] = t
            used += 1
    # Darknet zeroes a non-finite objectness in place, but only when it has truths.
    fix_obj = used > 0

    # Every cell: objectness towards 0 unless it already overlaps a truth well.
    for j in range(p.h):
        for i in range(p.w):
            for a in range(p.n):
                cell = a * entries * stride + j * p.w + i
                obj_index = cell + 4 * stride
                class_index = cell + 5 * stride
                _pred_box(out, anchors + 2 * mask[a], cell, i, j, p, pred)
                obj = out[obj_index]
                if fix_obj and not isfinite(obj):
                    obj = 0
                acc[IMG_ANYOBJ] += obj
                class_match = _any_class_above(out, class_index, stride, p.classes)
                best_match = best_iou = 0
                best_t = 0
                for u in range(used):
                    t = <Py_ssize_t>rows[u]
                    iou = _iou(pred, truths + t * TRUTH_COLUMNS + 1)
                    if iou > best_match and class_match:
                        best_match = iou
                    if iou > best_iou:
                        best_iou = iou
                        best_t = t
                delta[obj_index] = obj_norm * (zero - obj)
                if best_match > <floating>p.ignore_thresh:
                    if p.objectness_smooth:
                        delta[obj_index] = _larger(delta[obj_index],
                                                   obj_norm * (best_match - obj))
                    else:
                        delta[obj_index] = 0
                if best_iou > <floating>p.truth_thresh:
                    row = truths + best_t * TRUTH_COLUMNS
                    class_id = <Py_ssize_t>row[0]
                    multiplier = mult[class_id] if mult != NULL else one
                    if p.objectness_smooth:
                        delta[obj_index] = obj_norm * (best_iou * best_iou - obj)
                    else:
                        delta[obj_index] = obj_norm * (one - obj)
                    _delta_class(out, delta, class_index, class_id, mult, p, NULL)
                    if p.objectness_smooth:
                        delta[class_index + stride * class_id] = multiplier * (
                            best_iou * best_iou - out[class_index + stride * class_id])
                    _delta_box(row + 1, out, anchors + 2 * mask[a], cell, i, j,
                               two - row[3] * row[4], <floating>p.iou_normalizer * multiplier,
                               delta, p, ious, acc)
                    acc[IMG_TOTAL_BBOX] += 1

    # Every truth, in order: its cell and best-shaped anchor, plus (iou_thresh) the
    # mask's other anchors of a close enough shape.
    for u in range(used):
        row = truths + <Py_ssize_t>rows[u] * TRUTH_COLUMNS
        i = min(<Py_ssize_t>(row[1] * p.w), p.w - 1)
        j = min(<Py_ssize_t>(row[2] * p.h), p.h - 1)
        shape[0] = shape[1] = 0
        shape[2] = row[3]
        shape[3] = row[4]
        best_iou = 0
        best_n = 0
        for k in range(p.total):
            _anchor_box(anchors, k, p, anchor)
            iou = _iou(anchor, shape)
            if iou > best_iou:
                best_iou = iou
                best_n = k
        position = _mask_position(mask, p.n, best_n)
        if position >= 0:
            _responsible(out, delta, row, anchors, best_n, position, i, j, mult, fix_obj, p,
                         sums, acc)
        if p.iou_thresh < 1:
            for k in range(p.total):
                position = _mask_position(mask, p.n, k)
                if position < 0 or k == best_n:
                    continue
                _anchor_box(anchors, k, p, anchor)
                if _iou_of_kind(anchor, shape, p.iou_thresh_kind) > <floating>p.iou_thresh:
                    _responsible(out, delta, row, anchors, k, position, i, j, mult, fix_obj,
                                 p, sums, acc)

    if p.iou_thresh < 1:
        # averages_yolo_deltas: a cell's box delta shared among its positive classes.
        for j in range(p.h):
            for i in range(p.w):
                for a in range(p.n):
                    cell = a * entries * stride + j * p.w + i
                    if delta[cell + 4 * stride] == 0:
                        continue
                    positives = 0
                    for k in range(p.classes):
                        if delta[cell + (5 + k) * stride] > 0:
                            positives += 1
                    if positives > 0:
                        for k in range(4):
                            delta[cell + k * stride] = delta[cell + k * stride] / positives

    # Darknet's mag_array adds float squares in a float sum that its compiler vectorises, in
    # an order that depends on the buffers' alignment; double sums of the float squares,
    # rounded once in _finish, are the closest to it (bit-exact for most golden costs).
    for a in range(p.n):
        for k in range(entries):
            square_sum = 0
            for i in range(stride):
                square = delta[(a * entries + k) * stride + i]
                square_sum += square * square
            acc[IMG_SQUARES] += square_sum
            if k >= 4:
                acc[IMG_NOBOX_SQUARES] += square_sum
    acc[IMG_IOU] = sums[0]
    acc[IMG_IOU_LOSS] = sums[1]
    acc[IMG_GIOU_LOSS] = sums[2]


# ----------------------------------------------------------------------------------------
# forward_yolo_layer: the images, then the cost and statistics

cdef struct LossJob:
    const void* out
    void* delta
    const void* truths
    const void* anchors
    const Py_ssize_t* mask
    const void* mult
    double* images
    const YoloLossParams* p


cdef void _image_part_f32(void* ctx, int b) noexcept nogil:
    cdef LossJob* job = <LossJob*>ctx
    _image(<const float*>job.out, <float*>job.delta, <const float*>job.truths,
           <const float*>job.anchors, job.mask, <const float*>job.mult, job.images, job.p, b)


cdef void _image_part_f64(void* ctx, int b) noexcept nogil:
    cdef LossJob* job = <LossJob*>ctx
    _image(<const double*>job.out, <double*>job.delta, <const double*>job.truths,
           <const double*>job.anchors, job.mask, <const double*>job.mult, job.images, job.p, b)


@cython.cdivision(True)
cdef void _finish(floating precision, const double* images, double* stats,
                  const YoloLossParams* p) noexcept nogil:
    """The cost and statistics from the images' sums, added in image order (as Darknet adds
    its threads' float sums), rounded as the type of ``precision`` (its only use)."""
    cdef Py_ssize_t image_row = IMG_SLOTS + p.boxes, b, k
    cdef floating iou_sum = 0, iou_loss_sum = 0, giou_loss_sum = 0
    cdef floating v, total, nobox, loss_sum, cost
    cdef double tallies[IMG_SLOTS]
    cdef double count
    for k in range(IMG_SLOTS):
        tallies[k] = 0
    for b in range(p.batch):
        iou_sum = iou_sum + <floating>images[b * image_row + IMG_IOU]
        iou_loss_sum = iou_loss_sum + <floating>images[b * image_row + IMG_IOU_LOSS]
        giou_loss_sum = giou_loss_sum + <floating>images[b * image_row + IMG_GIOU_LOSS]
        for k in range(IMG_SLOTS):
            tallies[k] += images[b * image_row + k]
    count = max(tallies[IMG_COUNT], 1.0)
    # mag_array's sqrt of the float sum, squared by the double pow.
    v = fsqrt(<floating>tallies[IMG_SQUARES])
    total = <floating>(<double>v * <double>v)
    v = fsqrt(<floating>tallies[IMG_NOBOX_SQUARES])
    nobox = <floating>(<double><floating>p.obj_normalizer * (<double>v * <double>v))
    if p.iou_loss == KIND_MSE:
        cost = total
    else:
        loss_sum = giou_loss_sum if p.iou_loss == KIND_GIOU else iou_loss_sum
        cost = <floating>p.iou_normalizer * (loss_sum / <floating>count) + nobox
    stats[ST_COST] = cost
    stats[ST_AVG_IOU] = iou_sum / <floating>count
    stats[ST_COUNT] = count
    stats[ST_CLASS_LOSS] = nobox / p.batch
    stats[ST_IOU_LOSS] = (total - nobox) / p.batch
    stats[ST_TOTAL_LOSS] = total / p.batch
    stats[ST_AVG_OBJ] = tallies[IMG_OBJ] / count
    stats[ST_AVG_NOOBJ] = tallies[IMG_ANYOBJ] / <double>(p.w * p.h * p.n * p.batch)
    stats[ST_AVG_CLASS_PROB] = tallies[IMG_CLASS_PROB] / count
    stats[ST_RECALL50] = tallies[IMG_RECALL50] / count
    stats[ST_RECALL75] = tallies[IMG_RECALL75] / count
    stats[ST_RESPONSIBLE] = tallies[IMG_COUNT]
    stats[ST_TOTAL_BBOX] = tallies[IMG_TOTAL_BBOX]
    stats[ST_REWRITTEN_BBOX] = tallies[IMG_REWRITTEN]
    stats[ST_IOU_SUM] = iou_sum
    stats[ST_IOU_LOSS_SUM] = iou_loss_sum
    stats[ST_GIOU_LOSS_SUM] = giou_loss_sum


cdef void _yolo_loss_step(const StepData* d) noexcept nogil:
    cdef const YoloLossParams* p = <const YoloLossParams*>d.params
    cdef LossJob job
    job.out, job.delta, job.truths = d.buf[LOSS_OUT], d.buf[LOSS_DELTA], d.buf[LOSS_TRUTH]
    job.anchors, job.mult = d.buf[LOSS_ANCHORS], d.buf[LOSS_MULT]
    job.mask = <const Py_ssize_t*>d.buf[LOSS_MASK]
    job.images = <double*>d.buf[LOSS_IMAGES]
    job.p = p
    # Images are independent (each writes its own delta and row of sums), as Darknet's
    # thread per image; the sums are combined afterwards in image order.
    run_parts(_image_part_f32 if d.f32 else _image_part_f64, &job, <int>p.batch)
    if d.f32:
        _finish(<float>0, job.images, <double*>d.buf[LOSS_STATS], p)
    else:
        _finish(<double>0, job.images, <double*>d.buf[LOSS_STATS], p)


# ----------------------------------------------------------------------------------------
# Python entry points

#: Darknet's ``max_delta`` default: no clipping.
NO_CLIP = float(FLT_MAX)


def _flag(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)) or (is_integer(value) and value in (0, 1)):
        return bool(value)
    raise ArgumentTypeError(f"{name} must be a bool (or 0/1), not {value!r}")


def _iou_kind(name: str, value) -> int:
    if not isinstance(value, str) or value not in IOU_LOSSES:
        raise ArgumentError(f"unknown {name} {value!r}; expected one of "
                            f"{', '.join(IOU_LOSSES)}")
    return IOU_LOSSES.index(value)


def _anchor_table(anchors, dtype) -> np.ndarray:
    """anchors as a flat (w0, h0, w1, h1, ...) array of ``dtype``, checked."""
    try:
        table = np.asarray(anchors, dtype=np.float64)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"anchors must be (w, h) pairs of numbers, not "
                                f"{anchors!r}") from None
    if table.ndim != 2 or table.shape[1] != 2 or table.shape[0] < 1:
        raise ArgumentError(f"anchors must have shape (num, 2): (w, h) pairs in pixels, "
                            f"not {table.shape}")
    if not (np.isfinite(table).all() and (table > 0).all()):
        raise ArgumentError(f"anchors must be finite and > 0, not {table.tolist()}")
    return np.ascontiguousarray(table.reshape(-1), dtype=dtype)


def _int_list(name: str, values, what: str) -> list:
    """``values`` as a non-empty list of ints, each named ``name[k]`` in errors."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) == 0:
        raise ArgumentTypeError(f"{name} must be a non-empty sequence of {what}s, "
                                f"not {values!r}")
    for position, value in enumerate(values):
        if not is_integer(value):
            raise ArgumentTypeError(f"{name}[{position}] must be {what} (int), not {value!r}")
    return [int(value) for value in values]


def _mask_table(mask, total: int) -> np.ndarray:
    indices = _int_list("mask", mask, "an anchor index")
    for position, index in enumerate(indices):
        if not 0 <= index < total:
            raise ArgumentError(f"mask[{position}] = {index} is out of range: there are "
                                f"{total} anchors (0..{total - 1})")
    return np.array(indices, dtype=np.intp)


def _class_multipliers(counters_per_class, int classes, double max_delta, dtype):
    """get_classes_multipliers: max(counts) / counts[c] (counts below 1 as 1), at most
    max_delta, in ``dtype`` (Darknet's float division for float32)."""
    if counters_per_class is None:
        return None
    counters = _int_list("counters_per_class", counters_per_class, "a count")
    if len(counters) != classes:
        raise ArgumentError(f"counters_per_class has {len(counters)} values, expected one "
                            f"per class ({classes})")
    counts = np.array([max(c, 1) for c in counters], dtype=dtype)
    table = np.asarray(counts.max() / counts, dtype=dtype)
    return np.ascontiguousarray(np.minimum(table, dtype(max_delta)), dtype=dtype)


def loss_tables(anchors, mask, int classes, counters_per_class=None,
                double max_delta=NO_CLIP) -> tuple:
    """The constant inputs of the loss of one ``[yolo]`` layer, checked as ``yolo_loss_step``
    checks them: (anchor table, flat float32 (w, h) pairs in pixels; mask, int32 anchor
    indices; class multipliers of ``counters_per_class``, float32, or None)."""
    anchor_table = _anchor_table(anchors, np.float32)
    mask_table = _mask_table(mask, anchor_table.shape[0] // 2).astype(np.int32)
    return (anchor_table, mask_table,
            _class_multipliers(counters_per_class, classes, max_delta, np.float32))


def check_truths(truths, classes, max_boxes=200) -> None:
    """Raise ArgumentError unless ``truths`` is an (N, boxes, 5) float32/float64 array of rows
    (class, cx, cy, w, h) the loss can use: at most ``max_boxes`` rows per image (the [yolo]
    ``max=``), every value finite, and in every box row (w > 0 and h > 0) an integral class
    in [0, classes) and a centre in [0, 1]. Rows with w <= 0 or h <= 0 are padding."""
    classes = positive_int("classes", classes)
    max_boxes = positive_int("max_boxes", max_boxes)
    check_input("truths", truths, (3,), layout="(N, boxes, 5)")
    if truths.shape[2] != TRUTH_COLUMNS:
        raise ArgumentError(f"truths must have shape (N, boxes, 5) with rows (class, cx, cy, "
                            f"w, h), not {truths.shape}")
    if truths.shape[1] > max_boxes:
        raise ArgumentError(f"truths has {truths.shape[1]} boxes per image, more than "
                            f"max_boxes={max_boxes} (the [yolo] max=)")
    values = truths.astype(np.float64)

    def where(wrong) -> str:
        b, t = np.argwhere(wrong)[0]
        return f"truths[{b}, {t}] = {values[b, t].tolist()}"

    wrong = ~np.isfinite(values).all(axis=2)
    if wrong.any():
        raise ArgumentError(f"{where(wrong)} is not finite")
    boxes = (values[..., 3] > 0) & (values[..., 4] > 0)
    cls = values[..., 0]
    wrong = boxes & ((cls < 0) | (cls >= classes) | (cls != np.floor(cls)))
    if wrong.any():
        raise ArgumentError(f"{where(wrong)}: the class must be an integer in [0, {classes})")
    wrong = boxes & ((values[..., 1:3] < 0) | (values[..., 1:3] > 1)).any(axis=2)
    if wrong.any():
        raise ArgumentError(f"{where(wrong)}: the centre (cx, cy) must be in [0, 1]")


def yolo_loss_step(output, delta, truths, stats, *, anchors, mask, classes, net_w, net_h,
                   ignore_thresh=0.5, truth_thresh=1.0, iou_thresh=1.0, iou_thresh_kind="iou",
                   iou_loss="mse", iou_normalizer=0.75, obj_normalizer=1.0, cls_normalizer=1.0,
                   max_delta=NO_CLIP, label_smooth_eps=0.0, counters_per_class=None,
                   new_coords=False, focal_loss=False, objectness_smooth=False,
                   max_boxes=200) -> NativeStep:
    """Darknet's ``[yolo]`` training loss (see the module docstring for the formulas).

    output: (N, n*(5+classes), H, W) float32/float64, the layer's forward output, n =
    len(mask); delta: same shape and dtype, written (assigned); truths: (N, boxes, 5) of the
    same dtype, rows (class, cx, cy, w, h) normalised (see ``check_truths``); stats:
    (len(YOLO_STAT_NAMES),) float64, written. anchors: every anchor of the layer's
    ``anchors=`` as (w, h) pairs in pixels; mask: the indices of this layer's anchors;
    net_w, net_h: the network input size in pixels. The other keywords are the [yolo]
    options of the same name, with Darknet's defaults; iou_loss and iou_thresh_kind are one
    of mse, iou, giou, diou, ciou; max_delta=NO_CLIP (FLT_MAX) does not clip.
    """
    check_input("output", output)
    check_input("delta", delta, like=output, like_name="output", writable=True)
    check_input("truths", truths, (3,), like=output, like_name="output",
                layout="(N, boxes, 5)")
    check_input("stats", stats, (1,), writable=True)
    if stats.dtype != np.float64 or stats.shape[0] != YOLO_STATS:
        raise ArgumentError(f"stats must be a float64 array of shape ({YOLO_STATS},), not "
                            f"{stats.dtype} {stats.shape}")
    if delta.shape != output.shape:
        raise ArgumentError(f"delta must have the shape of output {output.shape}, not "
                            f"{delta.shape}")
    for name, other in (("output", output), ("truths", truths), ("stats", stats)):
        if np.may_share_memory(delta, other):
            raise ArgumentError(f"delta must not overlap {name}")
    classes = positive_int("classes", classes)
    net_w = positive_int("net_w", net_w)
    net_h = positive_int("net_h", net_h)
    max_boxes = positive_int("max_boxes", max_boxes)
    check_truths(truths, classes, max_boxes)
    if truths.shape[0] != output.shape[0]:
        raise ArgumentError(f"truths has {truths.shape[0]} images, output {output.shape[0]}")
    dtype = output.dtype.type
    anchor_table = _anchor_table(anchors, dtype)
    total = anchor_table.shape[0] // 2
    mask_table = _mask_table(mask, total)
    n = mask_table.shape[0]
    if output.shape[1] != n * (5 + classes):
        raise ArgumentError(f"output must have n*(5+classes) = {n * (5 + classes)} channels "
                            f"for {n} masked anchors and classes={classes}, not "
                            f"{output.shape[1]}")
    max_delta = number("max_delta", max_delta)
    if max_delta <= 0:
        raise ArgumentError(f"max_delta must be > 0, not {max_delta!r}")
    multipliers = _class_multipliers(counters_per_class, classes, max_delta, dtype)
    images = np.zeros((output.shape[0], IMG_SLOTS + truths.shape[1]), dtype=np.float64)

    cdef NativeStep step = new_step(
        _yolo_loss_step, "yolo_loss",
        (output, delta, truths, anchor_table, mask_table, multipliers, stats, images),
        output.dtype == np.float32, sizeof(YoloLossParams))
    cdef YoloLossParams* p = <YoloLossParams*>step.data.params
    p.batch, p.n, p.total, p.classes = output.shape[0], n, total, classes
    p.h, p.w, p.boxes = output.shape[2], output.shape[3], truths.shape[1]
    p.net_w, p.net_h = net_w, net_h
    p.iou_loss = _iou_kind("iou_loss", iou_loss)
    p.iou_thresh_kind = _iou_kind("iou_thresh_kind", iou_thresh_kind)
    p.new_coords = _flag("new_coords", new_coords)
    p.focal_loss = _flag("focal_loss", focal_loss)
    p.objectness_smooth = _flag("objectness_smooth", objectness_smooth)
    p.clip = max_delta < NO_CLIP
    p.max_delta = max_delta
    p.ignore_thresh = number("ignore_thresh", ignore_thresh, 0.0, 1.0)
    p.truth_thresh = number("truth_thresh", truth_thresh, 0.0, 1.0)
    p.iou_thresh = number("iou_thresh", iou_thresh, 0.0, 1.0)
    p.label_smooth_eps = number("label_smooth_eps", label_smooth_eps, 0.0, 1.0)
    p.iou_normalizer = number("iou_normalizer", iou_normalizer)
    p.obj_normalizer = number("obj_normalizer", obj_normalizer)
    p.cls_normalizer = number("cls_normalizer", cls_normalizer)
    return step


def yolo_loss(output, delta, truths, stats, **options) -> None:
    """``yolo_loss_step(output, delta, truths, stats, **options)`` run once."""
    yolo_loss_step(output, delta, truths, stats, **options).run()


def yolo_loss_stats(stats) -> dict:
    """A stats array as {name: value} (counts as ints), by ``YOLO_STAT_NAMES``."""
    check_input("stats", stats, (1,))
    if stats.shape[0] != YOLO_STATS:
        raise ArgumentError(f"stats must have {YOLO_STATS} entries, not {stats.shape[0]}")
    counts = {"count", "responsible", "total_bbox", "rewritten_bbox"}
    return {name: int(stats[k]) if name in counts else float(stats[k])
            for k, name in enumerate(YOLO_STAT_NAMES)}


# ----------------------------------------------------------------------------------------
# yolo

cdef enum:  # buffer roles
    YOLO_X, YOLO_OUT

cdef struct YoloParams:
    Py_ssize_t tasks    # batch * anchors
    Py_ssize_t entries  # 5 + classes
    Py_ssize_t spatial  # H * W
    double alpha        # scale_x_y
    double beta         # -0.5 * (scale_x_y - 1), rounded as the dtype computes it
    bint new_coords
    bint exact          # Darknet's scalar logistic; else kernels.h's vectorised one (float32)


@cython.cdivision(True)
cdef void _yolo(const floating* src, floating* dst, const YoloParams* p) noexcept nogil:
    cdef Py_ssize_t spatial = p.spatial, entries = p.entries, task, i, base
    cdef floating alpha = <floating>p.alpha, beta = <floating>p.beta
    for task in range(p.tasks):
        # Anchor a of sample b owns channels [a*entries, (a+1)*entries) of that sample.
        base = task * entries * spatial
        for i in range(entries * spatial):
            dst[base + i] = src[base + i]
        if not p.new_coords:
            if floating is float and not p.exact:
                dm_act_f32(dst + base, 2 * spatial, DM_ACT_LOGISTIC)
                dm_act_f32(dst + base + 4 * spatial, (entries - 4) * spatial, DM_ACT_LOGISTIC)
            else:
                for i in range(2 * spatial):
                    dst[base + i] = logistic(dst[base + i])
                for i in range(4 * spatial, entries * spatial):
                    dst[base + i] = logistic(dst[base + i])
        for i in range(2 * spatial):
            dst[base + i] = dst[base + i] * alpha + beta


cdef void _yolo_step(const StepData* d) noexcept nogil:
    cdef const YoloParams* p = <const YoloParams*>d.params
    if d.f32:
        _yolo(<const float*>d.buf[YOLO_X], <float*>d.buf[YOLO_OUT], p)
    else:
        _yolo(<const double*>d.buf[YOLO_X], <double*>d.buf[YOLO_OUT], p)


def yolo_step(x, out, int n, int classes, double scale_x_y=1.0,
              bint new_coords=False, bint exact=True) -> NativeStep:
    """Darknet ``[yolo]`` forward: the layer's ``output`` as forward_yolo_layer leaves it.

    x: (N, n*(5+classes), H, W), the preceding convolution's output; out: same shape and
    dtype (may be x). n is the number of anchors in ``mask``. Per anchor the channels are
    x, y, w, h, objectness, classes. Unless new_coords, the logistic ``1/(1+exp(-v))`` is
    applied to x, y, objectness and the classes (w, h are left raw); then, always,
    ``x, y = v*scale_x_y - 0.5*(scale_x_y - 1)`` (computed in float32 for float32 input,
    as Darknet's scal_add_cpu does). ``exact``: the logistic is Darknet's scalar
    ``1/(1+expf(-v))`` (training: the loss sees Darknet's bits); False: for float32, the
    vectorised logistic of the convolution epilogues (``kernels.h``, within a few ulp of it,
    about 4x faster).
    """
    check_input("x", x)
    check_out(out, x, x.shape)
    if n < 1 or classes < 0:
        raise ArgumentError(f"yolo needs n >= 1 anchors and classes >= 0, got n={n} "
                         f"classes={classes}")
    if x.shape[1] != n * (5 + classes):
        raise ArgumentError(f"yolo with n={n} anchors and classes={classes} needs "
                         f"{n * (5 + classes)} input channels, got {x.shape[1]}")
    f32 = x.dtype == np.float32
    cdef NativeStep step = new_step(_yolo_step, "yolo", (x, out), f32, sizeof(YoloParams))
    cdef YoloParams* p = <YoloParams*>step.data.params
    p.tasks = x.shape[0] * n
    p.entries = 5 + classes
    p.spatial = x.shape[2] * x.shape[3]
    if f32:
        p.alpha = np.float32(scale_x_y)
        p.beta = np.float32(-0.5) * (np.float32(scale_x_y) - np.float32(1))
    else:
        p.alpha = scale_x_y
        p.beta = -0.5 * (scale_x_y - 1.0)
    p.new_coords = new_coords
    p.exact = exact
    return step


def yolo_forward(x, out, int n, int classes, double scale_x_y=1.0, bint new_coords=False) -> None:
    """``yolo_step(x, out, n, classes, scale_x_y, new_coords)`` run once."""
    yolo_step(x, out, n, classes, scale_x_y, new_coords).run()
