"""Cases of ``shaders/resample.metal``: upsampling (and, with a negative stride, Darknet's
downsampling), [reorg] and [reorg3d], forward and backward, and the half twins."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import resample
from darknet_metal.diagnostics.kernel_parity import (
    NCHW,
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    Step,
    dims,
    nan_filled,
    normal,
)
from darknet_metal.ops.resample import Reorg3dOp, ReorgOp


def upsample_args(shape: NCHW, stride: int, scale: float) -> dict[str, int | float]:
    """dm_upsample_args of an (N, C, H, W) input."""
    n, c, h, w = shape
    oh, ow = resample.upsample_output_shape(shape, stride)[2:]
    return {"planes": n * c, "height": h, "width": w, "out_h": oh, "out_w": ow,
            "stride": stride, "scale": scale}


def _upsample(shape: NCHW, stride: int, scale: float, *, half: bool = False) -> KernelCase:
    args = upsample_args(shape, stride, scale)
    kernel = "upsample_fwd_f16" if half else "upsample_fwd_f32"
    dtype = np.float16 if half else np.float32

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0).astype(dtype)
        want = np.empty(resample.upsample_output_shape(shape, stride), np.float32)
        resample.upsample_forward(x.astype(np.float32), want, stride, scale)
        check = (Check("y", want.astype(np.float16), Exact()) if half
                 else Check("y", want, Close(1e-6, 1e-6)))
        return CaseData({"x": x, "y": nan_filled(want.shape, dtype)}, (check,))

    return KernelCase(f"{kernel}-{dims(shape)}-s{stride}-scale{scale:g}",
                      (Step(kernel, args, {"out_w": args["out_w"], "out_h": args["out_h"],
                                           "planes": args["planes"]}),), make)


def _upsample_backward(shape: NCHW, stride: int, scale: float) -> KernelCase:
    args = upsample_args(shape, stride, scale)
    oh, ow = args["out_h"], args["out_w"]
    cols, rows = (shape[3], shape[2]) if stride > 0 else (ow, oh)

    def make(rng: np.random.Generator) -> CaseData:
        delta = normal(rng, (*shape[:2], oh, ow), 3.0)
        x_grad = normal(rng, shape, 3.0)
        want = x_grad.copy()
        resample.upsample_backward(delta, want, stride, scale)
        return CaseData({"delta": delta, "x_grad": x_grad}, (Check("x_grad", want, Exact()),))

    return KernelCase(f"upsample_bwd_f32-{dims(shape)}-s{stride}-scale{scale:g}",
                      (Step("upsample_bwd_f32", args,
                            {"cols": cols, "rows": rows, "planes": args["planes"]}),), make)


def reorg_args(shape: NCHW, stride: int, reverse: bool,
               layer: type[ReorgOp]) -> tuple[dict[str, int], dict[str, int]]:
    """(dm_reorg_args, grid sizes) of a reorg of (N, C, H, W) input ``shape``. Both layers
    are Darknet's reorg_cpu with forward=reverse: [reorg] (its reorg_old) on the input's own
    (w, h, c), [reorg3d] on the output's."""
    out_shape = resample.reorg_output_shape(shape, stride, reverse)
    n, c, h, w = out_shape if layer.maps_output_dims else shape
    return ({"batch": n, "width": w, "height": h, "channels": c, "stride": stride,
             "reverse": int(reverse)}, {"width": w, "height": h, "slices": n * c})


def _reorg_name(kernel: str, shape: NCHW, stride: int, reverse: bool,
                layer: type[ReorgOp]) -> str:
    return f"{kernel}-{layer.kind}-{dims(shape)}-s{stride}" + ("-reverse" if reverse else "")


def _reorg(shape: NCHW, stride: int, reverse: bool, layer: type[ReorgOp], *,
           half: bool = False) -> KernelCase:
    kernel = "reorg_fwd_f16" if half else "reorg_fwd_f32"
    dtype = np.float16 if half else np.float32

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0).astype(dtype)
        want = np.empty(resample.reorg_output_shape(shape, stride, reverse), np.float32)
        resample.reorg_forward(x.astype(np.float32), want, stride, reverse, layer.kind)
        return CaseData({"x": x, "y": nan_filled(want.shape, dtype)},
                        (Check("y", want.astype(dtype), Exact()),))

    return KernelCase(_reorg_name(kernel, shape, stride, reverse, layer),
                      (Step(kernel, *reorg_args(shape, stride, reverse, layer)),), make)


def _reorg_backward(shape: NCHW, stride: int, reverse: bool,
                    layer: type[ReorgOp]) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        delta = normal(rng, resample.reorg_output_shape(shape, stride, reverse), 3.0)
        x_grad = normal(rng, shape, 3.0)
        want = x_grad.copy()
        resample.reorg_backward(delta, want, stride, reverse, layer.kind)
        return CaseData({"delta": delta, "x_grad": x_grad}, (Check("x_grad", want, Exact()),))

    return KernelCase(_reorg_name("reorg_bwd_f32", shape, stride, reverse, layer),
                      (Step("reorg_bwd_f32", *reorg_args(shape, stride, reverse, layer)),), make)


REORGS = (  # (shape, stride, reverse, the op whose index map it is)
    ((1, 4, 6, 6), 2, False, ReorgOp),
    ((2, 9, 6, 3), 3, False, ReorgOp),
    ((1, 8, 3, 5), 2, True, ReorgOp),
    ((2, 4, 1, 1), 2, True, ReorgOp),
    ((1, 3, 6, 10), 2, False, Reorg3dOp),
    ((2, 2, 9, 3), 3, False, Reorg3dOp),
    ((1, 16, 3, 5), 2, True, Reorg3dOp),
)

CASES: tuple[KernelCase, ...] = (
    *(_upsample(shape, stride, scale) for shape, stride, scale in (
        ((1, 3, 13, 13), 2, 1.0),
        ((2, 5, 7, 1), 3, 0.5),
        ((1, 7, 1, 1), 2, 1.0),
        ((1, 3, 6, 4), -2, 1.0),
        ((2, 5, 7, 5), -2, 0.25),
        ((1, 3, 9, 9), -3, 2.0),
    )),
    *(_reorg(*reorg) for reorg in REORGS),
    *(_upsample_backward(shape, stride, scale) for shape, stride, scale in (
        ((1, 3, 13, 13), 2, 1.0),
        ((2, 5, 7, 1), 3, 0.5),
        ((1, 7, 1, 1), 2, 1.0),
        ((2, 9, 61, 61), 2, 0.75),  # 66978 inputs
        ((1, 3, 6, 4), -2, 1.0),
        ((2, 5, 7, 5), -2, 0.25),  # sizes the stride does not divide: the flat-index reads
        ((1, 3, 9, 9), -3, 2.0),
    )),
    *(_reorg_backward(*reorg) for reorg in (*REORGS, ((2, 16, 46, 46), 2, False, ReorgOp))),
    _upsample((2, 5, 9, 11), 2, 1.0, half=True),
    *(_reorg((2, 8, 4, 6), 2, reverse, ReorgOp, half=True) for reverse in (False, True)),
)
