"""The Darknet-style layer table printed by ``Network.summary`` and ``darknet-metal summary``."""

from __future__ import annotations

import math

from darknet_metal.layers import LayerSpec, Shape

_SHORT = {
    "convolutional": "conv",
    "connected": "connected",
    "maxpool": "max",
    "avgpool": "avg",
    "route": "route",
    "shortcut": "shortcut",
    "upsample": "upsample",
    "reorg": "reorg",
    "scale_channels": "scale_channels",
    "sam": "sam",
    "softmax": "softmax",
    "dropout": "dropout",
    "yolo": "yolo",
    "cost": "cost",
}


def _shape(shape: Shape) -> str:
    c, h, w = shape
    return f"{w:4d} x{h:4d} x{c:5d}"


def _describe(spec: LayerSpec) -> str:
    v = spec.values
    if spec.kind == "convolutional":
        stride = (f"{v['stride_x']}" if v["stride_x"] == v["stride_y"]
                  else f"{v['stride_x']}x{v['stride_y']}")
        dil = f"({v['dilation']})" if v["dilation"] > 1 else ""
        groups = f" {v['groups']}g" if v["groups"] > 1 else ""
        return f"{v['filters']:5d}{groups:>4s} {v['size']:2d} x{v['size']:2d}/{stride:>3s}{dil}"
    if spec.kind == "maxpool":
        return f"          {v['size']:2d} x{v['size']:2d}/{v['stride_x']:3d}"
    if spec.kind == "route":
        text = " ".join(str(i) for i in v["layers"])
        if v["groups"] > 1:
            text += f" (group {v['group_id']}/{v['groups']})"
        return text
    if spec.kind in ("shortcut", "sam", "scale_channels"):
        src = v["from"]
        return "from " + (" ".join(map(str, src)) if isinstance(src, list) else str(src))
    if spec.kind in ("upsample", "reorg"):
        return f"            {v['stride']:2d}x"
    if spec.kind == "connected":
        return f"{v['output']:5d}"
    return ""


def summary_table(specs: list[LayerSpec], input_shape: Shape) -> str:
    """One line per layer: index, kind, parameters, input -> output (W x H x C), BFLOPs."""
    lines = [f"input {_shape(input_shape)}",
             "   layer   filters  size/strd(dil)      input                output"]
    total = 0.0
    for spec in specs:
        flops = f" {spec.bflops:6.3f} BF" if spec.flops else ""
        total += spec.bflops
        lines.append(f"{spec.index:4d} {_SHORT[spec.kind]:<9s}{_describe(spec):<22s}"
                     f"{_shape(spec.in_shape)} -> {_shape(spec.out_shape)}{flops}")
    params = sum(math.prod(s) for spec in specs
                 for s in spec.param_shapes.values())
    lines.append(f"Total BFLOPS {total:.3f}, {params:,} parameters")
    return "\n".join(lines)
