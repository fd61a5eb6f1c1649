"""Cases of ``shaders/batchnorm.metal``: the bias gradient and batch norm's training forward
and backward. Their sums are Darknet's serial ones, as the CPU's: the same bits. The backward's
delta formula is float here and double on the CPU (Metal has no double): a few roundings
apart."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import batchnorm, conv
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Exact,
    KernelCase,
    RelL2,
    Step,
    dims,
    nan_filled,
    normal,
)

SHAPES = ((2, 7, 13, 13), (3, 5, 1, 1), (5, 13), (1, 3, 7, 7), (2, 3, 200, 200))
STATISTICS = ("mean", "variance", "rolling_mean", "rolling_variance")


def layout(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, channels, spatial) of an (N, C) or (N, C, H, W) shape."""
    return (shape[0], shape[1], 1) if len(shape) == 2 else (shape[0], shape[1],
                                                            shape[2] * shape[3])


def batchnorm_args(batch: int, channels: int, spatial: int, *, momentum: float = 0.0,
                   eps: float = batchnorm.EPS, exact: bool = False) -> dict[str, int | float]:
    """dm_batchnorm_args: both momentum factors rounded from the double momentum, as the CPU
    rounds them (1 - momentum is not computed in float)."""
    return {"batch": batch, "channels": channels, "spatial": spatial, "eps": eps,
            "momentum": momentum, "one_minus_momentum": 1.0 - momentum, "exact": int(exact)}


def _bias_grad(shape: tuple[int, ...]) -> KernelCase:
    n, c, spatial = layout(shape)

    def make(rng: np.random.Generator) -> CaseData:
        delta, bias_grad = normal(rng, shape, offset=0.5), normal(rng, c, 10.0)
        want = bias_grad.copy()
        conv.bias_grad_step(delta, want).run()
        # Darknet's serial sums, image by image, as the CPU adds them: the same bits.
        return CaseData({"delta": delta, "bias_grad": bias_grad},
                        (Check("bias_grad", want, Exact()),))

    return KernelCase(f"bias_bwd_f32-{dims(shape)}",
                      (Step("bias_bwd_f32", {"batch": n, "channels": c, "spatial": spatial},
                            {"channels": c}),), make)


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
    NaN outputs."""
    c = x.shape[1]
    return {"x": x, "scale": scale, "bias": bias, "rolling_mean": rolling[0],
            "rolling_variance": rolling[1], "mean": nan_filled(c), "variance": nan_filled(c),
            "x_norm": nan_filled(x.shape), "out": nan_filled(x.shape)}


def forward_steps(shape: tuple[int, ...], args: dict[str, int | float]) -> tuple[Step, ...]:
    """The statistics, then the normalisation, on arrays named after their roles."""
    n, c, spatial = layout(shape)
    return (Step("batchnorm_fwd_stats_f32", args, {"channels": c}),
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
        # And they are float sums: against float64 ones, within O(n) roundings.
        per_channel = x.astype(np.float64).reshape(n, c, spatial).transpose(1, 0, 2)
        per_channel = per_channel.reshape(c, -1)
        return CaseData(arrays, (*(Check(name, w, Exact()) for name, w in want.items()),
                                 Check("mean", per_channel.mean(axis=1), RelL2(1e-5)),
                                 Check("variance", per_channel.var(axis=1, ddof=1),
                                       RelL2(1e-4))))

    return KernelCase(f"batchnorm_fwd_f32-{dims(shape)}",
                      forward_steps(shape, batchnorm_args(n, c, spatial, momentum=momentum)),
                      make)


def _normalisation(shape: tuple[int, ...]) -> KernelCase:
    """Given the CPU's statistics, x_norm and out (written over x) and the recomputed x_norm
    are the CPU's exactly."""
    n, c, spatial = layout(shape)
    args = batchnorm_args(n, c, spatial)
    sizes = {"spatial": spatial, "channels": c, "batch": n}
    steps = (
        Step("batchnorm_fwd_norm_f32", args, sizes,
             {"x": "y", "mean": "mean", "variance": "variance", "scale": "scale",
              "bias": "bias", "x_norm": "x_norm", "out": "y"}),
        Step("batchnorm_fwd_xnorm_f32", args, sizes,
             {"x": "x", "mean": "mean", "variance": "variance", "x_norm": "recomputed"}),
    )

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 2.0, -1.0)
        scale, bias = normal(rng, c), normal(rng, c)
        cpu = forward_train(x, scale, bias, (np.zeros(c, np.float32),) * 2, 0.9)
        again = nan_filled(shape)
        batchnorm.batchnorm_normalized_step(x, cpu["mean"], cpu["variance"], again).run()
        arrays = {"x": x, "y": x.copy(), "mean": cpu["mean"], "variance": cpu["variance"],
                  "scale": scale, "bias": bias, "x_norm": nan_filled(shape),
                  "recomputed": nan_filled(shape)}
        return CaseData(arrays, (Check("x_norm", cpu["x_norm"], Exact()),
                                 Check("y", cpu["out"], Exact()),
                                 Check("recomputed", cpu["x_norm"], Exact()),
                                 Check("recomputed", again, Exact())))

    return KernelCase(f"batchnorm_fwd_norm_f32-{dims(shape)}-in_place", steps, make)


def backward_arrays(rng: np.random.Generator, shape: tuple[int, ...], x_scale: float = 2.0,
                    x_offset: float = 3.0) -> dict[str, np.ndarray]:
    """The arrays of ``backward_steps``: x and its statistics (the CPU's forward), delta,
    scale, the scale and bias gradients it adds into, and NaN sums."""
    c = shape[1]
    x = normal(rng, shape, x_scale, x_offset)
    cpu = forward_train(x, normal(rng, c), normal(rng, c), (np.zeros(c, np.float32),) * 2, 0.9)
    return {"x": x, "mean": cpu["mean"], "variance": cpu["variance"], "x_norm": cpu["x_norm"],
            "delta": normal(rng, shape, 0.1, 0.02), "scale": normal(rng, c),
            "scale_grad": normal(rng, c), "bias_grad": normal(rng, c),
            "mean_delta": nan_filled(c), "var_delta": nan_filled(c)}


def backward_train(a: dict[str, np.ndarray], exact: bool) -> dict[str, np.ndarray]:
    """The CPU's backward: delta, scale_grad and bias_grad after it."""
    got = {name: a[name].copy() for name in ("delta", "scale_grad", "bias_grad")}
    batchnorm.batchnorm_backward(got["delta"], a["x"], a["mean"], a["variance"], a["x_norm"],
                                 a["scale"], got["scale_grad"], got["bias_grad"], exact=exact)
    return got


def backward_steps(shape: tuple[int, ...], args: dict[str, int | float]) -> tuple[Step, ...]:
    """The sums (into the scale and bias gradients, mean_delta and var_delta), then delta."""
    n, c, spatial = layout(shape)
    return (Step("batchnorm_bwd_sums_f32", args, {"channels": c}),
            Step("batchnorm_bwd_delta_f32", args, {"spatial": spatial, "channels": c,
                                                   "batch": n}))


def _backward(shape: tuple[int, ...], exact: bool) -> KernelCase:
    n, c, spatial = layout(shape)

    def make(rng: np.random.Generator) -> CaseData:
        arrays = backward_arrays(rng, shape)
        want = backward_train(arrays, exact)
        return CaseData(arrays, (Check("scale_grad", want["scale_grad"], Exact()),
                                 Check("bias_grad", want["bias_grad"], Exact()),
                                 Check("delta", want["delta"], RelL2(1e-6))))

    return KernelCase(f"batchnorm_bwd_f32-{dims(shape)}" + ("-exact" if exact else ""),
                      backward_steps(shape, batchnorm_args(n, c, spatial, exact=exact)), make)


CASES: tuple[KernelCase, ...] = (
    *(_bias_grad(shape) for shape in ((2, 7, 13, 13), (3, 5, 1, 1), (5, 13), (1, 1, 7, 7),
                                      (64, 3), (2, 3, 200, 200))),
    *(_forward(shape) for shape in SHAPES),
    *(_normalisation(shape) for shape in ((2, 7, 13, 13), (5, 13))),
    *(_backward(shape, exact) for shape in SHAPES for exact in (False, True)),
)
