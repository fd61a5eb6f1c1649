"""The [yolo] training loss kernels (``shaders/yolo.metal``) in the Metal emulator against
the CPU reference ``darknet_metal.cpu.yolo_loss`` (float32), under forward, reverse and random
thread order, and against the golden Darknet [yolo] deltas the CPU reproduces."""

from __future__ import annotations

import math

import numpy as np
import pytest
from metal_harness import ORDERS
from training_golden import YOLO_CASES, yolo_passes

from darknet_metal.cpu import heads
from darknet_metal.cpu import yolo_loss as yl
from darknet_metal.model.cfg_schema import IOU_LOSSES

STATS = len(yl.YOLO_STAT_NAMES)
FLT_MAX = float(np.finfo(np.float32).max)
ANCHORS9 = [(6, 7), (10, 14), (16, 12), (22, 26), (34, 30), (48, 52), (60, 45), (80, 90),
            (110, 100)]

_DEFAULTS = dict(ignore_thresh=0.5, truth_thresh=1.0, iou_thresh=1.0, iou_thresh_kind="iou",
                 iou_loss="mse", iou_normalizer=0.75, obj_normalizer=1.0, cls_normalizer=1.0,
                 max_delta=FLT_MAX, label_smooth_eps=0.0, counters_per_class=None,
                 new_coords=False, focal_loss=False, objectness_smooth=False)


def kernel_args(output, truths, *, anchors, mask, classes, net_w, net_h, **options):
    """dm_yolo_loss_args and the multipliers buffer for the CPU step's keywords."""
    o = dict(_DEFAULTS, **options)
    o.pop("max_boxes", None)
    table = np.asarray(anchors, np.float32).reshape(-1)
    n, _, h, w = output.shape
    args = dict(
        batch=n, anchors=len(mask), classes=classes, height=h, width=w, boxes=truths.shape[1],
        total=table.size // 2, net_w=net_w, net_h=net_h,
        iou_loss=IOU_LOSSES.index(o["iou_loss"]),
        iou_thresh_kind=IOU_LOSSES.index(o["iou_thresh_kind"]),
        new_coords=int(o["new_coords"]), focal_loss=int(o["focal_loss"]),
        objectness_smooth=int(o["objectness_smooth"]),
        counters=int(o["counters_per_class"] is not None),
        ignore_thresh=o["ignore_thresh"], truth_thresh=o["truth_thresh"],
        iou_thresh=o["iou_thresh"], iou_normalizer=o["iou_normalizer"],
        obj_normalizer=o["obj_normalizer"], cls_normalizer=o["cls_normalizer"],
        max_delta=o["max_delta"], label_smooth_eps=o["label_smooth_eps"])
    mult = yl._class_multipliers(o["counters_per_class"], classes, o["max_delta"], np.float32)
    if mult is None:
        mult = np.full(classes, np.nan, np.float32)  # bound, never read
    return args, table, np.asarray(mask, np.int32), mult


def run_kernels(runner, output, truths, order="forward", seed=7, delta=None, **options):
    """(delta, stats as float32 (17,), scratch) from the four dispatches."""
    args, table, mask, mult = kernel_args(output, truths, **options)
    n, a, h, w = args["batch"], args["anchors"], args["height"], args["width"]
    if delta is None:
        delta = np.full_like(output, np.nan)  # assigned in full
    partials = np.full(n * a * h * w * 4, np.nan, np.float32)
    images = np.full(n * 10, np.nan, np.float32)
    stats = np.full(STATS, np.nan, np.float32)
    inputs = {"output": output, "truths": truths, "anchor_table": table, "mask": mask,
              "multipliers": mult}
    cells = {"spatial": h * w, "anchors": a, "batch": n}
    kw = dict(order=order, seed=seed)
    runner.run("yolo_loss_bwd_cells_f32", args,
               {**inputs, "delta": delta, "partials": partials}, cells, **kw)
    runner.run("yolo_loss_bwd_truths_f32", args,
               {**inputs, "delta": delta, "images": images}, {"batch": n}, **kw)
    runner.run("yolo_loss_bwd_squares_f32", args, {"delta": delta, "partials": partials},
               cells, **kw)
    runner.run("yolo_loss_bwd_stats_f32", args,
               {"partials": partials, "images": images, "stats": stats}, {"one": 1}, **kw)
    return delta, stats, (partials, images)


def run_cpu(output, truths, **options):
    delta = np.full_like(output, np.nan)
    stats = np.zeros(STATS)
    yl.yolo_loss(output, delta, truths, stats, **options)
    return delta, stats


def ulps(a, b):
    """Distance in float32 units in the last place, elementwise."""
    def ordered(x):
        i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


def rel_l2(ours, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm((np.asarray(ours, np.float64) - ref).ravel())
                 / max(np.linalg.norm(ref.ravel()), 1e-300))


def check_stats(stats, ref, rtol=1e-5):
    for k, name in enumerate(yl.YOLO_STAT_NAMES):
        assert stats[k] == pytest.approx(ref[k], rel=rtol, abs=1e-6 * max(1.0, abs(ref[0]))), \
            (name, float(stats[k]), ref[k])


def _shape_iou(box, shape):
    inter = min(box[2], shape[0]) * min(box[3], shape[1])
    return inter / (box[2] * box[3] + shape[0] * shape[1] - inter)


def make_case(seed, *, n_img=3, h=5, w=7, classes=3, mask=(1, 3, 4), anchors=ANCHORS9[:6],
              net=(64, 64), new_coords=False, boxes=7, hits=5):
    """A float32 [yolo] output and truths. Per image: row 2 is padding; rows 5 and 6 repeat
    the cell (and most likely the anchor) of rows 0 and 1 with another class and the same
    class; some cells predict a truth's box closely so that the ignore, truth_thresh and
    recall rules act. Image 1 has no truths at all when n_img > 2."""
    rng = np.random.default_rng(seed)
    n, e = len(mask), 5 + classes
    x = rng.normal(0, 1.0, (n_img, n * e, h, w)).astype(np.float32)
    out = np.empty_like(x)
    heads.yolo_forward(x, out, n, classes, 1.05, new_coords)
    o = out.reshape(n_img, n, e, h, w)
    if new_coords:
        o[:] = rng.uniform(0.05, 0.95, o.shape)
    truths = np.zeros((n_img, boxes, 5))
    for b in range(n_img):
        for t in range(min(boxes, 5)):
            truths[b, t] = [rng.integers(classes), rng.uniform(0.02, 0.98),
                            rng.uniform(0.02, 0.98), rng.uniform(0.08, 0.7),
                            rng.uniform(0.08, 0.7)]
        truths[b, 2, 3:] = 0
        for t, source, shift in [(5, 0, 1), (6, 1, 0)]:
            if t < boxes:
                truths[b, t] = truths[b, source]
                truths[b, t, 0] = (truths[b, source, 0] + shift) % classes
                truths[b, t, 3:] *= rng.uniform(0.95, 1.05, 2)
    if n_img > 2:
        truths[1] = 0
    for k in range(hits):
        b, t = k % n_img, k % 5
        if truths[b, t, 3] == 0:
            continue
        cls, cx, cy, tw, th = truths[b, t]
        i, j = int(cx * w), int(cy * h)
        # On the anchor the truth picks when the mask has it.
        shapes = [np.array([0, 0, aw / net[0], ah / net[1]]) for aw, ah in anchors]
        best = int(np.argmax([_shape_iou(box, (tw, th)) for box in shapes]))
        a = list(mask).index(best) if best in mask else rng.integers(n)
        anchor = anchors[mask[a]]
        o[b, a, 0, j, i] = cx * w - i + rng.normal(0, 0.03)
        o[b, a, 1, j, i] = cy * h - j + rng.normal(0, 0.03)
        if new_coords:
            o[b, a, 2, j, i] = math.sqrt(tw * net[0] / (4 * anchor[0])) * rng.uniform(0.9, 1.1)
            o[b, a, 3, j, i] = math.sqrt(th * net[1] / (4 * anchor[1])) * rng.uniform(0.9, 1.1)
        else:
            o[b, a, 2, j, i] = math.log(tw * net[0] / anchor[0]) + rng.normal(0, 0.1)
            o[b, a, 3, j, i] = math.log(th * net[1] / anchor[1]) + rng.normal(0, 0.1)
        o[b, a, 5 + int(cls), j, i] = 0.8
    options = dict(anchors=anchors, mask=list(mask), classes=classes, net_w=net[0],
                   net_h=net[1], new_coords=new_coords)
    return out, truths.astype(np.float32), options


def assert_matches_cpu(delta, stats, ref_delta, ref_stats, max_ulps=0, skip=()):
    """Deltas within max_ulps float32 ulps of the CPU's; statistics within 1e-5 relative,
    but iou_loss_per_image = (total - nobox)/N, a difference of two sums, relative to the
    total (the CPU sums the squares in double, the kernels in float32)."""
    assert np.isfinite(delta).all()
    if max_ulps is None:
        scale = float(np.abs(ref_delta).max())
        np.testing.assert_allclose(delta, ref_delta, rtol=1e-6, atol=1e-7 * scale)
    else:
        worst = int(ulps(delta, ref_delta).max()) if delta.size else 0
        assert worst <= max_ulps, (worst, rel_l2(delta, ref_delta))
    assert rel_l2(delta, ref_delta) <= 1e-7
    for k, name in enumerate(yl.YOLO_STAT_NAMES):
        if name in skip:
            continue
        if not math.isfinite(ref_stats[k]):  # squares of deltas beyond 1.8e19
            assert stats[k] == ref_stats[k], (name, float(stats[k]), ref_stats[k])
            continue
        scale = ref_stats[5] if name == "iou_loss_per_image" else abs(ref_stats[k])
        assert abs(float(stats[k]) - ref_stats[k]) <= 1e-5 * scale + 1e-7, \
            (name, float(stats[k]), ref_stats[k])


# ---- every option against the CPU ------------------------------------------------------------

CIOU_ULPS = 0
# name -> (make_case keywords, loss options, ulps allowed)
CASES = {
    "mse": ({}, {}, 0),
    "iou": (dict(h=7, w=5, mask=(0, 1, 2)), dict(iou_loss="iou", iou_normalizer=0.5), 0),
    "giou_iou_thresh": (dict(mask=(2, 4), anchors=ANCHORS9[:8]),
                        dict(iou_loss="giou", iou_thresh=0.2, iou_thresh_kind="giou"), 0),
    "diou": (dict(h=13, w=13, n_img=2, classes=5),
             dict(iou_loss="diou", iou_thresh=0.2), 0),
    # CIoU's aspect term is rounded through double on the CPU, in float32 here: its w and h
    # deltas differ by a few ulps, more where the aspect term nearly cancels the rest.
    "ciou": (dict(mask=(6, 7, 8), anchors=ANCHORS9, net=(96, 128), h=3, w=9),
             dict(iou_loss="ciou", iou_normalizer=0.07, iou_thresh=0.3), CIOU_ULPS),
    "mse_iou_thresh_ciou_kind": ({}, dict(iou_thresh=0.15, iou_thresh_kind="ciou"), 0),
    "iou_iou_thresh_diou_kind": (dict(classes=2), dict(iou_loss="iou", iou_thresh=0.25,
                                                        iou_thresh_kind="diou"), 0),
    "label_smooth_truth_thresh": ({}, dict(label_smooth_eps=0.1, truth_thresh=0.55,
                                           ignore_thresh=0.3), 0),
    "max_delta": ({}, dict(iou_loss="iou", max_delta=0.02, iou_normalizer=2.0), 0),
    "counters_per_class": ({}, dict(iou_loss="iou", counters_per_class=[5, 0, 20],
                                    cls_normalizer=0.5, max_delta=3.0), 0),
    "counters_mse_truth_thresh": ({}, dict(counters_per_class=[1, 4, 2], truth_thresh=0.5,
                                           obj_normalizer=0.7), 0),
    "new_coords_mse": (dict(new_coords=True, mask=(2,), anchors=ANCHORS9[:7]), {}, 0),
    "new_coords_ciou": (dict(new_coords=True, h=1, w=1, boxes=6, hits=2),
                        dict(iou_loss="ciou", ignore_thresh=0.2, iou_thresh=0.2), CIOU_ULPS),
    "focal_loss": (dict(classes=4), dict(focal_loss=True, truth_thresh=0.5,
                                          label_smooth_eps=0.2), 0),
    "objectness_smooth": ({}, dict(objectness_smooth=True, ignore_thresh=0.3, truth_thresh=0.6,
                                   iou_thresh=0.2, iou_loss="giou"), 0),
    "one_class_one_anchor": (dict(classes=1, mask=(3,), n_img=1, h=7, w=7),
                             dict(iou_loss="ciou", truth_thresh=0.6, ignore_thresh=0.4), CIOU_ULPS),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_cpu_in_every_thread_order(emu_runner, name):
    shape, options, max_ulps = CASES[name]
    output, truths, base = make_case(sum(map(ord, name)), **shape)
    base.update(options)
    ref_delta, ref_stats = run_cpu(output, truths, **base)
    assert ref_stats[11] >= 1  # some truth is responsible
    first = None
    for order in ORDERS:
        delta, stats, scratch = run_kernels(emu_runner, output, truths, order=order, **base)
        if first is None:
            first = (delta, stats, scratch)
            assert_matches_cpu(delta, stats, ref_delta, ref_stats, max_ulps)
        else:
            again = (delta, stats, *scratch)
            for ours, theirs in zip(again, (first[0], first[1], *first[2]), strict=True):
                np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_the_cases_reach_every_rule(emu_runner):
    # Shared cells rewrite boxes, truth_thresh adds boxes beyond the responsible ones,
    # iou_thresh adds anchors, the ignore rule zeroes objectness deltas.
    output, truths, options = make_case(sum(map(ord, "label_smooth_truth_thresh")))
    _, stats, _ = run_kernels(emu_runner, output, truths, **options, label_smooth_eps=0.1,
                              truth_thresh=0.55, ignore_thresh=0.3)
    named = dict(zip(yl.YOLO_STAT_NAMES, stats, strict=True))
    assert named["rewritten_bbox"] >= 1 and named["total_bbox"] > named["responsible"]
    assert named["recall50"] > 0
    output, truths, options = make_case(sum(map(ord, "giou_iou_thresh")), mask=(2, 4),
                                        anchors=ANCHORS9[:8])
    base = run_kernels(emu_runner, output, truths, **options)[1][11]
    more = run_kernels(emu_runner, output, truths, **options, iou_thresh=0.2)[1][11]
    assert more > base
    delta = run_kernels(emu_runner, output, truths, **options, ignore_thresh=0.3)[0]
    obj = delta.reshape(3, 2, 8, 5, 7)[:, :, 4]
    assert (obj == 0).any()


def test_large_layer_many_truths(emu_runner):
    # 2 x 3*(5+80) x 13 x 13 = 86190 elements, 40 rows per image, several per cell.
    output, truths, options = make_case(21, n_img=2, h=13, w=13, classes=80, boxes=40,
                                        mask=(3, 4, 5), hits=12)
    rng = np.random.default_rng(21)
    for b in range(2):
        for t in range(7, 40):
            truths[b, t] = [rng.integers(80), rng.uniform(0, 1), rng.uniform(0, 1),
                            rng.uniform(0.05, 0.9), rng.uniform(0.05, 0.9)]
        truths[b, 30:35] = truths[b, 10:15]  # same cells and anchors, same classes
    assert output.size > 65536
    for extra in (dict(iou_loss="ciou", iou_normalizer=0.07, iou_thresh=0.213),
                  dict(truth_thresh=0.7, ignore_thresh=0.5)):
        ref_delta, ref_stats = run_cpu(output, truths, **options, **extra)
        delta, stats, _ = run_kernels(emu_runner, output, truths, order="random", **options,
                                      **extra)
        assert_matches_cpu(delta, stats, ref_delta, ref_stats, max_ulps=CIOU_ULPS)
        assert ref_stats[13] >= 5  # rewritten boxes


def test_no_truths_and_padding_anywhere(emu_runner):
    output, truths, options = make_case(9, n_img=2)
    truths[:] = 0
    truths[0, 4] = [1, 0.0, 1.0, 0.3, 0.2]  # centre on the edges: the last cell row
    truths[0, 5] = [0, 0.5, 0.5, 0.0, 0.3]  # padding (zero width) between boxes
    truths[0, 6] = [2, 1.0, 0.0, 0.2, 0.4]
    for rows in (truths, np.zeros_like(truths), np.zeros((2, 0, 5), np.float32)):
        ref_delta, ref_stats = run_cpu(output, rows, **options)
        delta, stats, _ = run_kernels(emu_runner, output, rows, **options)
        assert_matches_cpu(delta, stats, ref_delta, ref_stats)


def test_delta_is_assigned_whatever_it_held(emu_runner):
    output, truths, options = make_case(6)
    options.update(iou_loss="giou", iou_thresh=0.3)
    first = run_kernels(emu_runner, output, truths, **options)[0]
    held = np.random.default_rng(6).normal(size=output.shape).astype(np.float32)
    again = run_kernels(emu_runner, output, truths, delta=held, **options)[0]
    np.testing.assert_array_equal(again, first)


@pytest.mark.parametrize("iou_loss", IOU_LOSSES)
def test_huge_logits_give_finite_delta_and_stats(any_math_runner, iou_loss):
    # +-1e4 logits: sizes exp(1e4) (the CPU's infinite boxes) and exp(-1e4) = 0, saturated
    # objectness and classes.
    output, truths, options = make_case(10)
    x = np.random.default_rng(10).choice([-1e4, 1e4], output.shape).astype(np.float32)
    heads.yolo_forward(x, output, 3, 3, 1.05, False)
    options.update(iou_loss=iou_loss, iou_thresh=0.2, iou_normalizer=0.07, truth_thresh=0.0,
                   ignore_thresh=0.0)
    delta, stats, _ = run_kernels(any_math_runner, output, truths, **options)
    assert np.isfinite(delta).all() and np.isfinite(stats).all()
    ref_delta, ref_stats = run_cpu(output, truths, **options)
    assert_matches_cpu(delta, stats, ref_delta, ref_stats)


@pytest.mark.parametrize("iou_loss", ["iou", "giou", "ciou"])
def test_large_finite_sizes_give_the_cpus_finite_deltas(any_math_runner, iou_loss, request):
    # Raw sizes up to +-90: predictions from huge to infinite (exp overflows past 88.72),
    # intermediate products overflowing in the IoU gradients (zeroed, as on the CPU). The
    # deltas stay finite; their squares may not (so may the CPU's total loss). The fast-math
    # build rounds the IoU gradients differently: a tolerance there.
    output, truths, options = make_case(11)
    rng = np.random.default_rng(11)
    sizes = output.reshape(3, 3, 8, 5, 7)[:, :, 2:4]
    sizes[:] = rng.uniform(-90, 90, sizes.shape)
    sizes[:, :, :, 2] = rng.uniform(88.5, 89, sizes[:, :, :, 2].shape)
    options.update(iou_loss=iou_loss, iou_thresh=0.2, iou_normalizer=0.07, truth_thresh=0.0,
                   ignore_thresh=0.0)
    delta, stats, _ = run_kernels(any_math_runner, output, truths, **options)
    ref_delta, ref_stats = run_cpu(output, truths, **options)
    exact = "fast_math" not in request.node.name
    assert_matches_cpu(delta, stats, ref_delta, ref_stats, max_ulps=0 if exact else None)


# ---- the golden Darknet data ------------------------------------------------------------------


@pytest.mark.skipif(not YOLO_CASES, reason="needs ../shared/golden/darknet-v5-train")
@pytest.mark.parametrize("case", YOLO_CASES)
def test_reproduces_the_golden_darknet_deltas(emu_runner, case):
    for stem, options, output, truths, golden, head, _ in yolo_passes(case):
        delta, stats, _ = run_kernels(emu_runner, output, truths, order="random", **options)
        ref_delta, ref_stats = run_cpu(output, truths, **options)
        assert_matches_cpu(delta, stats, ref_delta, ref_stats, max_ulps=4)
        # What the CPU reference achieves against Darknet itself (tests/test_yolo_loss.py).
        assert rel_l2(delta, golden) <= 1e-4, stem
        assert float(np.abs(delta - golden).max()) <= 1e-6, stem
        named = dict(zip(yl.YOLO_STAT_NAMES, stats.astype(np.float64), strict=True))
        assert abs(named["cost"] - head["cost"]) <= 1e-5 * head["cost"], stem
        assert named["count"] == head["count"], stem
        assert named["avg_iou"] == pytest.approx(head["avg_iou"], rel=1e-5, abs=1e-6), stem
