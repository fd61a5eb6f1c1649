"""``darknet-metal doctor``: what a user runs to check the Metal path on their machine.

It reports the device facts, builds the pipeline of every registry kernel, runs the kernel
parity suite (small one-layer-kind networks that exercise every kernel the layers use, with
both GEMM variants, plus direct checks of the kernels no layer kind uses) and a yolov3-tiny
network parity at a small input size (real weights when they are in the model cache, random
ones otherwise), each against the CPU reference, and returns a text report to paste into a bug
report with an overall verdict.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from darknet_metal.diagnostics.parity import (
    compare,
    format_report,
    format_training_report,
    run_parity,
    run_training_parity,
)
from darknet_metal.metal import get_device, registry
from darknet_metal.metal.dispatch import gemm_args, gemm_kernel, pack
from darknet_metal.model.activations import ACTIVATIONS, CHANNEL_ACTIVATIONS

_NET = "[net]\nwidth={w}\nheight={h}\nchannels={c}\n"

_ELEMENTWISE = [a for a in ACTIVATIONS if a not in CHANNEL_ACTIVATIONS]


def _combine(sam_activation: str) -> str:
    """[shortcut] (plain and weighted), [scale_channels] both ways and [sam] (with
    ``sam_activation``) after two convolutions."""
    return _NET.format(w=7, h=5, c=4) + (
        "[convolutional]\nfilters=4\nsize=1\nstride=1\npad=0\nactivation=leaky\n\n"
        "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\nactivation=linear\n\n"
        "[shortcut]\nfrom=-2\nactivation=linear\n\n"
        "[shortcut]\nfrom=-2,-3\nweights_type=per_channel\nweights_normalization=softmax\n"
        "activation=swish\n\n"
        "[avgpool]\n\n"
        "[scale_channels]\nfrom=-2\n\n"
        "[convolutional]\nfilters=1\nsize=1\nstride=1\npad=0\nactivation=logistic\n\n"
        "[scale_channels]\nfrom=-2\nscale_wh=1\n\n"
        f"[sam]\nfrom=-3\nactivation={sam_activation}\n"
    )


#: Small networks that together run every kernel a layer kind dispatches: (name, cfg text).
MINI_NETWORKS: list[tuple[str, str]] = [
    (
        "conv-activations",
        _NET.format(w=7, h=5, c=3)
        + "".join(
            f"[convolutional]\nfilters=5\nsize=3\nstride=1\npad=1\nactivation={a}\n\n"
            for a in _ELEMENTWISE
        ),
    ),
    (
        "conv-shapes",
        _NET.format(w=13, h=7, c=6)
        + (
            "[convolutional]\nbatch_normalize=1\nfilters=8\nsize=3\nstride=2\npad=1\n"
            "activation=leaky\n\n"
            "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\ngroups=2\ndilation=2\n"
            "activation=mish\n\n"
            "[convolutional]\nfilters=7\nsize=1\nstride=1\npad=0\nactivation=logistic\n\n"
            "[convolutional]\nfilters=5\nsize=3\nstride=1\npad=1\n"
            "activation=normalize_channels\n\n"
            "[convolutional]\nfilters=5\nsize=1\nstride=1\npad=0\n"
            "activation=normalize_channels_softmax\n\n"
            "[convolutional]\nfilters=5\nsize=1\nstride=1\npad=0\n"
            "activation=normalize_channels_softmax_maxval\n"
        ),
    ),
    (
        "pool-route-resample",
        _NET.format(w=16, h=12, c=6)
        + (
            "[maxpool]\nsize=3\nstride=2\n\n"
            "[maxpool]\nmaxpool_depth=1\nout_channels=2\n\n"
            "[route]\nlayers=-2,-1\n\n"
            "[reorg]\nstride=2\n\n"
            "[route]\nlayers=-1\ngroups=4\ngroup_id=3\n\n"
            "[upsample]\nstride=2\n\n"
            "[reorg3d]\nstride=2\n\n"
            "[reorg3d]\nstride=2\nreverse=1\n\n"
            "[upsample]\nstride=-2\nscale=0.5\n\n"
            "[avgpool]\n"
        ),
    ),
    ("combine", _combine("normalize_channels")),
    (
        "heads",
        _NET.format(w=5, h=3, c=3)
        + (
            "[convolutional]\nfilters=21\nsize=1\nstride=1\npad=0\nactivation=linear\n\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nnum=3\nscale_x_y=1.05\n\n"
            "[route]\nlayers=-2\n\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nnum=3\nnew_coords=1\n"
            "scale_x_y=2.0\n\n"
            "[connected]\noutput=12\nactivation=relu\n\n"
            "[softmax]\ngroups=3\ntemperature=0.5\n"
        ),
    ),
]


#: Small networks for the half-storage (fp16) kernels: the layer kinds they cover.
HALF_NETWORKS: list[tuple[str, str]] = [
    (
        "half-detector",
        _NET.format(w=16, h=12, c=3)
        + (
            "[convolutional]\nbatch_normalize=1\nfilters=8\nsize=3\nstride=1\npad=1\n"
            "activation=leaky\n\n"
            "[maxpool]\nsize=2\nstride=2\n\n"
            "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\nactivation=mish\n\n"
            "[route]\nlayers=-1\ngroups=2\ngroup_id=1\n\n"
            "[upsample]\nstride=2\n\n"
            "[route]\nlayers=-1,0\n\n"
            "[convolutional]\nfilters=21\nsize=1\nstride=1\npad=0\nactivation=linear\n\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nnum=3\nscale_x_y=1.05\n"
        ),
    ),
    (
        "half-connected",
        _NET.format(w=5, h=3, c=3)
        + "[connected]\noutput=12\nactivation=relu\n\n[connected]\noutput=4\n"
        "activation=linear\n",
    ),
    ("half-combine", _combine("normalize_channels")),
    (
        "half-channels",
        _NET.format(w=7, h=5, c=3)
        + "".join(f"[convolutional]\nfilters=5\nsize=1\nstride=1\npad=0\nactivation={a}\n\n"
                  for a in ("normalize_channels_softmax", "normalize_channels_softmax_maxval")),
    ),
    (
        "half-pool-softmax",
        _NET.format(w=16, h=12, c=8)
        + (
            "[maxpool]\nmaxpool_depth=1\nout_channels=4\n\n"
            "[reorg]\nstride=2\n\n"
            "[connected]\noutput=10\nactivation=linear\n\n"
            "[softmax]\ngroups=2\n"
        ),
    ),
]


def _half_direct_checks(device: Any) -> list[tuple[str, float, bool]]:
    """The half-storage kernels no fp16 layer dispatches yet (the separate activation, the
    copy streams use) against NumPy, as half."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(777) * 3).astype(np.float16)
    results = []
    src = device.upload(x)
    out = device.buffer(x.nbytes)
    try:
        got = np.empty_like(x)
        device.dispatch(*pack("copy_buf_f16", {"src": src, "dst": out}, {"n": x.size},
                              {"n": x.size}))
        out.read_into(got)
        results.append(("copy_buf_f16", *_verdict(got.astype(np.float32),
                                                   x.astype(np.float32))))
        leaky = ACTIVATIONS.index("leaky")
        device.dispatch(*pack("activation_fwd_f16", {"x": src, "y": out},
                              {"n": x.size, "act": leaky}, {"n": x.size}))
        out.read_into(got)
        v = x.astype(np.float64)
        want = np.where(v > 0, v, 0.1 * v).astype(np.float16).astype(np.float32)
        diff = float(np.abs(got.astype(np.float32) - want).max())
        results.append(("activation_fwd_f16", diff, diff <= 2.0**-10 * float(np.abs(want).max())))
    finally:
        src.release()
        out.release()
    return results


def _direct_checks(device: Any) -> list[tuple[str, float, bool]]:
    """Kernels no layer dispatches at inference: the transposed-A GEMMs against a float64
    NumPy product, and the training kernels against the CPU reference."""
    rng = np.random.default_rng(5)
    results = []
    m, n, k = 17, 33, 29
    a = rng.standard_normal((k, m)).astype(np.float32)  # stored transposed
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    ref = (a.T.astype(np.float64) @ b.astype(np.float64) + bias[:, None]).astype(np.float32)
    args, sizes = gemm_args(M=m, N=n, K=k, lda=m, ldb=n, ldc=n, bias_mode=registry.BIAS_ROWS,
                            act=0)
    for name in (gemm_kernel("tn", False), gemm_kernel("tn", True)):
        got = _run(device, name, {"a": a, "b": b, "bias": bias}, "c", (m, n), args, sizes)
        results.append((name, *_verdict(got, ref)))
    return (results + _training_checks(device, rng) + _yolo_loss_checks(device)
            + _elementwise_training_checks(device))


def _training_checks(device: Any, rng: np.random.Generator) -> list[tuple[str, float, bool]]:
    """The convolution's training kernels (im2col.metal, batchnorm.metal) against the CPU
    reference, each adding into non-zero gradients where it accumulates."""
    from darknet_metal.cpu import batchnorm, conv, im2col

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    results = []
    # col2im: stride 2, padding, two groups of two channels, two images.
    n, groups, cg, h, w, ksize, stride, pad = 2, 2, 2, 7, 6, 3, 2, 1
    oh, ow = (h + 2 * pad - ksize) // stride + 1, (w + 2 * pad - ksize) // stride + 1
    col, image = rand(n * groups, cg * ksize * ksize, oh * ow), rand(n, groups * cg, h, w)
    want = image.copy()
    for z in range(n * groups):
        b, g = divmod(z, groups)
        im2col.col2im_add(col[z], want[b, g * cg : (g + 1) * cg], ksize, stride, stride, pad, 1,
                          oh, ow)
    geometry = dict(channels=cg, height=h, width=w, ksize=ksize, stride_x=stride,
                    stride_y=stride, pad=pad, dilation=1, out_h=oh, out_w=ow)
    got = _run_roles(device, "col2im_bwd_f32", {"col": col, "image": image}, geometry,
                     {"spatial": h * w, "channels": cg, "slices": n * groups})
    results.append(("col2im_bwd_f32", *_verdict(got["image"], want)))

    # Bias gradient and batch norm on (N, C, H, W) = (2, 5, 3, 7).
    shape = (2, 5, 3, 7)
    c, spatial = shape[1], shape[2] * shape[3]
    channels = {"channels": c}
    values = {"spatial": spatial, "channels": c, "batch": shape[0]}
    delta, bias_grad = rand(*shape), rand(c)
    want = bias_grad.copy()
    conv.bias_grad(delta, want)
    got = _run_roles(device, "bias_bwd_f32", {"delta": delta, "bias_grad": bias_grad},
                     {"batch": shape[0], "channels": c, "spatial": spatial},
                     channels)
    results.append(("bias_bwd_f32", *_verdict(got["bias_grad"], want)))

    x, scale, bias = rand(*shape) * np.float32(2.0) + np.float32(1.0), rand(c), rand(c)
    rolling = (rand(c), np.abs(rand(c)))
    mean, var, x_norm, out = (np.empty(c, np.float32), np.empty(c, np.float32),
                              np.empty_like(x), np.empty_like(x))
    rm, rv = rolling[0].copy(), rolling[1].copy()
    momentum = batchnorm.MOMENTUM_CONV
    batchnorm.batchnorm_forward_train(x, mean, var, x_norm, out, scale, bias, rm, rv, momentum)
    args = dict(batch=shape[0], channels=c, spatial=spatial, eps=batchnorm.EPS,
                momentum=momentum, one_minus_momentum=1.0 - momentum, exact=0)
    stats = ("mean", "variance", "rolling_mean", "rolling_variance")
    got = _run_roles(device, "batchnorm_fwd_stats_f32",
                     {"x": x, "mean": mean, "variance": var, "rolling_mean": rolling[0],
                      "rolling_variance": rolling[1]}, args, channels)
    results.append(("batchnorm_fwd_stats_f32",
                    *_verdict(np.concatenate([got[s] for s in stats]),
                              np.concatenate([mean, var, rm, rv]))))
    got = _run_roles(device, "batchnorm_fwd_norm_f32",
                     {"x": x, "mean": mean, "variance": var, "scale": scale, "bias": bias,
                      "x_norm": np.empty_like(x), "out": np.empty_like(x)}, args, values)
    results.append(("batchnorm_fwd_norm_f32",
                    *_verdict(np.stack([got["x_norm"], got["out"]]), np.stack([x_norm, out]))))
    got = _run_roles(device, "batchnorm_fwd_xnorm_f32",
                     {"x": x, "mean": mean, "variance": var, "x_norm": np.empty_like(x)}, args,
                     values)
    results.append(("batchnorm_fwd_xnorm_f32", *_verdict(got["x_norm"], x_norm)))

    delta, grads = rand(*shape), (rand(c), rand(c))
    want_delta, want_sg, want_bg = delta.copy(), grads[0].copy(), grads[1].copy()
    batchnorm.batchnorm_backward(want_delta, x, mean, var, x_norm, scale, want_sg, want_bg)
    sums = _run_roles(device, "batchnorm_bwd_sums_f32",
                      {"delta": delta, "x": x, "mean": mean, "variance": var, "x_norm": x_norm,
                       "scale": scale, "scale_grad": grads[0], "bias_grad": grads[1],
                       "mean_delta": np.empty(c, np.float32),
                       "var_delta": np.empty(c, np.float32)}, args, channels)
    results.append(("batchnorm_bwd_sums_f32",
                    *_verdict(np.concatenate([sums["scale_grad"], sums["bias_grad"]]),
                              np.concatenate([want_sg, want_bg]))))
    got = _run_roles(device, "batchnorm_bwd_delta_f32",
                     {"x": x, "mean": mean, "variance": var, "scale": scale,
                      "mean_delta": sums["mean_delta"], "var_delta": sums["var_delta"],
                      "delta": delta}, args, values)
    results.append(("batchnorm_bwd_delta_f32", *_verdict(got["delta"], want_delta)))
    return results


def _yolo_loss_checks(device: Any) -> list[tuple[str, float, bool]]:
    """The [yolo] training loss kernels, dispatched in order on shared buffers, against the
    CPU loss (delta and statistics) on a small head: two images, two truths on one cell,
    CIoU with iou_thresh."""
    from darknet_metal.cpu import heads, yolo_loss
    from darknet_metal.model.cfg_schema import IOU_LOSSES

    rng = np.random.default_rng(6)
    n_img, classes, h, w, mask = 2, 3, 5, 7, [1, 2]
    anchors = np.array([(6, 7), (10, 14), (16, 12), (22, 26)], np.float32)
    logits = rng.standard_normal((n_img, len(mask) * (5 + classes), h, w)).astype(np.float32)
    output = np.empty_like(logits)
    heads.yolo_forward(logits, output, len(mask), classes, 1.05, False)
    truths = np.zeros((n_img, 4, 5), np.float32)
    truths[..., 0] = rng.integers(classes, size=(n_img, 4))
    truths[..., 1:3] = rng.uniform(0.05, 0.95, (n_img, 4, 2))
    truths[..., 3:] = rng.uniform(0.1, 0.3, (n_img, 4, 2))
    truths[:, 3, 1:3] = truths[:, 0, 1:3]
    options = dict(ignore_thresh=0.5, truth_thresh=0.9, iou_thresh=0.2, iou_normalizer=0.07,
                   obj_normalizer=1.0, cls_normalizer=1.0, label_smooth_eps=0.0,
                   max_delta=float(np.finfo(np.float32).max))
    want = np.empty_like(output)
    want_stats = np.zeros(len(yolo_loss.YOLO_STAT_NAMES))
    yolo_loss.yolo_loss(output, want, truths, want_stats, anchors=anchors, mask=mask,
                        classes=classes, net_w=64, net_h=64, iou_loss="ciou", **options)
    args = dict(batch=n_img, anchors=len(mask), classes=classes, height=h, width=w,
                boxes=truths.shape[1], total=len(anchors), net_w=64, net_h=64,
                iou_loss=IOU_LOSSES.index("ciou"), iou_thresh_kind=IOU_LOSSES.index("iou"),
                new_coords=0, focal_loss=0, objectness_smooth=0, counters=0, **options)
    cells = {"spatial": h * w, "anchors": len(mask), "batch": n_img}
    bufs = {
        "output": device.upload(output), "truths": device.upload(truths),
        "anchor_table": device.upload(anchors.reshape(-1)),
        "mask": device.upload(np.array(mask, np.int32)),
        "multipliers": device.upload(np.zeros(classes, np.float32)),
        "delta": device.buffer(output.nbytes),
        "partials": device.buffer(4 * 4 * n_img * len(mask) * h * w),
        "images": device.buffer(4 * 10 * n_img), "stats": device.buffer(4 * len(want_stats)),
    }
    try:
        for name, sizes in (("yolo_loss_bwd_cells_f32", cells),
                            ("yolo_loss_bwd_truths_f32", {"batch": n_img}),
                            ("yolo_loss_bwd_squares_f32", cells),
                            ("yolo_loss_bwd_stats_f32", {"one": 1})):
            roles = registry.kernel(name).roles
            device.dispatch(*pack(name, {r: bufs[r] for r in roles}, args, sizes))
        delta = np.empty_like(output)
        bufs["delta"].read_into(delta)
        stats = np.empty(len(want_stats), np.float32)
        bufs["stats"].read_into(stats)
    finally:
        for b in bufs.values():
            b.release()
    diff, ok = _verdict(delta, want)
    # Float32 sums on the device, double on the CPU.
    ok = ok and bool(np.allclose(stats, want_stats, rtol=1e-4, atol=1e-6 * want_stats[5]))
    names = ("yolo_loss_bwd_cells_f32", "yolo_loss_bwd_truths_f32",
             "yolo_loss_bwd_squares_f32", "yolo_loss_bwd_stats_f32")
    return [(name, diff, ok) for name in names]


def _run_roles(
    device: Any,
    name: str,
    arrays: dict[str, np.ndarray | None],
    args: dict[str, int | float],
    sizes: dict[str, int],
) -> dict[str, np.ndarray]:
    """Upload ``arrays`` (by role; integer arrays keep their type, the others become
    float32; None where the kernel does not touch the role), dispatch kernel ``name`` once
    and return the roles it writes, read back."""
    k = registry.kernel(name)
    arrays = {role: None if a is None else np.ascontiguousarray(
        a, None if np.issubdtype(np.asarray(a).dtype, np.integer) else np.float32)
        for role, a in arrays.items()}
    bufs = {role: None if a is None else device.upload(a) for role, a in arrays.items()}
    placeholder = device.buffer(4)
    try:
        bound = {role: placeholder if b is None else b for role, b in bufs.items()}
        device.dispatch(*pack(name, bound, args, sizes))
        result = {}
        for role in k.outputs:
            result[role] = np.empty_like(arrays[role])
            bufs[role].read_into(result[role])
        return result
    finally:
        for b in (*bufs.values(), placeholder):
            if b is not None:
                b.release()


def _layers_train_checks(device: Any) -> list[tuple[str, float, bool]]:
    """The training kernels of the pooling, resample, route, combine and heads shaders, which
    no inference pass dispatches, against the CPU reference's steps on small odd shapes (each
    backward adding into a random gradient)."""
    from darknet_metal.cpu import combine, heads, pooling, resample, route

    rng = np.random.default_rng(11)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    results: list[tuple[str, float, bool]] = []

    def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
        results.append((name, *_verdict(got.astype(np.float32), want.astype(np.float32))))

    # Max pooling, 3x3 stride-1 windows (overlapping), ties from integer values.
    x = rng.integers(-2, 2, (1, 3, 7, 5)).astype(np.float32)
    pool = {"planes": 3, "height": 7, "width": 5, "out_h": 7, "out_w": 5, "size": 3,
            "stride_x": 1, "stride_y": 1, "padding": 2}
    y, idx = np.empty((1, 3, 7, 5), np.float32), np.empty((1, 3, 7, 5), np.int32)
    pooling.maxpool_forward_train(x, y, idx, 3, 1, 1, 2)
    got = _run_roles(device, "maxpool_fwd_train_f32",
                     {"x": x, "y": np.zeros_like(y), "indexes": np.zeros_like(idx)}, pool,
                     {"out_w": 5, "out_h": 7, "planes": 3})
    check("maxpool_fwd_train_f32", np.concatenate([got["y"].ravel(), got["indexes"].ravel()]),
          np.concatenate([y.ravel(), idx.ravel()]))
    delta, grad = rand(1, 3, 7, 5), rand(1, 3, 7, 5)
    want = grad.copy()
    pooling.maxpool_backward(delta, idx, want)
    got = _run_roles(device, "maxpool_bwd_f32", {"delta": delta, "indexes": idx, "x_grad": grad},
                     pool, {"width": 5, "height": 7, "planes": 3})
    check("maxpool_bwd_f32", got["x_grad"], want)

    x = rand(2, 5, 3, 3)
    depth = {"batch": 2, "channels": 5, "spatial": 9, "out_channels": 2}
    y, idx = np.empty((2, 2, 3, 3), np.float32), np.empty((2, 2, 3, 3), np.int32)
    pooling.maxpool_depth_forward_train(x, y, idx)
    got = _run_roles(device, "maxpool_depth_fwd_train_f32",
                     {"x": x, "y": np.zeros_like(y), "indexes": np.zeros_like(idx)}, depth,
                     {"spatial": 9, "out_channels": 2, "batch": 2})
    check("maxpool_depth_fwd_train_f32",
          np.concatenate([got["y"].ravel(), got["indexes"].ravel()]),
          np.concatenate([y.ravel(), idx.ravel()]))
    delta, grad = rand(2, 2, 3, 3), rand(2, 5, 3, 3)
    want = grad.copy()
    pooling.maxpool_backward(delta, idx, want)
    got = _run_roles(device, "maxpool_depth_bwd_f32",
                     {"delta": delta, "indexes": idx, "x_grad": grad}, depth,
                     {"spatial": 9, "channels": 5, "batch": 2})
    check("maxpool_depth_bwd_f32", got["x_grad"], want)

    delta, grad = rand(2, 3, 1, 1), rand(2, 3, 5, 7)
    want = grad.copy()
    pooling.avgpool_backward(delta, want)
    got = _run_roles(device, "avgpool_bwd_f32", {"delta": delta, "x_grad": grad},
                     {"planes": 6, "spatial": 35}, {"spatial": 35, "planes": 6})
    check("avgpool_bwd_f32", got["x_grad"], want)

    for stride, shape, out in ((2, (1, 3, 5, 3), (10, 6)), (-2, (1, 3, 7, 5), (3, 2))):
        delta, grad = rand(1, 3, *out), rand(*shape)
        want = grad.copy()
        resample.upsample_backward(delta, want, stride, 0.5)
        cols, rows = (shape[3], shape[2]) if stride > 0 else (out[1], out[0])
        got = _run_roles(device, "upsample_bwd_f32", {"delta": delta, "x_grad": grad},
                         {"planes": 3, "height": shape[2], "width": shape[3], "out_h": out[0],
                          "out_w": out[1], "stride": stride, "scale": 0.5},
                         {"cols": cols, "rows": rows, "planes": 3})
        check(f"upsample_bwd_f32 stride={stride}", got["x_grad"], want)

    for reverse, shape in ((False, (2, 4, 6, 4)), (True, (1, 8, 3, 5))):
        out_shape = resample.reorg_output_shape(shape, 2, reverse)
        delta, grad = rand(*out_shape), rand(*shape)
        want = grad.copy()
        resample.reorg_backward(delta, want, 2, reverse)  # [reorg]
        n, c, h, w = shape
        got = _run_roles(device, "reorg_bwd_f32", {"delta": delta, "x_grad": grad},
                         {"batch": n, "width": w, "height": h, "channels": c, "stride": 2,
                          "reverse": int(reverse)}, {"width": w, "height": h, "slices": n * c})
        check(f"reorg_bwd_f32 reverse={int(reverse)}", got["x_grad"], want)

    delta, grad = rand(2, 9, 3, 5), rand(2, 6, 3, 5)
    want = grad.copy()
    route.route_backward(delta, want, 3, 3, 4)
    got = _run_roles(device, "route_bwd_f32", {"delta": delta, "x_grad": grad},
                     {"batch": 2, "spatial": 15, "channels": 3, "src_channels": 6,
                      "src_offset": 3, "dst_channels": 9, "dst_offset": 4},
                     {"spatial": 15, "channels": 3, "batch": 2})
    check("route_bwd_f32", got["x_grad"], want)

    # Shortcut with per-channel softmax weights: one source with fewer channels, one more.
    n, c, h, w = 2, 5, 3, 3
    x, delta = rand(n, c, h, w), rand(n, c, h, w)
    sources = [rand(n, 3, h, w), rand(n, 7, h, w)]
    weights, wgrad = rand(3 * c), rand(3 * c)
    grads = [rand(n, c, h, w), rand(n, 3, h, w), rand(n, 7, h, w)]
    want_g = [g.copy() for g in grads]
    want_w = wgrad.copy()
    norm = 2  # softmax, in dm_shortcut_weights_args' numbering
    combine.shortcut_backward(delta, x, sources, weights, "per_channel",
                              combine.WEIGHTS_NORMALIZATIONS[norm], want_g[0], want_g[1:], want_w)
    wargs = {"n_inputs": 3, "channels": c, "per_channel": 1, "normalization": norm}
    table = _run_roles(device, "shortcut_weights_fwd_f32",
                       {"weights": weights, "table": np.zeros(3 * c, np.float32)}, wargs,
                       {"channels": c})["table"]
    gnorm = np.zeros(3 * c, np.float32)
    for row, inp in enumerate([x, *sources]):
        bwd = {"batch": n, "channels": c, "spatial": h * w, "src_channels": inp.shape[1],
               "row": row, "weighted": 1}
        used = min(c, inp.shape[1])
        got = _run_roles(device, "shortcut_bwd_f32",
                         {"delta": delta, "table": table, "grad": grads[row]}, bwd,
                         {"spatial": h * w, "channels": used, "batch": n})
        check(f"shortcut_bwd_f32 input {row}", got["grad"], want_g[row])
        partial = _run_roles(device, "shortcut_bwd_dot_f32",
                             {"delta": delta, "input": inp,
                              "partial": np.zeros(n * c, np.float32)},
                             bwd, {"channels": used, "batch": n})["partial"]
        gnorm = _run_roles(device, "shortcut_bwd_weights_f32",
                           {"partial": partial, "acc": gnorm},
                           {"batch": n, "channels": c, "src_channels": inp.shape[1],
                            "row": row, "per_channel": 1, "accumulate": 0},
                           {"columns": c})["acc"]
    got = _run_roles(device, "shortcut_bwd_norm_f32",
                     {"weights": weights, "g": gnorm, "weight_grad": wgrad}, wargs,
                     {"columns": c})
    results.append(("shortcut_bwd_{dot,weights,norm}_f32",
                    *_verdict(got["weight_grad"], want_w)))

    for scale_wh in (False, True):
        x_from, delta = rand(2, 5, 3, 3), rand(2, 5, 3, 3)
        scale = rand(2, 1, 3, 3) if scale_wh else rand(2, 5, 1, 1)
        xg, sg = rand(2, 5, 3, 3), rand(*scale.shape)
        want_x, want_s = xg.copy(), sg.copy()
        combine.scale_channels_backward(delta, x_from, scale, want_x, want_s, scale_wh)
        sargs = {"batch": 2, "channels": 5, "spatial": 9, "scale_wh": int(scale_wh)}
        got = _run_roles(device, "scale_channels_bwd_f32",
                         {"delta": delta, "scale": scale, "x_from_grad": xg}, sargs,
                         {"spatial": 9, "channels": 5, "batch": 2})
        check(f"scale_channels_bwd_f32 scale_wh={int(scale_wh)}", got["x_from_grad"], want_x)
        got = _run_roles(device, "scale_channels_bwd_scale_f32",
                         {"delta": delta, "x_from": x_from, "scale_grad": sg}, sargs,
                         {"factors": scale.size})
        check(f"scale_channels_bwd_scale_f32 scale_wh={int(scale_wh)}", got["scale_grad"],
              want_s)

    x_from, x, delta, g_from, g_x = (rand(2, 3, 5, 7) for _ in range(5))
    want_from, want_x = g_from.copy(), g_x.copy()
    combine.sam_backward(delta, x_from, x, want_from, want_x)
    got = _run_roles(device, "sam_bwd_f32", {"delta": delta, "x_from": x_from, "x": x,
                                             "x_from_grad": g_from, "x_grad": g_x},
                     {"n": x.size}, {"n": x.size})
    check("sam_bwd_f32", np.concatenate([got["x_from_grad"].ravel(), got["x_grad"].ravel()]),
          np.concatenate([want_from.ravel(), want_x.ravel()]))

    p = np.empty((3, 7), np.float32)
    heads.softmax_forward(rand(3, 7), p)
    truth = np.eye(3, 7, dtype=np.float32)
    for name, cpu in (("softmax_fwd_xent_f32", heads.softmax_cross_entropy),
                      ("cost_fwd_sse_f32", heads.cost_sse)):
        want_d, want_l = np.empty_like(p), np.empty_like(p)
        cpu(p, truth, want_d, want_l)
        got = _run_roles(device, name, {"pred": p, "truth": truth, "delta": np.zeros_like(p),
                                        "loss": np.zeros_like(p)}, {"n": p.size}, {"n": p.size})
        check(name, np.concatenate([got["delta"].ravel(), got["loss"].ravel()]),
              np.concatenate([want_d.ravel(), want_l.ravel()]))
    return results


def _kernel_names(check: str) -> set[str]:
    """The kernels a check line names: its first word, with ``{a,b}`` alternatives expanded
    (``shortcut_bwd_{dot,norm}_f32``)."""
    word = check.split()[0]
    if "{" not in word:
        return {word}
    head, rest = word.split("{", 1)
    options, tail = rest.split("}", 1)
    return {head + o + tail for o in options.split(",")}


def _elementwise_training_checks(device: Any) -> list[tuple[str, float, bool]]:
    """The elementwise training kernels (no layer dispatches them yet) against their CPU
    reference steps; the draws and the updates must agree bit for bit."""
    from darknet_metal.cpu import activations as cpu_act
    from darknet_metal.cpu import dropout, fill, update

    rng = np.random.default_rng(6)
    n = 1001
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    delta = rng.standard_normal(n).astype(np.float32)
    results = []

    def check(name, buffers, out, want, args, sizes, exact=False):
        got = _run_roles(device, name, buffers, args, sizes)[out]
        diff, ok = _verdict(got.astype(np.float64), want.astype(np.float64))
        results.append((name, diff, ok and (not exact or got.tobytes() == want.tobytes())))

    act = "mish"
    want = delta.copy().reshape(1, -1)
    cpu_act.gradient(x.reshape(1, -1), act, want)
    check("activation_bwd_f32", {"y_or_x": x, "delta": delta}, "delta", want.reshape(-1),
          {"n": n, "act": ACTIVATIONS.index(act)}, {"n": n})
    shape = (2, 7, 13, 11)
    y = rng.standard_normal(shape).astype(np.float32)
    d4 = rng.standard_normal(shape).astype(np.float32)
    for variant in sorted(CHANNEL_ACTIVATIONS):
        yv, want = y.copy(), d4.copy()
        cpu_act.activate(yv, variant)
        cpu_act.gradient(yv, variant, want)
        check(f"{variant}_bwd_f32", {"y": yv, "delta": d4}, "delta", want,
              {"batch": 2, "channels": 7, "spatial": 143}, {"spatial": 143, "batch": 2})
    want = np.full(n, 0.25, np.float32)
    check("fill_buf_f32", {"x": x}, "x", want, {"n": n, "value": 0.25}, {"n": n}, exact=True)
    check("copy_buf_f32", {"src": x, "dst": delta}, "dst", x, {"n": n}, {"n": n}, exact=True)
    want = delta.copy()
    fill.add_step(x, want, 0.5).run()
    check("add_buf_f32", {"src": x, "dst": delta}, "dst", want, {"n": n, "scale": 0.5},
          {"n": n}, exact=True)
    start, seed = 2**32 - 1, 2**40 + 17
    counter = np.array([start], np.uint64)
    rand = np.empty(n, np.float32)
    dropout.uniform_fill(rand, seed, counter)
    words = np.array([start], np.uint64).view(np.uint32)
    check("uniform_buf_f32", {"counter": words, "rand": x}, "rand", rand,
          {"n": n, "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32}, {"n": n}, exact=True)
    check("uniform_buf_advance_f32", {"counter": words}, "counter", counter.view(np.uint32),
          {"count": 1}, {"count": 1}, exact=True)
    p = np.float32(0.4)
    scale = np.float32(1.0 / (1.0 - float(p)))
    for name, role, step in (("dropout_fwd_train_f32", "x", dropout.dropout_forward_train),
                             ("dropout_bwd_f32", "delta", dropout.dropout_backward)):
        want = x.copy()
        step(want, rand, float(p))
        check(name, {"rand": rand, role: x}, role, want,
              {"n": n, "probability": p, "scale": scale}, {"n": n}, exact=True)
    w = (rng.standard_normal(n) * 0.1).astype(np.float32)
    lr = np.array([0.01], np.float32)
    want = w.copy()
    update.sgd_update(want, delta.copy(), lr, 0.0005, 0.9, 64, True, 0.5)
    args = {"n": n, "batch": 64, "apply_decay": 1, "decay": 0.0005, "momentum": 0.9,
            "lr_scale": 0.5}
    check("sgd_upd_f32", {"lr": lr, "param": w, "grad_acc": delta}, "param", want, args,
          {"n": n}, exact=True)
    m, v, t = np.abs(delta) * 0.1, delta * delta, np.array([3.0], np.float32)
    want = w.copy()
    update.adam_update(want, delta.copy(), m.copy(), v.copy(), lr, t, 0.0005, 0.9, 0.999, 1e-7,
                       64)
    args = {"n": n, "batch": 64, "decay": 0.0005, "b1": 0.9, "b2": 0.999, "eps": 1e-7,
            "lr_scale": 1.0}
    check("adam_upd_f32", {"lr": lr, "t": t, "param": w, "grad_acc": delta, "m": m, "v": v},
          "param", want, args, {"n": n})
    bad = x.copy()
    bad[n // 2] = np.inf
    flag = np.ones(1, np.float32)
    update.all_finite_step(bad, flag).run()
    check("finite_buf_f32", {"x": bad, "flag": np.ones(1, np.float32)}, "flag", flag,
          {"n": n}, {"n": n}, exact=True)
    return results


def _verdict(got: np.ndarray, want: np.ndarray) -> tuple[float, bool]:
    r = compare(got, want)
    return r["max_abs"], r["ok"]


def _run(
    device: Any,
    name: str,
    inputs: dict[str, np.ndarray],
    output: str,
    out_shape: tuple[int, ...],
    args: dict[str, int | float],
    sizes: dict[str, int],
) -> np.ndarray:
    """Upload ``inputs`` (by role), dispatch kernel ``name`` once with its ``output`` role
    bound to a new buffer of ``out_shape``, and return that output."""
    bufs = {role: device.upload(np.ascontiguousarray(a, np.float32)) for role, a in inputs.items()}
    out = device.buffer(4 * int(np.prod(out_shape)))
    try:
        device.dispatch(*pack(name, {**bufs, output: out}, args, sizes))
        result = np.empty(out_shape, np.float32)
        out.read_into(result)
        return result
    finally:
        for b in (*bufs.values(), out):
            b.release()


def _section(title: str) -> str:
    return f"\n== {title} " + "=" * max(0, 66 - len(title))


def _print_line(line: str) -> None:
    # Flushed line by line, so a piped or redirected run shows each check as it finishes.
    print(line, flush=True)


def run_doctor(
    device: str | None = None, *, size: int = 96, out: Callable[[str], None] = _print_line
) -> bool:
    """Run every check on ``device`` (default: "metal" when available, else "emu"), writing
    the report line by line through ``out`` (default: stdout, flushed after each line); True
    when everything passed."""
    from darknet_metal import __version__
    from darknet_metal.metal import is_available

    if device is None:
        device = "metal" if is_available("metal") else "emu"
    ok = True
    out(f"darknet-metal doctor {__version__}")
    out(f"python {platform.python_version()} on {platform.platform()} ({platform.machine()})")
    out(f"numpy {np.__version__}")
    out(_section("device"))
    try:
        dev = get_device(device)
    except Exception as e:  # report any failure to create the device, do not crash
        out(f"device {device!r} unavailable: {e}")
        return False
    for key, value in dev.info.items():
        out(f"{key:>28}: {value}")

    out(_section("pipelines"))
    failed = []
    for name, k in registry.KERNELS.items():
        try:
            facts = dev.pipeline_info(name)
        except Exception as e:
            failed.append(name)
            out(f"  FAIL {name}: {e}")
            continue
        if k.grid.threads_per_group > facts["max_total_threads"]:
            failed.append(name)
            out(
                f"  FAIL {name}: needs {k.grid.threads_per_group} threads per group, "
                f"pipeline allows {facts['max_total_threads']}"
            )
    out(f"  {len(registry.KERNELS) - len(failed)}/{len(registry.KERNELS)} pipelines built")
    ok &= not failed

    out(_section("kernel parity (vs CPU reference)"))
    exercised: set[str] = set()
    networks = [(n, t, "fp32") for n, t in MINI_NETWORKS]
    networks += [(n, t, "fp16") for n, t in HALF_NETWORKS]
    with tempfile.TemporaryDirectory() as tmp:
        for name, text, precision in networks:
            path = os.path.join(tmp, f"{name}.cfg")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            kind = "GEMM" if precision == "fp32" else "fp16"
            for gemm in ("tiled", "simd"):
                try:
                    report = run_parity(path, seed=1, device=device, gemm=gemm, input_seed=2,
                                        precision=precision)
                except Exception:
                    ok = False
                    out(f"  FAIL {name} ({gemm} {kind}): error\n{traceback.format_exc()}")
                    continue
                for row in report["layers"]:
                    exercised.update(row["kernels"])  # as dispatched: _f16 names in fp16
                worst = max(r["max_abs"] for r in report["layers"])
                bad = [r["index"] for r in report["layers"] if not r["ok"]]
                out(
                    f"  {'ok  ' if not bad else 'FAIL'} {name:<22} {gemm:<5} {kind}  "
                    f"{len(report['layers']):>2} layers, max abs diff {worst:.2e}"
                    + (f", failing layers {bad}" if bad else "")
                )
                ok &= not bad
    try:
        for name, diff, passed in [*_direct_checks(dev), *_layers_train_checks(dev),
                                   *_half_direct_checks(dev)]:
            exercised.update(_kernel_names(name))
            out(f"  {'ok  ' if passed else 'FAIL'} {name:<34} max abs diff {diff:.2e}")
            ok &= passed
    except Exception:
        ok = False
        out(f"  FAIL direct kernel checks: error\n{traceback.format_exc()}")
    missing = sorted(set(registry.KERNELS) - exercised)
    out(
        f"  kernels checked: {len(exercised & set(registry.KERNELS))}/{len(registry.KERNELS)}"
        + (f"; not checked: {missing}" if missing else "")
    )
    ok &= not missing

    cfg, weights = _yolov3_tiny()
    train_size = min(size, 64)
    for title, run, text in (
        (f"network parity: yolov3-tiny at {size}x{size}",
         lambda: run_parity(cfg, weights, seed=1, device=device, size=(size, size)),
         format_report),
        (f"training step: yolov3-tiny at {train_size}x{train_size}, batch 2",
         lambda: run_training_parity(cfg, seed=1, device=device,
                                     size=(train_size, train_size), batch=2),
         format_training_report),
    ):
        out(_section(title))
        try:
            start = time.perf_counter()
            report = run()
            out(text(report))
            out(f"({time.perf_counter() - start:.1f} s)")
            ok &= report["ok"]
        except Exception:
            ok = False
            out(f"FAIL: error\n{traceback.format_exc()}")

    out(_section("speed: yolov4-tiny 416x416, batch 1, random weights"))
    if device == "emu":
        out("  skipped: the emulator checks correctness; its speed says nothing of a GPU")
    else:
        try:
            measure_speed(device, size=416, out=out)
        except Exception:
            ok = False
            out(f"FAIL: error\n{traceback.format_exc()}")

    stats = dev.stats()
    out(_section("device counters"))
    for key in (
        "kernels_dispatched",
        "command_buffers_committed",
        "waits",
        "cpu_fallbacks",
        "pipelines_built",
        "peak_allocated_bytes",
    ):
        out(f"{key:>28}: {stats[key]}")
    out(_section("verdict"))
    out(
        "PASS: the Metal path agrees with the CPU reference on this device"
        if ok
        else "FAIL: see the failures above"
    )
    return bool(ok)


def measure_speed(
    device: str, *, size: int = 416, repeats: int = 20, out: Callable[[str], None] = _print_line
) -> tuple[float, float]:
    """Median ms per yolov4-tiny forward pass (random weights, batch 1, ``size`` x ``size``)
    on ``device`` and on this package's CPU path, measured in turn; returns (device, cpu)."""
    from darknet_metal.model.bundled import get_spec
    from darknet_metal.network import load

    cfg = get_spec("yolov4-tiny").cfg
    x = np.random.default_rng(0).uniform(0, 1, (1, 3, size, size)).astype(np.float32)
    medians = []
    for name in (device, "cpu"):
        net = load(cfg, seed=0, device=name, input_size=(size, size))
        net.forward(x)  # warm up: pipelines, programs, buffers
        times = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            net.forward(x)
            times.append(time.perf_counter() - start)
        medians.append(1e3 * float(np.median(times)))
    gpu, cpu = medians
    out(
        f"  {device}: {gpu:.2f} ms   cpu (this package, BLAS): {cpu:.2f} ms   "
        f"speed-up {cpu / gpu:.1f}x"
    )
    out("  (design target on Apple silicon: at least 14x Darknet's CPU/OpenBLAS build)")
    return gpu, cpu


def _yolov3_tiny() -> tuple[str, str | None]:
    """The bundled yolov3-tiny cfg and its cached weights (None when not downloaded)."""
    from darknet_metal.errors import ModelNotFoundError
    from darknet_metal.model.bundled import get_spec, model_files

    try:
        files = model_files("yolov3-tiny", download=False)
    except ModelNotFoundError:
        return str(get_spec("yolov3-tiny").cfg), None
    return str(files.cfg), str(files.weights)
