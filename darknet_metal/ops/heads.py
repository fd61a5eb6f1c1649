"""The [softmax] output layer (classifiers); [yolo] is ops.yolo."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import heads as cpu_heads
from darknet_metal.cpu.step import NativeStep
from darknet_metal.model.cfg import Section
from darknet_metal.ops.base import Op, Params, Shape, as_rows, emit_input_gradient
from darknet_metal.ops.key_dispositions import IMPLEMENTED
from darknet_metal.ops.loss import emit_device_add_into_input, emit_device_loss
from darknet_metal.runtime.program import LayerEmitter

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState


class SoftmaxOp(Op):
    kind = "softmax"
    short_name = "softmax"
    computes_loss = True
    training_keys = {
        "tree": "hierarchical softmax is not supported",
        "spatial": "spatial softmax is not supported",
        "noloss": IMPLEMENTED,
    }

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        inputs = shape[0] * shape[1] * shape[2]
        if inputs % s.values["groups"]:
            raise s.error(f"groups={s.values['groups']} does not divide the {inputs} inputs",
                          "groups")
        return cls(s, [s.index - 1], shape, shape)

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        # Each image's values in memory order, in `groups` runs of softmax(x / T).
        groups, temperature = self.values["groups"], self.values["temperature"]
        x = g.node("Reshape", [g.source(self.inputs[0]), g.shape([0, groups, -1])])
        if temperature != 1:
            x = g.mul(x, 1.0 / temperature)
        y = g.node("Softmax", [x], axis=2)
        return g.node("Reshape", [y, g.shape([0, *self.out_shape])])

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        return [cpu_heads.softmax_step(sources[0], out, self.values["groups"],
                                       self.values["temperature"])]

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # With a truth (and without noloss), Darknet's forward also computes the
        # cross-entropy delta and the per-element loss (its cost is their sum).
        super().emit_cpu_train(e, ts)
        if self.values["noloss"]:
            return
        truth, loss = ts.truth(e.batch), ts.buffer("loss", (e.batch, self.out_size))
        e.host([e.output], [e.own_delta()], lambda r, w: [
            cpu_heads.softmax_cross_entropy_step(as_rows(r[0]), truth, as_rows(w[0]), loss)])

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_input_gradient(e, cpu_heads.softmax_backward_step)

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        self.emit_device_forward(e)
        if not self.values["noloss"]:
            emit_device_loss(e, ts, "softmax_fwd_xent_f32", "loss")

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_device_add_into_input(e, 1.0)

    def emit_device_forward(self, e: LayerEmitter) -> None:
        groups = self.values["groups"]
        rows = e.batch * groups
        e.kernel("softmax_fwd_f32", {"x": e.inputs[0], "y": e.output}, {"rows": rows},
                 rows=rows, n=self.out_size // groups, temperature=self.values["temperature"])
