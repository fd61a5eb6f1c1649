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
