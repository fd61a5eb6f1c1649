"""[upsample] (nearest neighbour, or Darknet's summing reverse mode), [reorg] and [reorg3d]."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from darknet_metal.cpu import resample as cpu_resample
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
from darknet_metal.runtime.program import LayerEmitter

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState


def _describe_stride(spec: Op) -> str:
    return f"            {spec.values['stride']:2d}x"


class UpsampleOp(Op):
    kind = "upsample"
    short_name = "upsample"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        c, h, w = shape
        stride = s.values["stride"]
        if stride > 0:
            out = (c, h * stride, w * stride)
        else:
            if h % -stride or w % -stride:
                raise s.error(f"stride={stride} does not divide the input {h}x{w}", "stride")
            out = (c, h // -stride, w // -stride)
        return cls(s, [s.index - 1], shape, positive(s, out, "stride"))

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        return [cpu_resample.upsample_step(sources[0], out, self.values["stride"],
                                           self.values["scale"])]

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        v = self.values
        emit_input_gradient(e, lambda delta, into: cpu_resample.upsample_backward_step(
            delta, into, v["stride"], v["scale"]))

    def _args(self, batch: int) -> dict[str, int | float]:
        c, h, w = self.in_shape
        _, oh, ow = self.out_shape
        return dict(planes=batch * c, height=h, width=w, out_h=oh, out_w=ow,
                    stride=self.values["stride"], scale=self.values["scale"])

    def emit_device_forward(self, e: LayerEmitter) -> None:
        args = self._args(e.batch)
        e.kernel("upsample_fwd_f32", {"x": e.inputs[0], "y": e.output},
                 {"out_w": args["out_w"], "out_h": args["out_h"], "planes": args["planes"]},
                 **args)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # A gather over the input's pixels (stride > 0), or over the outputs (stride < 0,
        # where no two outputs share an input).
        args = self._args(e.batch)
        side = ("width", "height") if self.values["stride"] > 0 else ("out_w", "out_h")
        emit_device_input_gradient(e, "upsample_bwd_f32", {
            "cols": args[side[0]], "rows": args[side[1]], "planes": args["planes"]}, **args)

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        stride, scale = self.values["stride"], self.values["scale"]
        x = g.source(self.inputs[0])
        if stride > 0:
            # Output pixel (y, x) is input (y // s, x // s): nearest, asymmetric, floor.
            y = g.node("Resize", [x, "", g.const([1, 1, stride, stride], "scales",
                                                 dtype=np.float32)],
                       mode="nearest", coordinate_transformation_mode="asymmetric",
                       nearest_mode="floor")
        else:
            # Darknet's reverse mode sums each -s x -s block: the block's mean times s^2.
            s = -stride
            y = g.mul(g.node("AveragePool", [x], kernel_shape=[s, s], strides=[s, s]),
                      float(s * s))
        return y if scale == 1 else g.mul(y, scale)

    def describe(self) -> str:
        return _describe_stride(self)


class ReorgOp(Op):
    """Darknet's original reorg: space to depth, or depth to space with ``reverse=1``."""

    kind = "reorg"
    short_name = "reorg"
    #: Which side's dims the layer gives Darknet's reorg_cpu (the one index map of both
    #: reorg layers): [reorg] its input's, [reorg3d] its output's.
    maps_output_dims: ClassVar[bool] = False

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        c, h, w = shape
        stride = s.values["stride"]
        # reorg_cpu permutes through a (C/stride^2, H*stride, W*stride) view of the side
        # whose dims it is given, so those channels must divide.
        if c % (stride * stride) and (s.values["reverse"] or not cls.maps_output_dims):
            raise s.error(f"{cls.kind} needs the input channels ({c}) divisible by stride^2",
                          "stride")
        if s.values["reverse"]:
            out = (c // (stride * stride), h * stride, w * stride)
            if cls.maps_output_dims and out[0] % (stride * stride):
                raise s.error(f"{cls.kind} reverse=1 needs the input channels ({c}) divisible "
                              "by stride^4", "stride")
        else:
            if h % stride or w % stride:
                raise s.error(f"stride={stride} does not divide the input {h}x{w}", "stride")
            out = (c * stride * stride, h // stride, w // stride)
        return cls(s, [s.index - 1], shape, positive(s, out, "stride"))

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        return [cpu_resample.reorg_step(sources[0], out, self.values["stride"],
                                        self.values["reverse"], self.kind)]

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        v = self.values
        emit_input_gradient(e, lambda delta, into: cpu_resample.reorg_backward_step(
            delta, into, v["stride"], v["reverse"], self.kind))

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        # Darknet's index maps are not DepthToSpace's or SpaceToDepth's in general: gather
        # each image's values through the map the CPU layer computes, applied to their own
        # positions (exact in float64).
        positions = np.arange(int(np.prod(self.in_shape)), dtype=np.float64)
        moved = np.empty((1, *self.out_shape), np.float64)
        cpu_resample.reorg_forward(positions.reshape(1, *self.in_shape), moved,
                                   self.values["stride"], bool(self.values["reverse"]),
                                   self.kind)
        flat = g.node("Reshape", [g.source(self.inputs[0]), g.shape([0, -1])])
        picked = g.node("Gather", [flat, g.const(moved.reshape(-1).astype(np.int64),
                                                 "positions")], axis=1)
        return g.node("Reshape", [picked, g.shape([0, *self.out_shape])])

    def _dims_args(self, batch: int) -> tuple[dict[str, int], dict[str, int]]:
        c, h, w = self.out_shape if self.maps_output_dims else self.in_shape
        return ({"width": w, "height": h, "slices": batch * c},
                dict(batch=batch, width=w, height=h, channels=c, stride=self.values["stride"],
                     reverse=int(bool(self.values["reverse"]))))

    def emit_device_forward(self, e: LayerEmitter) -> None:
        sizes, args = self._dims_args(e.batch)
        e.kernel("reorg_fwd_f32", {"x": e.inputs[0], "y": e.output}, sizes, **args)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        sizes, args = self._dims_args(e.batch)
        emit_device_input_gradient(e, "reorg_bwd_f32", sizes, **args)

    def describe(self) -> str:
        return _describe_stride(self)


class Reorg3dOp(ReorgOp):
    """Darknet's newer reorg: a plain space to depth (and its quirky reverse)."""

    kind = "reorg3d"
    short_name = "reorg3d"
    maps_output_dims = True
