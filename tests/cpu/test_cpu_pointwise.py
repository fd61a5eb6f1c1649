"""The packed float32 1x1 convolution (cpu/pointwise.pyx, kernels.h dm_gemm8_f32) against
NumPy in float64, and its refusals.

Shapes reach the kernel's edges: fewer output pixels than a block of columns (the column-at-a-
time path), a last block that starts inside the one before, filter counts that leave a
partial block of 8, one channel, a batch of images, and the threads' split of rows and columns.
"""

import numpy as np
import pytest
from reference import NP_ACTIVATIONS

from darknet_metal.cpu import pointwise
from darknet_metal.errors import ArgumentError
from darknet_metal.model.activations import ACTIVATION_ID

EPS32 = 2.0**-24


def case(n, c, hw, f, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, *hw)).astype(np.float32)
    w = (rng.standard_normal((f, c)) / np.sqrt(c)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    return x, w, b


def reference(x, w, b):
    """The products in float64, and a bound on a float32 chain of c fused multiply-adds
    plus the bias: (c + 1) roundings of at most |partial sum| each."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = np.einsum("fc,nchw->nfhw", w64, x64) + b[None, :, None, None]
    mag = np.einsum("fc,nchw->nfhw", np.abs(w64), np.abs(x64)) + np.abs(b)[None, :, None, None]
    return ref, (x.shape[1] + 1) * EPS32 * mag


# n, c, (h, w), f
SHAPES = [(1, 3, (2, 3), 5), (2, 17, (4, 8), 9), (1, 64, (5, 7), 8), (1, 1, (13, 13), 1),
          (2, 40, (13, 13), 17), (1, 128, (26, 26), 255), (3, 9, (1, 33), 24),
          (1, 256, (6, 50), 70)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_product_within_the_rounding_bound(shape):
    x, w, b = case(*shape, seed=sum(shape[:2]) + shape[3])
    out = np.full((shape[0], shape[3], *shape[2]), np.nan, np.float32)
    pointwise.conv1x1_forward(x, pointwise.pack_weights(w), b, out, ACTIVATION_ID["linear"])
    ref, bound = reference(x, w, b)
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.parametrize("act", ["leaky", "logistic", "mish", "relu6", "swish"])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=str)
def test_activations_fused_in_the_epilogue(shape, act):
    x, w, b = case(*shape, seed=7)
    out = np.empty((shape[0], shape[3], *shape[2]), np.float32)
    pointwise.conv1x1_forward(x, pointwise.pack_weights(w), b, out, ACTIVATION_ID[act])
    ref, _ = reference(x, w, b)
    np.testing.assert_allclose(out, NP_ACTIVATIONS[act](ref), rtol=2e-5, atol=2e-5)


def test_packed_layout_is_blocks_of_eight_filters_channel_by_channel():
    w = np.arange(11 * 5, dtype=np.float32).reshape(11, 5)
    packed = pointwise.pack_weights(w)
    assert packed.shape == (pointwise.packed_size(11, 5),) == (16 * 5,)
    blocks = packed.reshape(2, 5, 8)
    np.testing.assert_array_equal(blocks[0], w[:8].T)
    np.testing.assert_array_equal(blocks[1, :, :3], w[8:].T)
    assert not blocks[1, :, 3:].any()


def test_same_bits_for_every_split():
    # One image and a batch of four: different part counts, the same chain per output.
    x, w, b = case(4, 33, (19, 21), 19, seed=3)
    packed = pointwise.pack_weights(w)
    whole = np.empty((4, 19, 19, 21), np.float32)
    pointwise.conv1x1_forward(x, packed, b, whole, ACTIVATION_ID["leaky"])
    for i in range(4):
        one = np.empty((1, 19, 19, 21), np.float32)
        pointwise.conv1x1_forward(x[i:i + 1].copy(), packed, b, one, ACTIVATION_ID["leaky"])
        np.testing.assert_array_equal(one[0], whole[i])


def test_refusals_name_the_argument():
    x, w, b = case(1, 4, (3, 3), 2, seed=0)
    packed = pointwise.pack_weights(w)
    out = np.empty((1, 2, 3, 3), np.float32)
    leaky = ACTIVATION_ID["leaky"]
    with pytest.raises(ArgumentError, match="x must be float32"):
        pointwise.conv1x1_step(x.astype(np.float64), packed, b, out, leaky)
    with pytest.raises(ArgumentError, match="packed weights have 7 floats, expected 32"):
        pointwise.conv1x1_step(x, packed[:7].copy(), b, out, leaky)
    with pytest.raises(ArgumentError, match=r"out shape \(1, 3, 3, 3\)"):
        pointwise.conv1x1_step(x, packed, b, np.empty((1, 3, 3, 3), np.float32), leaky)
    with pytest.raises(ArgumentError, match="activation id 99"):
        pointwise.conv1x1_step(x, packed, b, out, 99)
    with pytest.raises(ArgumentError, match="weights must be float32"):
        pointwise.pack_weights(w.astype(np.float64))
    with pytest.raises(ArgumentError, match="C-contiguous"):
        pointwise.pack_weights(np.asfortranarray(np.ones((3, 4), np.float32)))
