"""Cases of ``shaders/batchnorm.metal``: the bias gradient and batch norm's training forward
and backward. Their per-channel sums are trees (runs, then per channel), not Darknet's serial
order that the CPU keeps: each sum is judged against the exact (float64) one, at least as
close to it as the CPU's is, and against the CPU's within a relative 1e-5. What
follows from the sums (x_norm, out, delta) is judged against the CPU's given the same
statistics elsewhere (``_normalisation``) and here within the sums' rounding."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import activation as cpu_activation
from darknet_metal.cpu import batchnorm, conv
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    RelL2,
    Step,
    dims,
    nan_filled,
    normal,
    rel_l2,
)
from darknet_metal.metal.kernels.batchnorm import sum_runs
from darknet_metal.model.activations import ACTIVATION_ID

SHAPES = ((2, 7, 13, 13), (3, 5, 1, 1), (5, 13), (1, 3, 7, 7), (2, 3, 200, 200))
STATISTICS = ("mean", "variance", "rolling_mean", "rolling_variance")


def layout(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, channels, spatial) of an (N, C) or (N, C, H, W) shape."""
    return (shape[0], shape[1], 1) if len(shape) == 2 else (shape[0], shape[1],
                                                            shape[2] * shape[3])


def batchnorm_args(batch: int, channels: int, spatial: int, *, momentum: float = 0.0,
                   eps: float = batchnorm.EPS, exact: bool = False) -> dict[str, int | float]:
    """dm_batchnorm_args: both momentum factors rounded from the double momentum, as the CPU
    rounds them (1 - momentum is not computed in float); the sums' runs (``sum_runs``)."""
    return {"batch": batch, "channels": channels, "spatial": spatial, "eps": eps,
            "momentum": momentum, "one_minus_momentum": 1.0 - momentum, "exact": int(exact),
            "act": 0, **sum_runs(batch, spatial)}


def per_channel(a: np.ndarray) -> np.ndarray:
    """(channels, batch*spatial) float64 view of an (N, C) or (N, C, H, W) array."""
    n, c = a.shape[:2]
    return a.astype(np.float64).reshape(n, c, -1).transpose(1, 0, 2).reshape(c, -1)


def sum_checks(name: str, got_cpu: np.ndarray, exact: np.ndarray) -> tuple[Check, ...]:
    """A per-channel sum: at least as exact as the CPU's serial float one (a hair of slack:
    float32 cannot always be closer than a result already within an ulp or two), and within a
    relative 1e-5 of it, or twice the CPU's own distance from the exact sum where that is
    larger (a long serial float sum is the less exact of the two)."""
    cpu_error = rel_l2(got_cpu, exact)
    return (Check(name, exact, RelL2(cpu_error + 2e-7)),
            Check(name, got_cpu, RelL2(max(1e-5, 2.0 * cpu_error))))


def _runs(args: dict[str, int | float]) -> dict[str, int]:
    return {"chunks": int(args["chunks"]), "channels": int(args["channels"])}


def bias_steps(batch: int, channels: int, spatial: int) -> tuple[Step, ...]:
    """bias_grad += the per-channel sums of delta: runs, then per channel (a ``partials``
    array of channels*chunks floats)."""
    args = {"batch": batch, "channels": channels, "spatial": spatial,
            **sum_runs(batch, spatial)}
    return (Step("bias_bwd_part_f32", args, _runs(args)),
            Step("bias_bwd_f32", args, {"channels": channels}))


def partials_for(channels: int, batch: int, spatial: int, sums: int = 1) -> np.ndarray:
    """The NaN-filled scratch of the runs' partial sums."""
    return nan_filled(sums * channels * int(sum_runs(batch, spatial)["chunks"]))


def _bias_grad(shape: tuple[int, ...]) -> KernelCase:
    n, c, spatial = layout(shape)

    def make(rng: np.random.Generator) -> CaseData:
        delta, bias_grad = normal(rng, shape, offset=0.5), normal(rng, c, 10.0)
        want = bias_grad.copy()
        conv.bias_grad_step(delta, want).run()
        exact = bias_grad.astype(np.float64) + per_channel(delta).sum(axis=1)
        return CaseData({"delta": delta, "bias_grad": bias_grad,
                         "partials": partials_for(c, n, spatial)},
                        sum_checks("bias_grad", want, exact))

    return KernelCase(f"bias_bwd_f32-{dims(shape)}", bias_steps(n, c, spatial), make)


def forward_train(x: np.ndarray, scale: np.ndarray, bias: np.ndarray,
                  rolling: tuple[np.ndarray, np.ndarray],
                  momentum: float) -> dict[str, np.ndarray]:
    """The CPU's training forward: the statistics, the rolling ones updated, x_norm, out."""
    c = x.shape[1]
    got = {"mean": np.empty(c, np.float32), "variance": np.empty(c, np.float32),
           "x_norm": np.empty_like(x), "out": np.empty_like(x),
           "rolling_mean": rolling[0].copy(), "rolling_variance": rolling[1].copy()}
    batchnorm.batchnorm_forward_train(x, got["mean"], got["variance"], got["x_norm"],
                                      got["out"], scale, bias, got["rolling_mean"],
                                      got["rolling_variance"], momentum)
    return got


def forward_arrays(x: np.ndarray, scale: np.ndarray, bias: np.ndarray,
                   rolling: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of ``forward_steps``: the inputs, the rolling statistics they update, and
    NaN outputs (x_norm is not one: the device recomputes it for the backward)."""
    c = x.shape[1]
    n, spatial = x.shape[0], int(np.prod(x.shape[2:]))
    return {"x": x, "scale": scale, "bias": bias, "rolling_mean": rolling[0],
            "rolling_variance": rolling[1], "mean": nan_filled(c), "variance": nan_filled(c),
            "out": nan_filled(x.shape),
            "mean_partials": partials_for(c, n, spatial),
            "variance_partials": partials_for(c, n, spatial)}


def forward_steps(shape: tuple[int, ...], args: dict[str, int | float]) -> tuple[Step, ...]:
    """The mean, the variance around it (each runs, then per channel; partial sums in
    ``mean_partials`` and ``variance_partials``), then the normalisation, on arrays named
    after their roles."""
    n, c, spatial = layout(shape)
    return (Step("batchnorm_fwd_mean_part_f32", args, _runs(args),
                 {"x": "x", "partials": "mean_partials"}),
            Step("batchnorm_fwd_mean_f32", args, {"channels": c},
                 {"partials": "mean_partials", "mean": "mean"}),
            Step("batchnorm_fwd_var_part_f32", args, _runs(args),
                 {"x": "x", "mean": "mean", "partials": "variance_partials"}),
            Step("batchnorm_fwd_var_f32", args, {"channels": c},
                 {"partials": "variance_partials", "mean": "mean", "variance": "variance",
                  "rolling_mean": "rolling_mean", "rolling_variance": "rolling_variance"}),
            Step("batchnorm_fwd_norm_f32", args, {"spatial": spatial, "channels": c,
                                                  "batch": n}))


def _forward(shape: tuple[int, ...]) -> KernelCase:
    n, c, spatial = layout(shape)
    momentum = batchnorm.MOMENTUM_CONNECTED if len(shape) == 2 else batchnorm.MOMENTUM_CONV

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 2.0, 3.0)
        scale, bias = normal(rng, c), normal(rng, c)
        rolling = (normal(rng, c), np.abs(normal(rng, c)) + np.float32(0.5))
        want = forward_train(x, scale, bias, rolling, momentum)
        arrays = forward_arrays(x, scale, bias, rolling)
        values = per_channel(x)
        mean, variance = values.mean(axis=1), values.var(axis=1, ddof=1)
        # The rest follows the statistics: within their rounding of the CPU's.
        rest = tuple(Check(name, want[name], RelL2(1e-5))
                     for name in ("out", "rolling_mean", "rolling_variance"))
        return CaseData(arrays, (*sum_checks("mean", want["mean"], mean),
                                 *sum_checks("variance", want["variance"], variance), *rest))

    return KernelCase(f"batchnorm_fwd_f32-{dims(shape)}",
                      forward_steps(shape, batchnorm_args(n, c, spatial, momentum=momentum)),
                      make)


def _normalisation(shape: tuple[int, ...], act: str = "linear") -> KernelCase:
    """Given the CPU's statistics, out (written over x) is the CPU's exactly, then the
    activation applied to it (Darknet's, after the normalisation)."""
    n, c, spatial = layout(shape)
    args = {**batchnorm_args(n, c, spatial), "act": ACTIVATION_ID[act]}
    sizes = {"spatial": spatial, "channels": c, "batch": n}
    steps = (
        Step("batchnorm_fwd_norm_f32", args, sizes,
             {"x": "y", "mean": "mean", "variance": "variance", "scale": "scale",
              "bias": "bias", "out": "y"}),
    )

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 2.0, -1.0)
        scale, bias = normal(rng, c), normal(rng, c)
        cpu = forward_train(x, scale, bias, (np.zeros(c, np.float32),) * 2, 0.9)
        arrays = {"y": x.copy(), "mean": cpu["mean"], "variance": cpu["variance"],
                  "scale": scale, "bias": bias}
        want = cpu["out"].copy()
        cpu_activation.activate(want, ACTIVATION_ID[act])
        # exp and log round otherwise on a GPU than in the C library (as activation_fwd_f32's
        # cases allow); the normalisation itself is exact.
        same = Exact() if act in ("linear", "leaky") else Close(2e-6, 1e-6)
        return CaseData(arrays, (Check("y", want, same),))

    return KernelCase(f"batchnorm_fwd_norm_f32-{dims(shape)}-{act}-in_place", steps, make)


def backward_arrays(rng: np.random.Generator, shape: tuple[int, ...], x_scale: float = 2.0,
                    x_offset: float = 3.0) -> dict[str, np.ndarray]:
    """The arrays of ``backward_steps``: x and its statistics (the CPU's forward), delta,
    scale, the scale and bias gradients it adds into, and NaN sums."""
    c = shape[1]
    x = normal(rng, shape, x_scale, x_offset)
    cpu = forward_train(x, normal(rng, c), normal(rng, c), (np.zeros(c, np.float32),) * 2, 0.9)
    n, spatial = shape[0], int(np.prod(shape[2:]))
    return {"x": x, "mean": cpu["mean"], "variance": cpu["variance"], "x_norm": cpu["x_norm"],
            "delta": normal(rng, shape, 0.1, 0.02), "scale": normal(rng, c),
            "scale_grad": normal(rng, c), "bias_grad": normal(rng, c),
            "mean_delta": nan_filled(c), "var_delta": nan_filled(c),
            "partials": partials_for(c, n, spatial, sums=3)}


def backward_train(a: dict[str, np.ndarray], exact: bool) -> dict[str, np.ndarray]:
    """The CPU's backward: delta, scale_grad and bias_grad after it."""
    got = {name: a[name].copy() for name in ("delta", "scale_grad", "bias_grad")}
    batchnorm.batchnorm_backward(got["delta"], a["x"], a["mean"], a["variance"], a["x_norm"],
                                 a["scale"], got["scale_grad"], got["bias_grad"], exact=exact)
    return got


def backward_steps(shape: tuple[int, ...], args: dict[str, int | float]) -> tuple[Step, ...]:
    """The sums (runs into ``partials``, then per channel into the scale and bias gradients,
    mean_delta and var_delta), then delta."""
    n, c, spatial = layout(shape)
    return (Step("batchnorm_bwd_part_f32", args, _runs(args)),
            Step("batchnorm_bwd_sums_f32", args, {"channels": c}),
            Step("batchnorm_bwd_delta_f32", args, {"spatial": spatial, "channels": c,
                                                   "batch": n}))


def _backward(shape: tuple[int, ...], exact: bool) -> KernelCase:
    n, c, spatial = layout(shape)

    def make(rng: np.random.Generator) -> CaseData:
        arrays = backward_arrays(rng, shape)
        want = backward_train(arrays, exact)
        delta = per_channel(arrays["delta"])
        scale_exact = arrays["scale_grad"] + (delta * per_channel(arrays["x_norm"])).sum(axis=1)
        bias_exact = arrays["bias_grad"] + delta.sum(axis=1)
        return CaseData(arrays, (*sum_checks("scale_grad", want["scale_grad"], scale_exact),
                                 *sum_checks("bias_grad", want["bias_grad"], bias_exact),
                                 Check("delta", want["delta"], RelL2(1e-5))))

    return KernelCase(f"batchnorm_bwd_f32-{dims(shape)}" + ("-exact" if exact else ""),
                      backward_steps(shape, batchnorm_args(n, c, spatial, exact=exact)), make)


CASES: tuple[KernelCase, ...] = (
    *(_bias_grad(shape) for shape in ((2, 7, 13, 13), (3, 5, 1, 1), (5, 13), (1, 1, 7, 7),
                                      (64, 3), (2, 3, 200, 200))),
    *(_forward(shape) for shape in SHAPES),
    *(_normalisation(shape) for shape in ((2, 7, 13, 13), (5, 13))),
    *(_normalisation((2, 7, 5, 5), act) for act in ("leaky", "mish", "logistic")),
    *(_backward(shape, exact) for shape in SHAPES for exact in (False, True)),
)
