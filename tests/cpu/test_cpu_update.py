"""Parameter updates (``darknet_metal.cpu.update``): Darknet's SGD, Adam, the finiteness check.

References: the parameters and momentum buffers of the real Darknet V5 after every update of
its training cases (../shared/golden/darknet-v5-train), reproduced bit for bit from the
previous parameters, the dumped accumulators and the rate of the case's cfg; a NumPy float64
Adam; NumPy formulas in the kernel's operation order (float32 fused multiply-adds through
``darknet_metal.fp32.fma32``). Steps run alone and through ``StepList``.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import np_adam_update, np_sgd_update
from training_golden import CASES, TRAIN, cfg_net_values, read_golden

from darknet_metal.cpu import executor, update
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.fp32 import fma32
from darknet_metal.trainer import learning_rate

DTYPES = [np.float32, np.float64]
# Darknet's accumulator names per parameter kind; decay applies to weights only.
KINDS = {"weights": ("weight", True), "biases": ("bias", False), "scales": ("scale", False)}


def _rand(shape, seed, dtype=np.float32, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _scalar(value, dtype=np.float32):
    return np.array([value], dtype)


def _run(steps):
    executor.StepList(steps if isinstance(steps, list) else [steps], None).run()


def _ulps(a, b) -> int:
    """Largest distance in units in the last place between two float32 arrays."""
    def ordered(x):
        i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(2**31) - i, i)

    return int(np.max(np.abs(ordered(a) - ordered(b)), initial=0))


# ---------------------------------------------------------------------------------------
# Darknet's updates, bit for bit


@pytest.fixture(scope="module")
def golden():
    return read_golden()


@pytest.mark.parametrize("case", CASES)
def test_sgd_reproduces_darknet_bit_for_bit(golden, case):
    # A trainer's loop: steps bound once to the live parameters and accumulators; before
    # each update the rate goes into lr_buffer and the iteration's accumulator into grad_acc.
    data = golden.load_case(str(TRAIN / case))
    index, arrays = data["index"], data["arrays"]
    net = cfg_net_values(TRAIN / case / index["cfg"])
    lr = _scalar(0.0)
    live, steps = {}, []
    for layer, params in arrays["init.weights"].items():
        for kind, (_, decayed) in KINDS.items():
            if layer == "header" or kind not in params:
                continue
            w = params[kind].copy()
            wu = np.zeros_like(w)
            live[layer, kind] = (w, wu)
            steps.append(update.sgd_update_step(w, wu, lr, net["decay"], net["momentum"],
                                                net["batch"], decayed))
    assert len(steps) >= 10
    program = executor.StepList(steps, None)
    checked = 0
    for record in index["steps"]:
        k = record["step"]
        assert record["update_batch"] == net["batch"]
        lr[0] = learning_rate(net, k)
        assert lr[0] == np.float32(record["rate"])
        for (layer, kind), (w, wu) in live.items():
            np.copyto(wu, arrays[f"s{k}_{layer}_{KINDS[kind][0]}_updates"].reshape(w.shape))
        program.run()
        after = arrays[f"step{k}.weights"]
        for (layer, kind), (w, wu) in live.items():
            momentum = arrays[f"s{k}_{layer}_{KINDS[kind][0]}_updates_after_update"]
            for name, got, want in [("param", w, after[layer][kind]),
                                    ("momentum", wu, momentum.reshape(w.shape))]:
                assert _ulps(got, want) == 0, f"step {k} {layer} {kind} {name}"
                checked += got.size
    assert checked > 5000


def test_the_golden_check_tells_fused_from_unfused_arithmetic(golden):
    # Rounding a*x and then a*x + y in float32 misses Darknet's weights; the check above
    # would see it.
    arrays = golden.load_case(str(TRAIN / "micro-layers"))["arrays"]
    f = np.float32
    rate, shrink = f(f(0.001) / f(4)), f(-f(0.0005) * f(4))
    fused = unfused = 0
    for layer, params in arrays["init.weights"].items():
        if "weights" not in params:
            continue
        w, want = params["weights"], arrays["step1.weights"][layer]["weights"]
        wu = arrays[f"s1_{layer}_weight_updates"].reshape(w.shape)
        unfused += np.count_nonzero(rate * (shrink * w + wu) + w != want)
        fused += np.count_nonzero(fma32(rate, fma32(shrink, w, wu), w) != want)
    assert fused == 0 and unfused > 100


# ---------------------------------------------------------------------------------------
# SGD


@pytest.mark.parametrize("apply_decay", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (5, 3, 3, 3), (9, 11), (0,)])
def test_sgd_matches_the_formula_exactly(shape, dtype, apply_decay):
    w, wu = _rand(shape, 1, dtype), _rand(shape, 2, dtype, 40.0)
    want_w, want_wu = np_sgd_update(w, wu, 0.013, 0.0005, 0.9, 6, apply_decay, 0.5)
    update.sgd_update(w, wu, _scalar(0.013, dtype), 0.0005, 0.9, 6, apply_decay, 0.5)
    np.testing.assert_array_equal(w, want_w)
    np.testing.assert_array_equal(wu, want_wu)


def test_sgd_is_pytorch_sgd_with_momentum_and_weight_decay():
    # With g = -wu/B the mean gradient: v = momentum*v + g + decay*w; w -= lr*v.
    w, grad = _rand((13,), 3, np.float64), _rand((13,), 4, np.float64)
    lr, momentum, decay, batch = 0.01, 0.9, 5e-4, 8
    wu, v, w_ref = np.zeros(13), np.zeros(13), w.copy()
    for _ in range(3):
        wu += -grad * batch  # Darknet's accumulator: the negative summed gradient
        update.sgd_update(w, wu, _scalar(lr, np.float64), decay, momentum, batch, True)
        v = momentum * v + grad + decay * w_ref
        w_ref = w_ref - lr * v
    np.testing.assert_allclose(w, w_ref, rtol=1e-12)


def test_float32_and_float64_agree():
    w64, wu64 = _rand((31, 17), 5, np.float64), _rand((31, 17), 6, np.float64, 10.0)
    w32, wu32 = w64.astype(np.float32), wu64.astype(np.float32)
    for w, wu, dtype in [(w64, wu64, np.float64), (w32, wu32, np.float32)]:
        update.sgd_update(w, wu, _scalar(0.1, dtype), 0.001, 0.9, 4, True)
    np.testing.assert_allclose(w32, w64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(wu32, wu64, rtol=1e-5, atol=1e-5)


def test_a_bound_step_reads_the_rate_when_it_runs():
    w, wu = _rand((40,), 7), _rand((40,), 8)
    w2, wu2 = w.copy(), wu.copy()
    lr = _scalar(0.0)
    step = update.sgd_update_step(w, wu, lr, 0.0005, 0.9, 2, True)
    for rate in (0.1, 0.001, 0.0):
        lr[0] = rate
        step.run()
        update.sgd_update(w2, wu2, _scalar(rate), 0.0005, 0.9, 2, True)
        np.testing.assert_array_equal(w, w2)
        np.testing.assert_array_equal(wu, wu2)


def test_parameters_and_accumulators_may_share_one_arena():
    # A trainer may keep every array in one allocation: disjoint slices are not overlaps.
    arena = _rand((60,), 9)
    w, wu = arena[:30].copy(), arena[30:].copy()
    update.sgd_update(w, wu, _scalar(0.5), 0.01, 0.9, 3, True)
    _run(update.sgd_update_step(arena[:30], arena[30:], _scalar(0.5), 0.01, 0.9, 3, True))
    np.testing.assert_array_equal(arena, np.concatenate([w, wu]))


# ---------------------------------------------------------------------------------------
# Adam


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-13), (np.float32, 2e-6)])
def test_adam_follows_a_float64_oracle_over_three_steps(dtype, rtol):
    shape, batch, decay, b1, b2, eps = (6, 5, 3), 4, 0.0005, 0.9, 0.999, 1e-6
    w_ref = _rand(shape, 11, np.float64)
    m_ref, v_ref = np.zeros(shape), np.zeros(shape)
    w, m, v = w_ref.astype(dtype), np.zeros(shape, dtype), np.zeros(shape, dtype)
    wu = np.zeros(shape, dtype)
    lr, t = _scalar(0, dtype), _scalar(0, dtype)
    step = update.adam_update_step(w, wu, m, v, lr, t, decay, b1, b2, eps, batch)
    for it, rate in [(1, 0.01), (2, 0.02), (3, 0.005)]:
        grad = _rand(shape, 20 + it, np.float64, 3.0)
        wu[...] = grad
        lr[0], t[0] = rate, it
        step.run()
        w_ref, m_ref, v_ref = np_adam_update(w_ref, grad, m_ref, v_ref, rate, it, decay, b1, b2,
                                           eps, batch)
        assert not wu.any(), "Adam leaves the accumulator at 0"
        np.testing.assert_allclose(m, m_ref, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(v, v_ref, rtol=rtol, atol=rtol)
        # The parameter moves by about lr a step: compare with that scale.
        np.testing.assert_allclose(w, w_ref, rtol=rtol, atol=rtol * 10)


def test_adam_decays_and_steps_against_the_gradient_sign():
    # Darknet's accumulators are negative gradients: a positive wu moves w up.
    w = np.full(4, 2.0)
    wu = np.array([1.0, -1.0, 0.0, 0.0])
    m, v = np.zeros(4), np.zeros(4)
    update.adam_update(w, wu, m, v, _scalar(0.1, np.float64), _scalar(1, np.float64),
                       0.0, 0.9, 0.999, 1e-8, 1)
    np.testing.assert_allclose(w, [2.1, 1.9, 2.0, 2.0], rtol=1e-6)
    # With decay alone (no gradient) every parameter shrinks towards 0.
    w, wu = np.array([2.0, -3.0]), np.zeros(2)
    update.adam_update(w, wu, np.zeros(2), np.zeros(2), _scalar(0.1, np.float64),
                       _scalar(1, np.float64), 0.01, 0.9, 0.999, 1e-8, 4)
    np.testing.assert_allclose(w, [1.9, -2.9], rtol=1e-6)


# ---------------------------------------------------------------------------------------
# finiteness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [0, 13, 96])
def test_all_finite_finds_every_non_finite_value(dtype, bad, at):
    x = _rand((97,), 12, dtype, 1e30)
    assert update.all_finite(x)
    x[at] = bad
    flag = _scalar(1, dtype)
    _run(update.all_finite_step(x, flag))
    assert flag[0] == 0 and not update.all_finite(x)


def test_all_finite_only_clears_the_flag():
    finite = _rand((5, 3), 13)
    flag = _scalar(0)
    _run(update.all_finite_step(finite, flag))
    assert flag[0] == 0, "a later finite array does not undo an earlier failure"
    flag[0] = 1
    _run(update.all_finite_step(finite, flag))
    assert flag[0] == 1
    empty = np.zeros((0,), np.float32)
    assert update.all_finite(empty)
    big = np.full(3, np.finfo(np.float32).max, np.float32)
    assert update.all_finite(big)


def test_a_diverging_update_is_detected():
    # One pass: the update, then the check of what it wrote. A huge rate overflows float32.
    w, wu = _rand((50,), 14), _rand((50,), 15, np.float32, 1e3)
    lr, flag = _scalar(0.01), _scalar(1)
    program = executor.StepList([update.sgd_update_step(w, wu, lr, 0.0005, 0.9, 1, True),
                                 update.all_finite_step(w, flag)], None)
    program.run()
    assert flag[0] == 1
    lr[0] = 1e38
    program.run()
    assert flag[0] == 0 and not np.all(np.isfinite(w))


# ---------------------------------------------------------------------------------------
# arguments


def _sgd_args(**change):
    args = {"param": np.zeros((3, 4), np.float32), "grad_acc": np.zeros((3, 4), np.float32),
            "lr_buffer": _scalar(0.1), "decay": 0.0005, "momentum": 0.9, "batch": 4,
            "apply_decay": True}
    args.update(change)
    return args


def _readonly(shape):
    a = np.zeros(shape, np.float32)
    a.flags.writeable = False
    return a


_SHARED = np.zeros((3, 4), np.float32)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"param": [1.0]}, ArgumentTypeError, ["param", "numpy array"]),
        ({"param": np.zeros((3, 4), np.int32)}, ArgumentError, ["param", "int32"]),
        ({"param": _readonly((3, 4))}, ArgumentError, ["param", "writable"]),
        ({"param": np.zeros((4, 3), np.float32).T}, ArgumentError, ["param", "C-contiguous"]),
        ({"grad_acc": np.zeros((4, 3), np.float32)}, ArgumentError, ["grad_acc", "(4, 3)"]),
        ({"grad_acc": np.zeros((3, 4))}, ArgumentError, ["grad_acc", "float64"]),
        ({"param": _SHARED, "grad_acc": _SHARED}, ArgumentError, ["param", "grad_acc",
                                                                  "overlap"]),
        ({"lr_buffer": np.zeros(2, np.float32)}, ArgumentError, ["lr_buffer", "one value"]),
        ({"lr_buffer": _scalar(0.1, np.float64)}, ArgumentError, ["lr_buffer", "float64"]),
        ({"lr_buffer": np.zeros((1, 1), np.float32)}, ArgumentError, ["lr_buffer", "(1,)"]),
        ({"decay": -1.0}, ArgumentError, ["decay", "-1.0"]),
        ({"momentum": float("nan")}, ArgumentError, ["momentum", "nan"]),
        ({"batch": 0}, ArgumentError, ["batch", "0"]),
        ({"lr_scale": float("inf")}, ArgumentError, ["lr_scale", "inf"]),
    ],
)
def test_sgd_bad_arguments_are_named(change, error, words):
    with pytest.raises(error) as info:
        update.sgd_update_step(**_sgd_args(**change))
    for word in words:
        assert word in str(info.value)


def _adam_args(**change):
    shape = (2, 5)
    args = {"param": np.zeros(shape), "grad_acc": np.zeros(shape), "m": np.zeros(shape),
            "v": np.zeros(shape), "lr_buffer": _scalar(0.1, np.float64),
            "t_buffer": _scalar(1, np.float64), "decay": 0.0005, "B1": 0.9, "B2": 0.999,
            "eps": 1e-6, "batch": 4}
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"m": np.zeros((2, 5), np.float32)}, ArgumentError, ["m", "float32"]),
        ({"v": np.zeros(10)}, ArgumentError, ["v", "(10,)"]),
        ({"v": None}, ArgumentTypeError, ["v", "numpy array"]),
        ({"t_buffer": np.zeros(3)}, ArgumentError, ["t_buffer", "one value"]),
        ({"B1": 1.0}, ArgumentError, ["B1", "1.0"]),
        ({"B2": -0.1}, ArgumentError, ["B2", "-0.1"]),
        ({"eps": 0.0}, ArgumentError, ["eps", "0.0"]),
        ({"batch": -3}, ArgumentError, ["batch", "-3"]),
    ],
)
def test_adam_bad_arguments_are_named(change, error, words):
    with pytest.raises(error) as info:
        update.adam_update_step(**_adam_args(**change))
    for word in words:
        assert word in str(info.value)


def test_adam_state_must_not_overlap():
    arena = np.zeros(20)
    args = _adam_args(m=arena[:10].reshape(2, 5), v=arena[5:15].reshape(2, 5))
    with pytest.raises(ArgumentError, match="m and v must not overlap"):
        update.adam_update_step(**args)


def test_all_finite_bad_arguments_are_named():
    with pytest.raises(ArgumentError, match="flag_buffer must have the dtype of array"):
        update.all_finite_step(np.zeros(3, np.float32), np.ones(1))
    with pytest.raises(ArgumentError, match="flag_buffer must be writable"):
        update.all_finite_step(np.zeros(3, np.float32), _readonly((1,)))
    with pytest.raises(ArgumentTypeError, match="array must be a numpy array"):
        update.all_finite("x")


def test_the_kernels_use_native_steps():
    steps = [update.sgd_update_step(**_sgd_args()),
             update.adam_update_step(**_adam_args()),
             update.all_finite_step(np.zeros(2), np.ones(1))]
    assert [s.kind for s in steps] == ["sgd_update", "adam_update", "all_finite"]
    assert [s.dtype for s in steps] == [np.float32, np.float64, np.float64]
