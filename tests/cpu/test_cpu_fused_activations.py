"""The float32 activations the convolution epilogues fuse (darknet_metal/cpu/kernels.h).

They are Darknet's formulas with libm's expf replaced by a branch-free polynomial exp, so
they are checked three ways:
- against the float64 NumPy definitions over a dense sweep of inputs, extremes included,
  with the maximum error stated per activation;
- against the scalar functions ``activations.activate`` uses (bit for bit for the
  activations without exp, within a stated bound for the others, same NaN and infinities);
- inside the convolutions: a fused convolution equals the unfused one followed by the
  activation, on every convolution path, and every target_clones variant of the header
  gives the same bits.
"""

from __future__ import annotations

import pathlib
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
from reference import NP_ACTIVATIONS
from shared_paths import ROOT

from darknet_metal.cpu import activation as act
from darknet_metal.cpu import conv, winograd
from darknet_metal.model.activations import ACTIVATIONS

HEADER_DIR = ROOT / "darknet_metal" / "cpu"
FUSABLE = [a for a in ACTIVATIONS if a in NP_ACTIVATIONS and act.fusable(a)]
# Computed with the same float operations as the scalar functions, no exp involved.
EXACT = ["linear", "leaky", "revleaky", "relu", "relu6", "hard_mish", "hardtan", "lhtan",
         "plse", "ramp", "relie", "stair"]
WITH_EXP = ["logistic", "swish", "mish", "tanh", "loggy", "elu", "selu", "gelu"]

F32_MIN = float(np.finfo(np.float32).tiny)  # 2^-126
ULP1 = 2.0**-23  # one ulp of 1.0

# Error bound against the float64 definition: |y - ref| <= RTOL*|ref| + atol. The vector
# exp is within ~1.5 ulp; the measured maxima over the sweep are logistic 1.4e-7,
# swish 1.8e-7, mish 2.7e-7 (relative). The absolute terms are Darknet's own:
# - logistic/swish: e^-x overflows for x < -88.72, giving 0 where the true value is below
#   3e-39 (times |x| for swish; the scalar function does the same);
# - tanh/loggy 2/(1 + e) - 1, elu/selu e^x - 1: cancellation near 0 leaves about an ulp of 1.
# - gelu x/(1 + e^(-2a)), a = 0.797885x + 0.035677x^3: a is rounded in float (about 2.5e-7
#   of |a|), which the exponential turns into a relative error of up to 5e-7*|a| where the
#   value is e^(2a)-small (measured 3.3e-7*|a| at x = -8.9, where the value is 1e-28); and 0
#   where e^(-2a) overflows, the true value being below 3e-39*|x| there.
RTOL = 4e-7
ATOL = {
    "logistic": 3e-39, "swish": 3e-39 * 104, "mish": 1e-43,
    "tanh": 2 * ULP1, "loggy": 2 * ULP1, "elu": ULP1 / 2, "selu": ULP1, "gelu": 1e-45,
}
GELU_RTOL_PER_ABS_A = 6e-7
GELU_ATOL_PER_ABS_X = 3e-39


def gelu_a(x):
    return 0.797885 * x + 0.035677 * x**3


# Float64 definitions where the NumPy one in test_cpu_activations cancels: Darknet's gelu
# 0.5x(1 + tanh(a)) loses everything below 1e-16 of 1 + tanh(a) for negative a, which
# x/(1 + e^(-2a)) (the same function) does not.
STABLE = {"gelu": lambda x: x / (1.0 + np.exp(-2.0 * gelu_a(x)))}
# Against the scalar functions: |fused - scalar| <= RTOL*|scalar| + atol, atol as below.
# mish is the one where they differ by more than an exp's ulps: Darknet's
# x * tanh(softplus(x)) loses about an ulp of 1 inside the tanh, times |x|; the fused
# x*n/(n + 2) does not (it is the more accurate of the two, see the float64 bound above).
# gelu: Darknet's 1 + tanh(a) loses about half an ulp of 1, times |x|/2 (and is 0 where the
# tanh rounds to -1); the fused form has the float-rounded a as above.
ATOL_VS_SCALAR = {"logistic": 1e-43, "swish": 1e-43, "tanh": 2 * ULP1, "loggy": 2 * ULP1,
                  "elu": 2 * ULP1, "selu": 2 * ULP1, "gelu": 1e-45}
MISH_VS_SCALAR_PER_ABS_X = 2 * ULP1
GELU_VS_SCALAR_PER_ABS_X = ULP1 / 2


def sweep() -> np.ndarray:
    """Dense float32 inputs: magnitudes 1e-45..1e4 on a log scale, 0..120 on a linear one,
    both signs, and the edges (+-0, subnormals, where exp overflows or underflows)."""
    pos = np.concatenate([np.logspace(-45, 4, 100001), np.linspace(0, 120, 120001)])
    edges = [0.0, 1e-45, 1e-40, 1.17e-38, 20.0, 20.000002, 19.999998, 88.72, 88.73, 89.0,
             103.9, 104.0, 105.0, 150.0, 1e4]
    x = np.concatenate([pos, -pos, edges, -np.asarray(edges)]).astype(np.float32)
    assert np.signbit(x[x == 0]).any() and (~np.signbit(x[x == 0])).any()
    return x


def fused(x, name):
    y = x.reshape(1, -1).copy()
    act.activate_fused(y, name)
    return y.reshape(-1)


def scalar(x, name):
    y = x.reshape(1, -1).copy()
    act.activate(y, name)
    return y.reshape(-1)


def test_fusable_set():
    assert set(FUSABLE) == set(EXACT) | set(WITH_EXP)
    assert set(FUSABLE) == {a for a in ACTIVATIONS if not a.startswith("normalize_channels")}
    assert not act.fusable("normalize_channels")


@pytest.mark.parametrize("name", WITH_EXP)
def test_matches_float64_definition(name):
    x = sweep()
    y = fused(x, name).astype(np.float64)
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        ref = STABLE.get(name, NP_ACTIVATIONS[name])(x64)
    finite = np.isfinite(ref)
    assert np.isfinite(y[finite]).all() or name in ("elu", "selu"), name
    ok = finite & np.isfinite(y)
    err = np.abs(y - ref)[ok]
    bound = RTOL * np.abs(ref[ok]) + ATOL[name]
    if name == "gelu":
        with np.errstate(all="ignore"):
            bound += (GELU_RTOL_PER_ABS_A * np.abs(gelu_a(x64[ok])) * np.abs(ref[ok])
                      + GELU_ATOL_PER_ABS_X * np.abs(x64[ok]))
    worst = np.argmax(err - bound)
    assert (err <= bound).all(), (name, x[ok][worst], y[ok][worst], ref[ok][worst])


@pytest.mark.parametrize("name", FUSABLE)
def test_agrees_with_scalar_functions(name):
    x = np.concatenate([sweep(), np.array([np.inf, -np.inf, np.nan], np.float32)])
    y, s = fused(x, name), scalar(x, name)
    if name in EXACT:
        np.testing.assert_array_equal(_bits(y), _bits(s), err_msg=name)
        return
    # Same NaNs (mish(-inf)) and the same infinities.
    np.testing.assert_array_equal(np.isnan(y), np.isnan(s), err_msg=name)
    both = ~np.isnan(y)
    np.testing.assert_array_equal(np.isinf(y[both]), np.isinf(s[both]), err_msg=name)
    fin = both & np.isfinite(y)
    y64, s64, x64 = (a[fin].astype(np.float64) for a in (y, s, x))
    if name == "mish":
        bound = RTOL * np.abs(s64) + MISH_VS_SCALAR_PER_ABS_X * np.abs(x64) + 1e-43
    elif name == "gelu":
        bound = (RTOL * np.abs(s64) + GELU_RTOL_PER_ABS_A * np.abs(gelu_a(x64)) * np.abs(s64)
                 + GELU_VS_SCALAR_PER_ABS_X * np.abs(x64) + GELU_ATOL_PER_ABS_X * np.abs(x64))
    else:
        bound = RTOL * np.abs(s64) + ATOL_VS_SCALAR[name]
    assert (np.abs(y64 - s64) <= bound).all(), name


def test_overflowing_exp_gives_limits_not_nan():
    # Darknet's logistic is 1/(1 + expf(-x)): 0 once expf overflows (x < -88.72), never NaN.
    x = np.array([-88.7, -88.73, -89.0, -103.0, -104.0, -105.0, -1e4, -np.inf], np.float32)
    lo = fused(x, "logistic")
    assert not np.isnan(lo).any() and (lo >= 0).all() and (lo[1:] == 0).all()
    assert lo[0] > 0  # 1/(1 + 3.3e38): subnormal, still positive
    sw = fused(x[:-1], "swish")
    assert not np.isnan(sw).any() and (sw[1:] == 0).all()
    assert (fused(x, "tanh") == -1).all() and (fused(x, "loggy") == -1).all()
    assert (fused(-x, "logistic") == 1).all() and (fused(-x[:-1], "swish") == -x[:-1]).all()
    big = np.array([20.5, 88.8, 1e4, 3e38, np.inf], np.float32)
    np.testing.assert_array_equal(fused(big, "mish"), big)  # x above the threshold 20
    np.testing.assert_array_equal(fused(-x[1:-1], "mish"), -x[1:-1])
    m = fused(x[:-1], "mish")
    assert not np.isnan(m).any() and (m <= 0).all()
    for name in ("elu", "selu"):  # no 0 * inf: each value takes its own branch
        big = np.array([100.0, 1e4], np.float32)
        scale = np.float32(1.0 if name == "elu" else 1.0507)
        np.testing.assert_array_equal(fused(big, name), scale * big)
        assert np.isfinite(fused(x, name)).all()


def test_zeros_and_subnormals():
    tiny = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, 1.1e-38, -1.1e-38], np.float32)
    np.testing.assert_array_equal(fused(tiny, "logistic"), np.full(8, 0.5, np.float32))
    for name in ("swish", "mish"):
        y = fused(tiny, name).astype(np.float64)
        k = {"swish": 0.5, "mish": np.tanh(np.log(2.0))}[name]
        np.testing.assert_allclose(y, k * tiny.astype(np.float64), rtol=2e-6, atol=2e-45)
        assert (np.signbit(y) == np.signbit(tiny)).all()


def test_activate_fused_rejects_what_it_cannot_do():
    from darknet_metal.errors import ArgumentError, ArgumentTypeError

    with pytest.raises(ArgumentTypeError):
        act.activate_fused(np.zeros((1, 4)), "mish")
    with pytest.raises(ArgumentError):
        act.activate_fused(np.zeros((1, 4), np.float32), "normalize_channels")


# ---------------------------------------------------------------------------------------
# Inside the convolutions.


def _case(n, c, h, w, f, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((f, c * k * k)) / np.sqrt(c * k * k)).astype(np.float32)
    # Outputs from about -120 to 120: past mish's threshold 20 and logistic's -88.7.
    b = np.linspace(-110, 110, f).astype(np.float32)
    return x, wt, b


def _conv(x, wt, b, k, stride, act_name):
    n, c, h, w = x.shape
    pad = k // 2
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    out = np.full((n, wt.shape[0], oh, ow), np.nan, x.dtype)
    ws = np.empty(max(1, conv.workspace_size(c, k, 1, oh, ow), 9 * c * (h + 2) * (w + 34)
                      + 9 * c * (wt.shape[0] + 8)), x.dtype)
    conv.conv2d_forward(x, wt, b, out, ws, k, stride, stride, pad, 1, 1,
                        ACTIVATIONS.index(act_name))
    return out


# direct 3x3 (few channels), im2col + GEMM 3x3 (stride 1 and 2), 1x1 GEMM.
CONV_CASES = {"direct": (2, 3, 9, 37, 11, 3, 1), "gemm3x3": (1, 20, 7, 13, 6, 3, 1),
              "gemm3x3s2": (1, 20, 9, 14, 5, 3, 2), "gemm1x1": (2, 24, 5, 6, 7, 1, 1)}


@pytest.mark.parametrize("name", FUSABLE)
@pytest.mark.parametrize("path", list(CONV_CASES))
def test_fused_convolution_equals_convolution_then_activation(path, name):
    n, c, h, w, f, k, stride = CONV_CASES[path]
    x, wt, b = _case(n, c, h, w, f, k, seed=len(path))
    lin = _conv(x, wt, b, k, stride, "linear")
    out = _conv(x, wt, b, k, stride, name)
    ref = lin.copy()
    act.activate_fused(ref, name)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("name", FUSABLE)
def test_fused_winograd_equals_winograd_then_activation(name):
    x, wt, b = _case(1, 8, 7, 131, 5, 3, seed=3)  # three 64-tile chunks, a half tile
    u = winograd.transform_filters(wt, 8)
    outs = []
    for a in ("linear", name):
        out = np.full((1, 5, 7, 131), np.nan, np.float32)
        ws = np.empty(winograd.workspace_size(8, 5, 7, 131), np.float32)
        winograd.winograd_forward(x, u, b, out, ws, ACTIVATIONS.index(a))
        outs.append(out)
    act.activate_fused(outs[0], name)
    np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32), name)


@pytest.mark.parametrize("name", ["mish", "swish", "logistic", "gelu", "stair"])
def test_float64_and_unfused_keep_the_scalar_functions(name):
    x, wt, b = _case(1, 20, 6, 7, 4, 3, seed=9)
    for dtype in (np.float64, np.float32):
        if dtype == np.float32 and act.fusable(name):
            continue
        xd, wd, bd = (a.astype(dtype) for a in (x, wt, b))
        lin = _conv(xd, wd, bd, 3, 1, "linear")
        act.activate(lin, name)
        np.testing.assert_array_equal(_conv(xd, wd, bd, 3, 1, name), lin, err_msg=name)


def test_connected_fuses_too():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 17)).astype(np.float32)
    wt = rng.standard_normal((9, 17)).astype(np.float32)
    b = np.linspace(-30, 30, 9).astype(np.float32)
    lin = np.empty((3, 9), np.float32)
    conv.connected_forward(x, wt, b, lin, ACTIVATIONS.index("linear"))
    out = np.empty((3, 9), np.float32)
    conv.connected_forward(x, wt, b, out, ACTIVATIONS.index("mish"))
    act.activate_fused(lin, "mish")
    np.testing.assert_array_equal(out, lin)


# ---------------------------------------------------------------------------------------
# Every target_clones variant.

# The header compiled once per instruction set the clones target, with the flags setup.py
# gives the extensions; the program applies each fused activation (and the bias epilogue)
# to the sweep and writes the results.
PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include "kernels.h"
int main(int argc, char **argv)
{
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    long n;
    if (!in || !out || fread(&n, sizeof n, 1, in) != 1)
        return 1;
    float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    const float bias[4] = {0.0f, 1.5f, -3.25f, 40.0f};
    if (fread(x, sizeof *x, (size_t)n, in) != (size_t)n)
        return 1;
    for (int act = DM_ACT_LINEAR; act <= DM_ACT_REVLEAKY; act++) {
        if (!dm_act_fusable(act))
            continue;
        memcpy(y, x, (size_t)n * sizeof *y);
        dm_act_f32(y, n, act);
        fwrite(y, sizeof *y, (size_t)n, out);
        memcpy(y, x, (size_t)n * sizeof *y);
        dm_bias_act_f32(y, bias, 4, n / 4, act);
        fwrite(y, sizeof *y, (size_t)n, out);
    }
    return fclose(out) != 0;
}
"""
VARIANTS = {"avx512f": ["-mavx512f"], "avx2": ["-mavx2"], "baseline": []}


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bits with every NaN made one: x86 propagates the first operand's NaN and a
    compiler orders commutative operands freely, so a NaN's sign may differ between
    variants (the value, NaN, does not)."""
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="target_clones variants exist on x86-64 Linux only",
)
def test_every_clone_variant_gives_the_same_bits(tmp_path):
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no gcc on PATH")
    flags = _cpu_flags()
    x = np.concatenate([sweep()[::7], np.array([np.inf, -np.inf, np.nan], np.float32)])
    x = x[: len(x) // 4 * 4]
    data = tmp_path / "x.bin"
    data.write_bytes(np.int64(len(x)).tobytes() + x.tobytes())
    (tmp_path / "prog.c").write_text(PROGRAM)
    results = {}
    for variant, extra in VARIANTS.items():
        if extra and extra[0][2:] not in flags:
            continue
        exe = tmp_path / f"prog_{variant}"
        # -U__linux__ compiles each function once, for the -m flags given.
        cmd = [compiler, "-std=c11", "-O3", "-ffp-contract=off", "-fno-trapping-math",
               "-U__linux__", *extra, f"-I{HEADER_DIR}", str(tmp_path / "prog.c"), "-o",
               str(exe)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        res = tmp_path / f"out_{variant}.bin"
        assert subprocess.run([str(exe), str(data), str(res)]).returncode == 0
        results[variant] = _bits(np.fromfile(res, np.float32))
    assert "baseline" in results
    base = results["baseline"]
    assert base.size == 2 * len(FUSABLE) * len(x)
    for variant, r in results.items():
        np.testing.assert_array_equal(r, base, err_msg=variant)
    # And the extension (whichever clone the loader picked) gives the same bits.
    ext = []
    for name in sorted(FUSABLE, key=ACTIVATIONS.index):
        ext.append(_bits(fused(x, name)))
        y = x.reshape(4, -1).copy()
        lin = y.copy()
        lin += np.array([0.0, 1.5, -3.25, 40.0], np.float32)[:, None]
        act.activate_fused(lin, name)
        ext.append(_bits(lin.reshape(-1)))
    np.testing.assert_array_equal(np.concatenate(ext), base)
