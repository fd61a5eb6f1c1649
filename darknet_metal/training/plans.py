"""Built training programs kept per input size, so a network trained at several sizes in turn
(Darknet's ``random=1``) builds each size's program once.

A program is pure bookkeeping until an executor binds it to memory; what it holds of the
training state is the arrays its ops declared while it was built (a loss layer's truths and
statistics, dropout's counter: ``LayerTrainState.extra``), which CPU steps capture and device
programs bind by name. A kept program is reused only while every such array is still the one
it was built with; otherwise it is built again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import numpy as np

from darknet_metal.training.state import TrainState

#: Programs kept per backend: Darknet's random=1 visits about ten sizes around the cfg's; the
#: least recently used is dropped beyond it.
MAX_TRAINING_PLANS = 16

T = TypeVar("T")


class TrainingPlans(Generic[T]):
    """Least-recently-used programs of one training state, by key (the executor's: input
    shape, mini-batch, first backward layer, kept deltas)."""

    def __init__(self, limit: int = MAX_TRAINING_PLANS) -> None:
        self.limit = limit
        self.state: TrainState | None = None
        self._plans: OrderedDict[Hashable, tuple[dict[tuple[int, str], np.ndarray], T]] = (
            OrderedDict())
        #: Builds and reuses since made (for tests and the README's figures).
        self.builds = 0
        self.hits = 0

    def get(self, state: TrainState, key: Hashable, build: Callable[[], T]) -> T:
        """The program of ``key`` for ``state``: the kept one if its arrays are still the
        state's, else ``build()`` (kept from then on)."""
        if state is not self.state:
            self._plans.clear()
            self.state = state
        held = self._plans.get(key)
        if held is not None and _same_arrays(state, held[0]):
            self._plans.move_to_end(key)
            self.hits += 1
            return held[1]
        plan = build()
        self.builds += 1
        self._plans[key] = (_arrays(state), plan)
        self._plans.move_to_end(key)
        while len(self._plans) > self.limit:
            self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
        self.state = None


def _arrays(state: TrainState) -> dict[tuple[int, str], np.ndarray]:
    return {(i, name): a for i, layer in state.layers.items() for name, a in layer.extra.items()}


def _same_arrays(state: TrainState, arrays: dict[tuple[int, str], np.ndarray]) -> bool:
    return all(state.layer(i).extra.get(name) is a for (i, name), a in arrays.items())
