"""What the executors need of a network's layer: the protocol every op (``ops.Op``) meets.

The executors run programs that layers emit; they never branch on a layer's kind. Typing them
against this protocol instead of the op classes keeps ``runtime`` below ``ops``: ops import
the program vocabulary they emit into, not the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from darknet_metal.model.cfg import Shape
from darknet_metal.model.weights import Params
from darknet_metal.runtime.program import LayerEmitter, ProgramLayer
from darknet_metal.runtime.train_state import LayerTrainState


class Layer(ProgramLayer, Protocol):
    """One layer of a network as the executors see it (``ops.base`` documents each member).

    ``index``: 0-based; ``inputs``: indices of the layers it reads (-1: the network input);
    ``out_shape``: (C, H, W) of one image.
    """

    index: int
    kind: str
    inputs: list[int]
    in_shape: Shape
    out_shape: Shape
    param_shapes: dict[str, tuple[int, ...]]
    output_is_input: bool
    delta_is_input_delta: bool
    statistics: tuple[str, ...]

    @property
    def values(self) -> dict[str, Any]: ...

    @property
    def trainable_params(self) -> tuple[str, ...]: ...

    @property
    def detection_head(self) -> Any: ...

    def prepare_cpu(self, params: Params | None, dtype: np.dtype) -> Any: ...

    def cpu_workspace(self, batch: int) -> int: ...

    def emit_cpu_forward(self, e: LayerEmitter, state: Any) -> None: ...

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None: ...

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None: ...

    def device_params(self, params: Params | None) -> dict[str, np.ndarray | int]: ...

    def emit_device_setup(self, e: LayerEmitter) -> None: ...

    def emit_device_forward(self, e: LayerEmitter) -> None: ...

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None: ...

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None: ...
