"""Batch normalisation of [convolutional] and [connected] layers: its parameters, the fold
into weights and biases for inference, and its training forward and backward on the CPU and
with kernels.

At inference batch norm is folded into the layer's weights and biases (in float64, once per
load); training runs it unfolded, on the mini-batch statistics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from darknet_metal.cpu import batchnorm as cpu_batchnorm
from darknet_metal.cpu import conv as cpu_conv
from darknet_metal.metal.kernels.batchnorm import sum_runs
from darknet_metal.model.weights import Params
from darknet_metal.ops.activation import LINEAR
from darknet_metal.ops.base import as_rows
from darknet_metal.runtime.program import LayerEmitter, Tensor

if TYPE_CHECKING:
    from darknet_metal.runtime.train_state import LayerTrainState

#: Darknet's epsilon under the square root of the variance (one value for the CPU steps,
#: the kernels' arguments and the inference fold).
BATCHNORM_EPSILON: float = cpu_batchnorm.EPS

#: The arrays batch normalisation adds to a layer.
BATCHNORM_PARAMS = ("scales", "rolling_mean", "rolling_variance")


def fold_batchnorm(layer: Params) -> tuple[np.ndarray, np.ndarray]:
    """Fold batch normalisation into (weights, biases) for inference.

    ``weights`` is (F, K), the other arrays (F,). With BN, ``y = scales*(Wx - mean)/sqrt(var +
    eps) + biases`` becomes ``W'x + b'`` with ``W' = W*scales/std`` and ``b' = biases -
    scales*mean/std``; computed in float64, returned as float64.
    """
    weights = layer["weights"].astype(np.float64)
    biases = layer["biases"].astype(np.float64)
    if "scales" not in layer:
        return weights, biases
    std = np.sqrt(layer["rolling_variance"].astype(np.float64) + BATCHNORM_EPSILON)
    factor = layer["scales"].astype(np.float64) / std
    return (weights * factor[:, None],
            biases - factor * layer["rolling_mean"].astype(np.float64))


def emit_batchnorm_train(e: LayerEmitter, ts: LayerTrainState, raw: Tensor, out: Tensor,
                         momentum: float, flat: bool = False) -> None:
    """Training forward of a layer's batch norm: ``out = scales*x_norm(raw) + biases`` on
    the mini-batch statistics, which (and x_norm) are kept for the backward; the rolling
    averages move by ``1 - momentum``. ``flat``: a connected layer's, statistics over the
    images only."""
    shape = as_rows if flat else np.asarray
    values = ts.values
    n = e.shape(raw)[1]
    mean, variance = e.tensor("mean", (n,)), e.tensor("variance", (n,))
    x_norm = e.tensor("x_norm", e.shape(raw))
    e.host([raw], [mean, variance, x_norm, out],
           lambda r, w: cpu_batchnorm.batchnorm_forward_train_step(
               shape(r[0]), w[0], w[1], shape(w[2]), shape(w[3]), values["scales"],
               values["biases"], values["rolling_mean"], values["rolling_variance"],
               momentum))


def emit_bias_gradient(e: LayerEmitter, ts: LayerTrainState, flat: bool = False) -> None:
    """Backward of the bias (and batch norm): the bias (and scale) gradients from ``e.delta``,
    which batch norm then turns into the gradient of its input in place. ``flat``: as for
    ``emit_batchnorm_train``."""
    shape = as_rows if flat else np.asarray
    bias_grad = ts.grads["biases"]
    if "scales" not in ts.values:
        e.host([e.delta], [], lambda r, w: [cpu_conv.bias_grad_step(shape(r[0]), bias_grad)])
        return
    layer = e.spec.index
    saved = [Tensor(layer, role) for role in ("raw", "mean", "variance")]
    # The normalised values are recomputed (the same bits) rather than kept from the
    # forward: one tensor less alive through the pass per batch-norm layer.
    x_norm = e.tensor("x_norm_again", e.shape(saved[0]))
    e.host(saved, [x_norm], lambda r, w: [cpu_batchnorm.batchnorm_normalized_step(
        shape(r[0]), r[1], r[2], shape(w[0]))])
    scales, scale_grad = ts.values["scales"], ts.grads["scales"]
    e.host([e.delta, *saved, x_norm], [e.delta], lambda r, w: [
        cpu_batchnorm.batchnorm_backward_step(shape(w[0]), shape(r[1]), r[2], r[3],
                                              shape(r[4]), scales, scale_grad, bias_grad)])


def _batchnorm_args(e: LayerEmitter, raw: Tensor, momentum: float) -> tuple[dict, dict, dict]:
    """(per-channel grid sizes, per-element grid sizes, argument fields) of the batch-norm
    kernels over ``raw`` ((N, C, H, W), or a connected layer's (N, C, 1, 1)); the per-channel
    sizes name the runs of the sums (``sum_runs``) for the ``*_part`` kernels too."""
    n, c = e.shape(raw)[:2]
    spatial = int(np.prod(e.shape(raw)[2:]))
    runs = sum_runs(n, spatial)
    # Rounded as the CPU rounds them: 1 - momentum in double, then to float.
    args = dict(batch=n, channels=c, spatial=spatial, eps=BATCHNORM_EPSILON,
                momentum=momentum, one_minus_momentum=float(np.float32(1.0 - momentum)),
                exact=0, act=LINEAR, **runs)
    return ({"channels": c, "chunks": runs["chunks"]},
            {"spatial": spatial, "channels": c, "batch": n}, args)


def emit_device_batchnorm_train(e: LayerEmitter, ts: LayerTrainState, raw: Tensor,
                                out: Tensor, momentum: float, act: int = LINEAR) -> None:
    """``emit_batchnorm_train`` with kernels: the mini-batch mean, the variance around it
    (two tree sums each: runs, then per channel; rolling averages updated in place), then
    ``out = act(scales*x_norm + biases)`` (``act`` element-wise: the layer's activation, when
    nothing needs its input)."""
    per_channel, per_element, args = _batchnorm_args(e, raw, momentum)
    c, chunks = per_channel["channels"], per_channel["chunks"]
    runs, channels = {"chunks": chunks, "channels": c}, {"channels": c}
    mean, variance = e.tensor("mean", (c,)), e.tensor("variance", (c,))
    partials = e.tensor("mean_partials", (c, chunks))
    e.kernel("batchnorm_fwd_mean_part_f32", {"x": raw, "partials": partials}, runs, **args)
    e.kernel("batchnorm_fwd_mean_f32", {"partials": partials, "mean": mean}, channels, **args)
    partials = e.tensor("variance_partials", (c, chunks))
    e.kernel("batchnorm_fwd_var_part_f32", {"x": raw, "mean": mean, "partials": partials},
             runs, **args)
    e.kernel("batchnorm_fwd_var_f32",
             {"partials": partials, "mean": mean, "variance": variance,
              "rolling_mean": ts.ref("rolling_mean"),
              "rolling_variance": ts.ref("rolling_variance")}, channels, **args)
    # x_norm is recomputed by the backward (one tensor less alive through the pass, and not
    # written here).
    e.kernel("batchnorm_fwd_norm_f32",
             {"x": raw, "mean": mean, "variance": variance, "scale": ts.ref("scales"),
              "bias": ts.ref("biases"), "out": out}, per_element, **{**args, "act": act})


def emit_device_bias_gradient(e: LayerEmitter, ts: LayerTrainState) -> None:
    """``emit_bias_gradient`` with kernels (each per-channel sum a tree: runs, then per
    channel)."""
    n, c = e.shape(e.delta)[:2]
    spatial = int(np.prod(e.shape(e.delta)[2:]))
    if "scales" not in ts.values:
        runs = sum_runs(n, spatial)
        args = dict(batch=n, channels=c, spatial=spatial, **runs)
        partials = e.tensor("bias_partials", (c, runs["chunks"]))
        e.kernel("bias_bwd_part_f32", {"delta": e.delta, "partials": partials},
                 {"chunks": runs["chunks"], "channels": c}, **args)
        e.kernel("bias_bwd_f32", {"partials": partials,
                                  "bias_grad": ts.ref("biases", "grad")}, {"channels": c},
                 **args)
        return
    layer = e.spec.index
    raw, mean, variance = (Tensor(layer, role) for role in ("raw", "mean", "variance"))
    per_channel, per_element, args = _batchnorm_args(e, raw, 0.0)
    chunks = per_channel["chunks"]
    mean_delta, var_delta = e.tensor("mean_delta", (c,)), e.tensor("var_delta", (c,))
    partials = e.tensor("backward_partials", (3, c, chunks))
    e.kernel("batchnorm_bwd_part_f32",
             {"delta": e.delta, "x": raw, "mean": mean, "variance": variance,
              "partials": partials}, {"chunks": chunks, "channels": c}, **args)
    scales = ts.ref("scales")
    e.kernel("batchnorm_bwd_sums_f32",
             {"partials": partials, "variance": variance, "scale": scales,
              "scale_grad": ts.ref("scales", "grad"), "bias_grad": ts.ref("biases", "grad"),
              "mean_delta": mean_delta, "var_delta": var_delta}, {"channels": c}, **args)
    e.kernel("batchnorm_bwd_delta_f32",
             {"x": raw, "mean": mean, "variance": variance, "scale": scales,
              "mean_delta": mean_delta, "var_delta": var_delta, "delta": e.delta},
             per_element, **args)
