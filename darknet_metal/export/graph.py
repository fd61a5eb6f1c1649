"""An ONNX graph under construction, in plain Python (no ``onnx`` import): the vocabulary each
op's ``emit_onnx`` writes its layer in, and Darknet's activations as ONNX operators.

Values are named strings; ``node`` appends one operator and returns its output's name,
``const`` adds an initializer. Float constants take the graph's float type (float32, or
float16 for an fp16 export) unless given another; shapes and indices are int64. The
``onnx_model`` module turns the finished graph into an ``onnx.ModelProto``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from darknet_metal.errors import ExportError
from darknet_metal.model.activations import ACTIVATIONS, CHANNEL_ACTIVATIONS

__all__ = ["INPUT", "OnnxGraph", "OnnxNode"]

#: The graph input's name: the batch of images, (N, C, H, W).
INPUT = "input"


@dataclass(frozen=True)
class OnnxNode:
    """One operator: ``op_type`` reading ``inputs`` ("" for an omitted optional one) and
    writing ``outputs``, with its attributes."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, Any] = field(default_factory=dict)


class OnnxGraph:
    """The nodes and initializers of an export, and each layer's output value.

    ``float_type``: np.float32 or np.float16, the type of every float tensor; ``opset``: the
    operator set the nodes are written for (some operators changed their signature)."""

    def __init__(self, float_type: type = np.float32, opset: int = 13) -> None:
        self.float_type = np.dtype(float_type)
        self.opset = opset
        self.nodes: list[OnnxNode] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.layer_outputs: dict[int, str] = {}
        #: (C, H, W) of one image at each layer's output (-1: the input).
        self.layer_shapes: dict[int, tuple[int, int, int]] = {}
        self._count = 0
        #: The layer being emitted (names and errors carry it).
        self.layer: int = -1
        self.kind: str = ""

    # -- building --------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        """A new value name, ``l<layer>_<hint>_<k>``."""
        self._count += 1
        return f"l{self.layer}_{hint}_{self._count}"

    def const(self, value: Any, hint: str = "const", dtype: Any = None) -> str:
        """An initializer holding ``value`` (float arrays in the graph's float type unless
        ``dtype`` says otherwise; integers as int64)."""
        array = np.asarray(value)
        if dtype is not None:
            array = array.astype(dtype)
        elif np.issubdtype(array.dtype, np.floating):
            array = array.astype(self.float_type)
        elif np.issubdtype(array.dtype, np.integer):
            array = array.astype(np.int64)
        name = self.fresh(hint)
        self.initializers[name] = np.ascontiguousarray(array)
        return name

    def shape(self, dims: Any) -> str:
        """An int64 shape initializer (0 copies the input's dimension, -1 infers one)."""
        return self.const(np.asarray(dims, np.int64), "shape")

    def node(self, op_type: str, inputs: list[str] | tuple[str, ...], hint: str | None = None,
             outputs: int = 1, **attributes: Any) -> Any:
        """Appends ``op_type`` and returns its output's name (a tuple for ``outputs`` > 1)."""
        names = tuple(self.fresh(hint or op_type.lower()) for _ in range(outputs))
        self.nodes.append(OnnxNode(op_type, tuple(inputs), names, attributes))
        return names[0] if outputs == 1 else names

    def concat(self, parts: Sequence[str], axis: int) -> str:
        """``parts`` joined along ``axis`` (one part: itself)."""
        return parts[0] if len(parts) == 1 else self.node("Concat", list(parts), axis=axis)

    def source(self, layer: int) -> str:
        """The value holding layer ``layer``'s output (-1: the graph input)."""
        return INPUT if layer < 0 else self.layer_outputs[layer]

    def shape_of(self, layer: int) -> tuple[int, int, int]:
        """(C, H, W) of layer ``layer``'s output for one image (-1: the input)."""
        return self.layer_shapes[layer]

    def refuse(self, why: str) -> ExportError:
        """The ExportError of the current layer: ``raise g.refuse("...")``."""
        return ExportError(f"layer {self.layer} ({self.kind}): {why}", layer=self.layer,
                           kind=self.kind)

    # -- Darknet's arithmetic ----------------------------------------------------------------

    def scalar(self, value: float) -> str:
        """A float scalar of the graph's type."""
        return self.const(np.asarray(value, np.float64), "scalar")

    def mul(self, x: str, value: float) -> str:
        return self.node("Mul", [x, self.scalar(value)])

    def add(self, x: str, value: float) -> str:
        return self.node("Add", [x, self.scalar(value)])

    def where(self, condition: str, then: str, otherwise: str) -> str:
        return self.node("Where", [condition, then, otherwise])

    def less(self, x: str, value: float) -> str:
        return self.node("Less", [x, self.scalar(value)])

    def greater(self, x: str, value: float) -> str:
        return self.node("Greater", [x, self.scalar(value)])

    def reduce_max(self, x: str, axis: int, keepdims: int = 0) -> str:
        """Maximum over ``axis`` (the axes moved from an attribute to an input in opset
        18)."""
        if self.opset >= 18:
            return self.node("ReduceMax", [x, self.const([axis], "axes")], keepdims=keepdims)
        return self.node("ReduceMax", [x], axes=[axis], keepdims=keepdims)

    def reduce_sum(self, x: str, axis: int) -> str:
        """Sum over ``axis``, kept as a dimension of 1 (axes an input since opset 13)."""
        return self.node("ReduceSum", [x, self.const([axis], "axes")], keepdims=1)

    def activation(self, x: str, act: int) -> str:
        """Darknet's activation ``act`` (an ``ACTIVATION_ID`` value) of ``x`` (channels on
        axis 1): its ONNX operator where one computes Darknet's formula, else the formula."""
        name = ACTIVATIONS[act]
        if name in CHANNEL_ACTIVATIONS:
            return self._channel_activation(x, name)
        if name == "linear":
            return x
        if name in ("leaky", "revleaky"):
            return self.node("LeakyRelu", [x], alpha=0.1)
        if name == "relie":
            return self.node("LeakyRelu", [x], alpha=0.01)
        if name == "relu":
            return self.node("Relu", [x])
        if name == "relu6":
            return self.node("Clip", [x, self.scalar(0.0), self.scalar(6.0)])
        if name == "hardtan":
            return self.node("Clip", [x, self.scalar(-1.0), self.scalar(1.0)])
        if name == "logistic":
            return self.node("Sigmoid", [x])
        if name == "loggy":
            return self.add(self.mul(self.node("Sigmoid", [x]), 2.0), -1.0)
        if name == "tanh":
            return self.node("Tanh", [x])
        if name == "elu":
            return self.node("Elu", [x], alpha=1.0)
        if name == "selu":
            return self.node("Selu", [x], alpha=1.6732, gamma=1.0507)
        if name == "swish":
            return self.node("Mul", [x, self.node("Sigmoid", [x])])
        if name == "mish":
            # x*tanh(softplus(x)); Darknet returns x above 20, where tanh(softplus) is 1.
            if self.opset >= 18:
                return self.node("Mish", [x])
            soft = self.node("Softplus", [x])
            return self.node("Mul", [x, self.node("Tanh", [soft])])
        if name == "gelu":
            # x / (1 + exp(-2a)) = x * sigmoid(2a), a = 0.797885 x + 0.035677 x^3.
            cube = self.node("Mul", [x, self.node("Mul", [x, x])])
            a = self.node("Add", [self.mul(x, 0.797885), self.mul(cube, 0.035677)])
            return self.node("Mul", [x, self.node("Sigmoid", [self.mul(a, 2.0)])])
        if name == "ramp":
            return self.node("Add", [self.node("Relu", [x]), self.mul(x, 0.1)])
        if name == "hard_mish":
            q = self.node("Add", [self.mul(self.node("Mul", [x, x]), 0.5), x])
            inner = self.where(self.greater(x, -2.0), q, self.scalar(0.0))
            return self.where(self.greater(x, 0.0), x, inner)
        if name == "lhtan":
            high = self.add(self.mul(self.add(x, -1.0), 0.001), 1.0)
            inner = self.where(self.greater(x, 1.0), high, x)
            return self.where(self.less(x, 0.0), self.mul(x, 0.001), inner)
        if name == "plse":
            low = self.mul(self.add(x, 4.0), 0.01)
            high = self.add(self.mul(self.add(x, -4.0), 0.01), 1.0)
            mid = self.add(self.mul(x, 0.125), 0.5)
            inner = self.where(self.greater(x, 4.0), high, mid)
            return self.where(self.less(x, -4.0), low, inner)
        if name == "stair":
            # floor(x) even: floor(x/2); odd: (x - floor(x)) + floor(x/2).
            fl = self.node("Floor", [x])
            half = self.node("Floor", [self.mul(x, 0.5)])
            even = self.node("Equal", [self.mul(self.node("Floor", [self.mul(fl, 0.5)]), 2.0),
                                       fl])
            odd = self.node("Add", [self.node("Sub", [x, fl]), half])
            return self.where(even, half, odd)
        raise self.refuse(f"activation={name} has no ONNX form here")  # pragma: no cover

    def _channel_activation(self, x: str, name: str) -> str:
        """Darknet's normalize_channels activations, each pixel across its channels (axis
        1): positive parts over 1e-4 + their sum; or exp(x - m) over 1e-4 + the sum of
        those, m = 0 (``_softmax``) or the pixel's maximum (``_softmax_maxval``)."""
        if name == "normalize_channels":
            parts = self.node("Relu", [x])
        else:
            if name == "normalize_channels_softmax_maxval":
                x = self.node("Sub", [x, self.reduce_max(x, 1, keepdims=1)])
            parts = self.node("Exp", [x])
        return self.node("Div", [parts, self.add(self.reduce_sum(parts, 1), 1e-4)])


