"""One op class per Darknet layer kind, and the table from kind to op.

Everything about a layer kind lives in its op (``ops.base`` lists what that is); nothing
outside this package (and the cfg parser and schema, which describe keys) branches on the
kind. A new kind is one class here, added to ``OPS`` with ``register``.
"""

from __future__ import annotations

from darknet_metal.cfg import Section
from darknet_metal.ops.base import LayerSpec, Params, Shape, Unsupported
from darknet_metal.ops.combine import SamOp, ScaleChannelsOp, ShortcutOp
from darknet_metal.ops.conv import ConnectedOp, ConvolutionalOp
from darknet_metal.ops.heads import SoftmaxOp, YoloOp
from darknet_metal.ops.identity import CostOp, DropoutOp
from darknet_metal.ops.pooling import AvgpoolOp, MaxpoolOp
from darknet_metal.ops.resample import Reorg3dOp, ReorgOp, UpsampleOp
from darknet_metal.ops.route import RouteOp

__all__ = ["OPS", "LayerSpec", "Params", "Shape", "Unsupported", "build_layer", "op_class",
           "register"]

#: Layer kind (cfg section name) -> its op class.
OPS: dict[str, type[LayerSpec]] = {}


def register(cls: type[LayerSpec]) -> type[LayerSpec]:
    """Adds an op class to ``OPS`` under its ``kind``; returns it (usable as a decorator)."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind")
    OPS[cls.kind] = cls
    return cls


def op_class(kind: str) -> type[LayerSpec]:
    """The op class of layer kind ``kind``; KeyError naming the known kinds otherwise."""
    try:
        return OPS[kind]
    except KeyError:
        raise KeyError(f"no op for layer kind {kind!r}; known: {sorted(OPS)}") from None


def build_layer(section: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
    """The layer of ``section`` (its op's ``build``); CfgError for a kind without an op."""
    op = OPS.get(section.kind)
    if op is None:
        raise section.error(f"layer kind '{section.kind}' is not supported")
    return op.build(section, shape, shapes)


for _cls in (ConvolutionalOp, ConnectedOp, MaxpoolOp, AvgpoolOp, RouteOp, ShortcutOp,
             UpsampleOp, ReorgOp, Reorg3dOp, ScaleChannelsOp, SamOp, SoftmaxOp, DropoutOp,
             YoloOp, CostOp):
    register(_cls)
