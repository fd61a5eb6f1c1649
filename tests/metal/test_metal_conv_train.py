"""Training kernels of convolutional and connected layers (``im2col.metal``,
``batchnorm.metal``) in the emulator against the CPU reference: col2im, the bias gradient,
batch norm's training forward and backward, and the weight and input gradients composed from
im2col, col2im and the GEMMs, under forward, reverse and random thread order.

The GEMM argument helpers below are the values a host uses for these dispatches."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS

from darknet_metal.cpu import batchnorm, conv, im2col
from darknet_metal.metal.dispatch import gemm_args
from darknet_metal.metal.registry import BIAS_NONE


def _rand(shape, seed, scale=1.0, offset=0.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def _poisoned(shape):
    # An output element the kernel forgets to write stays NaN and fails the comparison.
    return np.full(shape, np.nan, np.float32)


def _rel_l2(got, want):
    """Relative L2 error of got against want (0 when both are zero)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norm = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / norm) if norm else float(np.linalg.norm(got))


def _same_in_every_order(results):
    """Results of one dispatch sequence under each thread order are bit-identical."""
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first, other, strict=True):
            np.testing.assert_array_equal(a, b)


def _out_size(size, ksize, stride, pad, dil):
    return (size + 2 * pad * dil - dil * (ksize - 1) - 1) // stride + 1


# ---- argument values a host uses -----------------------------------------------------------


def im2col_args(cg, h, w, ksize, sx, sy, pad, dil, oh, ow):
    """dm_im2col_args of im2col_fwd_f32 and col2im_bwd_f32: channels per group, the layer's
    pad (the kernels pad pad*dilation pixels)."""
    return {
        "channels": cg,
        "height": h,
        "width": w,
        "ksize": ksize,
        "stride_x": sx,
        "stride_y": sy,
        "pad": pad,
        "dilation": dil,
        "out_h": oh,
        "out_w": ow,
    }


def conv_weight_grad_gemm(c, f, groups, ksize, h, w, oh, ow, direct):
    """gemm_nt[_simd]_f32 of a convolution's weight gradient, dispatched once per image b:
    weight_grad[g] (F/groups x K) += delta[b, g] (F/groups x out_h*out_w) @ cols[b, g]^T.

    Bind a = delta at offset b*F*out_h*out_w, b = the im2col columns at offset
    b*groups*K*out_h*out_w (direct 1x1: x at b*C*H*W, whose planes are the columns),
    c = weight_grad. Slices are the groups only: the images all add into one weight_grad, so
    they are separate dispatches, in order, rather than slices that would race on it."""
    cg, fg, spatial = c // groups, f // groups, oh * ow
    k = cg * ksize * ksize
    return gemm_args(
        M=fg,
        N=k,
        K=spatial,
        lda=spatial,
        ldb=spatial,
        ldc=k,
        bias_mode=BIAS_NONE,
        act=0,
        groups=groups,
        slices=groups,
        beta=1.0,
        a_group_stride=fg * spatial,
        b_group_stride=(cg * h * w) if direct else k * spatial,
        c_group_stride=fg * k,
    )


def conv_input_grad_gemm(c, f, groups, ksize, h, w, oh, ow, n, direct):
    """gemm_tn[_simd]_f32 of a convolution's input gradient, all images in one dispatch
    (slice z = image*groups + group): cols[b, g] (K x out_h*out_w) = W[g]^T @ delta[b, g].

    Bind a = weights, b = delta, c = a column workspace of n*groups*K*out_h*out_w floats
    (beta 0: it need not be initialised), then col2im_bwd_f32 adds it into x_grad. A direct
    1x1 convolution writes x_grad itself, with beta 1 (accumulating)."""
    cg, fg, spatial = c // groups, f // groups, oh * ow
    k = cg * ksize * ksize
    return gemm_args(
        M=k,
        N=spatial,
        K=fg,
        lda=k,
        ldb=spatial,
        ldc=spatial,
        bias_mode=BIAS_NONE,
        act=0,
        groups=groups,
        slices=n * groups,
        beta=1.0 if direct else 0.0,
        a_group_stride=fg * k,
        b_batch_stride=f * spatial,
        b_group_stride=fg * spatial,
        c_batch_stride=c * h * w if direct else groups * k * spatial,
        c_group_stride=cg * h * w if direct else k * spatial,
    )


def connected_weight_grad_gemm(batch, inputs, outputs):
    """gemm_tn[_simd]_f32: weight_grad (outputs x inputs) += delta^T @ x; a = delta
    (batch x outputs), b = x (batch x inputs), c = weight_grad."""
    return gemm_args(M=outputs, N=inputs, K=batch, lda=outputs, ldb=inputs, ldc=inputs,
                     bias_mode=BIAS_NONE, act=0, beta=1.0)


def connected_input_grad_gemm(batch, inputs, outputs):
    """gemm_nn[_simd]_f32: x_grad (batch x inputs) += delta @ weights; a = delta, b = weights
    (outputs x inputs), c = x_grad."""
    return gemm_args(M=batch, N=inputs, K=outputs, lda=outputs, ldb=inputs, ldc=inputs,
                     bias_mode=BIAS_NONE, act=0, beta=1.0)


def batchnorm_args(batch, channels, spatial, *, momentum=0.0, eps=batchnorm.EPS, exact=False):
    """dm_batchnorm_args: both momentum factors rounded from the double momentum, as the CPU
    rounds them (1 - momentum is not computed in float)."""
    return {
        "batch": batch,
        "channels": channels,
        "spatial": spatial,
        "eps": eps,
        "momentum": momentum,
        "one_minus_momentum": 1.0 - momentum,
        "exact": int(exact),
    }


def _layout(shape):
    return (shape[0], shape[1], 1) if len(shape) == 2 else (shape[0], shape[1],
                                                            shape[2] * shape[3])


# ---- col2im --------------------------------------------------------------------------------

COL2IM = [  # (batch, channels, h, w, ksize, stride_x, stride_y, pad, dilation, groups)
    (2, 3, 13, 13, 3, 1, 1, 1, 1, 1),
    (1, 4, 7, 7, 3, 2, 2, 1, 1, 2),
    (1, 5, 9, 7, 3, 1, 2, 2, 2, 1),
    (2, 3, 7, 5, 2, 2, 1, 0, 1, 3),
    (1, 3, 1, 1, 3, 1, 1, 1, 1, 1),
    (1, 2, 8, 9, 5, 3, 2, 2, 1, 1),
    (1, 2, 6, 6, 1, 2, 2, 0, 1, 1),  # 1x1 stride 2: some pixels receive nothing
    (1, 3, 160, 160, 3, 1, 1, 1, 1, 1),  # 76800 image elements
]


@pytest.mark.parametrize("case", COL2IM)
def test_col2im(emu_runner, case):
    n, c, h, w, ksize, sx, sy, pad, dil, groups = case
    cg = c // groups
    oh, ow = _out_size(h, ksize, sy, pad, dil), _out_size(w, ksize, sx, pad, dil)
    col = _rand((n * groups, cg * ksize * ksize, oh * ow), 1)
    start = _rand((n, c, h, w), 2)
    want = start.copy()
    for b in range(n):
        for g in range(groups):
            im2col.col2im_add(col[b * groups + g], want[b, g * cg : (g + 1) * cg], ksize, sx, sy,
                              pad * dil, dil, oh, ow)
    results = []
    for order in ORDERS:
        image = start.copy()
        emu_runner.run("col2im_bwd_f32", im2col_args(cg, h, w, ksize, sx, sy, pad, dil, oh, ow),
                       {"col": col, "image": image},
                       {"spatial": h * w, "channels": cg, "slices": n * groups}, order=order)
        # Each pixel adds its taps in the CPU's order: the same float sums.
        np.testing.assert_array_equal(image, want, err_msg=order)
        results.append((image,))
    _same_in_every_order(results)


# ---- bias gradient -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 7, 13, 13), (3, 5, 1, 1), (5, 13), (1, 1, 7, 7),
                                   (64, 3), (2, 3, 200, 200)])
def test_bias_grad(emu_runner, shape):
    delta = _rand(shape, 3, offset=0.5)
    start = _rand(shape[1], 4, scale=10.0)
    want = start.copy()
    conv.bias_grad_step(delta, want).run()
    n, c, spatial = _layout(shape)
    results = []
    for order in ORDERS:
        got = start.copy()
        emu_runner.run("bias_bwd_f32", {"batch": n, "channels": c, "spatial": spatial},
                       {"delta": delta, "bias_grad": got}, {"channels": c}, order=order)
        results.append((got,))
    _same_in_every_order(results)
    # Darknet's serial sums, image by image, as the CPU adds them: the same bits.
    np.testing.assert_array_equal(got, want)


# ---- batch norm forward --------------------------------------------------------------------

BN_SHAPES = [(2, 7, 13, 13), (3, 5, 1, 1), (5, 13), (1, 3, 7, 7), (2, 3, 200, 200)]


def _bn_cpu_forward(x, scale, bias, rolling, momentum):
    c = x.shape[1]
    mean, var = np.empty(c, np.float32), np.empty(c, np.float32)
    x_norm, out = np.empty_like(x), np.empty_like(x)
    rm, rv = rolling[0].copy(), rolling[1].copy()
    batchnorm.batchnorm_forward_train(x, mean, var, x_norm, out, scale, bias, rm, rv, momentum)
    return mean, var, rm, rv, x_norm, out


def _bn_emu_forward(runner, x, scale, bias, rolling, momentum, order):
    n, c, spatial = _layout(x.shape)
    args = batchnorm_args(n, c, spatial, momentum=momentum)
    mean, var = _poisoned(c), _poisoned(c)
    rm, rv = rolling[0].copy(), rolling[1].copy()
    runner.run("batchnorm_fwd_stats_f32", args,
               {"x": x, "mean": mean, "variance": var, "rolling_mean": rm,
                "rolling_variance": rv}, {"channels": c}, order=order)
    x_norm, out = _poisoned(x.shape), _poisoned(x.shape)
    runner.run("batchnorm_fwd_norm_f32", args,
               {"x": x, "mean": mean, "variance": var, "scale": scale, "bias": bias,
                "x_norm": x_norm, "out": out},
               {"spatial": spatial, "channels": c, "batch": n}, order=order)
    return mean, var, rm, rv, x_norm, out


@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batchnorm_forward(emu_runner, shape):
    c = shape[1]
    momentum = batchnorm.MOMENTUM_CONNECTED if len(shape) == 2 else batchnorm.MOMENTUM_CONV
    x = _rand(shape, 5, scale=2.0, offset=3.0)
    scale, bias = _rand(c, 6), _rand(c, 7)
    rolling = (_rand(c, 8), np.abs(_rand(c, 9)) + np.float32(0.5))
    want = _bn_cpu_forward(x, scale, bias, rolling, momentum)
    results = [_bn_emu_forward(emu_runner, x, scale, bias, rolling, momentum, order)
               for order in ORDERS]
    _same_in_every_order(results)
    got = results[0]
    # Darknet's serial sums, as the CPU's: the statistics and what follows are the same bits.
    names = ("mean", "variance", "rolling_mean", "rolling_variance", "x_norm", "out")
    for name, g, w in zip(names, got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)
    # And they are float sums: against float64 ones, within O(n) roundings.
    n, _, spatial = _layout(shape)
    per_channel = x.astype(np.float64).reshape(n, c, spatial).transpose(1, 0, 2).reshape(c, -1)
    assert _rel_l2(got[0], per_channel.mean(axis=1)) < 1e-5
    assert _rel_l2(got[1], per_channel.var(axis=1, ddof=1)) < 1e-4


@pytest.mark.parametrize("shape", [(2, 7, 13, 13), (5, 13)])
def test_batchnorm_normalisation_is_the_cpus_bit_for_bit(emu_runner, shape):
    """Given the same statistics, x_norm and out (written over x) and the recomputed x_norm
    are the CPU's exactly."""
    n, c, spatial = _layout(shape)
    x = _rand(shape, 10, scale=2.0, offset=-1.0)
    scale, bias = _rand(c, 11), _rand(c, 12)
    mean, var, _, _, x_norm, out = _bn_cpu_forward(x, scale, bias, (np.zeros(c, np.float32),) * 2,
                                                   0.9)
    again = _poisoned(shape)
    batchnorm.batchnorm_normalized_step(x, mean, var, again).run()
    np.testing.assert_array_equal(again, x_norm)
    args = batchnorm_args(n, c, spatial)
    sizes = {"spatial": spatial, "channels": c, "batch": n}
    for order in ORDERS:
        y, got_norm = x.copy(), _poisoned(shape)
        emu_runner.run("batchnorm_fwd_norm_f32", args,
                       {"x": y, "mean": mean, "variance": var, "scale": scale, "bias": bias,
                        "x_norm": got_norm, "out": y}, sizes, order=order)
        np.testing.assert_array_equal(got_norm, x_norm)
        np.testing.assert_array_equal(y, out)
        recomputed = _poisoned(shape)
        emu_runner.run("batchnorm_fwd_xnorm_f32", args,
                       {"x": x, "mean": mean, "variance": var, "x_norm": recomputed}, sizes,
                       order=order)
        np.testing.assert_array_equal(recomputed, x_norm)


# ---- batch norm backward -------------------------------------------------------------------


def _bn_backward_inputs(shape, seed, x_scale=2.0, x_offset=3.0):
    c = shape[1]
    x = _rand(shape, seed, scale=x_scale, offset=x_offset)
    mean, var, _, _, x_norm, _ = _bn_cpu_forward(x, _rand(c, seed + 1), _rand(c, seed + 2),
                                                 (np.zeros(c, np.float32),) * 2, 0.9)
    delta = _rand(shape, seed + 3, scale=0.1, offset=0.02)
    scale = _rand(c, seed + 4)
    grads = (_rand(c, seed + 5), _rand(c, seed + 6))  # scale_grad, bias_grad: accumulated
    return x, mean, var, x_norm, delta, scale, grads


def _bn_cpu_backward(x, mean, var, x_norm, delta, scale, grads, exact):
    d, sg, bg = delta.copy(), grads[0].copy(), grads[1].copy()
    batchnorm.batchnorm_backward(d, x, mean, var, x_norm, scale, sg, bg, exact=exact)
    return d, sg, bg


def _bn_emu_backward(runner, x, mean, var, x_norm, delta, scale, grads, exact, order):
    n, c, spatial = _layout(x.shape)
    args = batchnorm_args(n, c, spatial, exact=exact)
    d, sg, bg = delta.copy(), grads[0].copy(), grads[1].copy()
    mean_delta, var_delta = _poisoned(c), _poisoned(c)
    runner.run("batchnorm_bwd_sums_f32", args,
               {"delta": d, "x": x, "mean": mean, "variance": var, "x_norm": x_norm,
                "scale": scale, "scale_grad": sg, "bias_grad": bg, "mean_delta": mean_delta,
                "var_delta": var_delta}, {"channels": c}, order=order)
    runner.run("batchnorm_bwd_delta_f32", args,
               {"x": x, "mean": mean, "variance": var, "scale": scale,
                "mean_delta": mean_delta, "var_delta": var_delta, "delta": d},
               {"spatial": spatial, "channels": c, "batch": n}, order=order)
    return d, sg, bg


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batchnorm_backward(emu_runner, shape, exact):
    inputs = _bn_backward_inputs(shape, 20)
    want = _bn_cpu_backward(*inputs, exact)
    results = [_bn_emu_backward(emu_runner, *inputs, exact, order) for order in ORDERS]
    _same_in_every_order(results)
    delta, scale_grad, bias_grad = results[0]
    # The sums are Darknet's serial ones, as the CPU's: the same bits. The delta formula is
    # float here and double on the CPU (Metal has no double): a few roundings apart.
    np.testing.assert_array_equal(scale_grad, want[1])
    np.testing.assert_array_equal(bias_grad, want[2])
    assert _rel_l2(delta, want[0]) < 1e-6, _rel_l2(delta, want[0])


@pytest.mark.parametrize("shape", [(2, 5, 7, 7), (6, 9)])
def test_batchnorm_extreme_inputs_stay_finite(any_math_runner, shape):
    """Inputs of +-1e4 around a large offset, on the IEEE and the -ffast-math build."""
    c = shape[1]
    x = _rand(shape, 30, scale=1e4, offset=5e3)
    scale, bias = _rand(c, 31), _rand(c, 32)
    rolling = (np.zeros(c, np.float32), np.ones(c, np.float32))
    want = _bn_cpu_forward(x, scale, bias, rolling, 0.9)
    got = _bn_emu_forward(any_math_runner, x, scale, bias, rolling, 0.9, "forward")
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g).all()
        assert _rel_l2(g, w) < 1e-5
    inputs = _bn_backward_inputs(shape, 33, x_scale=1e4, x_offset=-5e3)
    want = _bn_cpu_backward(*inputs, False)
    got = _bn_emu_backward(any_math_runner, *inputs, False, "forward")
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g).all()
        assert _rel_l2(g, w) < 1e-4


# ---- convolution and connected gradients from im2col, col2im and GEMMs ---------------------

CONVS = [  # (batch, channels, h, w, filters, ksize, stride_x, stride_y, pad, dilation, groups)
    (2, 3, 7, 7, 5, 3, 1, 1, 1, 1, 1),
    (2, 4, 7, 5, 6, 3, 1, 1, 1, 1, 2),
    (1, 3, 13, 13, 5, 3, 2, 2, 1, 1, 1),
    (1, 5, 9, 9, 3, 3, 1, 1, 2, 2, 1),
    (1, 3, 7, 6, 4, 2, 1, 2, 0, 1, 1),
    (2, 6, 7, 7, 4, 1, 1, 1, 0, 1, 2),  # 1x1: the GEMMs read x and write x_grad directly
]


def _conv_backward_on_emu(runner, x, w, delta, wgrad, xgrad, case, simd, order):
    n, c, h, wd, f, ksize, sx, sy, pad, dil, groups = case
    oh, ow = delta.shape[2:]
    cg, spatial = c // groups, oh * ow
    k = cg * ksize * ksize
    direct = ksize == 1 and sx == 1 and sy == 1 and pad == 0
    suffix = "_simd_f32" if simd else "_f32"
    geometry = im2col_args(cg, h, wd, ksize, sx, sy, pad, dil, oh, ow)
    # Weight gradient: the columns of every image, then one accumulating GEMM per image.
    if direct:
        cols, per_image = x.reshape(-1), c * h * wd
    else:
        cols, per_image = _poisoned(n * groups * k * spatial), groups * k * spatial
        runner.run("im2col_fwd_f32", geometry, {"image": x, "col": cols},
                   {"spatial": spatial, "rows": k, "slices": n * groups}, order=order)
    args, sizes = conv_weight_grad_gemm(c, f, groups, ksize, h, wd, oh, ow, direct)
    flat_delta = delta.reshape(-1)
    for b in range(n):
        runner.run("gemm_nt" + suffix, args,
                   {"a": flat_delta[b * f * spatial : (b + 1) * f * spatial],
                    "b": cols[b * per_image : (b + 1) * per_image], "bias": None, "c": wgrad},
                   sizes, order=order)
    # Input gradient: W^T @ delta into columns, folded back by col2im (direct: into x_grad).
    args, sizes = conv_input_grad_gemm(c, f, groups, ksize, h, wd, oh, ow, n, direct)
    target = xgrad if direct else _poisoned(n * groups * k * spatial)
    runner.run("gemm_tn" + suffix, args, {"a": w, "b": delta, "bias": None, "c": target},
               sizes, order=order)
    if not direct:
        runner.run("col2im_bwd_f32", geometry, {"col": target, "image": xgrad},
                   {"spatial": h * wd, "channels": cg, "slices": n * groups}, order=order)


@pytest.mark.parametrize("simd", [False, True])
@pytest.mark.parametrize("case", CONVS)
def test_conv_backward_composed(emu_runner, case, simd):
    n, c, h, wd, f, ksize, sx, sy, pad, dil, groups = case
    oh, ow = _out_size(h, ksize, sy, pad, dil), _out_size(wd, ksize, sx, pad, dil)
    x = _rand((n, c, h, wd), 40)
    w = _rand((f, c // groups * ksize * ksize), 41)
    delta = _rand((n, f, oh, ow), 42)
    wgrad0, xgrad0 = _rand(w.shape, 43), _rand(x.shape, 44)
    ws = np.empty(max(1, conv.backward_workspace_size(c, ksize, groups, oh, ow)), np.float32)
    want_w, want_x = wgrad0.copy(), xgrad0.copy()
    geometry = (ksize, sx, sy, pad, dil, groups)
    conv.conv2d_backward_weights_step(x, delta, want_w, ws, *geometry).run()
    conv.conv2d_backward_input_step(w, delta, want_x, ws, *geometry).run()
    results = []
    for order in ORDERS:
        wgrad, xgrad = wgrad0.copy(), xgrad0.copy()
        _conv_backward_on_emu(emu_runner, x, w, delta, wgrad, xgrad, case, simd, order)
        results.append((wgrad, xgrad))
    _same_in_every_order(results)
    wgrad, xgrad = results[0]
    assert _rel_l2(wgrad, want_w) < 1e-6
    assert _rel_l2(xgrad, want_x) < 1e-6
    np.testing.assert_allclose(wgrad, want_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xgrad, want_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("simd", [False, True])
@pytest.mark.parametrize("batch,inputs,outputs", [(5, 13, 7), (1, 40, 33), (64, 9, 3)])
def test_connected_backward_composed(emu_runner, batch, inputs, outputs, simd):
    x, w = _rand((batch, inputs), 50), _rand((outputs, inputs), 51)
    delta = _rand((batch, outputs), 52)
    wgrad0, xgrad0, bgrad0 = _rand(w.shape, 53), _rand(x.shape, 54), _rand(outputs, 55)
    want_w, want_x, want_b = wgrad0.copy(), xgrad0.copy(), bgrad0.copy()
    conv.connected_backward_step(x, w, delta, want_w, want_x).run()
    conv.bias_grad_step(delta, want_b).run()
    suffix = "_simd_f32" if simd else "_f32"
    results = []
    for order in ORDERS:
        wgrad, xgrad, bgrad = wgrad0.copy(), xgrad0.copy(), bgrad0.copy()
        args, sizes = connected_weight_grad_gemm(batch, inputs, outputs)
        emu_runner.run("gemm_tn" + suffix, args, {"a": delta, "b": x, "bias": None, "c": wgrad},
                       sizes, order=order)
        args, sizes = connected_input_grad_gemm(batch, inputs, outputs)
        emu_runner.run("gemm_nn" + suffix, args, {"a": delta, "b": w, "bias": None, "c": xgrad},
                       sizes, order=order)
        emu_runner.run("bias_bwd_f32", {"batch": batch, "channels": outputs, "spatial": 1},
                       {"delta": delta, "bias_grad": bgrad}, {"channels": outputs},
                       order=order)
        results.append((wgrad, xgrad, bgrad))
    _same_in_every_order(results)
    for got, want in zip(results[0], (want_w, want_x, want_b), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
