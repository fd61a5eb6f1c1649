"""The elementwise training kernels (``shaders/{activation,buffers,dropout,update}.metal``) in
the Metal emulator against the CPU reference steps: activation derivatives, buffer utilities,
dropout and its counter-based draws, SGD and Adam updates, the finiteness flag. Every dispatch
runs under the three thread orders, which must agree bit for bit, at sizes that leave partial
threadgroups and above 2^16 elements."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS

from darknet_metal.cpu import activations as cpu_act
from darknet_metal.cpu import dropout, fill, update
from darknet_metal.model.activations import ACTIVATION_ID, ACTIVATIONS, CHANNEL_ACTIVATIONS

EPS = float(np.finfo(np.float32).eps)
SIZES = (1, 7, 70001)
# Derivatives taken from the activation's input (the others take its output).
FROM_INPUT = {"gelu", "mish", "swish", "hard_mish"}
# The reference computes parts of these in double: they agree to a few ulps of the terms.
ROUNDED = {"gelu", "mish"}
ELEMENTWISE = [a for a in ACTIVATIONS if a not in CHANNEL_ACTIVATIONS]


def _rand(shape, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _nonzero(shape, seed):
    """Random values bounded away from zero (initial contents of accumulated outputs)."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def _run_orders(runner, name, args, buffers, sizes, outputs):
    """Run ``name`` once per thread order, each time on fresh copies of ``buffers``; the
    outputs must be bit-identical across orders. Returns them (from the first order)."""
    results = []
    for order in ORDERS:
        bufs = {role: b.copy() for role, b in buffers.items()}
        runner.run(name, args, bufs, sizes, order=order)
        results.append({role: bufs[role].copy() for role in outputs})
    for other in results[1:]:
        for role in outputs:
            assert other[role].tobytes() == results[0][role].tobytes(), (name, role)
    return results[0]


def _derivative_argument(x, name):
    """What the derivative takes: the input for FROM_INPUT, else the output f(x)."""
    v = x.copy()
    if name not in FROM_INPUT:
        cpu_act.activate(v.reshape(1, -1), name)
    return v


def _activation_inputs(n, seed):
    x = _rand(n, seed)
    special = [0.0, -0.0, 1.0, -1.0, 20.5, -20.5, 4.0, -4.0, 2.5, 6.0, -2.0, 0.5]
    x[: min(n, len(special))] = special[:n]
    if n > 2000:
        x[100:1100] = np.linspace(-30.0, 30.0, 1000, dtype=np.float32)
    return x


def _assert_gradient_close(got, want, delta, name, scale=1.0):
    """Bit-equal for the activations computed in float by both; for ROUNDED, within 4 ulps of
    the derivative plus one ulp of 1 (the size of the terms it sums) times |delta|."""
    if name not in ROUNDED and scale == 1.0:
        np.testing.assert_array_equal(got, want, err_msg=name)
        return
    err = np.abs(got.astype(np.float64) - want)
    tol = scale * (4 * EPS * np.abs(want.astype(np.float64)) + EPS * np.abs(delta))
    bad = np.flatnonzero(~(err <= tol))
    assert bad.size == 0, (name, bad[:5], got[bad[:5]], want[bad[:5]])


# ---- activation derivatives --------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_activation_bwd(emu_runner, n):
    x = _activation_inputs(n, 0)
    delta0 = _nonzero(n, 1)
    for name in ELEMENTWISE:
        act = ACTIVATION_ID[name]
        v = _derivative_argument(x, name)
        want = delta0.copy().reshape(1, -1)
        cpu_act.gradient(v.reshape(1, -1), act, want)
        got = _run_orders(
            emu_runner,
            "activation_bwd_f32",
            {"n": n, "act": act},
            {"y_or_x": v, "delta": delta0},
            {"n": n},
            ["delta"],
        )["delta"]
        _assert_gradient_close(got, want.reshape(-1), delta0, name)


def test_activation_bwd_channel_ids_and_tail_untouched(emu_runner):
    x = _rand(300, 2)
    buf = np.concatenate([_nonzero(300, 3), np.full(5, 123.0, np.float32)])
    before = buf.copy()
    for name in sorted(CHANNEL_ACTIVATIONS):  # left to normalize_channels*_bwd_f32
        emu_runner.run("activation_bwd_f32", {"n": 300, "act": ACTIVATION_ID[name]},
                       {"y_or_x": x, "delta": buf}, {"n": 300})
    np.testing.assert_array_equal(buf, before)
    emu_runner.run("activation_bwd_f32", {"n": 300, "act": ACTIVATION_ID["relu"]},
                   {"y_or_x": x, "delta": buf}, {"n": 300})
    np.testing.assert_array_equal(buf[:300], before[:300] * (x > 0))
    assert (buf[300:] == 123.0).all()


SATURATING = np.array(
    [1e4, -1e4, 88.8, -88.8, 88.72283, -88.72284, 44.5, -44.5, 20.0, -20.0, 9.5, -9.5,
     0.0, -0.0, 1e-30, -1e-30, 3.0e38, -3.0e38],
    np.float32,
)


def test_activation_bwd_saturating_inputs_stay_finite(any_math_runner, request):
    """Extreme derivative arguments, given as outputs and as inputs alike: finite wherever
    the reference is (on both builds), and as close as elsewhere on the IEEE build."""
    ieee = "ieee" in request.node.callspec.id
    n = SATURATING.size
    delta0 = _nonzero(n, 4)
    for name in ELEMENTWISE:
        for v in (SATURATING, _derivative_argument(SATURATING, name)):
            act = ACTIVATION_ID[name]
            want = delta0.copy().reshape(1, -1)
            with np.errstate(all="ignore"):
                cpu_act.gradient(v.reshape(1, -1), act, want)
            want = want.reshape(-1)
            got = delta0.copy()
            any_math_runner.run("activation_bwd_f32", {"n": n, "act": act},
                                {"y_or_x": v, "delta": got}, {"n": n})
            finite = np.isfinite(want)
            assert np.isfinite(got[finite]).all(), (name, v[~np.isfinite(got) & finite])
            if ieee:
                _assert_gradient_close(got[finite], want[finite], delta0[finite], name)
            else:
                # Fast math may reassociate the compensated sums: close, not bit-equal.
                _assert_gradient_close(got[finite], want[finite], delta0[finite], name, 1000.0)


@pytest.mark.parametrize("shape", [(2, 7, 5, 3), (1, 3, 13, 13), (3, 5, 1, 1), (1, 1, 9, 9)])
def test_normalize_channels_bwd(emu_runner, shape):
    x = _rand(shape, 5)
    delta0 = _rand(shape, 6)
    n, c, h, w = shape
    for name in sorted(CHANNEL_ACTIVATIONS):
        y = x.copy()
        cpu_act.activate(y, name)
        if name == "normalize_channels":
            y[0, 0, 0, 0] = 0.0  # a zero output keeps its delta
        want = delta0.copy()
        cpu_act.gradient(y, name, want)
        got = _run_orders(
            emu_runner,
            f"{name}_bwd_f32",
            {"batch": n, "channels": c, "spatial": h * w},
            {"y": y, "delta": delta0},
            {"spatial": h * w, "batch": n},
            ["delta"],
        )["delta"]
        # The per-pixel sum runs in channel order as in the reference.
        np.testing.assert_array_equal(got, want, err_msg=name)


# ---- buffer utilities ----------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_fill_copy_add(emu_runner, n):
    want = np.empty(n, np.float32)
    fill.fill_step(want, -2.75).run()
    got = _run_orders(emu_runner, "fill_buf_f32", {"n": n, "value": -2.75},
                      {"x": np.full(n, np.nan, np.float32)}, {"n": n}, ["x"])["x"]
    np.testing.assert_array_equal(got, want)

    src = _rand(n, 7)
    want = np.full(n, np.nan, np.float32)
    fill.copy_step(src, want).run()
    got = _run_orders(emu_runner, "copy_buf_f32", {"n": n},
                      {"src": src, "dst": np.full(n, np.nan, np.float32)},
                      {"n": n}, ["dst"])["dst"]
    np.testing.assert_array_equal(got, want)

    dst0 = _rand(n, 8)
    for scale in (1.0, 0.37, -3.0):
        want = dst0.copy()
        fill.add_step(src, want, scale).run()
        if scale == 1.0:
            np.testing.assert_array_equal(want, dst0 + src)
        got = _run_orders(emu_runner, "add_buf_f32", {"n": n, "scale": scale},
                          {"src": src, "dst": dst0}, {"n": n}, ["dst"])["dst"]
        np.testing.assert_array_equal(got, want, err_msg=str(scale))


# ---- dropout -------------------------------------------------------------------------------


def _counter_words(value):
    """A uint64 counter as the kernels hold it: two uint32 words, low first."""
    return np.array([value], np.uint64).view(np.uint32).copy()


@pytest.mark.parametrize("n", [7, 65537, 70001])
@pytest.mark.parametrize("seed", [0, 12345, 2**64 - 1])
def test_uniform_draws_equal_the_reference(emu_runner, n, seed):
    for start in (0, 1, 41, 2**32 - 1, 2**63 + 5, 2**64 - 1):
        counter = np.array([start], np.uint64)
        want = np.full(n, np.nan, np.float32)
        dropout.uniform_fill(want, seed, counter)
        words = _counter_words(start)
        got = _run_orders(
            emu_runner,
            "uniform_buf_f32",
            {"n": n, "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32},
            {"counter": words, "rand": np.full(n, np.nan, np.float32)},
            {"n": n},
            ["rand", "counter"],
        )
        np.testing.assert_array_equal(got["rand"], want, err_msg=str(start))
        assert got["counter"].tobytes() == words.tobytes()  # only read


def test_uniform_passes_draw_anew_with_the_counter_advanced_between_them(emu_runner):
    """Three passes of (draw, advance) as a command buffer would encode them reproduce three
    runs of the reference step, counter included (carry into the high word)."""
    n, seed = 1001, 99
    start = 2**32 - 2
    counter = np.array([start], np.uint64)
    words = _counter_words(start)
    args = {"n": n, "seed_lo": seed, "seed_hi": 0}
    for _ in range(3):
        want = np.empty(n, np.float32)
        dropout.uniform_fill(want, seed, counter)
        got = np.full(n, np.nan, np.float32)
        emu_runner.run("uniform_buf_f32", args, {"counter": words, "rand": got}, {"n": n})
        emu_runner.run("uniform_buf_advance_f32", {"count": 1}, {"counter": words}, {"count": 1})
        np.testing.assert_array_equal(got, want)
        assert words.tobytes() == counter.tobytes()


def test_uniform_advance_several_counters(emu_runner):
    starts = [0, 7, 2**32 - 1, 2**64 - 1, 2**40 + 3]
    words = np.array(starts, np.uint64).view(np.uint32)
    got = _run_orders(emu_runner, "uniform_buf_advance_f32", {"count": len(starts)},
                      {"counter": words}, {"count": len(starts)}, ["counter"])
    want = (np.array(starts, np.uint64) + np.uint64(1)).view(np.uint32)  # wraps at 2^64
    np.testing.assert_array_equal(got["counter"], want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("probability", [0.0, 0.3, 0.5, 0.9])
def test_dropout_fwd_and_bwd(emu_runner, n, probability):
    rand = np.empty(n, np.float32)
    dropout.uniform_fill(rand, 3, np.zeros(1, np.uint64))
    rand[: min(n, 2)] = np.float32(probability)  # a draw equal to p keeps its element
    x0 = _rand(n, 9)
    p32 = np.float32(probability)
    args = {"n": n, "probability": p32, "scale": np.float32(1.0 / (1.0 - float(p32)))}
    for name, role, reference in (
        ("dropout_fwd_train_f32", "x", dropout.dropout_forward_train),
        ("dropout_bwd_f32", "delta", dropout.dropout_backward),
    ):
        want = x0.copy()
        reference(want, rand, probability)
        got = _run_orders(emu_runner, name, args, {"rand": rand, role: x0},
                          {"n": n}, [role])[role]
        np.testing.assert_array_equal(got, want, err_msg=name)


# ---- optimizer updates ---------------------------------------------------------------------


def _sgd_args(n, decay, momentum, batch, apply_decay, lr_scale):
    return {"n": n, "batch": batch, "apply_decay": int(apply_decay), "decay": decay,
            "momentum": momentum, "lr_scale": lr_scale}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("apply_decay", [True, False])
def test_sgd_bit_equal_over_successive_updates(emu_runner, n, apply_decay):
    decay, momentum, batch, lr_scale = 0.0005, 0.9, 64, 0.5
    w_cpu, wu_cpu = _rand(n, 10, 0.1), _rand(n, 11, 2.0)
    w_gpu, wu_gpu = w_cpu.copy(), wu_cpu.copy()
    args = _sgd_args(n, decay, momentum, batch, apply_decay, lr_scale)
    for it, lr in enumerate((0.001, 0.0026, 0.01)):
        lr_buf = np.array([lr], np.float32)
        update.sgd_update(w_cpu, wu_cpu, lr_buf, decay, momentum, batch, apply_decay, lr_scale)
        got = _run_orders(emu_runner, "sgd_upd_f32", args,
                          {"lr": lr_buf, "param": w_gpu, "grad_acc": wu_gpu},
                          {"n": n}, ["param", "grad_acc"])
        w_gpu, wu_gpu = got["param"], got["grad_acc"]
        np.testing.assert_array_equal(w_gpu, w_cpu, err_msg=f"param, update {it}")
        np.testing.assert_array_equal(wu_gpu, wu_cpu, err_msg=f"grad_acc, update {it}")
        wu_cpu += _rand(n, 20 + it, 2.0)  # the next iteration's gradient
        wu_gpu = wu_gpu + _rand(n, 20 + it, 2.0)


def _ulps(a, b):
    """Distance in float32 steps (the ordered integer images of the bit patterns)."""
    def ordered(x):
        i = x.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return np.abs(ordered(a) - ordered(b))


@pytest.mark.parametrize("n", SIZES)
def test_adam_within_two_ulps_over_successive_updates(emu_runner, n):
    decay, b1, b2, eps, batch, lr_scale = 0.0005, 0.9, 0.999, 1e-6, 16, 1.0
    state_cpu = [_rand(n, 12, 0.1), _rand(n, 13, 2.0), np.zeros(n, np.float32),
                 np.zeros(n, np.float32)]
    state_gpu = [a.copy() for a in state_cpu]
    roles = ["param", "grad_acc", "m", "v"]
    args = {"n": n, "batch": batch, "decay": decay, "b1": b1, "b2": b2, "eps": eps,
            "lr_scale": lr_scale}
    for it in range(3):
        lr_buf = np.array([0.001], np.float32)
        t_buf = np.array([it + 1], np.float32)
        update.adam_update(*state_cpu, lr_buf, t_buf, decay, b1, b2, eps, batch, lr_scale)
        got = _run_orders(
            emu_runner, "adam_upd_f32", args,
            {"lr": lr_buf, "t": t_buf, **dict(zip(roles, state_gpu, strict=True))},
            {"n": n}, roles,
        )
        state_gpu = [got[r] for r in roles]
        for role, g, c in zip(roles, state_gpu, state_cpu, strict=True):
            assert _ulps(g, c).max() <= 2, (role, it, _ulps(g, c).max())
        np.testing.assert_array_equal(state_gpu[1], 0.0)
        grad = _rand(n, 30 + it, 2.0)
        state_cpu[1] += grad
        state_gpu[1] = state_gpu[1] + grad


# ---- finiteness ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 70001])
def test_finite_flag(any_math_runner, n):
    base = _rand(n, 14)
    base[0] = np.finfo(np.float32).max  # large but finite
    base[-1] = -np.finfo(np.float32).tiny / 2  # subnormal
    places = sorted({0, n // 2, n - 1})
    cases = [(None, None)] + [(p, bad) for p in places for bad in (np.nan, np.inf, -np.inf)]
    for place, bad in cases:
        x = base.copy()
        if place is not None:
            x[place] = bad
        for start in (1.0, 0.0):
            want = np.array([start], np.float32)
            update.all_finite_step(x, want).run()
            got = _run_orders(any_math_runner, "finite_buf_f32", {"n": n},
                              {"x": x,
                                                        "flag": np.array([start], np.float32)},
                              {"n": n}, ["flag"])["flag"]
            assert got[0] == want[0] == (start if place is None else 0.0), (place, bad, start)


def test_finite_flag_collects_several_arrays(emu_runner):
    flag = np.ones(1, np.float32)
    for x in (_rand(300, 15), _rand(7, 16)):
        emu_runner.run("finite_buf_f32", {"n": x.size}, {"x": x, "flag": flag}, {"n": x.size})
    assert flag[0] == 1.0
    bad = _rand(13, 17)
    bad[5] = np.inf
    for x in (bad, _rand(9, 18)):  # a later clean array does not set it back
        emu_runner.run("finite_buf_f32", {"n": x.size}, {"x": x, "flag": flag}, {"n": x.size})
    assert flag[0] == 0.0
