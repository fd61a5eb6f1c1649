"""Cases composing whole convolutional and connected layers from ``shaders/im2col.metal``,
``shaders/gemm.metal`` and the bias gradient of ``shaders/batchnorm.metal``, against the CPU
layers: the forward (im2col, then one batched, grouped GEMM with bias and activation) and the
weight, input and bias gradients, with the GEMM arguments a host uses for each."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import conv
from darknet_metal.diagnostics.kernel_cases.batchnorm import bias_steps, partials_for
from darknet_metal.diagnostics.kernel_cases.im2col import im2col_args, out_size
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    KernelCase,
    RelL2,
    Step,
    nan_filled,
    normal,
)
from darknet_metal.metal.dispatch import BIAS_COLS, BIAS_NONE, BIAS_ROWS, gemm_args
from darknet_metal.model.activations import ACTIVATION_ID

Gemm = tuple[dict[str, int | float], dict[str, int]]


def conv_forward_gemm(c: int, f: int, groups: int, ksize: int, h: int, w: int, oh: int,
                      ow: int, n: int, act: str, direct: bool) -> Gemm:
    """gemm_nn[_simd]_f32 of a convolution's forward, all images in one dispatch (slice z =
    image*groups + group): y[b, g] = act(W[g] @ cols[b, g] + bias[g]); a = weights, b = the
    im2col columns (direct 1x1: x, whose planes are the columns), c = y."""
    cg, fg, spatial = c // groups, f // groups, oh * ow
    k = cg * ksize * ksize
    return gemm_args(M=fg, N=spatial, K=k, lda=k, ldb=spatial, ldc=spatial, groups=groups,
                     slices=n * groups, bias_mode=BIAS_ROWS, act=ACTIVATION_ID[act],
                     a_group_stride=fg * k,
                     b_batch_stride=c * h * w if direct else groups * k * spatial,
                     b_group_stride=cg * h * w if direct else k * spatial,
                     c_batch_stride=f * spatial, c_group_stride=fg * spatial,
                     bias_group_stride=fg)


def conv_weight_grad_gemm(c: int, f: int, groups: int, ksize: int, h: int, w: int, oh: int,
                          ow: int, direct: bool) -> Gemm:
    """gemm_nt[_simd]_f32 of a convolution's weight gradient, dispatched once per image b:
    weight_grad[g] (F/groups x K) += delta[b, g] (F/groups x out_h*out_w) @ cols[b, g]^T.

    Bind a = delta at offset b*F*out_h*out_w, b = the im2col columns at offset
    b*groups*K*out_h*out_w (direct 1x1: x at b*C*H*W, whose planes are the columns),
    c = weight_grad. Slices are the groups only: the images all add into one weight_grad, so
    they are separate dispatches, in order, rather than slices that would race on it."""
    cg, fg, spatial = c // groups, f // groups, oh * ow
    k = cg * ksize * ksize
    return gemm_args(M=fg, N=k, K=spatial, lda=spatial, ldb=spatial, ldc=k, bias_mode=BIAS_NONE,
                     act=0, groups=groups, slices=groups, beta=1.0, a_group_stride=fg * spatial,
                     b_group_stride=(cg * h * w) if direct else k * spatial,
                     c_group_stride=fg * k)


def conv_input_grad_gemm(c: int, f: int, groups: int, ksize: int, h: int, w: int, oh: int,
                         ow: int, n: int, direct: bool) -> Gemm:
    """gemm_tn[_simd]_f32 of a convolution's input gradient, all images in one dispatch
    (slice z = image*groups + group): cols[b, g] (K x out_h*out_w) = W[g]^T @ delta[b, g].

    Bind a = weights, b = delta, c = a column workspace of n*groups*K*out_h*out_w floats
    (beta 0: it need not be initialised), then col2im_bwd_f32 adds it into x_grad. A direct
    1x1 convolution writes x_grad itself, with beta 1 (accumulating)."""
    cg, fg, spatial = c // groups, f // groups, oh * ow
    k = cg * ksize * ksize
    return gemm_args(M=k, N=spatial, K=fg, lda=k, ldb=spatial, ldc=spatial, bias_mode=BIAS_NONE,
                     act=0, groups=groups, slices=n * groups, beta=1.0 if direct else 0.0,
                     a_group_stride=fg * k, b_batch_stride=f * spatial,
                     b_group_stride=fg * spatial,
                     c_batch_stride=c * h * w if direct else groups * k * spatial,
                     c_group_stride=cg * h * w if direct else k * spatial)


def connected_weight_grad_gemm(batch: int, inputs: int, outputs: int) -> Gemm:
    """gemm_tn[_simd]_f32: weight_grad (outputs x inputs) += delta^T @ x; a = delta
    (batch x outputs), b = x (batch x inputs), c = weight_grad."""
    return gemm_args(M=outputs, N=inputs, K=batch, lda=outputs, ldb=inputs, ldc=inputs,
                     bias_mode=BIAS_NONE, act=0, beta=1.0)


def connected_input_grad_gemm(batch: int, inputs: int, outputs: int) -> Gemm:
    """gemm_nn[_simd]_f32: x_grad (batch x inputs) += delta @ weights; a = delta, b = weights
    (outputs x inputs), c = x_grad."""
    return gemm_args(M=batch, N=inputs, K=outputs, lda=outputs, ldb=inputs, ldc=inputs,
                     bias_mode=BIAS_NONE, act=0, beta=1.0)


Conv = tuple[int, int, int, int, int, int, int, int, int, int, int]


def _is_direct(ksize: int, sx: int, sy: int, pad: int) -> bool:
    return ksize == 1 and sx == 1 and sy == 1 and pad == 0


def _conv_name(prefix: str, case: Conv) -> str:
    n, c, h, w, f, ksize, sx, sy, pad, dil, groups = case
    return f"{prefix}-{n}x{c}x{h}x{w}-f{f}-k{ksize}-s{sx}x{sy}-p{pad}-d{dil}-g{groups}"


def _conv_forward(gemm: str, case: Conv, act: str) -> KernelCase:
    n, c, h, w, f, ksize, sx, sy, pad, dil, groups = case
    oh, ow = out_size(h, ksize, sy, pad, dil), out_size(w, ksize, sx, pad, dil)
    cg, spatial = c // groups, oh * ow
    k = cg * ksize * ksize
    direct = _is_direct(ksize, sx, sy, pad)
    args, sizes = conv_forward_gemm(c, f, groups, ksize, h, w, oh, ow, n, act, direct)
    steps = () if direct else (
        Step("im2col_fwd_f32", im2col_args(cg, h, w, ksize, sx, sy, pad, dil, oh, ow),
             {"spatial": spatial, "channels": k // (ksize * ksize), "slices": n * groups},
             {"image": "x", "col": "cols"}),)
    steps += (Step(gemm, args, sizes, {"a": "w", "b": "x" if direct else "cols",
                                       "bias": "bias", "c": "y"}),)

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, (n, c, h, w))
        weights = normal(rng, (f, k)) * np.float32(0.3)
        bias = normal(rng, f)
        want = np.empty((n, f, oh, ow), np.float32)
        workspace = np.empty(max(1, conv.workspace_size(c, ksize, groups, oh, ow)), np.float32)
        conv.conv2d_forward(x, weights, bias, want, workspace, ksize, sx, sy, pad, dil, groups,
                            ACTIVATION_ID[act])
        arrays = {"x": x, "w": weights, "bias": bias, "y": nan_filled(want.shape)}
        if not direct:
            arrays["cols"] = nan_filled(n * groups * k * spatial)
        return CaseData(arrays, (Check("y", want, Close(1e-4, 1e-4)),))

    return KernelCase(f"{_conv_name(f'conv_fwd-{gemm}', case)}-{act}", steps, make)


def _connected_forward(gemm: str, batch: int, inputs: int, outputs: int) -> KernelCase:
    act = ACTIVATION_ID["logistic"]
    args, sizes = gemm_args(M=batch, N=outputs, K=inputs, lda=inputs, ldb=inputs, ldc=outputs,
                            bias_mode=BIAS_COLS, act=act)

    def make(rng: np.random.Generator) -> CaseData:
        x, weights = normal(rng, (batch, inputs)), normal(rng, (outputs, inputs))
        bias = normal(rng, outputs)
        want = np.empty((batch, outputs), np.float32)
        conv.connected_forward(x, weights, bias, want, act)
        return CaseData({"x": x, "w": weights, "bias": bias, "y": nan_filled(want.shape)},
                        (Check("y", want, Close(1e-5, 1e-6)),))

    return KernelCase(f"connected_fwd-{gemm}-{batch}x{inputs}x{outputs}-logistic",
                      (Step(gemm, args, sizes, {"a": "x", "b": "w", "bias": "bias", "c": "y"}),),
                      make)


def _conv_backward(simd: bool, case: Conv) -> KernelCase:
    """The weight gradient (im2col, one accumulating GEMM per image) and the input gradient
    (W^T @ delta into columns folded back by col2im; direct 1x1: into x_grad), each adding
    into a random gradient."""
    n, c, h, w, f, ksize, sx, sy, pad, dil, groups = case
    oh, ow = out_size(h, ksize, sy, pad, dil), out_size(w, ksize, sx, pad, dil)
    cg, spatial = c // groups, oh * ow
    k = cg * ksize * ksize
    direct = _is_direct(ksize, sx, sy, pad)
    suffix = "_simd_f32" if simd else "_f32"
    geometry = im2col_args(cg, h, w, ksize, sx, sy, pad, dil, oh, ow)
    steps = () if direct else (
        Step("im2col_fwd_f32", geometry,
             {"spatial": spatial, "channels": k // (ksize * ksize), "slices": n * groups},
             {"image": "x", "col": "cols"}),)
    cols, per_image = ("x", c * h * w) if direct else ("cols", groups * k * spatial)
    args, sizes = conv_weight_grad_gemm(c, f, groups, ksize, h, w, oh, ow, direct)
    steps += tuple(Step("gemm_nt" + suffix, args, sizes,
                        {"a": "delta", "b": cols, "bias": None, "c": "weight_grad"},
                        {"a": b * f * spatial, "b": b * per_image}) for b in range(n))
    args, sizes = conv_input_grad_gemm(c, f, groups, ksize, h, w, oh, ow, n, direct)
    target = "x_grad" if direct else "input_cols"
    steps += (Step("gemm_tn" + suffix, args, sizes,
                   {"a": "w", "b": "delta", "bias": None, "c": target}),)
    if not direct:
        steps += (Step("col2im_bwd_f32", geometry,
                       {"spatial": h * w, "channels": cg, "slices": n * groups},
                       {"col": "input_cols", "image": "x_grad"}),)

    def make(rng: np.random.Generator) -> CaseData:
        x, weights = normal(rng, (n, c, h, w)), normal(rng, (f, k))
        delta = normal(rng, (n, f, oh, ow))
        arrays = {"x": x, "w": weights, "delta": delta, "weight_grad": normal(rng, (f, k)),
                  "x_grad": normal(rng, (n, c, h, w))}
        if not direct:
            arrays["cols"] = nan_filled(n * groups * k * spatial)
            arrays["input_cols"] = nan_filled(n * groups * k * spatial)
        want_w, want_x = arrays["weight_grad"].copy(), arrays["x_grad"].copy()
        workspace = np.empty(max(1, conv.backward_workspace_size(c, ksize, groups, oh, ow)),
                             np.float32)
        geometry = (ksize, sx, sy, pad, dil, groups)
        conv.conv2d_backward_weights_step(x, delta, want_w, workspace, *geometry).run()
        conv.conv2d_backward_input_step(weights, delta, want_x, workspace, *geometry).run()
        return CaseData(arrays, tuple(Check(name, want, tolerance)
                                      for name, want in (("weight_grad", want_w),
                                                         ("x_grad", want_x))
                                      for tolerance in (RelL2(1e-6), Close(1e-5, 1e-5))))

    return KernelCase(_conv_name("conv_bwd-simd" if simd else "conv_bwd", case), steps, make)


def _connected_backward(simd: bool, batch: int, inputs: int, outputs: int) -> KernelCase:
    suffix = "_simd_f32" if simd else "_f32"
    steps = (
        Step("gemm_tn" + suffix, *connected_weight_grad_gemm(batch, inputs, outputs),
             {"a": "delta", "b": "x", "bias": None, "c": "weight_grad"}),
        Step("gemm_nn" + suffix, *connected_input_grad_gemm(batch, inputs, outputs),
             {"a": "delta", "b": "w", "bias": None, "c": "x_grad"}),
        *bias_steps(batch, outputs, 1),
    )

    def make(rng: np.random.Generator) -> CaseData:
        x, weights = normal(rng, (batch, inputs)), normal(rng, (outputs, inputs))
        delta = normal(rng, (batch, outputs))
        arrays = {"x": x, "w": weights, "delta": delta,
                  "weight_grad": normal(rng, weights.shape), "x_grad": normal(rng, x.shape),
                  "bias_grad": normal(rng, outputs),
                  "partials": partials_for(outputs, batch, 1)}
        want = {name: arrays[name].copy() for name in ("weight_grad", "x_grad", "bias_grad")}
        conv.connected_backward_step(x, weights, delta, want["weight_grad"],
                                     want["x_grad"]).run()
        conv.bias_grad_step(delta, want["bias_grad"]).run()
        return CaseData(arrays, tuple(Check(name, w, Close(1e-5, 1e-5))
                                      for name, w in want.items()))

    return KernelCase(f"connected_bwd{'-simd' if simd else ''}-{batch}x{inputs}x{outputs}",
                      steps, make)


FORWARD: tuple[tuple[Conv, str], ...] = (  # (N, C, H, W, F, ksize, sx, sy, pad, dil, groups)
    ((1, 3, 13, 13, 16, 3, 1, 1, 1, 1, 1), "leaky"),  # yolo-tiny's first layer, scaled down
    ((2, 5, 7, 7, 7, 3, 2, 2, 1, 1, 1), "mish"),
    ((1, 6, 7, 5, 4, 3, 1, 2, 1, 2, 2), "logistic"),
    ((1, 7, 13, 13, 9, 1, 1, 1, 0, 1, 1), "linear"),  # 1x1: the GEMM reads the input directly
    ((1, 4, 1, 1, 5, 3, 1, 1, 1, 1, 1), "leaky"),
    ((2, 4, 7, 7, 4, 3, 1, 1, 1, 1, 4), "relu"),  # depthwise
)
BACKWARD: tuple[Conv, ...] = (
    (2, 3, 7, 7, 5, 3, 1, 1, 1, 1, 1),
    (2, 4, 7, 5, 6, 3, 1, 1, 1, 1, 2),
    (1, 3, 13, 13, 5, 3, 2, 2, 1, 1, 1),
    (1, 5, 9, 9, 3, 3, 1, 1, 2, 2, 1),
    (1, 3, 7, 6, 4, 2, 1, 2, 0, 1, 1),
    (2, 6, 7, 7, 4, 1, 1, 1, 0, 1, 2),  # 1x1: the GEMMs read x and write x_grad directly
)

CASES: tuple[KernelCase, ...] = (
    *(_conv_forward(gemm, case, act) for gemm in ("gemm_nn_f32", "gemm_nn_simd_f32")
      for case, act in FORWARD),
    *(_connected_forward(gemm, *shape) for gemm in ("gemm_nt_f32", "gemm_nt_simd_f32")
      for shape in ((1, 29, 17), (3, 64, 33), (2, 5, 1))),
    *(_conv_backward(simd, case) for simd in (False, True) for case in BACKWARD),
    *(_connected_backward(simd, *shape) for simd in (False, True)
      for shape in ((5, 13, 7), (1, 40, 33), (64, 9, 3))),
)
