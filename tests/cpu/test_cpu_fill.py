"""fill_step, copy_step and add_step: the whole-array steps of training programs."""

import numpy as np
import pytest

from darknet_metal.cpu import executor, fill
from darknet_metal.errors import ArgumentError, ArgumentTypeError


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value", [0.0, -2.5])
def test_fills_every_element(dtype, value):
    x = np.full((3, 5, 7), np.nan, dtype)
    step = fill.fill_step(x, value)
    executor.StepList([step], None).run()
    assert (x == value).all()
    if value == 0:
        assert not np.signbit(x).any()  # +0.0, not -0.0
    x[1, 2, 3] = 9
    step.run()
    assert (x == value).all()


def test_bad_arguments():
    with pytest.raises(ArgumentTypeError, match="x"):
        fill.fill_step([1.0, 2.0])
    with pytest.raises(ArgumentError, match="float32 or float64"):
        fill.fill_step(np.zeros(3, np.int32))
    with pytest.raises(ArgumentError, match="writable"):
        a = np.zeros(3, np.float32)
        a.flags.writeable = False
        fill.fill_step(a)
    with pytest.raises(ArgumentError, match="finite"):
        fill.fill_step(np.zeros(3, np.float32), np.inf)
    with pytest.raises(ArgumentError, match="C-contiguous"):
        fill.fill_step(np.zeros((4, 4), np.float32)[:, ::2])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_copy(dtype):
    src = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(dtype)
    dst = np.full_like(src, np.nan)
    executor.StepList([fill.copy_step(src, dst)], None).run()
    np.testing.assert_array_equal(dst, src)


def test_copy_bad_arguments():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ArgumentError, match="dst"):
        fill.copy_step(a, np.zeros((3, 2), np.float32))
    with pytest.raises(ArgumentError, match="dst"):
        fill.copy_step(a, np.zeros((2, 3), np.float64))
    with pytest.raises(ArgumentError, match="overlap"):
        fill.copy_step(a, a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_add(dtype, scale):
    rng = np.random.default_rng(2)
    src = rng.standard_normal((3, 7)).astype(dtype)
    dst = rng.standard_normal((3, 7)).astype(dtype)
    want = dst + dtype(scale) * src
    fill.add_step(src, dst, scale).run()
    np.testing.assert_array_equal(dst, want)
    with pytest.raises(ArgumentError, match="overlap"):
        fill.add_step(dst, dst)


@pytest.mark.parametrize("n", [1, 3, 4, 1000, (1 << 16) - 1, (1 << 16) + 5, 3 * (1 << 16) + 7,
                               (1 << 18) + 5])
def test_copy_finite_copies_bits_and_finds_every_nan_and_infinity(n):
    rng = np.random.default_rng(n)
    src = rng.standard_normal(n).astype(np.float32)
    # Values at the edges of finite: the largest, the smallest subnormal, -0.
    src[: min(n, 3)] = np.array([np.finfo(np.float32).max, 1e-45, -0.0], np.float32)[: min(n, 3)]
    for dst in (np.empty(n, np.float32), np.empty(n + 1, np.float32)[1:]):  # aligned, not
        assert fill.copy_finite(src, dst) is True
        assert dst.tobytes() == src.tobytes()
    assert fill.copy_finite(src) is True
    for position in sorted({0, n // 2, n - 1, min(n - 1, 1 << 16)}):
        for bad in (np.nan, np.inf, -np.inf):
            broken = src.copy()
            broken[position] = bad
            assert fill.copy_finite(broken) is False
            out = np.empty_like(broken)
            assert fill.copy_finite(broken, out) is False
            assert out.tobytes() == broken.tobytes()  # copied whole all the same


def test_copy_finite_refuses_what_it_cannot_copy():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ArgumentError, match="float32"):
        fill.copy_finite(a.astype(np.float64))
    with pytest.raises(ArgumentError, match="shape"):
        fill.copy_finite(a, np.zeros((3, 2), np.float32))
    with pytest.raises(ArgumentError, match="writable"):
        out = np.zeros((2, 3), np.float32)
        out.flags.writeable = False
        fill.copy_finite(a, out)
    assert fill.copy_finite(np.zeros(0, np.float32)) is True
