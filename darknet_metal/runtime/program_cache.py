"""The one cache of built programs: least recently used first out, with what a program holds
given back when it leaves.

Both executors keep their inference programs in one (per batch and requested outputs) and
their training programs in another (per input size, ``TrainingPrograms``): Darknet's
``random=1`` visits about ten sizes around the cfg's, and a stream holds the program its pass
ring runs on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import numpy as np

from darknet_metal.runtime.train_state import TrainState

__all__ = ["MAX_PROGRAMS", "MAX_TRAINING_PROGRAMS", "ProgramCache", "TrainingPrograms"]

#: Inference programs kept per executor (one per (batch, requested outputs)).
MAX_PROGRAMS = 4
#: Training programs kept per executor (one per input size, mini-batch and options).
MAX_TRAINING_PROGRAMS = 16

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ProgramCache(Generic[K, V]):
    """Up to ``limit`` programs by key. ``release(program)`` gives back what a program that
    leaves holds (None: nothing to give back); ``held(program)`` says a program may not leave
    now (a stream runs on it); ``builds`` and ``hits`` count since made."""

    def __init__(self, limit: int, release: Callable[[V], None] | None = None,
                 held: Callable[[V], bool] | None = None) -> None:
        self.limit = limit
        self._release = release
        self._held = held
        self._programs: OrderedDict[K, V] = OrderedDict()
        self.builds = 0
        self.hits = 0

    def get(self, key: K, build: Callable[[], V],
            valid: Callable[[V], bool] | None = None) -> V:
        """The program of ``key``: the kept one (if ``valid`` says it still is), else
        ``build()``, made after the least recently used programs beyond the limit left."""
        kept = self._programs.get(key)
        if kept is not None and (valid is None or valid(kept)):
            self._programs.move_to_end(key)
            self.hits += 1
            return kept
        if kept is not None:
            self._drop(key)
        while len(self._programs) >= self.limit:
            free = next((k for k, p in self._programs.items()
                         if self._held is None or not self._held(p)), None)
            if free is None:
                break
            self._drop(free)
        program = build()
        self.builds += 1
        self._programs[key] = program
        return program

    def _drop(self, key: K) -> None:
        program = self._programs.pop(key)
        if self._release is not None:
            self._release(program)

    def clear(self) -> None:
        """Every program leaves (given back)."""
        while self._programs:
            self._drop(next(iter(self._programs)))

    def values(self) -> Iterator[V]:
        return iter(list(self._programs.values()))

    def __len__(self) -> int:
        return len(self._programs)


class TrainingPrograms(Generic[V]):
    """Built training programs of one training state, kept per key (the executor's: input
    shape, mini-batch, first backward layer, kept tensors) in a ``ProgramCache``.

    A program is bookkeeping until an executor binds it to memory; what it holds of the
    training state is the arrays its ops declared while it was built (a loss layer's truths
    and statistics, dropout's counter: ``LayerTrainState.extra``), which CPU steps capture and
    device programs bind by name. A kept program is reused only while every such array is
    still the one it was built with; another state empties the cache."""

    def __init__(self, limit: int = MAX_TRAINING_PROGRAMS) -> None:
        self.state: TrainState | None = None
        self._cache: ProgramCache[Hashable, tuple[dict[tuple[int, str], np.ndarray], V]] = (
            ProgramCache(limit))

    @property
    def builds(self) -> int:
        return self._cache.builds

    @property
    def hits(self) -> int:
        return self._cache.hits

    def get(self, state: TrainState, key: Hashable, build: Callable[[], V]) -> V:
        """The program of ``key`` for ``state``: the kept one if its arrays are still the
        state's, else ``build()``."""
        if state is not self.state:
            self._cache.clear()
            self.state = state
        def built() -> tuple[dict[tuple[int, str], np.ndarray], V]:
            program = build()
            # The arrays as the build left them: building declares some.
            return _arrays(state), program

        return self._cache.get(key, built, valid=lambda held: _same_arrays(state, held[0]))[1]

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
        self.state = None


def _arrays(state: TrainState) -> dict[tuple[int, str], np.ndarray]:
    return {(i, name): a for i, layer in state.layers.items() for name, a in layer.extra.items()}


def _same_arrays(state: TrainState, arrays: dict[tuple[int, str], np.ndarray]) -> bool:
    return all(state.layer(i).extra.get(name) is a for (i, name), a in arrays.items())
