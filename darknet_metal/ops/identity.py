"""[dropout] and [cost]: at inference their output is their input (no step, no memory).

In training, [dropout] zeroes and rescales its input in place (and its input's delta in the
backward), and [cost] compares its input with the truth (a loss layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from darknet_metal.cpu import dropout
from darknet_metal.cpu import heads as cpu_heads
from darknet_metal.ops.base import Op, Params, as_rows, emit_input_gradient
from darknet_metal.ops.key_dispositions import IMPLEMENTED
from darknet_metal.ops.loss import emit_device_add_into_input, emit_device_loss
from darknet_metal.runtime.program import LayerEmitter, Tensor

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState


class _Identity(Op):
    output_is_input = True

    def emit_cpu_forward(self, e: LayerEmitter, state: object) -> None:
        pass

    def emit_device_forward(self, e: LayerEmitter) -> None:
        pass

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        return g.source(self.inputs[0])


class DropoutOp(_Identity):
    kind = "dropout"
    short_name = "dropout"
    delta_is_input_delta = True
    training_keys = dict.fromkeys(("dropblock", "dropblock_size_rel", "dropblock_size_abs"),
                                  "DropBlock is not supported")

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # In place on the previous layer's output, as Darknet; the draws are kept for the
        # backward, a fresh set per pass from the layer's seeded counter-based stream.
        p = self.values["probability"]
        counter = ts.buffer("draws", (1,), np.uint64)
        rand = e.tensor("rand", e.shape(e.output))
        e.host([e.output], [rand, e.output], lambda r, w: [
            dropout.uniform_fill_step(w[0], ts.seed, counter),
            dropout.dropout_forward_train_step(w[1], w[0], p)])

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        p = self.values["probability"]
        e.host([e.delta, Tensor(self.index, "rand")], [e.delta], lambda r, w: [
            dropout.dropout_backward_step(w[0], r[1], p)])

    def _device_args(self, e: LayerEmitter) -> dict[str, int | float]:
        p = self.values["probability"]
        # scale as the CPU rounds it: 1/(1 - p) in double, then to float.
        return dict(n=int(np.prod(e.shape(e.output))), probability=p,
                    scale=float(np.float32(1.0 / (1.0 - p))))

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # The same draws as the CPU's (seed, counter, element), then the counter advances
        # in its own dispatch (the draw's threads all read it).
        args = self._device_args(e)
        ts.buffer("draws", (1,), np.uint64)
        counter = ts.ref("draws", "extra")
        rand = e.tensor("rand", e.shape(e.output))
        e.kernel("uniform_buf_f32", {"counter": counter, "rand": rand}, {"n": args["n"]},
                 n=args["n"], seed_lo=ts.seed & 0xFFFFFFFF, seed_hi=ts.seed >> 32)
        e.kernel("uniform_buf_advance_f32", {"counter": counter}, {"count": 1}, count=1)
        e.kernel("dropout_fwd_train_f32", {"rand": rand, "x": e.output}, {"n": args["n"]},
                 **args)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        args = self._device_args(e)
        e.kernel("dropout_bwd_f32", {"rand": Tensor(self.index, "rand"), "delta": e.delta},
                 {"n": args["n"]}, **args)


class CostOp(_Identity):
    kind = "cost"
    short_name = "cost"
    computes_loss = True
    training_keys = {"type": "only type=sse is supported in training", "scale": IMPLEMENTED,
                     "ratio": "keeping only the largest deltas (ratio) is not supported"}

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        truth = ts.truth(e.batch)
        errors = ts.buffer("errors", (e.batch, self.out_size))
        e.host([e.output], [e.own_delta()], lambda r, w: [
            cpu_heads.cost_sse_step(as_rows(r[0]), truth, as_rows(w[0]), errors)])

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        scale = self.values["scale"]
        emit_input_gradient(e, lambda delta, into: cpu_heads.cost_backward_step(delta, into,
                                                                                scale))

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_device_loss(e, ts, "cost_fwd_sse_f32", "errors")

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_device_add_into_input(e, self.values["scale"])
