"""The Darknet-style layer table printed by ``Network.summary`` and ``darknet-metal summary``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from darknet_metal.model.cfg import Shape


class SummaryRow(Protocol):
    """What a line of the table shows of a layer (``ops.Op`` has it)."""

    index: int
    short_name: str
    in_shape: Shape
    out_shape: Shape
    param_shapes: dict[str, tuple[int, ...]]
    flops: int

    @property
    def bflops(self) -> float: ...

    def describe(self) -> str: ...


def _shape(shape: Shape) -> str:
    c, h, w = shape
    return f"{w:4d} x{h:4d} x{c:5d}"


def summary_table(specs: Sequence[SummaryRow], input_shape: Shape) -> str:
    """One line per layer: index, kind, parameters, input -> output (W x H x C), BFLOPs."""
    lines = [f"input {_shape(input_shape)}",
             "   layer   filters  size/strd(dil)      input                output"]
    total = 0.0
    for spec in specs:
        flops = f" {spec.bflops:6.3f} BF" if spec.flops else ""
        total += spec.bflops
        lines.append(f"{spec.index:4d} {spec.short_name:<9s}{spec.describe():<22s}"
                     f"{_shape(spec.in_shape)} -> {_shape(spec.out_shape)}{flops}")
    params = sum(math.prod(s) for spec in specs
                 for s in spec.param_shapes.values())
    lines.append(f"Total BFLOPS {total:.3f}, {params:,} parameters")
    return "\n".join(lines)
