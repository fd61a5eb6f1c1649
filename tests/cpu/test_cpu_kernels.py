"""The vectorised float32 kernels (darknet_metal/cpu/kernels.h) against NumPy formulas.

Each case is shaped to reach the kernels' edges: row tails shorter than a vector block,
filter counts that leave a partial block, runs of Winograd tiles longer than one chunk,
activations the kernels do not fuse, and NaN in max pooling.
"""

import numpy as np
import pytest
from reference import np_conv

from darknet_metal.cpu import conv, pooling, winograd
from darknet_metal.model.activations import ACTIVATION_ID

LINEAR = ACTIVATION_ID["linear"]
LEAKY = ACTIVATION_ID["leaky"]
LOGISTIC = ACTIVATION_ID["logistic"]


def apply(act, ref):
    if act == LEAKY:
        return np.where(ref > 0, ref, 0.1 * ref)
    if act == LOGISTIC:
        return 1.0 / (1.0 + np.exp(-ref))
    return ref


def random_case(n, c, h, w, f, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((f, c * 9)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    return x, wt, b


# n, c, h, w, f, stride: output widths with a partial block of 8 or 32 columns (37, 5, 19,
# 35), exact blocks (32), filter counts with a partial block of 8 (11, 3, 17), the channel
# limit of the direct path (16), odd and even input sizes at
# stride 2 (Darknet's output is (in - 1) // 2 + 1).
DIRECT_CASES = [(2, 3, 9, 37, 11, 1), (1, 1, 4, 5, 3, 1), (1, 16, 6, 32, 8, 1),
                (1, 2, 1, 1, 17, 1), (2, 3, 9, 37, 11, 2), (1, 16, 10, 70, 8, 2),
                (1, 16, 7, 64, 17, 2), (1, 5, 2, 3, 9, 2), (1, 8, 1, 1, 3, 2)]


@pytest.mark.parametrize("act", [LINEAR, LEAKY, LOGISTIC])
@pytest.mark.parametrize("case", DIRECT_CASES)
def test_float32_3x3_few_channels_matches_reference(case, act):
    n, c, h, w, f, s = case
    assert c <= (conv.DIRECT_MAX_CHANNELS if s == 1 else conv.DIRECT_MAX_CHANNELS_STRIDE2)
    x, wt, b = random_case(n, c, h, w, f, seed=sum(case) + act)
    oh, ow = (h - 1) // s + 1, (w - 1) // s + 1
    out = np.full((n, f, oh, ow), np.nan, np.float32)
    direct = conv.direct_workspace_size(c, f, h, w, 3, s, s, 1, 1, 1)
    assert direct > 0
    ws = np.empty(max(conv.workspace_size(c, 3, 1, oh, ow), direct), np.float32)
    conv.conv2d_forward(x, wt, b, out, ws, 3, s, s, 1, 1, 1, act)
    ref = np_conv(x, wt, b, 3, s, s, 1, 1, 1)
    np.testing.assert_allclose(out, apply(act, ref), rtol=1e-4, atol=1e-4)


# Tile rows of 66 and 131 tiles (F(2x2)) and 33 and 66 (F(4x4)) span one to three 64-tile
# chunks; rows of at most 32 tiles are transformed several to a run (14 tiles: runs of 4 rows
# and a last of 3 with F(2x2); 7: 9 rows and 1 with F(4x4); 13 at 52x52: 4, 4, 4, 1), each
# row's last tile taking its right-hand columns from outside the run's slots; sizes no tile
# divides leave partial tiles.
WINOGRAD_CASES = [(1, 4, 5, 131, 3), (1, 32, 3, 262, 5), (2, 33, 7, 9, 2), (1, 8, 10, 263, 4),
                  (2, 5, 37, 27, 3), (1, 6, 52, 52, 4)]
#: Largest difference from the float64 direct convolution, relative to its largest value, of
#: each float32 F(m x m, 3x3): F(4x4)'s transforms scale by up to 8 (input, output) and its
#: filters by 1/24 (measured up to 1.2e-5 at 256 channels; 2e-6 at these sizes).
WINOGRAD_TOLERANCE = {2: 2e-6, 4: 1e-5}


@pytest.mark.parametrize("tile", winograd.TILES)
@pytest.mark.parametrize("act", [LINEAR, LEAKY, LOGISTIC])
@pytest.mark.parametrize("case", WINOGRAD_CASES)
def test_float32_winograd_matches_reference(case, act, tile):
    n, c, h, w, f = case
    x, wt, b = random_case(n, c, h, w, f, seed=sum(case) + act)
    out = np.full((n, f, h, w), np.nan, np.float32)
    ws = np.empty(winograd.workspace_size(c, f, h, w, tile), np.float32)
    winograd.winograd_forward(x, winograd.transform_filters(wt, c, tile), b, out, ws, act)
    ref = np_conv(x, wt, b, 3, 1, 1, 1, 1, 1)
    tol = WINOGRAD_TOLERANCE[tile] * np.abs(ref).max()
    np.testing.assert_allclose(out, apply(act, ref), rtol=0, atol=tol)


@pytest.mark.parametrize("tile", winograd.TILES)
@pytest.mark.parametrize("hw", [(0, 5), (5, 0), (0, 0)])
def test_float32_winograd_of_an_empty_image_writes_nothing(hw, tile):
    # No tile at all: the runs of tiles are empty (no division by the 0 tiles of a row).
    h, w = hw
    x, wt, b = random_case(1, 3, h, w, 2, seed=1)
    out = np.empty((1, 2, h, w), np.float32)
    ws = np.empty(max(1, winograd.workspace_size(3, 2, h, w, tile)), np.float32)
    winograd.winograd_forward(x, winograd.transform_filters(wt, 3, tile), b, out, ws, LEAKY)
    assert out.size == 0


@pytest.mark.parametrize("tile", winograd.TILES)
def test_float32_winograd_equals_float64_path_closely(tile):
    # The float64 path is the scalar code the vectorised transforms replace for float32.
    x, wt, b = random_case(1, 8, 11, 150, 4, seed=5)
    outs = []
    for dtype in (np.float32, np.float64):
        out = np.empty((1, 4, 11, 150), dtype)
        ws = np.empty(winograd.workspace_size(8, 4, 11, 150, tile), dtype)
        winograd.winograd_forward(
            x.astype(dtype),
            winograd.transform_filters(wt.astype(dtype), 8, tile),
            b.astype(dtype),
            out,
            ws,
            LEAKY,
        )
        outs.append(out)
    bound = 5 * WINOGRAD_TOLERANCE[tile] * np.abs(outs[1]).max()
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=bound)


@pytest.mark.parametrize("hw", [(8, 8), (6, 40), (416, 416), (2, 34)])
def test_float32_maxpool_2x2_stride2_matches_numpy(hw):
    h, w = hw
    rng = np.random.default_rng(h * w)
    x = rng.standard_normal((2, 3, h, w)).astype(np.float32)
    x[0, 0, 0, 0] = np.nan  # a NaN never wins: Darknet compares with a strict ">"
    x[0, 0, 0, 1] = -np.inf
    x[1, 2, :2, :2] = np.nan  # an all-NaN window keeps Darknet's starting value -FLT_MAX
    out = np.empty((2, 3, h // 2, w // 2), np.float32)
    pooling.maxpool_forward(x, out, 2, 2, 2, 1)
    win = (
        x.reshape(2, 3, h // 2, 2, w // 2, 2)
        .transpose(0, 1, 2, 4, 3, 5)
        .reshape(2, 3, h // 2, w // 2, 4)
    )
    ref = np.nanmax(np.where(np.isnan(win), -np.inf, win), axis=-1)
    ref = np.maximum(ref, -np.finfo(np.float32).max)
    np.testing.assert_array_equal(out, ref)
    assert out[1, 2, 0, 0] == -np.finfo(np.float32).max
