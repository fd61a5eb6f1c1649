"""[dropout] and [cost]: at inference their output is their input (no step, no memory)."""

from __future__ import annotations

from darknet_metal.ops.base import LayerSpec
from darknet_metal.program import LayerEmitter


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


class CostOp(_Identity):
    kind = "cost"
    short_name = "cost"
