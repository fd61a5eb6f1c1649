"""Tests of the Cython activations (darknet_metal.cpu.activation).

References, all written independently of the code under test:
- the mathematical definitions in NumPy float64 (tolerance-based; in reference.py);
- Darknet's float32 arithmetic replayed scalar by scalar with NumPy float32 operations and
  the C library's expf/logf/tanhf/powf through ctypes (must agree bit for bit);
- finite differences for the derivatives (float64);
- OpenCV DNN's Darknet importer for the activations it implements.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util

import numpy as np
import pytest
from opencv_ref import opencv_layer_outputs, write_darknet_weights
from reference import NP_ACTIVATIONS, np_normalize_channels

from darknet_metal.cpu import activation as act
from darknet_metal.model.activations import ACTIVATIONS

f32 = np.float32
SHAPES = [(2, 3, 5, 7), (2, 5, 1, 13), (2, 7, 13, 1), (2, 3, 13, 13)]
ELEMENTWISE = [a for a in ACTIVATIONS if not a.startswith("normalize_channels")]


def _have_cv2_darknet() -> bool:
    if importlib.util.find_spec("cv2") is None:
        return False
    import cv2

    return hasattr(cv2, "dnn") and hasattr(cv2.dnn, "readNetFromDarknet")


HAVE_CV2_DARKNET = _have_cv2_darknet()


# ---------------------------------------------------------------------------------------
# Inputs (the float64 definitions are NP_ACTIVATIONS in reference.py).


def _inputs(shape, seed, scale=5.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * scale
    flat = x.reshape(-1)
    special = [0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 6.0, -6.0, 20.0, -20.0, 21.0, -21.0, 0.5]
    flat[: min(len(special), flat.size)] = special[: flat.size]
    return x


# ---------------------------------------------------------------------------------------
# Darknet's float32 arithmetic, replayed with the C library's float functions.

_LIBM_PATH = ctypes.util.find_library("m")
_libm = ctypes.CDLL(_LIBM_PATH) if _LIBM_PATH else None


def _cfun(name, nargs):
    fn = getattr(_libm, name)
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float] * nargs
    return lambda *a: f32(fn(*(float(v) for v in a)))


if _libm is not None:
    expf, logf, tanhf, floorf = (_cfun(n, 1) for n in ("expf", "logf", "tanhf", "floorf"))
    powf = _cfun("powf", 2)

ONE, TWO = f32(1), f32(2)


def _dk_tanh(x):
    return TWO / (ONE + expf(f32(-2) * x)) - ONE


def _dk_softplus(x):
    if x > f32(20):
        return x
    if x < f32(-20):
        return expf(x)
    return logf(expf(x) + ONE)


def _dk_gelu(x):
    arg = 0.797885 * float(x) + 0.035677 * float(powf(x, 3.0))
    return f32(0.5 * float(x) * float(ONE + tanhf(f32(arg))))


def _dk_relu6(x):
    a = x if x > 0 else f32(0)
    return a if a < 6 else f32(6)


def _dk_stair(x):
    n = int(floorf(x))
    if n % 2 == 0:
        return floorf(x / TWO)
    return (x - f32(n)) + floorf(x / TWO)


DARKNET_F32 = {
    "linear": lambda x: x,
    "leaky": lambda x: x if x > 0 else f32(0.1) * x,
    "revleaky": lambda x: x if x > 0 else f32(0.1) * x,
    "relu": lambda x: x * f32(x > 0),
    "relu6": _dk_relu6,
    "logistic": lambda x: ONE / (ONE + expf(-x)),
    "loggy": lambda x: TWO / (ONE + expf(-x)) - ONE,
    "tanh": _dk_tanh,
    "elu": lambda x: f32(x >= 0) * x + f32(x < 0) * (expf(x) - ONE),
    "selu": lambda x: (
        f32(x >= 0) * f32(1.0507) * x + f32(x < 0) * f32(1.0507) * f32(1.6732) * (expf(x) - ONE)
    ),
    "gelu": _dk_gelu,
    "mish": lambda x: x * _dk_tanh(_dk_softplus(x)),
    "swish": lambda x: x * (ONE / (ONE + expf(-x))),
    "hard_mish": lambda x: x if x > 0 else (x * x / TWO + x if x > -2 else f32(0)),
    "hardtan": lambda x: f32(-1) if x < -1 else (ONE if x > 1 else x),
    "lhtan": lambda x: f32(0.001) * x if x < 0 else (f32(0.001) * (x - ONE) + ONE if x > 1 else x),
    "plse": lambda x: (
        f32(0.01) * (x + f32(4))
        if x < -4
        else (f32(0.01) * (x - f32(4)) + ONE if x > 4 else f32(0.125) * x + f32(0.5))
    ),
    "stair": _dk_stair,
    "ramp": lambda x: x * f32(x > 0) + f32(0.1) * x,
    "relie": lambda x: x if x > 0 else f32(0.01) * x,
}


# ---------------------------------------------------------------------------------------
# Forward.


def test_every_activation_has_a_reference():
    assert set(NP_ACTIVATIONS) == set(ELEMENTWISE)
    assert set(DARKNET_F32) == set(ELEMENTWISE)


@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_matches_numpy_definition(name, dtype):
    for k, shape in enumerate(SHAPES):
        x = _inputs(shape, k).astype(dtype)
        ref = NP_ACTIVATIONS[name](x.astype(np.float64))
        y = x.copy()
        act.activate(y, name)
        assert y.dtype == dtype
        if dtype == np.float32:
            # Darknet's float32 tanh is 2/(1+exp(-2x)) - 1: about one ulp of 1.0 absolute
            # error near 0, times x inside mish.
            np.testing.assert_allclose(y, ref, rtol=4e-6, atol=3e-6, err_msg=name)
        else:
            np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.skipif(_libm is None, reason="no C math library to replay Darknet's float math")
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_float32_is_bit_exact_to_darknet_arithmetic(name):
    rng = np.random.default_rng(7)
    grid = np.concatenate(
        [
            np.linspace(-30, 30, 241),
            rng.standard_normal(200) * 6,
            rng.standard_normal(60) * 1e-3,
            [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 6.0, 20.0, -20.0, 88.0, 100.0, -100.0],
        ]
    ).astype(np.float32)
    with np.errstate(all="ignore"):
        expected = np.array([DARKNET_F32[name](v) for v in grid], dtype=np.float32)
    y = grid.reshape(1, -1).copy()
    act.activate(y, ACTIVATIONS.index(name))
    # Where Darknet's float math overflows into NaN (elu/selu above 88.7), the package stays
    # finite (a documented departure); everywhere else the bits are Darknet's.
    darknet_finite = np.isfinite(expected) | np.isinf(expected)
    assert np.isfinite(y.reshape(-1)[~darknet_finite]).all(), name
    np.testing.assert_array_equal(y.reshape(-1)[darknet_finite], expected[darknet_finite],
                                  err_msg=name)


def test_elu_and_selu_stay_finite_where_darknet_overflows():
    # Darknet multiplies the exp branch by a 0/1 mask: 0 * inf is NaN for x > 88.7 and for
    # -inf. Here each takes its branch: x (times selu's scale) and the limit -1 (-1.7581).
    x = np.array([[100.0, 1e4, 1.0, -np.inf, -1e4]], dtype=np.float32)
    for name, scale, low in (("elu", 1.0, -1.0), ("selu", 1.0507, -1.0507 * 1.6732)):
        y = x.copy()
        act.activate(y, name)
        want = [np.float32(scale) * x[0, :3], np.float32(low), np.float32(low)]
        np.testing.assert_array_equal(y[0, :3], want[0], err_msg=name)
        np.testing.assert_allclose(y[0, 3:], want[1:], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", sorted(a for a in ACTIVATIONS if a.startswith("normalize")))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_channel_activations(name, dtype):
    for k, shape in enumerate(SHAPES):
        x = _inputs(shape, 10 + k, scale=2.0).astype(dtype)
        y = x.copy()
        act.activate(y, name)
        ref = np_normalize_channels(name, x.astype(np.float64))
        tol = 2e-6 if dtype == np.float32 else 1e-13
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.skipif(_libm is None, reason="no C math library to replay Darknet's float math")
def test_normalize_channels_softmax_maxval_is_bit_exact():
    x = _inputs((2, 5, 3, 4), 3, scale=3.0).astype(np.float32)
    expected = np.empty_like(x)
    for b in range(2):
        for i in range(3):
            for j in range(4):
                v = x[b, :, i, j]
                m = v[0]
                for k in range(1, 5):
                    m = v[k] if v[k] > m else m
                total = f32(0.0001)
                for k in range(5):
                    total = total + expf(v[k] - m)
                expected[b, :, i, j] = [expf(v[k] - m) / total for k in range(5)]
    y = x.copy()
    act.activate(y, "normalize_channels_softmax_maxval")
    np.testing.assert_array_equal(y, expected)


def test_two_dimensional_input_is_n_f_1_1():
    x = _inputs((3, 11), 4, scale=2.0)
    for name in ("mish", "normalize_channels_softmax"):
        flat, four_d = x.copy(), x.reshape(3, 11, 1, 1).copy()
        act.activate(flat, name)
        act.activate(four_d, name)
        np.testing.assert_array_equal(flat, four_d.reshape(3, 11))
    y = x.copy()
    act.activate(y, "normalize_channels")
    np.testing.assert_allclose(y, np_normalize_channels("normalize_channels", x), rtol=1e-13)


@pytest.mark.parametrize("name", ["leaky", "mish", "gelu", "logistic"])
def test_threaded_path_equals_per_piece_results(name):
    # Above one chunk the work is split across threads; values must not depend on it.
    x = _inputs((2, 16, 64, 33), 5).astype(np.float32)
    whole = x.copy()
    act.activate(whole, name)
    for b in range(2):
        for c in range(16):
            piece = x[b : b + 1, c : c + 1].copy()
            act.activate(piece, name)
            np.testing.assert_array_equal(whole[b, c], piece[0, 0])


def test_ids_and_names_are_the_same_activation():
    x = _inputs((2, 3, 5, 7), 6)
    for i, name in enumerate(ACTIVATIONS):
        a, b = x.copy(), x.copy()
        act.activate(a, name)
        act.activate(b, np.int64(i))
        np.testing.assert_array_equal(a, b)
        assert act.activation_id(name) == i


# ---------------------------------------------------------------------------------------
# Derivatives.

# Activations whose Darknet derivative takes the input rather than the output.
INPUT_BASED = {"gelu", "mish", "swish", "hard_mish"}
SMOOTH = ["linear", "logistic", "loggy", "tanh", "elu", "selu", "gelu", "mish", "swish"]


def _gelu_darknet_gradient_formula(x):
    # Darknet's gelu_gradient is the derivative of the formula with 0.0356774.
    return 0.5 * x * (1.0 + np.tanh(0.797885 * x + 0.0356774 * x**3))


@pytest.mark.parametrize("name", SMOOTH + ["hard_mish"])
def test_gradient_matches_finite_differences(name):
    rng = np.random.default_rng(11)
    x = rng.uniform(-6, 6, size=(2, 3, 5, 7))
    x = np.where(np.abs(x) < 0.05, 0.5, x)  # away from the kink of elu/selu at 0
    if name == "hard_mish":
        x = np.where(np.abs(x + 2) < 0.05, -1.0, x)
    f = _gelu_darknet_gradient_formula if name == "gelu" else NP_ACTIVATIONS[name]
    h = 1e-5
    numeric = (f(x + h) - f(x - h)) / (2 * h)
    arg = x.copy() if name in INPUT_BASED else f(x)
    delta = rng.uniform(0.5, 2.0, size=x.shape)
    expected = delta * numeric
    act.gradient(arg, name, delta)
    tol = 2e-6 if name == "gelu" else 1e-7  # gelu: Darknet rounds 0.3989425 to 0.398942
    np.testing.assert_allclose(delta, expected, rtol=tol, atol=tol, err_msg=name)


PIECEWISE_DERIVATIVE = {
    "leaky": lambda x: np.where(x > 0, 1.0, 0.1),
    "revleaky": lambda x: np.where(x > 0, 1.0, 0.1),
    "relu": lambda x: np.where(x > 0, 1.0, 0.0),
    "relu6": lambda x: np.where((x > 0) & (x < 6), 1.0, 0.0),
    "hardtan": lambda x: np.where((x > -1) & (x < 1), 1.0, 0.0),
    "lhtan": lambda x: np.where((x > 0) & (x < 1), 1.0, 0.001),
    "plse": lambda x: np.where((x > -4) & (x < 4), 0.125, 0.01),
    "ramp": lambda x: np.where(x > 0, 1.1, 0.1),
    "relie": lambda x: np.where(x > 0, 1.0, 0.01),
    # Darknet tests the output for a whole number: flat steps give 0, ramps 1.
    "stair": lambda x: np.where(np.floor(x) % 2 == 0, 0.0, 1.0),
}


@pytest.mark.parametrize("name", sorted(PIECEWISE_DERIVATIVE))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_piecewise_gradient_from_output(name, dtype):
    rng = np.random.default_rng(12)
    x = rng.uniform(-9, 9, size=(2, 5, 1, 13))
    # Stay off the kinks and, for stair, off outputs that are whole numbers.
    x = np.where(np.abs(x - np.round(x)) < 0.05, x + 0.3, x)
    y = NP_ACTIVATIONS[name](x).astype(dtype)
    delta = rng.uniform(-2, 2, size=x.shape).astype(dtype)
    expected = delta.astype(np.float64) * PIECEWISE_DERIVATIVE[name](x)
    act.gradient(y, name, delta)
    np.testing.assert_allclose(delta, expected, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(a for a in ACTIVATIONS if a.startswith("normalize")))
def test_channel_gradient_is_darknets(name):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 5, 3, 4))
    y = np_normalize_channels(name, x)
    delta = rng.standard_normal(x.shape)
    g = (y * delta).sum(axis=1, keepdims=True)
    mask = (y > 0) if name == "normalize_channels" else np.ones_like(y, dtype=bool)
    expected = np.where(mask, delta * g, delta)
    act.gradient(y, name, delta)
    np.testing.assert_allclose(delta, expected, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------
# Against OpenCV DNN: a 1x1 identity convolution followed by the activation.


@pytest.mark.skipif(not HAVE_CV2_DARKNET, reason="needs opencv-python with the Darknet importer")
@pytest.mark.parametrize("name", ["linear", "leaky", "relu", "logistic", "tanh", "mish", "swish"])
def test_matches_opencv(tmp_path, name):
    c, h, w = 5, 7, 13
    cfg = tmp_path / "act.cfg"
    cfg.write_text(
        f"[net]\nwidth={w}\nheight={h}\nchannels={c}\n\n"
        f"[convolutional]\nfilters={c}\nsize=1\nstride=1\npad=0\nactivation={name}\n"
    )
    weights = tmp_path / "act.weights"
    write_darknet_weights(weights, [np.zeros(c), np.eye(c)])
    x = _inputs((2, c, h, w), 21, scale=4.0).astype(np.float32)
    (ref,) = opencv_layer_outputs(cfg, weights, x, [0])
    tol = 1e-4 * np.abs(ref).max() + 1e-5
    for dtype in (np.float32, np.float64):
        y = x.astype(dtype)
        act.activate(y, name)
        assert np.abs(y - ref).max() <= tol, name


# ---------------------------------------------------------------------------------------
# Bad input.


def test_bad_input_raises_clear_errors():
    x = np.zeros((2, 3, 4, 5), np.float32)
    with pytest.raises(ValueError, match="unknown activation 'lekay'"):
        act.activate(x, "lekay")
    with pytest.raises(ValueError, match="out of range"):
        act.activate(x, len(ACTIVATIONS))
    with pytest.raises(TypeError, match="name or an int"):
        act.activate(x, 1.5)
    with pytest.raises(ValueError, match="float32 or float64"):
        act.activate(x.astype(np.int32), "leaky")
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) or \(N, F\)"):
        act.activate(np.zeros((2, 3, 4), np.float32), "leaky")
    with pytest.raises(ValueError, match="C-contiguous"):
        act.activate(x[:, :, ::2], "leaky")
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        act.activate(ro, "leaky")
    with pytest.raises(ValueError, match="shape and dtype of y_or_x"):
        act.gradient(x, "leaky", np.zeros((2, 3, 4, 5), np.float64))
    with pytest.raises(TypeError, match="numpy array"):
        act.activate([1.0, 2.0], "leaky")
