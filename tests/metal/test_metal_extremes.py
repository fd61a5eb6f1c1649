"""Kernels on extreme inputs, on the IEEE and the -ffast-math builds of the shaders (Metal
compiles with fast math unless told otherwise, and its compiler may then assume NaN and
infinity away): saturating activations and derivatives, batch norm around large offsets,
softmax-normalised shortcut weights of +-1e4, losses of vanishing probabilities, and the
finiteness flag. Finite wherever the CPU reference is, and close to it. The kernels on
ordinary inputs, on the emulator the package ships: test_metal_cases.py."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS, HarnessDevice

from darknet_metal.cpu import heads
from darknet_metal.diagnostics.kernel_cases import case
from darknet_metal.diagnostics.kernel_cases.activation import (
    ELEMENTWISE,
    activated,
    derivative_argument,
    gradient,
    gradient_tolerance,
)
from darknet_metal.diagnostics.kernel_cases.batchnorm import (
    backward_arrays,
    backward_steps,
    backward_train,
    batchnorm_args,
    forward_arrays,
    forward_steps,
    forward_train,
    layout,
)
from darknet_metal.diagnostics.kernel_cases.combine import shortcut_backward_case
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    KernelCase,
    RelL2,
    nonzero,
    normal,
    run_case,
)
from darknet_metal.model.activations import ACTIVATION_ID

SATURATING = np.array(
    [1e4, -1e4, 88.8, -88.8, 88.72283, -88.72284, 44.5, -44.5, 20.0, -20.0, 9.5, -9.5,
     0.0, -0.0, 1e-30, -1e-30, 3.0e38, -3.0e38],
    np.float32,
)


def test_activations_stay_finite_on_saturating_inputs(any_math_runner):
    # exp overflow must not turn into NaN.
    x = np.array([1e4, -1e4, 88.8, -88.8, 100.0, -100.0, 0.0, 30.0, -30.0], np.float32)
    for name in ELEMENTWISE:
        y = np.full(x.shape, np.nan, np.float32)
        any_math_runner.run("activation_fwd_f32", {"n": x.size, "act": ACTIVATION_ID[name]},
                            {"x": x, "y": y}, {"n": x.size})
        assert np.isfinite(y).all(), (name, y)
        np.testing.assert_allclose(y, activated(x, name), rtol=2e-5, atol=1e-6, err_msg=name)


def test_activation_bwd_saturating_inputs_stay_finite(any_math_runner, request):
    """Extreme derivative arguments, given as outputs and as inputs alike: finite wherever
    the reference is (on both builds), and as close as elsewhere on the IEEE build."""
    ieee = "ieee" in request.node.callspec.id
    n = SATURATING.size
    delta0 = nonzero(np.random.default_rng(4), n)
    for name in ELEMENTWISE:
        for v in (SATURATING, derivative_argument(SATURATING, name)):
            with np.errstate(all="ignore"):
                want = gradient(v, name, delta0)
            got = delta0.copy()
            any_math_runner.run("activation_bwd_f32", {"n": n, "act": ACTIVATION_ID[name]},
                                {"y_or_x": v, "delta": got}, {"n": n})
            finite = np.isfinite(want)
            assert np.isfinite(got[finite]).all(), (name, v[~np.isfinite(got) & finite])
            # Fast math may reassociate the compensated sums: close, not bit-equal.
            tolerance = gradient_tolerance(name, delta0[finite], 1.0 if ieee else 1000.0)
            assert tolerance.holds(got[finite], want[finite]), name


@pytest.mark.parametrize("shape", [(2, 5, 7, 7), (6, 9)])
def test_batchnorm_extreme_inputs_stay_finite(any_math_device, shape):
    """Inputs of +-1e4 around a large offset: the forward within 1e-5 and the backward
    within 1e-4 relative L2 of the CPU's (which a non-finite value fails)."""
    n, c, spatial = layout(shape)

    def forward(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 1e4, 5e3)
        scale, bias = normal(rng, c), normal(rng, c)
        rolling = (np.zeros(c, np.float32), np.ones(c, np.float32))
        want = forward_train(x, scale, bias, rolling, 0.9)
        # x_norm is the CPU's alone: the device recomputes it for the backward.
        return CaseData(forward_arrays(x, scale, bias, rolling),
                        tuple(Check(name, w, RelL2(1e-5)) for name, w in want.items()
                              if name != "x_norm"))

    def backward(rng: np.random.Generator) -> CaseData:
        arrays = backward_arrays(rng, shape, 1e4, -5e3)
        want = backward_train(arrays, False)
        return CaseData(arrays, tuple(Check(name, w, RelL2(1e-4)) for name, w in want.items()))

    args = batchnorm_args(n, c, spatial, momentum=0.9)
    for kernel_case in (KernelCase("forward", forward_steps(shape, args), forward),
                        KernelCase("backward", backward_steps(shape, args), backward)):
        result = run_case(any_math_device, kernel_case)
        assert result.ok, (kernel_case.name, result.failures)


@pytest.mark.parametrize("norm", ["relu", "softmax"])
def test_shortcut_saturating_weights(any_math_device, norm):
    # Weights of +-1e4: softmax's exp underflows to 0 without overflowing anywhere.
    kernel_case = shortcut_backward_case("per_channel", norm, weight_scale=1e4)
    data = kernel_case.build()
    outputs = run_case(any_math_device, kernel_case, data).outputs
    for check in data.checks:
        got = outputs[check.array]
        assert np.isfinite(got).all(), check.array
        np.testing.assert_allclose(got, check.want, rtol=1e-5, atol=1e-4, err_msg=check.array)


def test_loss_heads_extreme_inputs(any_math_runner):
    # Cross-entropy on probabilities down to 1e-30; squared error on values of +-1e4.
    cases = (
        ("softmax_fwd_xent_f32", heads.softmax_cross_entropy,
         [1e-30, 1.0, 0.5, 3e-8, 0.25, 1e-37], [1.0, 1.0, 0.0, 1.0, 0.0, 0.5]),
        ("cost_fwd_sse_f32", heads.cost_sse,
         [1e4, -1e4, 0.5, 3e-8, -0.0, 1e4], [-1e4, 1e4, 0.0, 1.0, 0.0, 1e4]),
    )
    for name, cpu, pred, truth in cases:
        pred = np.array([pred], np.float32)
        truth = np.array([truth], np.float32)
        want_d, want_l = np.empty_like(pred), np.empty_like(pred)
        cpu(pred, truth, want_d, want_l)
        delta, loss = np.full_like(pred, np.nan), np.full_like(pred, np.nan)
        any_math_runner.run(name, {"n": pred.size},
                            {"pred": pred, "truth": truth, "delta": delta, "loss": loss},
                            {"n": pred.size})
        assert np.isfinite(loss).all() and np.isfinite(delta).all(), name
        np.testing.assert_array_equal(delta, want_d, err_msg=name)
        np.testing.assert_allclose(loss, want_l, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("n", [1, 7, 70001])
def test_finite_flag_on_the_fast_math_build(fast_math_runner, n):
    device = HarnessDevice(fast_math_runner.emu)
    for order in ORDERS:
        device.set_thread_order(order, 7)
        result = run_case(device, case(f"finite_buf_f32-n{n}"))
        assert result.ok, (order, result.failures)


def test_the_fast_math_build_leaves_subnormals_alone(fast_math_runner):
    # Loading it must not switch the process to flush-to-zero (the CPU reference would change).
    tiny = np.array([1e-40], np.float32)
    assert (tiny * np.float32(1.0))[0] != 0.0
    assert fast_math_runner is not None
