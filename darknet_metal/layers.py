"""Layer specifications: shapes, parameters and cost of each cfg section.

``build_layers`` turns parsed cfg sections into ``LayerSpec`` objects: the input layers each one
reads, its output shape, the shapes of its learnable parameters in Darknet's ``.weights``
order, and its multiply-adds. It is the single place where shape rules live; backends only
execute specs. Shape errors are reported as ``CfgError`` at the offending section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from darknet_metal.activations import ACTIVATION_ID
from darknet_metal.cfg import NetConfig, Section

Shape = tuple[int, int, int]  # (C, H, W) of one image

#: Parameter names of each kind in the order they are stored in a ``.weights`` file.
#: Batch-norm parameters are present only when the layer has ``batch_normalize=1``.
WEIGHT_ORDER: dict[str, tuple[str, ...]] = {
    "convolutional": ("biases", "scales", "rolling_mean", "rolling_variance", "weights"),
    "connected": ("biases", "weights", "scales", "rolling_mean", "rolling_variance"),
    "shortcut": ("weights",),
}
BATCHNORM_PARAMS = ("scales", "rolling_mean", "rolling_variance")


@dataclass
class LayerSpec:
    """One network layer as every backend sees it.

    ``inputs`` are 0-based indices of the layers whose outputs this layer reads, -1 meaning
    the network input. The first entry is the "main" input (the previous layer for most
    kinds). ``param_shapes`` is ordered as in the ``.weights`` file.
    """

    index: int
    kind: str
    section: Section
    inputs: list[int]
    in_shape: Shape
    out_shape: Shape
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    flops: int = 0  # floating point operations for one image, counted as Darknet does

    @property
    def values(self) -> dict[str, Any]:
        return self.section.values

    @property
    def activation(self) -> int:
        """Activation id (see ``darknet_metal.activations``); linear for kinds without one."""
        return ACTIVATION_ID[self.values.get("activation", "linear")]

    @property
    def out_size(self) -> int:
        c, h, w = self.out_shape
        return c * h * w

    @property
    def type(self) -> str:
        """The cfg section kind, e.g. ``"convolutional"``."""
        return self.kind

    @property
    def bflops(self) -> float:
        """Billions of floating point operations for one image, as Darknet's summary prints:
        2 per multiply-add for convolutional and connected layers, one per compared value
        for maxpool, none for the other kinds."""
        return self.flops / 1e9


def _positive(section: Section, shape: Shape, what: str) -> Shape:
    if min(shape) < 1:
        raise section.error(f"{what} gives an empty output shape {shape} (C, H, W)")
    return shape


def _conv(s: Section, shape: Shape) -> LayerSpec:
    v = s.values
    c, h, w = shape
    n, size, groups = v["filters"], v["size"], v["groups"]
    pad, dilation = v["padding"], v["dilation"]
    sx, sy = v["stride_x"], v["stride_y"]
    for key in ("binary", "xnor", "antialiasing", "sway", "rotate", "stretch", "stretch_sway",
                "assisted_excitation"):
        if v.get(key):
            raise s.error(f"'{key}' convolutions are not supported", key)
    if v.get("share_index") is not None:
        raise s.error("'share_index' (weights shared between layers) is not supported",
                      "share_index")
    if c % groups or n % groups:
        raise s.error(f"groups={groups} must divide the input channels ({c}) and filters ({n})",
                      "groups")
    out_h = (h + 2 * pad - size) // sy + 1
    out_w = (w + 2 * pad - size) // sx + 1
    if dilation > 1:
        # Darknet sizes the output without the dilation but samples with it; only the
        # combinations where both agree are well defined.
        true_h = (h + 2 * pad * dilation - dilation * (size - 1) - 1) // sy + 1
        true_w = (w + 2 * pad * dilation - dilation * (size - 1) - 1) // sx + 1
        if (true_h, true_w) != (out_h, out_w):
            raise s.error(
                f"dilation={dilation} with size={size} pad={pad} gives {true_h}x{true_w} "
                f"samples but Darknet allocates {out_h}x{out_w}; use pad=1 with an odd size",
                "dilation",
            )
    out = _positive(s, (n, out_h, out_w), f"size={size} stride=({sx},{sy}) padding={pad}")
    params = {"biases": (n,)}
    if v["batch_normalize"]:
        params.update({"scales": (n,), "rolling_mean": (n,), "rolling_variance": (n,)})
    params["weights"] = (n, c // groups * size * size)
    flops = 2 * n * (c // groups) * size * size * out_h * out_w
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, out, params, flops)


def _connected(s: Section, shape: Shape) -> LayerSpec:
    v = s.values
    inputs = shape[0] * shape[1] * shape[2]
    outputs = v["output"]
    params = {"biases": (outputs,), "weights": (outputs, inputs)}
    if v["batch_normalize"]:
        params.update({"scales": (outputs,), "rolling_mean": (outputs,),
                       "rolling_variance": (outputs,)})
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, (outputs, 1, 1), params,
                     2 * inputs * outputs)


def _maxpool(s: Section, shape: Shape) -> LayerSpec:
    v = s.values
    c, h, w = shape
    if v.get("antialiasing"):
        raise s.error("antialiased maxpool is not supported", "antialiasing")
    if v.get("maxpool_depth"):
        out = (v["out_channels"], h, w)
        if out[0] > c:
            raise s.error(f"out_channels={out[0]} exceeds the input channels ({c})",
                          "out_channels")
    else:
        size, pad = v["size"], v["padding"]
        out = (c, (h + pad - size) // v["stride_y"] + 1, (w + pad - size) // v["stride_x"] + 1)
    out = _positive(s, out, "this maxpool")
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, out,
                     flops=out[0] * out[1] * out[2] * v["size"] * v["size"])


def _avgpool(s: Section, shape: Shape) -> LayerSpec:
    c, h, w = shape
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, (c, 1, 1))


def _route(s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
    v = s.values
    groups, group_id = v["groups"], v["group_id"]
    if not 0 <= group_id < groups:
        raise s.error(f"group_id={group_id} must be in [0, groups={groups})", "group_id")
    sources = list(v["layers"])
    first = shapes[sources[0]]
    channels = 0
    for src in sources:
        c, h, w = shapes[src]
        if (h, w) != first[1:]:
            raise s.error(
                f"layer {src} output is {h}x{w} but layer {sources[0]} output is "
                f"{first[1]}x{first[2]}: routed layers must have the same width and height",
                "layers",
            )
        if c % groups:
            raise s.error(f"groups={groups} does not divide layer {src}'s {c} channels", "groups")
        channels += c // groups
    return LayerSpec(s.index, s.kind, s, sources, first, (channels, first[1], first[2]))


def _shortcut(s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
    v = s.values
    sources = list(v["from"])
    for src in sources:
        if shapes[src][1:] != shape[1:]:
            raise s.error(
                f"layer {src} output is {shapes[src][1]}x{shapes[src][2]} but the input is "
                f"{shape[1]}x{shape[2]}: shortcut layers must have the same width and height",
                "from",
            )
    params: dict[str, tuple[int, ...]] = {}
    kind = v["weights_type"]
    if kind == "per_feature":
        params["weights"] = (len(sources) + 1,)
    elif kind == "per_channel":
        params["weights"] = (len(sources) + 1, shape[0])
    return LayerSpec(s.index, s.kind, s, [s.index - 1, *sources], shape, shape, params)


def _upsample(s: Section, shape: Shape) -> LayerSpec:
    c, h, w = shape
    stride = s.values["stride"]
    if stride > 0:
        out = (c, h * stride, w * stride)
    else:
        if h % -stride or w % -stride:
            raise s.error(f"stride={stride} does not divide the input {h}x{w}", "stride")
        out = (c, h // -stride, w // -stride)
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, _positive(s, out, "stride"))


def _reorg(s: Section, shape: Shape) -> LayerSpec:
    c, h, w = shape
    stride = s.values["stride"]
    # Darknet's reorg permutes through a (C/stride^2, H*stride, W*stride) view in both
    # directions, so the channels must divide either way.
    if c % (stride * stride):
        raise s.error(f"reorg needs the input channels ({c}) divisible by stride^2", "stride")
    if s.values["reverse"]:
        out = (c // (stride * stride), h * stride, w * stride)
    else:
        if h % stride or w % stride:
            raise s.error(f"stride={stride} does not divide the input {h}x{w}", "stride")
        out = (c * stride * stride, h // stride, w // stride)
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, _positive(s, out, "stride"))


def _scale_channels(s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
    src = s.values["from"]
    target = shapes[src]
    if s.values["scale_wh"]:
        ok = shape == (1, target[1], target[2])
    else:
        ok = shape == (target[0], 1, 1)
    if not ok:
        want = (1, *target[1:]) if s.values["scale_wh"] else (target[0], 1, 1)
        raise s.error(f"the previous layer's output {shape} cannot scale layer {src}'s "
                      f"{target}: expected {want}", "from")
    return LayerSpec(s.index, s.kind, s, [s.index - 1, src], shape, target)


def _sam(s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
    src = s.values["from"]
    if shapes[src] != shape:
        raise s.error(f"layer {src} output {shapes[src]} differs from the input {shape}", "from")
    return LayerSpec(s.index, s.kind, s, [s.index - 1, src], shape, shape)


def _softmax(s: Section, shape: Shape) -> LayerSpec:
    inputs = shape[0] * shape[1] * shape[2]
    if inputs % s.values["groups"]:
        raise s.error(f"groups={s.values['groups']} does not divide the {inputs} inputs",
                      "groups")
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, shape)


def _yolo(s: Section, shape: Shape) -> LayerSpec:
    v = s.values
    expected = len(v["mask"]) * (v["classes"] + 5)
    if shape[0] != expected:
        raise s.error(
            f"the input has {shape[0]} channels but {len(v['mask'])} masked anchors x "
            f"(classes={v['classes']} + 5) need {expected}: set filters={expected} in the "
            "convolutional layer before",
            "classes",
        )
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, shape)


def _identity(s: Section, shape: Shape) -> LayerSpec:
    return LayerSpec(s.index, s.kind, s, [s.index - 1], shape, shape)


_SIMPLE = {
    "convolutional": _conv,
    "connected": _connected,
    "maxpool": _maxpool,
    "avgpool": _avgpool,
    "upsample": _upsample,
    "reorg": _reorg,
    "softmax": _softmax,
    "yolo": _yolo,
    "dropout": _identity,
    "cost": _identity,
}
_MULTI = {
    "route": _route,
    "shortcut": _shortcut,
    "scale_channels": _scale_channels,
    "sam": _sam,
}

#: Every layer kind the network builder knows (checked against the cfg parser by tests).
LAYER_KINDS: frozenset[str] = frozenset(_SIMPLE) | frozenset(_MULTI)


def input_shape(config: NetConfig) -> Shape:
    """(C, H, W) of the network input from ``[net]``."""
    v = config.net.values
    return (v["channels"], v["height"], v["width"])


def build_layers(config: NetConfig) -> list[LayerSpec]:
    """Shape-check a parsed cfg and return one ``LayerSpec`` per layer, in cfg order."""
    shape = input_shape(config)
    if min(shape) < 1:
        raise config.net.error(f"the network input {shape} (channels, height, width) is empty")
    specs: list[LayerSpec] = []
    shapes: list[Shape] = []
    for section in config.layers:
        if section.kind in _SIMPLE:
            spec = _SIMPLE[section.kind](section, shape)
        elif section.kind in _MULTI:
            spec = _MULTI[section.kind](section, shape, shapes)
        else:
            raise section.error(f"layer kind '{section.kind}' is not supported")
        specs.append(spec)
        shapes.append(spec.out_shape)
        shape = spec.out_shape
    return specs
