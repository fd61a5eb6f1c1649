"""The [yolo] training loss kernels (``shaders/yolo.metal``) where the case table
(test_metal_cases.py: every option against the CPU loss) does not reach: that its cases reach
every rule of the loss, huge and overflowing predictions on the IEEE and the -ffast-math
builds, and the golden Darknet [yolo] deltas the CPU reproduces."""

from __future__ import annotations

import numpy as np
import pytest
from training_golden import YOLO_CASES, yolo_passes

from darknet_metal.cpu import yolo as yl
from darknet_metal.diagnostics.kernel_cases import case
from darknet_metal.diagnostics.kernel_cases.yolo import (
    LOSSES,
    YoloHead,
    yolo_loss_case,
    yolo_loss_data,
    yolo_loss_steps,
)
from darknet_metal.diagnostics.kernel_parity import KernelCase, rel_l2, run_case
from darknet_metal.model.cfg_schema import IOU_LOSSES


def _stats(result) -> dict[str, float]:
    """The statistics of a passing run, by name."""
    assert result.ok, result.failures
    return dict(zip(yl.YOLO_STAT_NAMES, result.outputs["stats"].astype(np.float64),
                    strict=True))


def test_the_cases_reach_every_rule(emu_device):
    # Shared cells rewrite boxes, truth_thresh adds boxes beyond the responsible ones,
    # iou_thresh adds anchors, the ignore rule zeroes objectness deltas.
    named = _stats(run_case(emu_device, case("yolo_loss_bwd_f32-label_smooth_truth_thresh")))
    assert named["rewritten_bbox"] >= 1 and named["total_bbox"] > named["responsible"]
    assert named["recall50"] > 0
    # One name, so one draw: the options alone differ.
    head = LOSSES["giou_iou_thresh"][0]
    base = _stats(run_case(emu_device, yolo_loss_case("giou_iou_thresh", head, {})))
    more = _stats(run_case(emu_device, yolo_loss_case("giou_iou_thresh", head,
                                                      {"iou_thresh": 0.2})))
    assert more["responsible"] > base["responsible"]
    ignoring = yolo_loss_case("giou_iou_thresh", head, {"ignore_thresh": 0.3})
    result = run_case(emu_device, ignoring)
    assert result.ok, result.failures
    obj = result.outputs["delta"].reshape(3, 2, 8, 5, 7)[:, :, 4]
    assert (obj == 0).any()


def _loss_case(name: str, output: np.ndarray, truths: np.ndarray, options: dict,
               max_ulps: int | None = 0) -> KernelCase:
    """The loss on these inputs against the CPU's."""
    return KernelCase(name, yolo_loss_steps(output.shape, truths.shape[1], options),
                      lambda rng: yolo_loss_data(output, truths, options, max_ulps=max_ulps))


def _extreme_options(head: YoloHead, iou_loss: str) -> dict:
    return head.options(iou_loss=iou_loss, iou_thresh=0.2, iou_normalizer=0.07,
                        truth_thresh=0.0, ignore_thresh=0.0)


@pytest.mark.parametrize("iou_loss", IOU_LOSSES)
def test_huge_logits_give_finite_delta_and_stats(any_math_device, iou_loss):
    # +-1e4 logits: sizes exp(1e4) (the CPU's infinite boxes) and exp(-1e4) = 0, saturated
    # objectness and classes.
    head = YoloHead()
    output, truths = head.draw(np.random.default_rng(10))
    x = np.random.default_rng(10).choice([-1e4, 1e4], output.shape).astype(np.float32)
    yl.yolo_forward(x, output, 3, 3, 1.05, False)
    result = run_case(any_math_device, _loss_case("huge_logits", output, truths,
                                                  _extreme_options(head, iou_loss)))
    for name in ("delta", "stats"):
        assert np.isfinite(result.outputs[name]).all(), name
    assert result.ok, result.failures


@pytest.mark.parametrize("iou_loss", ["iou", "giou", "ciou"])
def test_large_finite_sizes_give_the_cpus_finite_deltas(any_math_device, iou_loss, request):
    # Raw sizes up to +-90: predictions from huge to infinite (exp overflows past 88.72),
    # intermediate products overflowing in the IoU gradients (zeroed, as on the CPU). The
    # deltas stay finite; their squares may not (so may the CPU's total loss). The fast-math
    # build rounds the IoU gradients differently: a tolerance there.
    head = YoloHead()
    output, truths = head.draw(np.random.default_rng(11))
    rng = np.random.default_rng(11)
    sizes = output.reshape(3, 3, 8, 5, 7)[:, :, 2:4]
    sizes[:] = rng.uniform(-90, 90, sizes.shape)
    sizes[:, :, :, 2] = rng.uniform(88.5, 89, sizes[:, :, :, 2].shape)
    exact = "fast_math" not in request.node.name
    result = run_case(any_math_device, _loss_case("large_sizes", output, truths,
                                                  _extreme_options(head, iou_loss),
                                                  0 if exact else None))
    assert np.isfinite(result.outputs["delta"]).all()
    assert result.ok, result.failures


@pytest.mark.skipif(not YOLO_CASES, reason="needs ../shared/golden/darknet-v5-train")
@pytest.mark.parametrize("golden_case", YOLO_CASES)
def test_reproduces_the_golden_darknet_deltas(emu_device, golden_case):
    emu_device.set_thread_order("random", seed=7)
    for stem, options, output, truths, golden, head, _ in yolo_passes(golden_case):
        result = run_case(emu_device, _loss_case(stem, output, truths, options, max_ulps=4))
        named = _stats(result)
        delta = result.outputs["delta"]
        # What the CPU reference achieves against Darknet itself (tests/cpu/test_yolo_loss.py).
        assert rel_l2(delta, golden) <= 1e-4, stem
        assert float(np.abs(delta - golden).max()) <= 1e-6, stem
        assert abs(named["cost"] - head["cost"]) <= 1e-5 * head["cost"], stem
        assert named["count"] == head["count"], stem
        assert named["avg_iou"] == pytest.approx(head["avg_iou"], rel=1e-5, abs=1e-6), stem
