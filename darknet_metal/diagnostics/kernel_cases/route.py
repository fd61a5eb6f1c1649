"""Cases of ``shaders/route.metal``: [route] of two sources, whole or one channel group of
each, forward into one output (also in half storage) and backward into each source's
gradient."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import route
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Exact,
    KernelCase,
    Step,
    nan_filled,
    normal,
)

BATCH, HEIGHT, WIDTH = 2, 7, 5
#: The channels of the two sources: every group of either is routed.
SOURCES = (6, 10)


def route_args(channels: int, src_channels: int, src_offset: int, dst_channels: int,
               dst_offset: int, accumulate: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(dm_route_args, grid sizes) moving ``channels`` planes of each image."""
    spatial = HEIGHT * WIDTH
    return ({"batch": BATCH, "spatial": spatial, "channels": channels,
             "src_channels": src_channels, "src_offset": src_offset,
             "dst_channels": dst_channels, "dst_offset": dst_offset, "accumulate": accumulate},
            {"spatial": spatial, "channels": channels, "batch": BATCH})


def _layout(groups: int) -> list[tuple[int, int, int]]:
    """(source channels, channels routed, offset in the output) of each source, one group of
    ``groups`` routed from each."""
    widths = [c // groups for c in SOURCES]
    return [(c, wd, sum(widths[:i])) for i, (c, wd) in enumerate(zip(SOURCES, widths,
                                                                      strict=True))]


def _forward(groups: int, group_id: int, *, half: bool = False) -> KernelCase:
    kernel = "route_fwd_f16" if half else "route_fwd_f32"
    dtype = np.float16 if half else np.float32
    layout = _layout(groups)
    out_c = sum(wd for _, wd, _ in layout)
    steps = tuple(Step(kernel, *route_args(wd, c, group_id * wd, out_c, offset),
                       {"x": f"source{i}", "y": "y"})
                  for i, (c, wd, offset) in enumerate(layout))

    def make(rng: np.random.Generator) -> CaseData:
        sources = [normal(rng, (BATCH, c, HEIGHT, WIDTH), 3.0).astype(dtype) for c in SOURCES]
        want = nan_filled((BATCH, out_c, HEIGHT, WIDTH))
        for s, (_, wd, offset) in zip(sources, layout, strict=True):
            route.route_forward(s.astype(np.float32), want, group_id * wd, wd, offset)
        return CaseData({"source0": sources[0], "source1": sources[1],
                         "y": nan_filled(want.shape, dtype)},
                        (Check("y", want.astype(dtype), Exact()),))

    return KernelCase(f"{kernel}-groups{groups}-id{group_id}", steps, make)


def _backward(groups: int, group_id: int, accumulate: int = 1) -> KernelCase:
    """Adding into random gradients, or (``accumulate`` 0, whole sources) setting gradients
    of NaN, as a delta's first writer does."""
    layout = _layout(groups)
    out_c = sum(wd for _, wd, _ in layout)
    steps = tuple(Step("route_bwd_f32",
                       *route_args(wd, c, group_id * wd, out_c, offset, accumulate),
                       {"delta": "delta", "x_grad": f"grad{i}"})
                  for i, (c, wd, offset) in enumerate(layout))

    def make(rng: np.random.Generator) -> CaseData:
        grads = [normal(rng, (BATCH, c, HEIGHT, WIDTH), 3.0) if accumulate
                 else nan_filled((BATCH, c, HEIGHT, WIDTH)) for c in SOURCES]
        delta = normal(rng, (BATCH, out_c, HEIGHT, WIDTH), 3.0)
        checks = []
        for i, (g, (_, wd, offset)) in enumerate(zip(grads, layout, strict=True)):
            want = g.copy() if accumulate else np.zeros_like(g)
            route.route_backward(delta, want, group_id * wd, wd, offset)
            checks.append(Check(f"grad{i}", want, Exact()))
        return CaseData({"delta": delta, "grad0": grads[0], "grad1": grads[1]}, tuple(checks))

    return KernelCase(f"route_bwd_f32-groups{groups}-id{group_id}"
                      + ("" if accumulate else "-set"), steps, make)


GROUPS = ((1, 0), (2, 1), (2, 0))

CASES: tuple[KernelCase, ...] = (
    *(_forward(groups, group_id) for groups, group_id in GROUPS),
    *(_backward(groups, group_id) for groups, group_id in GROUPS),
    _backward(1, 0, accumulate=0),
    *(_forward(groups, group_id, half=True) for groups, group_id in ((1, 0), (2, 1))),
)
