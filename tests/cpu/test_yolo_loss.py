"""Tests of the ``[yolo]`` training loss (``darknet_metal.cpu.yolo``).

References: the real Darknet V5's ``[yolo]`` deltas, costs and verbose statistics in
../shared/golden/darknet-v5-train (CIoU, DIoU, MSE and GIoU heads), and a float64 NumPy
oracle written from the loss's description (``NpYoloLoss`` in reference.py) for what that
data leaves out (iou_thresh, label smoothing, truth_thresh, max_delta, new_coords,
counters_per_class, the plain IoU loss, focal loss, objectness smoothing). The oracle takes
the IoU-family box gradients by central differences of the function Darknet differentiates,
so it shares no derivative formula with the kernel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from reference import NpYoloLoss
from training_golden import YOLO_CASES, yolo_passes

from darknet_metal.cpu import yolo as yl
from darknet_metal.errors import ArgumentError, ArgumentTypeError

STATS = len(yl.YOLO_STAT_NAMES)


# ----------------------------------------------------------------------------------------
# helpers


def run_loss(output, truths, **options):
    """(delta, stats dict) from the kernel."""
    delta = np.full_like(output, np.nan)  # assigned in full
    stats = np.zeros(STATS)
    yl.yolo_loss(output, delta, truths, stats, **options)
    return delta, yl.yolo_loss_stats(stats)


def rel_l2(ours, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm((np.asarray(ours, np.float64) - ref).ravel())
                 / max(np.linalg.norm(ref.ravel()), 1e-300))


ANCHORS = [(6, 7), (10, 14), (16, 12), (22, 26), (34, 30), (48, 52)]


def random_case(seed, *, n_img=2, h=5, w=7, classes=3, mask=(1, 3, 4), net=(64, 64),
                new_coords=False, scale_x_y=1.05, dtype=np.float64, hits=4):
    """A [yolo] output and truths: per image 7 rows, row 2 padding, rows 5 and 6 on the cell
    (and most likely the anchor) of rows 0 and 1, of another class and of the same class.
    Some cells predict a truth's box closely, so the ignore and truth_thresh rules act."""
    rng = np.random.default_rng(seed)
    n, e = len(mask), 5 + classes
    x = rng.normal(0, 1.0, (n_img, n * e, h, w))
    out = np.empty_like(x)
    yl.yolo_forward(x, out, n, classes, scale_x_y, new_coords)
    if new_coords:
        out.reshape(n_img, n, e, h, w)[:, :, :] = rng.uniform(0.05, 0.95, (n_img, n, e, h, w))
    truths = np.zeros((n_img, 7, 5))
    for b in range(n_img):
        for t in range(5):
            truths[b, t] = [rng.integers(classes), rng.uniform(0.05, 0.95),
                            rng.uniform(0.05, 0.95), rng.uniform(0.08, 0.7),
                            rng.uniform(0.08, 0.7)]
        truths[b, 2, 3:] = 0  # padding between boxes
        for t, source, shift in [(5, 0, 1), (6, 1, 0)]:
            truths[b, t] = truths[b, source]
            truths[b, t, 0] = (truths[b, source, 0] + shift) % classes
            truths[b, t, 3:] *= rng.uniform(0.95, 1.05, 2)
    o = out.reshape(n_img, n, e, h, w)
    for k in range(hits):
        b, t = k % n_img, k % 5
        if truths[b, t, 3] == 0:
            continue
        cls, cx, cy, tw, th = truths[b, t]
        i, j = int(cx * w), int(cy * h)
        a = rng.integers(n)
        anchor = ANCHORS[mask[a]]
        o[b, a, 0, j, i] = cx * w - i + rng.normal(0, 0.03)
        o[b, a, 1, j, i] = cy * h - j + rng.normal(0, 0.03)
        if new_coords:
            o[b, a, 2, j, i] = math.sqrt(tw * net[0] / (4 * anchor[0])) * rng.uniform(0.9, 1.1)
            o[b, a, 3, j, i] = math.sqrt(th * net[1] / (4 * anchor[1])) * rng.uniform(0.9, 1.1)
        else:
            o[b, a, 2, j, i] = math.log(tw * net[0] / anchor[0]) + rng.normal(0, 0.1)
            o[b, a, 3, j, i] = math.log(th * net[1] / anchor[1]) + rng.normal(0, 0.1)
        o[b, a, 5 + int(cls), j, i] = 0.8
    options = dict(anchors=ANCHORS, mask=list(mask), classes=classes, net_w=net[0],
                   net_h=net[1], new_coords=new_coords)
    return out.astype(dtype), truths.astype(dtype), options


# ----------------------------------------------------------------------------------------
# the golden data


@pytest.mark.skipif(not YOLO_CASES, reason="needs ../shared/golden/darknet-v5-train")
@pytest.mark.parametrize("case", YOLO_CASES)
def test_reproduces_darknet_deltas_costs_and_stats(case):
    worst = {"rel_l2": 0.0, "max_abs": 0.0, "cost": 0.0}
    bbox = {}
    for stem, options, output, truths, golden, head, record in yolo_passes(case):
        delta, stats = run_loss(output, truths, **options)
        worst["rel_l2"] = max(worst["rel_l2"], rel_l2(delta, golden))
        worst["max_abs"] = max(worst["max_abs"], float(np.abs(delta - golden).max()))
        cost_error = abs(stats["cost"] - head["cost"]) / head["cost"]
        worst["cost"] = max(worst["cost"], cost_error)
        assert rel_l2(delta, golden) <= 1e-4, stem
        assert cost_error <= 1e-4, (stem, stats["cost"], head["cost"])
        # The verbose line has 6 significant digits; iou_loss is total - class loss, so its
        # error is the sums' rounding, relative to the total.
        assert stats["count"] == head["count"], stem
        assert stats["avg_iou"] == pytest.approx(head["avg_iou"], rel=1e-5, abs=1e-6), stem
        total = head["total_loss_per_image"]
        for name in ("class_loss_per_image", "iou_loss_per_image", "total_loss_per_image"):
            assert abs(stats[name] - head[name]) <= 1e-6 * total + 1e-6, (stem, name)
        key = (stem.split("_L")[0], id(record))
        seen = bbox.setdefault(key, [record, 0, 0])
        seen[1] += stats["total_bbox"]
        seen[2] += stats["rewritten_bbox"]
    for record, total_bbox, rewritten in bbox.values():
        assert total_bbox == record["total_bbox_increment"]
        assert rewritten == record["rewritten_bbox_increment"]
    print(f"{case}: delta relative L2 <= {worst['rel_l2']:.2e}, max abs error "
          f"{worst['max_abs']:.2e}; cost relative error <= {worst['cost']:.2e}")
    # Near bit-exact: only the IoU-family box deltas differ, by a few float32 ulps (the
    # order of Darknet's -Ofast arithmetic in dx_box_iou).
    assert worst["max_abs"] <= 1e-6 and worst["cost"] <= 1e-5


@pytest.mark.skipif(not YOLO_CASES, reason="needs ../shared/golden/darknet-v5-train")
@pytest.mark.parametrize("case", ["micro-v3-adam", "micro-layers"])
def test_the_oracle_agrees_with_darknet(case):
    # MSE and GIoU, the oracle's own cross-check (its DIoU/CIoU box gradients are not written).
    for stem, options, output, truths, golden, head, _ in yolo_passes(case):
        oracle = NpYoloLoss(output, truths.astype(np.float64), **options)
        assert rel_l2(oracle.delta_array(), golden) <= 1e-5, stem
        assert oracle.stats()["cost"] == pytest.approx(head["cost"], rel=1e-5), stem


# ----------------------------------------------------------------------------------------
# the oracle on what the golden data does not cover

ORACLE_CASES = {
    "mse": {},
    "iou": dict(iou_loss="iou", iou_normalizer=0.5),
    "giou_iou_thresh": dict(iou_loss="giou", iou_thresh=0.2, iou_thresh_kind="giou"),
    "mse_iou_thresh_ciou_kind": dict(iou_thresh=0.15, iou_thresh_kind="ciou"),
    "iou_iou_thresh_diou_kind": dict(iou_loss="iou", iou_thresh=0.25, iou_thresh_kind="diou"),
    "label_smooth_truth_thresh": dict(label_smooth_eps=0.1, truth_thresh=0.55,
                                      ignore_thresh=0.3),
    "max_delta": dict(iou_loss="iou", max_delta=0.02, iou_normalizer=2.0),
    "counters_per_class": dict(iou_loss="iou", counters_per_class=[5, 0, 20],
                               cls_normalizer=0.5, max_delta=3.0),
    "counters_mse_truth_thresh": dict(counters_per_class=[1, 4, 2], truth_thresh=0.5,
                                      obj_normalizer=0.7),
    "new_coords_mse": dict(new_coords=True),
    "new_coords_iou": dict(new_coords=True, iou_loss="iou", ignore_thresh=0.2),
    "focal_loss": dict(focal_loss=True, truth_thresh=0.5, label_smooth_eps=0.2),
    "objectness_smooth": dict(objectness_smooth=True, ignore_thresh=0.3, truth_thresh=0.6,
                              iou_thresh=0.2, iou_loss="giou"),
}


@pytest.mark.parametrize("name", sorted(ORACLE_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_oracle(name, seed):
    options = dict(ORACLE_CASES[name])
    new_coords = options.pop("new_coords", False)
    output, truths, base = random_case(seed, new_coords=new_coords)
    base.update(options)
    delta, stats = run_loss(output, truths, **base)
    oracle = NpYoloLoss(output, truths, **base)
    expected = oracle.delta_array()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(delta, expected, rtol=0, atol=1e-7 * scale)
    for key, value in oracle.stats().items():
        assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_random_cases_reach_every_rule():
    # The options above are only tested if the random cases make them act.
    output, truths, options = random_case(0)
    base = run_loss(output, truths, **options)[0]
    channels = {"box": slice(0, 4), "obj": 4}
    for extra, changed in [(dict(ignore_thresh=0.3), "obj"),
                           (dict(truth_thresh=0.5), "box"),
                           (dict(iou_thresh=0.2), "box")]:
        delta = run_loss(output, truths, **options, **extra)[0]
        part = (slice(None), slice(None), channels[changed])
        assert not np.array_equal(delta.reshape(2, 3, 8, 5, 7)[part],
                                  base.reshape(2, 3, 8, 5, 7)[part]), extra
    clipped = run_loss(output, truths, **options, iou_loss="iou", max_delta=0.02)[0]
    unclipped = run_loss(output, truths, **options, iou_loss="iou")[0]
    assert np.abs(unclipped).max() > 0.02 and not np.array_equal(clipped, unclipped)
    stats = run_loss(output, truths, **options)[1]
    assert stats["rewritten_bbox"] >= 1 and stats["responsible"] >= 4


def test_float32_matches_float64():
    for seed, extra in [(3, {}), (4, dict(iou_loss="ciou", iou_normalizer=0.07)),
                        (5, dict(iou_loss="diou", iou_thresh=0.2))]:
        output, truths, options = random_case(seed)
        d64, s64 = run_loss(output, truths, **options, **extra)
        d32, s32 = run_loss(output.astype(np.float32), truths.astype(np.float32), **options,
                            **extra)
        assert d32.dtype == np.float32
        assert rel_l2(d32, d64) <= 1e-5
        assert s32["cost"] == pytest.approx(s64["cost"], rel=1e-5)
        assert s32["count"] == s64["count"]


def test_delta_is_assigned_and_rerunning_gives_the_same():
    output, truths, options = random_case(6)
    delta = np.full_like(output, 7.0)
    stats = np.zeros(STATS)
    step = yl.yolo_loss_step(output, delta, truths, stats, **options)
    step.run()
    first, first_stats = delta.copy(), stats.copy()
    step.run()
    np.testing.assert_array_equal(delta, first)
    np.testing.assert_array_equal(stats, first_stats)
    np.testing.assert_array_equal(first, run_loss(output, truths, **options)[0])


def test_images_are_independent():
    # Each image is one part on the executor's threads; its delta is what it gets alone.
    output, truths, options = random_case(12, n_img=5, dtype=np.float32)
    delta, stats = run_loss(output, truths, **options, iou_loss="ciou")
    responsible = 0
    for b in range(5):
        alone, alone_stats = run_loss(output[b:b + 1].copy(), truths[b:b + 1].copy(),
                                      **options, iou_loss="ciou")
        np.testing.assert_array_equal(delta[b:b + 1], alone)
        responsible += alone_stats["responsible"]
    assert stats["responsible"] == responsible


def test_runs_in_a_step_list_after_the_forward():
    from darknet_metal.cpu.executor import StepList

    output, truths, options = random_case(13, dtype=np.float32)
    rng = np.random.default_rng(13)
    logits = rng.normal(size=output.shape).astype(np.float32)
    delta, stats = np.zeros_like(output), np.zeros(STATS)
    steps = StepList([yl.yolo_step(logits, output, 3, 3, 1.05),
                      yl.yolo_loss_step(output, delta, truths, stats, **options)],
                     input_array=logits)
    other = rng.normal(size=output.shape).astype(np.float32)
    steps.run(other)
    expected = np.empty_like(output)
    yl.yolo_forward(other, expected, 3, 3, 1.05)
    np.testing.assert_array_equal(output, expected)
    np.testing.assert_array_equal(delta, run_loss(expected, truths, **options)[0])


def test_a_refilled_truth_array_with_bad_rows_skips_them():
    # The step checks the truths it is given; rows written later that it cannot use are
    # skipped rather than read out of bounds.
    output, truths, options = random_case(7)
    delta, stats = np.zeros_like(output), np.zeros(STATS)
    step = yl.yolo_loss_step(output, delta, truths, stats, **options)
    reference = run_loss(output, truths, **options)[0]
    truths[0, 2] = [99, 0.5, 0.5, 0.2, 0.2]  # the padding row: class out of range
    truths[1, 2] = [0, np.nan, 0.5, 0.2, 0.2]
    step.run()
    np.testing.assert_array_equal(delta, reference)


def test_padding_rows_anywhere_and_centres_on_the_edges():
    # Darknet stops at the first row with x == 0; here rows are boxes when w, h > 0, and a
    # centre at 1.0 lands in the last cell.
    output, truths, options = random_case(8)
    truths[:] = 0
    truths[0, 3] = [1, 0.0, 1.0, 0.3, 0.2]
    truths[1, 1] = [2, 1.0, 0.0, 0.2, 0.4]
    delta, stats = run_loss(output, truths, **options)
    oracle = NpYoloLoss(output, truths, **options)
    np.testing.assert_allclose(delta, oracle.delta_array(), atol=1e-9)
    assert stats["responsible"] == oracle.stats()["responsible"]


def test_no_truths():
    output, truths, options = random_case(9)
    truths[:] = 0
    delta, stats = run_loss(output, truths, **options)
    obj = output.reshape(2, 3, 8, 5, 7)[:, :, 4]
    np.testing.assert_array_equal(delta.reshape(2, 3, 8, 5, 7)[:, :, 4], -obj)
    assert stats["count"] == 1 and stats["responsible"] == 0
    assert stats["cost"] == pytest.approx(float((obj ** 2).sum()))


@pytest.mark.parametrize("iou_loss", ["mse", "iou", "giou", "diou", "ciou"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_logits_give_finite_delta_and_cost(iou_loss, dtype):
    rng = np.random.default_rng(10)
    output, truths, options = random_case(10, dtype=dtype)
    x = (rng.choice([-1e4, 1e4], output.shape)).astype(dtype)
    yl.yolo_forward(x, output, 3, 3, 1.05, False)
    delta, stats = run_loss(output, truths, **options, iou_loss=iou_loss, iou_thresh=0.2,
                            iou_normalizer=0.07)
    assert np.isfinite(delta).all()
    assert all(math.isfinite(v) for v in stats.values())


# ----------------------------------------------------------------------------------------
# arguments


def _arguments():
    output, truths, options = random_case(11, dtype=np.float32)
    return output, np.zeros_like(output), truths, np.zeros(STATS), options


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a[2].__setitem__((0, 0, 0), 3), ArgumentError, r"truths\[0, 0\].*class"),
    (lambda a: a[2].__setitem__((0, 1, 0), 1.5), ArgumentError, r"truths\[0, 1\].*class"),
    (lambda a: a[2].__setitem__((1, 3, 2), np.inf), ArgumentError, r"truths\[1, 3\].*finite"),
    (lambda a: a[2].__setitem__((1, 0, 1), 1.2), ArgumentError, r"truths\[1, 0\].*centre"),
    (lambda a: a[4].update(max_boxes=5), ArgumentError, "7 boxes per image.*max_boxes=5"),
    (lambda a: a[4].update(mask=[1, 3, 6]), ArgumentError, r"mask\[2\] = 6 is out of range"),
    (lambda a: a[4].update(mask=[1, 3, 2.0]), ArgumentTypeError, r"mask\[2\]"),
    (lambda a: a[4].update(iou_loss="siou"), ArgumentError, "unknown iou_loss 'siou'"),
    (lambda a: a[4].update(iou_thresh_kind="x"), ArgumentError, "unknown iou_thresh_kind"),
    (lambda a: a[4].update(anchors=[(1, 2), (0, 3)]), ArgumentError, "anchors must be"),
    (lambda a: a[4].update(anchors="10,14"), ArgumentTypeError, "anchors must be"),
    (lambda a: a[4].update(classes=4), ArgumentError, "channels"),
    (lambda a: a[4].update(net_w=0), ArgumentError, "net_w"),
    (lambda a: a[4].update(ignore_thresh=1.5), ArgumentError, "ignore_thresh"),
    (lambda a: a[4].update(iou_normalizer=float("nan")), ArgumentError, "iou_normalizer"),
    (lambda a: a[4].update(max_delta=0), ArgumentError, "max_delta"),
    (lambda a: a[4].update(counters_per_class=[1, 2]), ArgumentError, "counters_per_class"),
    (lambda a: a[4].update(focal_loss=2), ArgumentTypeError, "focal_loss"),
])
def test_bad_arguments_are_named(change, error, match):
    args = list(_arguments())
    change(args)
    output, delta, truths, stats, options = args
    with pytest.raises(error, match=match):
        yl.yolo_loss_step(output, delta, truths, stats, **options)


def test_bad_arrays_are_named():
    output, delta, truths, stats, options = _arguments()
    with pytest.raises(ArgumentError, match="delta must have the dtype of output"):
        yl.yolo_loss_step(output, delta.astype(np.float64), truths, stats, **options)
    with pytest.raises(ArgumentError, match="truths must have the dtype of output"):
        yl.yolo_loss_step(output, delta, truths.astype(np.float64), stats, **options)
    with pytest.raises(ArgumentError, match="stats must be a float64"):
        yl.yolo_loss_step(output, delta, truths, np.zeros(3), **options)
    with pytest.raises(ArgumentError, match="delta must not overlap output"):
        yl.yolo_loss_step(output, output, truths, stats, **options)
    with pytest.raises(ArgumentError, match="truths has 1 images"):
        yl.yolo_loss_step(output, delta, truths[:1].copy(), stats, **options)
    with pytest.raises(ArgumentError, match=r"truths must have shape \(N, boxes, 5\)"):
        yl.yolo_loss_step(output, delta, np.zeros((2, 6, 6), np.float32), stats, **options)
    with pytest.raises(ArgumentError, match="stats must have 17 entries"):
        yl.yolo_loss_stats(np.zeros(3))


def test_stats_names():
    assert len(set(yl.YOLO_STAT_NAMES)) == STATS
    stats = yl.yolo_loss_stats(np.arange(STATS, dtype=np.float64))
    assert list(stats) == list(yl.YOLO_STAT_NAMES)
    assert stats["count"] == 2 and isinstance(stats["count"], int)
