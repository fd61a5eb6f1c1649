"""A network's layers: one ``LayerSpec`` (the op of its kind) per cfg section.

``build_layers`` checks every section against its input shapes through its op's ``build``
(shape rules live with the op) and returns the layers in cfg order.
"""

from __future__ import annotations

from darknet_metal.cfg import NetConfig
from darknet_metal.ops import OPS, LayerSpec, Shape, build_layer

__all__ = ["LAYER_KINDS", "LayerSpec", "Shape", "build_layers", "input_shape"]

#: Every layer kind the network builder knows (checked against the cfg parser by tests).
LAYER_KINDS: frozenset[str] = frozenset(OPS)


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
        spec = build_layer(section, shape, shapes)
        specs.append(spec)
        shapes.append(spec.out_shape)
        shape = spec.out_shape
    return specs
