"""Cases of ``shaders/pooling.metal``: max pooling over windows and across channels, average
pooling, the training forwards with their argmax indexes, the backwards, and the half twins.
Maxima are moved, never computed: bit for bit, ties and windows wholly outside the image
(index -1) included."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from darknet_metal.cpu import pooling
from darknet_metal.diagnostics.kernel_cases.half import half_twin
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


def pool_args(shape: NCHW, size: int, sx: int, sy: int, padding: int,
              accumulate: int = 1) -> dict[str, int]:
    """dm_pool_args of a window pool of (N, C, H, W) ``shape`` (``accumulate``: the backward
    adds into the gradient, or sets it with 0)."""
    n, c, h, w = shape
    oh, ow = pooling.pool_output_hw(h, w, size, sx, sy, padding)
    return {"planes": n * c, "height": h, "width": w, "out_h": oh, "out_w": ow, "size": size,
            "stride_x": sx, "stride_y": sy, "padding": padding, "accumulate": accumulate}


def pool_input(rng: np.random.Generator, shape: NCHW, values: str) -> np.ndarray:
    """3 * N(0, 1) draws; ``ties``: integers from -2 to 1 (many equal maxima); ``negative``:
    every value below -0.5 (padding never wins)."""
    if values == "ties":
        return rng.integers(-2, 2, shape).astype(np.float32)
    x = normal(rng, shape, 3.0)
    return -np.abs(x) - np.float32(0.5) if values == "negative" else x


def _window_name(kernel: str, shape: NCHW, size: int, sx: int, sy: int, padding: int) -> str:
    return f"{kernel}-{dims(shape)}-k{size}-s{sx}x{sy}-p{padding}"


def _maxpool(shape: NCHW, size: int, sx: int, sy: int, padding: int, *,
             half: bool = False) -> KernelCase:
    args = pool_args(shape, size, sx, sy, padding)
    grid = {"out_w": args["out_w"], "out_h": args["out_h"], "planes": args["planes"]}
    kernel = "maxpool_fwd_f16" if half else "maxpool_fwd_f32"
    dtype = np.float16 if half else np.float32

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0).astype(dtype)
        want = np.empty((*shape[:2], args["out_h"], args["out_w"]), np.float32)
        pooling.maxpool_forward(x.astype(np.float32), want, size, sx, sy, padding)
        check = (Check("y", want.astype(np.float16), Exact()) if half
                 else Check("y", want, Close(1e-6, 1e-7)))
        return CaseData({"x": x, "y": np.full(want.shape, 77.0, dtype)}, (check,))

    return KernelCase(_window_name(kernel, shape, size, sx, sy, padding),
                      (Step(kernel, args, grid),), make)


def _maxpool_nan_and_ties() -> KernelCase:
    """Darknet's strict ``>`` never picks NaN: the maximum of NaN and tied ones is 1."""
    args = pool_args((1, 1, 2, 2), 2, 2, 2, 0)

    def make(rng: np.random.Generator) -> CaseData:
        x = np.array([[[[np.nan, 1.0], [1.0, np.nan]]]], np.float32)
        return CaseData({"x": x, "y": nan_filled((1, 1, 1, 1))},
                        (Check("y", np.ones((1, 1, 1, 1), np.float32), Exact()),))

    return KernelCase("maxpool_fwd_f32-nan_and_ties",
                      (Step("maxpool_fwd_f32", args, {"out_w": 1, "out_h": 1, "planes": 1}),),
                      make)


def _maxpool_depth(shape: NCHW, out_c: int) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0)
        want = np.empty((n, out_c, h, w), np.float32)
        pooling.maxpool_depth_forward(x, want)
        return CaseData({"x": x, "y": nan_filled(want.shape)}, (Check("y", want, Exact()),))

    return KernelCase(f"maxpool_depth_fwd_f32-{dims(shape)}-to{out_c}",
                      (Step("maxpool_depth_fwd_f32",
                            {"batch": n, "channels": c, "spatial": h * w, "out_channels": out_c},
                            {"spatial": h * w, "out_channels": out_c, "batch": n}),), make)


def _avgpool(shape: NCHW) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0)
        want = np.empty((n, c, 1, 1), np.float32)
        pooling.avgpool_forward(x, want)
        return CaseData({"x": x, "y": nan_filled(want.shape)},
                        (Check("y", want, Close(1e-6, 1e-7)),))

    return KernelCase(f"avgpool_fwd_f32-{dims(shape)}",
                      (Step("avgpool_fwd_f32", {"planes": n * c, "spatial": h * w},
                            {"planes": n * c}),), make)


def _argmax_make(shape: NCHW, out_shape: NCHW, values: str,
                 forward_train: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
                 accumulate: bool = True) -> Callable[[np.random.Generator], CaseData]:
    """The data of a training forward (outputs and argmax indexes, by ``forward_train`` on
    the CPU) followed by the backward through the indexes it wrote, adding into a random
    gradient (or, not ``accumulate``, setting a gradient of NaN)."""

    def make(rng: np.random.Generator) -> CaseData:
        x = pool_input(rng, shape, values)
        want_y, want_idx = np.empty(out_shape, np.float32), np.empty(out_shape, np.int32)
        forward_train(x, want_y, want_idx)
        delta = normal(rng, out_shape, 3.0)
        x_grad = normal(rng, shape, 3.0) if accumulate else nan_filled(shape)
        want_grad = x_grad.copy() if accumulate else np.zeros(shape, np.float32)
        pooling.maxpool_backward(delta, want_idx, want_grad)
        arrays = {"x": x, "y": nan_filled(out_shape), "indexes": nan_filled(out_shape, np.int32),
                  "delta": delta, "x_grad": x_grad}
        return CaseData(arrays, (Check("y", want_y, Exact()),
                                 Check("indexes", want_idx, Exact()),
                                 Check("x_grad", want_grad, Exact())))

    return make


def _maxpool_train(shape: NCHW, size: int, sx: int, sy: int, padding: int,
                   values: str, accumulate: int = 1) -> KernelCase:
    """The training forward (outputs and argmax indexes), then the backward through the
    indexes it wrote, adding into a random gradient (or, ``accumulate`` 0, setting one)."""
    n, c, h, w = shape
    args = pool_args(shape, size, sx, sy, padding, accumulate)
    steps = (Step("maxpool_fwd_train_f32", args,
                  {"out_w": args["out_w"], "out_h": args["out_h"], "planes": n * c}),
             Step("maxpool_bwd_f32", args, {"width": w, "height": h, "planes": n * c}))

    make = _argmax_make(shape, (n, c, args["out_h"], args["out_w"]), values,
                        lambda x, y, idx: pooling.maxpool_forward_train(x, y, idx, size, sx, sy,
                                                                        padding),
                        accumulate=bool(accumulate))

    name = _window_name("maxpool_fwd_train_f32", shape, size, sx, sy, padding)
    return KernelCase(f"{name}-{values}" + ("" if accumulate else "-set"), steps, make)


def _maxpool_overlapping_windows() -> KernelCase:
    """One maximum shared by all nine 3x3 stride-1 windows around it: its gradient gathers
    nine deltas."""
    shape = (1, 1, 5, 5)
    args = pool_args(shape, 3, 1, 1, 2)
    steps = (Step("maxpool_fwd_train_f32", args, {"out_w": 5, "out_h": 5, "planes": 1}),
             Step("maxpool_bwd_f32", args, {"width": 5, "height": 5, "planes": 1}))

    def make(rng: np.random.Generator) -> CaseData:
        x = np.zeros(shape, np.float32)
        x[0, 0, 2, 2] = 5.0
        delta = np.arange(25, dtype=np.float32).reshape(shape)
        y, idx = np.empty(shape, np.float32), np.empty(shape, np.int32)
        pooling.maxpool_forward_train(x, y, idx, 3, 1, 1, 2)
        want = np.ones(shape, np.float32)
        pooling.maxpool_backward(delta, idx, want)
        gathered = np.float32(1.0) + delta[0, 0, 1:4, 1:4].sum()
        return CaseData({"x": x, "y": nan_filled(shape), "indexes": nan_filled(shape, np.int32),
                         "delta": delta, "x_grad": np.ones(shape, np.float32)},
                        (Check("x_grad", want, Exact()),
                         Check("x_grad", gathered, Exact(), (0, 0, 2, 2))))

    return KernelCase("maxpool_bwd_f32-overlapping_windows", steps, make)


def _maxpool_depth_train(shape: NCHW, out_c: int, values: str) -> KernelCase:
    n, c, h, w = shape
    args = {"batch": n, "channels": c, "spatial": h * w, "out_channels": out_c}
    steps = (Step("maxpool_depth_fwd_train_f32", args,
                  {"spatial": h * w, "out_channels": out_c, "batch": n}),
             Step("maxpool_depth_bwd_f32", args, {"spatial": h * w, "channels": c, "batch": n}))

    make = _argmax_make(shape, (n, out_c, h, w), values, pooling.maxpool_depth_forward_train)
    return KernelCase(f"maxpool_depth_fwd_train_f32-{dims(shape)}-to{out_c}-{values}", steps,
                      make)


def _avgpool_backward(shape: NCHW) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        delta, x_grad = normal(rng, (n, c, 1, 1), 3.0), normal(rng, shape, 3.0)
        want = x_grad.copy()
        pooling.avgpool_backward(delta, want)
        return CaseData({"delta": delta, "x_grad": x_grad}, (Check("x_grad", want, Exact()),))

    return KernelCase(f"avgpool_bwd_f32-{dims(shape)}",
                      (Step("avgpool_bwd_f32", {"planes": n * c, "spatial": h * w},
                            {"spatial": h * w, "planes": n * c}),), make)


def _depth_reference(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    y = np.empty((2, 2, 20, 1), np.float32)
    pooling.maxpool_depth_forward(a["x"].reshape(2, 6, 20, 1), y)
    return {"y": y}


def _average_reference(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    y = np.empty((1, 12, 1, 1), np.float32)
    pooling.avgpool_forward(a["x"].reshape(1, 12, 7, 7), y)
    return {"y": y}


WINDOWS = (  # (shape, size, stride_x, stride_y, padding)
    ((1, 3, 13, 13), 2, 1, 1, 1),  # yolov3-tiny's last maxpool: 13x13 stays 13x13
    ((2, 5, 7, 7), 2, 2, 2, 1),
    ((1, 7, 13, 13), 3, 2, 2, 2),
    ((1, 3, 7, 1), 2, 1, 2, 1),
    ((1, 5, 1, 1), 3, 1, 1, 2),
    ((1, 3, 7, 7), 5, 3, 1, 0),
    ((1, 3, 4, 4), 2, 1, 1, 6),  # windows wholly outside the image
)
TRAIN_WINDOWS = (  # (shape, size, stride_x, stride_y, padding, values)
    ((1, 3, 13, 13), 2, 1, 1, 1, "normal"),
    ((2, 5, 7, 7), 2, 2, 2, 1, "ties"),
    ((1, 7, 13, 13), 3, 1, 1, 2, "ties"),  # overlapping windows, many equal maxima
    ((1, 3, 13, 13), 3, 2, 2, 2, "negative"),  # padding never wins over negatives
    ((1, 3, 7, 1), 2, 1, 2, 1, "normal"),
    ((1, 5, 1, 1), 3, 1, 1, 2, "negative"),
    ((1, 3, 7, 7), 5, 3, 1, 0, "ties"),
    ((1, 3, 4, 4), 2, 1, 1, 6, "normal"),  # windows wholly outside: index -1
    ((2, 9, 61, 61), 3, 1, 1, 2, "ties"),  # 66978 inputs
)

CASES: tuple[KernelCase, ...] = (
    *(_maxpool(*window) for window in WINDOWS),
    _maxpool_nan_and_ties(),
    *(_maxpool_depth(shape, out_c) for shape, out_c in (((2, 7, 5, 3), 3), ((1, 6, 13, 13), 2),
                                                        ((1, 5, 1, 1), 5))),
    *(_avgpool(shape) for shape in ((2, 7, 7, 7), (1, 65, 1, 1), (1, 3, 13, 13))),
    *(_maxpool_train(*window) for window in TRAIN_WINDOWS),
    # Setting the gradient, as a delta's first writer does (index -1 windows included).
    _maxpool_train((2, 4, 13, 13), 2, 2, 2, 1, "normal", accumulate=0),
    _maxpool_train((1, 3, 4, 4), 2, 1, 1, 6, "normal", accumulate=0),
    _maxpool_overlapping_windows(),
    *(_maxpool_depth_train(shape, out_c, values) for shape, out_c, values in (
        ((2, 7, 5, 3), 3, "ties"),
        ((1, 6, 13, 13), 2, "normal"),
        ((1, 5, 1, 1), 5, "negative"),
        ((1, 3, 3, 3), 5, "normal"),  # more output channels than input: index -1
        ((2, 33, 33, 33), 11, "ties"),  # 71874 inputs
    )),
    *(_avgpool_backward(shape) for shape in ((2, 7, 7, 7), (1, 65, 1, 1), (1, 3, 13, 13),
                                             (2, 35, 31, 31))),
    # Every window holds a pixel.
    _maxpool((2, 5, 9, 11), 2, 2, 2, 1, half=True),
    half_twin("maxpool_depth_fwd", "2x6x20-to2",
              {"batch": 2, "channels": 6, "spatial": 20, "out_channels": 2},
              {"spatial": 20, "out_channels": 2, "batch": 2}, _depth_reference, exact=True),
    half_twin("avgpool_fwd", "12x49", {"planes": 12, "spatial": 49}, {"planes": 12},
              _average_reference),
)
