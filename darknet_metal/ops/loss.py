"""What the loss layers ([softmax], [cost]) share on a device: the loss kernel writing the
layer's own delta and per-element loss, and the delta added back into the layer's input."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from darknet_metal.runtime.program import LayerEmitter

if TYPE_CHECKING:
    from darknet_metal.runtime.train_state import LayerTrainState

__all__ = ["emit_device_add_into_input", "emit_device_loss"]


def emit_device_loss(e: LayerEmitter, ts: LayerTrainState, kernel: str, name: str) -> None:
    """A loss head's training forward on the device: ``kernel`` (softmax cross-entropy or
    sse) writes the layer's delta (truth minus prediction) and the per-element loss into
    ``ts.extra[name]``, from its output and the mini-batch's truths."""
    n = e.batch * e.spec.out_size
    ts.truth(e.batch)
    ts.buffer(name, (e.batch, e.spec.out_size))
    e.kernel(kernel, {"pred": e.output, "truth": ts.ref("truth", "extra"),
                      "delta": e.own_delta(), "loss": ts.ref(name, "extra")}, {"n": n}, n=n)


def emit_device_add_into_input(e: LayerEmitter, scale: float) -> None:
    """Backward of a loss head: its delta, times ``scale``, added into its input's."""
    into = e.input_delta(0)
    if into is not None:
        n = int(np.prod(e.shape(e.delta)))
        e.kernel("add_buf_f32", {"src": e.delta, "dst": into}, {"n": n}, n=n, scale=scale)
