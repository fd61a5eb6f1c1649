"""A network as an ONNX model: ``export_onnx`` and ``build_model``.

Each layer's op writes itself (``Op.emit_onnx``) into an ``OnnxGraph``; this module adds the
outputs (the ``[yolo]`` layers' outputs as ``forward`` returns them, or the last layer's,
and with ``outputs="boxes"`` the decoded boxes, per-class confidences and objectness of
every head),
the metadata a consumer needs to prepare the input and read the outputs, and writes the
checked model atomically. The ``onnx`` package is an extra (``pip install
darknet-metal[export]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from darknet_metal.errors import ArgumentError, DependencyError, ExportError
from darknet_metal.export.graph import INPUT, OnnxGraph
from darknet_metal.files import atomic_write

__all__ = ["DEFAULT_OPSET", "MIN_OPSET", "ExportableLayer", "ExportableNetwork", "build_model",
           "export_onnx"]

if TYPE_CHECKING:
    from darknet_metal.model.cfg import NetConfig
    from darknet_metal.model.weights import Params


class ExportableLayer(Protocol):
    """What an export reads of a layer (each op of ``darknet_metal.ops`` is one): ``values``
    its cfg keys, ``out_shape`` (C, H, W) of one image, ``detection_head`` the decoder's
    ``YoloHead`` or None, and ``emit_onnx`` writing the layer into a graph."""

    index: int
    kind: str
    out_shape: tuple[int, int, int]

    @property
    def values(self) -> dict[str, Any]: ...

    @property
    def detection_head(self) -> Any: ...

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str: ...


class ExportableNetwork(Protocol):
    """What an export reads of a network (``darknet_metal.Network`` is one)."""

    config: NetConfig
    layers: Sequence[ExportableLayer]
    params: Mapping[int, Params]
    names: Sequence[str] | None

    @property
    def input_shape(self) -> tuple[int, int, int]: ...


#: The operator set written unless asked otherwise: read by ONNX Runtime and OpenCV 4.x.
DEFAULT_OPSET = 13
#: The oldest operator set the exporter writes (Split's sizes as an input, Resize's modes).
MIN_OPSET = 13
#: Names of the decoded outputs (the first two are those of Darknet V5's exporter).
BOXES, CONFIDENCES, OBJECTNESS = "boxes", "confs", "objectness"


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:
        raise DependencyError("ONNX export needs the onnx package: pip install "
                              "'darknet-metal[export]'") from exc
    return onnx


def _check_options(batch: int | str, outputs: str, fp16: bool, opset: int | None,
                   newest: int) -> tuple[int | str, int]:
    if batch != "dynamic" and (isinstance(batch, bool) or not isinstance(batch, int)
                               or batch < 1):
        raise ArgumentError(f"batch must be a positive int or 'dynamic', not {batch!r}")
    if outputs not in ("raw", "boxes"):
        raise ArgumentError(f"outputs must be 'raw' or 'boxes', not {outputs!r}")
    if not isinstance(fp16, bool):
        raise ArgumentError(f"fp16 must be True or False, not {fp16!r}")
    if opset is None:
        opset = DEFAULT_OPSET
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise ArgumentError(f"opset must be an int from {MIN_OPSET} to {newest} (the onnx "
                            f"package's newest), not {opset!r}")
    return batch, opset


def _raw_name(op: ExportableLayer) -> str:
    """The output holding a [yolo] layer's output."""
    return f"yolo_{op.index}"


def _head_metadata(op: ExportableLayer) -> dict[str, Any]:
    v = op.values
    return {"layer": op.index, "output": _raw_name(op), "classes": v["classes"],
            "anchors": np.reshape(v["anchors"], (-1, 2)).tolist(), "mask": list(v["mask"]),
            "scale_x_y": v["scale_x_y"], "new_coords": bool(v["new_coords"]),
            "grid": list(op.out_shape[1:])}


def _decode(g: OnnxGraph, heads: list[ExportableLayer], input_shape: tuple[int, int, int]
            ) -> tuple[str, str, str]:
    """Every head's boxes (N, K, 4: centre x, centre y, width, height relative to the
    network input), confidences (N, K, classes: objectness x class probability) and
    objectness (N, K), K running over heads, then anchors, rows and columns, as
    ``decode_yolo`` orders its candidates."""
    _, net_h, net_w = input_shape
    for op in heads[1:]:
        if op.values["classes"] != heads[0].values["classes"]:
            raise ExportError(f"layer {op.index} ({op.kind}): outputs='boxes' needs every "
                              f"head to have layer {heads[0].index}'s classes="
                              f"{heads[0].values['classes']}, not {op.values['classes']}",
                              layer=op.index, kind=op.kind)
    boxes, confidences, objectnesses = [], [], []
    for op in heads:
        g.layer, g.kind = op.index, op.kind
        head = op.detection_head
        n, classes = len(head.anchors), head.classes
        if classes < 1:
            raise g.refuse("outputs='boxes' needs classes >= 1")
        _, h, w = op.out_shape
        x = g.node("Reshape", [g.source(op.index), g.shape([0, n, 5 + classes, h, w])])
        tx, ty, tw, th, objectness, probability = g.node(
            "Split", [x, g.const([1, 1, 1, 1, 1, classes], "split")], axis=2, outputs=6)
        columns = g.const(np.arange(w, dtype=np.float32).reshape(1, 1, 1, 1, w), "columns")
        rows = g.const(np.arange(h, dtype=np.float32).reshape(1, 1, 1, h, 1), "rows")
        cx = g.node("Div", [g.node("Add", [columns, tx]), g.scalar(w)])
        cy = g.node("Div", [g.node("Add", [rows, ty]), g.scalar(h)])
        sides = []
        for t, anchor, size in ((tw, head.anchors[:, 0], net_w), (th, head.anchors[:, 1], net_h)):
            if head.new_coords:
                scale = g.mul(g.node("Mul", [t, t]), 4.0)
            else:
                scale = g.node("Exp", [t])
            anchors = g.const(anchor.reshape(1, n, 1, 1, 1), "anchors")
            sides.append(g.node("Div", [g.node("Mul", [scale, anchors]), g.scalar(size)]))
        box = g.node("Concat", [cx, cy, *sides], axis=2)
        box = g.node("Transpose", [box], perm=[0, 1, 3, 4, 2])
        boxes.append(g.node("Reshape", [box, g.shape([0, -1, 4])]))
        conf = g.node("Mul", [objectness, probability])
        conf = g.node("Transpose", [conf], perm=[0, 1, 3, 4, 2])
        confidences.append(g.node("Reshape", [conf, g.shape([0, -1, classes])]))
        objectnesses.append(g.node("Reshape", [objectness, g.shape([0, -1])]))
    return (g.concat(boxes, axis=1), g.concat(confidences, axis=1),
            g.concat(objectnesses, axis=1))


def build_model(net: ExportableNetwork, *, batch: int | str = 1, outputs: str = "raw",
                fp16: bool = False, opset: int | None = None) -> Any:
    """The ``onnx.ModelProto`` of ``net`` (see ``export_onnx``), checked by
    ``onnx.checker``. Raises ExportError for a layer ONNX cannot express, ArgumentError for
    a bad option."""
    onnx = _onnx()
    from onnx import TensorProto, helper, numpy_helper

    batch, opset = _check_options(batch, outputs, fp16, opset, onnx.defs.onnx_opset_version())
    heads = [op for op in net.layers if op.detection_head is not None]
    if outputs == "boxes" and not heads:
        raise ExportError("outputs='boxes' needs [yolo] layers; this network has none")
    g = OnnxGraph(np.float16 if fp16 else np.float32, opset)
    g.layer_shapes[-1] = tuple(net.input_shape)
    for op in net.layers:
        g.layer, g.kind = op.index, op.kind
        g.layer_outputs[op.index] = op.emit_onnx(g, net.params.get(op.index))
        g.layer_shapes[op.index] = tuple(op.out_shape)

    elem = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    named: list[tuple[str, str, list[Any]]] = []
    if heads:
        for op in heads:
            named.append((_raw_name(op), g.source(op.index), [batch, *op.out_shape]))
    else:
        last = net.layers[-1]
        named.append(("output", g.source(last.index), [batch, *last.out_shape]))
    if outputs == "boxes":
        boxes, confidences, objectness = _decode(g, heads, net.input_shape)
        count = sum(len(op.detection_head.anchors) * op.out_shape[1] * op.out_shape[2]
                    for op in heads)
        named.append((BOXES, boxes, [batch, count, 4]))
        named.append((CONFIDENCES, confidences, [batch, count, heads[0].values["classes"]]))
        named.append((OBJECTNESS, objectness, [batch, count]))

    # Each node is named after its first output, l<layer>_...: profilers and viewers show
    # the layer it belongs to.
    nodes = [helper.make_node(n.op_type, list(n.inputs), list(n.outputs), name=n.outputs[0],
                              **n.attributes) for n in g.nodes]
    nodes += [helper.make_node("Identity", [value], [name]) for name, value, _ in named]
    initializers = [numpy_helper.from_array(array, name)
                    for name, array in g.initializers.items()]
    graph = helper.make_graph(
        nodes, "darknet_metal",
        [helper.make_tensor_value_info(INPUT, elem, [batch, *net.input_shape])],
        [helper.make_tensor_value_info(name, elem, shape) for name, _, shape in named],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="darknet_metal", producer_version=_version())
    model.ir_version = min(model.ir_version, _IR_VERSION.get(opset, model.ir_version))
    helper.set_model_props(model, _metadata(net, heads, outputs, fp16))
    onnx.checker.check_model(model, full_check=True)
    return model


#: The IR version each opset came with, so that older runtimes read the file.
_IR_VERSION = {13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9, 21: 10}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("darknet-metal")
    except PackageNotFoundError:
        return "(not installed)"


def _metadata(net: ExportableNetwork, heads: list[ExportableLayer], outputs: str,
              fp16: bool) -> dict[str, str]:
    c, h, w = net.input_shape
    letterbox = bool(net.config.net.values.get("letter_box"))
    return {
        "darknet_metal.input": json.dumps({
            "name": INPUT, "layout": "NCHW", "channels": c, "height": h, "width": w,
            "dtype": "float16" if fp16 else "float32", "color": "RGB" if c == 3 else "as read",
            "values": "pixel / 255, in [0, 1]",
            "resize": ("Darknet's letterbox_image (aspect kept, grey bars)" if letterbox
                       else "Darknet's resize_image (bilinear stretch, aspect not kept)"),
        }),
        "darknet_metal.heads": json.dumps([_head_metadata(op) for op in heads]),
        "darknet_metal.classes": json.dumps(list(net.names) if net.names else None),
        "darknet_metal.outputs": json.dumps({
            **({} if heads else {"output": "the last layer's output, (N, C, H, W)"}),
            **{_raw_name(op): "the [yolo] layer's output as Darknet leaves it: (N, "
               "anchors*(5+classes), H, W), logistic on x, y, objectness and classes unless "
               "new_coords, scale_x_y applied" for op in heads},
            **({BOXES: "(N, K, 4) centre x, centre y, width, height relative to the network "
                       "input (0..1); K = heads x anchors x rows x columns in that order",
                CONFIDENCES: "(N, K, classes) objectness x class probability, unthresholded; "
                             "NMS not applied",
                OBJECTNESS: "(N, K) each candidate's objectness"}
               if outputs == "boxes" else {}),
        }),
        **({"darknet_metal.postprocess": json.dumps(_postprocess_settings(net, heads))}
           if outputs == "boxes" else {}),
    }


def _postprocess_settings(net: ExportableNetwork,
                          heads: list[ExportableLayer]) -> dict[str, Any]:
    """The keyword arguments of ``darknet_metal.postprocess`` that this network fixes: what
    ``detect`` takes from its cfg (the last ``[yolo]`` layer chooses the NMS, as in
    Darknet)."""
    _, h, w = net.input_shape
    last = heads[-1].values
    return {"input_size": [w, h], "letterbox": bool(net.config.net.values.get("letter_box")),
            "nms_kind": last["nms_kind"], "beta_nms": float(last["beta_nms"]),
            "names": list(net.names) if net.names else None}


def export_onnx(net: ExportableNetwork, path: str | os.PathLike[str], *, batch: int | str = 1,
                outputs: str = "raw", fp16: bool = False, opset: int | None = None) -> None:
    """Write ``net`` as an ONNX model to ``path`` (atomically: a failed export leaves no
    file).

    ``batch``: the batch the model takes, or ``"dynamic"`` (any). ``outputs``: ``"raw"``,
    one output per ``[yolo]`` layer (``yolo_<layer>``) holding exactly what ``forward``
    returns (a network without heads: its last layer's output, ``output``); ``"boxes"``
    adds ``boxes`` (N, K, 4), ``confs`` (N, K, classes) and ``objectness`` (N, K), the
    decoded candidates before NMS, which ``darknet_metal.postprocess`` turns into
    ``detect``'s detections. ``fp16``: weights, input and outputs as float16. ``opset``:
    the ONNX operator set (default ``DEFAULT_OPSET``). Batch norm is folded into the
    convolutions. The model's metadata names the classes, each head's anchors and mask, and
    how the input is prepared.

    Raises ExportError naming the layer, its kind and why when ONNX cannot express it,
    ArgumentError for a bad option, DependencyError without the ``onnx`` package.
    """
    model = build_model(net, batch=batch, outputs=outputs, fp16=fp16, opset=opset)
    data = model.SerializeToString()
    atomic_write(path, lambda f: f.write(data))
