"""One op class per Darknet layer kind, and the table from kind to op.

Owns: everything about a layer kind (``ops.base`` lists what that is: shapes, parameters,
Darknet's initialisation, the CPU forward and backward, the GPU steps it emits, what training
does with its keys); the table of kinds (``OPS``) and a network's layers built from a cfg
(``build_layers``). Nothing outside this package (and the cfg parser and schema, which
describe keys) branches on the kind. A new kind is one class here, added to ``OPS`` with
``register``.

May import: ``errors``, ``model``, ``runtime`` (the program vocabulary ops emit into and the
training arrays they bind), ``cpu`` (the Cython kernels), ``metal`` (the kernel registry)
and ``export.graph`` (the ONNX vocabulary ``Op.emit_onnx`` writes in).
"""

from __future__ import annotations

from darknet_metal.ops.base import Op, Params, Shape
from darknet_metal.ops.combine import SamOp, ScaleChannelsOp, ShortcutOp
from darknet_metal.ops.conv import ConnectedOp, ConvolutionalOp
from darknet_metal.ops.heads import SoftmaxOp
from darknet_metal.ops.identity import CostOp, DropoutOp
from darknet_metal.ops.layers import (
    OPS,
    build_layer,
    build_layers,
    init_params,
    op_class,
    register,
)
from darknet_metal.ops.pooling import AvgpoolOp, MaxpoolOp
from darknet_metal.ops.resample import Reorg3dOp, ReorgOp, UpsampleOp
from darknet_metal.ops.route import RouteOp
from darknet_metal.ops.yolo import YoloOp

__all__ = ["LAYER_KINDS", "OPS", "Op", "Params", "Shape", "build_layer", "build_layers",
           "init_params", "op_class", "register"]

for _cls in (ConvolutionalOp, ConnectedOp, MaxpoolOp, AvgpoolOp, RouteOp, ShortcutOp,
             UpsampleOp, ReorgOp, Reorg3dOp, ScaleChannelsOp, SamOp, SoftmaxOp, DropoutOp,
             YoloOp, CostOp):
    register(_cls)

#: Every layer kind the network builder knows (checked against the cfg parser by tests).
LAYER_KINDS: frozenset[str] = frozenset(OPS)
