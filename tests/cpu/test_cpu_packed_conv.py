"""The float32 convolutions with packed weights (cpu/packed_conv.pyx, kernels.h dm_gemm8_f32)
against NumPy in float64, and their refusals.

1x1 shapes reach the kernel's edges: fewer output pixels than a block of columns (the padded
panel), a last block that starts inside the one before, filter counts that leave a partial
block of 8, one channel, a batch of images, and the threads' split of rows and columns.
Unfolded (im2col) shapes take both ways of sharing the work: blocks of output rows unfolded
and multiplied by one part (large outputs), and the whole image unfolded first (small ones).
"""

import numpy as np
import pytest
from reference import NP_ACTIVATIONS, np_conv

from darknet_metal.cpu import packed_conv
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.model.activations import ACTIVATION_ID

EPS32 = 2.0**-24


def case(n, c, hw, f, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, *hw)).astype(np.float32)
    w = (rng.standard_normal((f, c)) / np.sqrt(c)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    return x, w, b


def conv1x1(x, packed, b, out, act):
    packed_conv.conv_forward(x, packed, b, out, None, 1, 1, 1, 0, 1, act)


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
    conv1x1(x, packed_conv.pack_weights(w), b, out, ACTIVATION_ID["linear"])
    ref, bound = reference(x, w, b)
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.parametrize("act", ["leaky", "logistic", "mish", "relu6", "swish"])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=str)
def test_activations_fused_in_the_epilogue(shape, act):
    x, w, b = case(*shape, seed=7)
    out = np.empty((shape[0], shape[3], *shape[2]), np.float32)
    conv1x1(x, packed_conv.pack_weights(w), b, out, ACTIVATION_ID[act])
    ref, _ = reference(x, w, b)
    np.testing.assert_allclose(out, NP_ACTIVATIONS[act](ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_leaky_is_the_linear_output_selected(shape):
    # Leaky and linear blocks are finished in registers, other activations out of line:
    # leaky must still be Darknet's "x > 0 ? x : 0.1f * x" of the same sums, bit for bit.
    x, w, b = case(*shape, seed=5)
    packed = packed_conv.pack_weights(w)
    outs = {}
    for act in ("linear", "leaky"):
        outs[act] = np.empty((shape[0], shape[3], *shape[2]), np.float32)
        conv1x1(x, packed, b, outs[act], ACTIVATION_ID[act])
    y = outs["linear"]
    np.testing.assert_array_equal(outs["leaky"], np.where(y > 0, y, np.float32(0.1) * y))


def test_packed_layout_is_blocks_of_eight_filters_channel_by_channel():
    w = np.arange(11 * 5, dtype=np.float32).reshape(11, 5)
    packed = packed_conv.pack_weights(w)
    assert packed.shape == (packed_conv.packed_size(11, 5),) == (16 * 5,)
    blocks = packed.reshape(2, 5, 8)
    np.testing.assert_array_equal(blocks[0], w[:8].T)
    np.testing.assert_array_equal(blocks[1, :, :3], w[8:].T)
    assert not blocks[1, :, 3:].any()


def test_same_bits_for_every_split():
    # One image and a batch of four: different part counts, the same chain per output.
    x, w, b = case(4, 33, (19, 21), 19, seed=3)
    packed = packed_conv.pack_weights(w)
    whole = np.empty((4, 19, 19, 21), np.float32)
    conv1x1(x, packed, b, whole, ACTIVATION_ID["leaky"])
    for i in range(4):
        one = np.empty((1, 19, 19, 21), np.float32)
        conv1x1(x[i:i + 1].copy(), packed, b, one, ACTIVATION_ID["leaky"])
        np.testing.assert_array_equal(one[0], whole[i])


@pytest.mark.parametrize("act", ["linear", "leaky", "mish"])
@pytest.mark.parametrize("columns", [1, 3, 49, 52, 100, 169])
def test_last_columns_same_bits_as_inside_a_block(columns, act):
    # A few columns past the last whole vector take the kernel's tail (8 filters a vector,
    # several filter blocks at once); the same columns with more after them fall inside a
    # vector block. Both must be the same chain: the same bits. 70 filters: 9 blocks, the
    # last partial, so the tail's groups of blocks end short too.
    x, w, b = case(1, 37, (1, columns + 40), 70, seed=columns)
    packed = packed_conv.pack_weights(w)
    wide = np.empty((1, 70, 1, columns + 40), np.float32)
    conv1x1(x, packed, b, wide, ACTIVATION_ID[act])
    narrow = np.empty((1, 70, 1, columns), np.float32)
    conv1x1(np.ascontiguousarray(x[..., :columns]), packed, b, narrow, ACTIVATION_ID[act])
    np.testing.assert_array_equal(narrow, wide[..., :columns])
    ref, bound = reference(np.ascontiguousarray(x[..., :columns]), w, b)
    if act == "linear":
        assert np.all(np.abs(narrow - ref) <= bound)


# n, c, (h, w), f, ksize, (stride_x, stride_y), pad, dilation
UNFOLDED = [
    (1, 3, (9, 37), 11, 3, (1, 1), 1, 1),      # too little work to share: one part
    (2, 5, (8, 7), 9, 3, (2, 2), 1, 1),        # fewer columns than a block
    (1, 16, (128, 130), 32, 3, (2, 2), 1, 1),  # blocks of rows on the threads
    (1, 32, (64, 64), 40, 3, (1, 1), 1, 1),
    (1, 64, (26, 26), 72, 3, (2, 2), 1, 1),    # unfolded by channels on the threads
    (1, 4, (11, 13), 6, 1, (2, 2), 0, 1),      # 1x1 stride 2
    (1, 3, (10, 12), 5, 5, (1, 1), 2, 1),
    (1, 6, (15, 17), 7, 3, (2, 1), 1, 1),
    (1, 5, (12, 12), 4, 3, (1, 1), 1, 2),      # dilated
    (2, 8, (6, 9), 3, 2, (1, 1), 0, 1),
]


def unfolded_case(case, seed):
    n, c, (h, w), f, k, (sx, sy), pad, dil = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((f, c * k * k)) / np.sqrt(c * k * k)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    ref = np_conv(x.astype(np.float64), wt.astype(np.float64), b.astype(np.float64), k, sx,
                  sy, pad, dil, 1)
    mag = np_conv(np.abs(x).astype(np.float64), np.abs(wt).astype(np.float64),
                  np.abs(b).astype(np.float64), k, sx, sy, pad, dil, 1)
    out = np.full(ref.shape, np.nan, np.float32)
    size = packed_conv.workspace_size(c, k, sx, sy, pad, *ref.shape[2:])
    assert size == (0 if (k, sx, sy, pad) == (1, 1, 1, 0) else c * k * k * ref[0, 0].size)
    packed_conv.conv_forward(x, packed_conv.pack_weights(wt), b, out,
                             np.empty(size, np.float32), k, sx, sy, pad, dil,
                             ACTIVATION_ID["linear"])
    return out, ref, (c * k * k + 1) * EPS32 * mag


@pytest.mark.parametrize("case", UNFOLDED, ids=str)
def test_unfolded_product_within_the_rounding_bound(case):
    out, ref, bound = unfolded_case(case, seed=len(str(case)))
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.parametrize("act", ["leaky", "mish"])
def test_unfolded_activation_fused(act):
    n, c, (h, w), f = 1, 8, (20, 21), 10
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((f, c * 9)) / 8).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    out = np.empty((n, f, 10, 11), np.float32)
    packed_conv.conv_forward(x, packed_conv.pack_weights(wt), b, out,
                             np.empty(packed_conv.workspace_size(c, 3, 2, 2, 1, 10, 11),
                                      np.float32), 3, 2, 2, 1, 1, ACTIVATION_ID[act])
    ref = np_conv(x.astype(np.float64), wt.astype(np.float64), b.astype(np.float64), 3, 2, 2,
                  1, 1, 1)
    np.testing.assert_allclose(out, NP_ACTIVATIONS[act](ref), rtol=2e-5, atol=2e-5)


def step(x, packed, b, out, act, workspace=None, ksize=1, stride=1, pad=0):
    return packed_conv.conv_step(x, packed, b, out, workspace, ksize, stride, stride, pad, 1,
                                 act)


def test_refusals_name_the_argument():
    x, w, b = case(1, 4, (3, 3), 2, seed=0)
    packed = packed_conv.pack_weights(w)
    out = np.empty((1, 2, 3, 3), np.float32)
    leaky = ACTIVATION_ID["leaky"]
    with pytest.raises(ArgumentError, match="x must be float32"):
        step(x.astype(np.float64), packed, b, out, leaky)
    with pytest.raises(ArgumentError, match="packed weights have 7 floats, expected 32"):
        step(x, packed[:7].copy(), b, out, leaky)
    with pytest.raises(ArgumentError, match=r"out shape \(1, 3, \.\.\.\) does not match"):
        step(x, packed, b, np.empty((1, 3, 3, 3), np.float32), leaky)
    with pytest.raises(ArgumentError, match=r"out spatial size 3x3 does not match"):
        step(x, packed, b, out, leaky, ksize=1, stride=2)
    with pytest.raises(ArgumentError, match="activation id 99"):
        step(x, packed, b, out, 99)
    with pytest.raises(ArgumentError, match="weights must be float32"):
        packed_conv.pack_weights(w.astype(np.float64))
    with pytest.raises(ArgumentError, match="C-contiguous"):
        packed_conv.pack_weights(np.asfortranarray(np.ones((3, 4), np.float32)))
    # A 3x3 convolution unfolds its input: 4*9*9 floats of workspace.
    packed3 = packed_conv.pack_weights(np.ones((2, 36), np.float32))
    with pytest.raises(ArgumentTypeError, match="workspace must be a numpy array"):
        step(x, packed3, b, out, leaky, None, 3, 1, 1)
    with pytest.raises(ArgumentError, match="workspace has 323 elements, needs 324"):
        step(x, packed3, b, out, leaky, np.empty(323, np.float32), 3, 1, 1)
