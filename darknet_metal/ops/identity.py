"""[dropout] and [cost]: at inference their output is their input (no step, no memory)."""

from __future__ import annotations

from darknet_metal.ops.base import LayerSpec
from darknet_metal.program import LayerEmitter
from darknet_metal.training.keys import IMPLEMENTED


class _Identity(LayerSpec):
    output_is_input = True

    def emit_cpu_forward(self, e: LayerEmitter, state: object) -> None:
        pass

    def emit_device_forward(self, e: LayerEmitter) -> None:
        pass


class DropoutOp(_Identity):
    kind = "dropout"
    short_name = "dropout"
    delta_is_input_delta = True
    training_keys = dict.fromkeys(("dropblock", "dropblock_size_rel", "dropblock_size_abs"),
                                  "DropBlock is not supported")


class CostOp(_Identity):
    kind = "cost"
    short_name = "cost"
    training_keys = {"type": IMPLEMENTED, "scale": IMPLEMENTED,
                     "ratio": "keeping only the largest deltas (ratio) is not supported"}
