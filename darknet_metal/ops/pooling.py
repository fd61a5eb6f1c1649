"""[maxpool] (windows, and ``maxpool_depth`` across channels) and global [avgpool]."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import pooling as cpu_pooling
from darknet_metal.cpu.step import NativeStep
from darknet_metal.model.cfg import Section
from darknet_metal.ops.base import (
    Op,
    Params,
    Shape,
    emit_device_input_gradient,
    emit_input_gradient,
    positive,
)
from darknet_metal.runtime.program import LayerEmitter, Tensor

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState


class MaxpoolOp(Op):
    kind = "maxpool"
    short_name = "max"
    training_keys = {
        "maxpool_zero_nonmax": "zeroing non-maximal inputs is not supported in training",
    }

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
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
            out = (c, (h + pad - size) // v["stride_y"] + 1,
                   (w + pad - size) // v["stride_x"] + 1)
        out = positive(s, out, "this maxpool")
        # Darknet counts one operation per compared value.
        flops = out[0] * out[1] * out[2] * v["size"] * v["size"]
        return cls(s, [s.index - 1], shape, out, flops=flops)

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        v = self.values
        if v["maxpool_depth"]:
            return [cpu_pooling.maxpool_depth_step(sources[0], out)]
        return [cpu_pooling.maxpool_step(sources[0], out, v["size"], v["stride_x"],
                                         v["stride_y"], v["padding"])]

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        v = self.values
        x = g.source(self.inputs[0])
        if v["maxpool_depth"]:
            # Output channel k: the maximum of input channels k, k + K, k + 2K, ... (K the
            # output channels): pad the channels with -inf to a multiple of K, then reduce
            # over the (C/K, K) view's first axis.
            c, h, w = self.in_shape
            k = self.out_shape[0]
            rows = -(-c // k)
            if rows * k != c:
                x = g.node("Pad", [x, g.const([0, 0, 0, 0, 0, rows * k - c, 0, 0], "pads"),
                                   g.scalar(-np.inf)], mode="constant")
            x = g.node("Reshape", [x, g.shape([0, rows, k, h, w])])
            return g.reduce_max(x, 1)
        # Darknet's window starts padding//2 before the input; ONNX ignores padded values,
        # as Darknet does the positions outside.
        pad = v["padding"]
        begin, end = pad // 2, pad - pad // 2
        return g.node("MaxPool", [x], kernel_shape=[v["size"], v["size"]],
                      strides=[v["stride_y"], v["stride_x"]], pads=[begin, begin, end, end])

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # Darknet keeps the position of each window's maximum for the backward.
        v = self.values
        indexes = e.tensor("indexes", e.shape(e.output), dtype="int32")
        if v["maxpool_depth"]:
            e.host([e.inputs[0]], [e.output, indexes], lambda r, w: [
                cpu_pooling.maxpool_depth_forward_train_step(r[0], w[0], w[1])])
        else:
            e.host([e.inputs[0]], [e.output, indexes], lambda r, w: [
                cpu_pooling.maxpool_forward_train_step(r[0], w[0], w[1], v["size"],
                                                       v["stride_x"], v["stride_y"],
                                                       v["padding"])])

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_input_gradient(e, cpu_pooling.maxpool_backward_step,
                            [Tensor(self.index, "indexes")])

    def _kernel_args(self, batch: int) -> tuple[str, dict[str, int], dict[str, int]]:
        """(kernel prefix, output grid sizes, argument fields) of this maxpool's kernels."""
        v = self.values
        c, h, w = self.in_shape
        oc, oh, ow = self.out_shape
        if v["maxpool_depth"]:
            return ("maxpool_depth", {"spatial": h * w, "out_channels": oc, "batch": batch},
                    dict(batch=batch, channels=c, spatial=h * w, out_channels=oc))
        return ("maxpool", {"out_w": ow, "out_h": oh, "planes": batch * c},
                dict(planes=batch * c, height=h, width=w, out_h=oh, out_w=ow, size=v["size"],
                     stride_x=v["stride_x"], stride_y=v["stride_y"], padding=v["padding"],
                     accumulate=1))

    def emit_device_forward(self, e: LayerEmitter) -> None:
        prefix, sizes, args = self._kernel_args(e.batch)
        e.kernel(f"{prefix}_fwd_f32", {"x": e.inputs[0], "y": e.output}, sizes, **args)

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        prefix, sizes, args = self._kernel_args(e.batch)
        indexes = e.tensor("indexes", e.shape(e.output), dtype="int32")
        e.kernel(f"{prefix}_fwd_train_f32", {"x": e.inputs[0], "y": e.output,
                                             "indexes": indexes}, sizes, **args)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # The backward gathers over the input: its grid is the input's.
        prefix, _, args = self._kernel_args(e.batch)
        c, h, w = self.in_shape
        saved = {"indexes": Tensor(self.index, "indexes")}
        if self.values["maxpool_depth"]:
            emit_device_input_gradient(e, f"{prefix}_bwd_f32",
                                       {"spatial": h * w, "channels": c, "batch": e.batch},
                                       saved, **args)
            return
        # The gather writes every input element: the delta's first writer sets it.
        target = e.input_delta_target(0)
        if target is not None:
            e.kernel("maxpool_bwd_f32", {"delta": e.delta, **saved, "x_grad": target[0]},
                     {"width": w, "height": h, "planes": e.batch * c},
                     **{**args, "accumulate": int(target[1])})

    def describe(self) -> str:
        v = self.values
        return f"          {v['size']:2d} x{v['size']:2d}/{v['stride_x']:3d}"


class AvgpoolOp(Op):
    kind = "avgpool"
    short_name = "avg"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        return cls(s, [s.index - 1], shape, (shape[0], 1, 1))

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        return [cpu_pooling.avgpool_step(sources[0], out)]

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        return g.node("GlobalAveragePool", [g.source(self.inputs[0])])

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_input_gradient(e, cpu_pooling.avgpool_backward_step)

    def emit_device_forward(self, e: LayerEmitter) -> None:
        c, h, w = self.in_shape
        planes = e.batch * c
        e.kernel("avgpool_fwd_f32", {"x": e.inputs[0], "y": e.output}, {"planes": planes},
                 planes=planes, spatial=h * w)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        c, h, w = self.in_shape
        planes = e.batch * c
        emit_device_input_gradient(e, "avgpool_bwd_f32", {"spatial": h * w, "planes": planes},
                                   planes=planes, spatial=h * w)
