"""What training changes, per layer: parameters, gradient accumulators, optimizer moments.

Darknet keeps one accumulator per trainable array (``weight_updates``, ``bias_updates``,
``scale_updates``): backward passes add the mini-batches' gradients into it, the update
applies it and leaves ``momentum`` times it behind (SGD), or zeroes it (Adam, which keeps its
moments apart). ``TrainState`` holds those arrays in the compute dtype, bound once by the
training programs, so an iteration allocates nothing; ``snapshot``/``restore`` copy every
array a step writes, for a step that must leave no trace (``Network.gradients``, a step
refused for non-finite values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from darknet_metal.cpu.update import all_finite
from darknet_metal.errors import ArgumentError
from darknet_metal.model.weights import Params
from darknet_metal.runtime.program import Param

#: The groups of a layer's training arrays, as ``Param.group`` names them on a device.
GROUPS = ("value", "grad", "adam_m", "adam_v", "extra")

#: The accumulator names Darknet gives each trainable array (for messages and summaries).
ACCUMULATOR_NAMES = {"weights": "weight_updates", "biases": "bias_updates",
                     "scales": "scale_updates"}


@dataclass
class LayerTrainState:
    """One layer's training arrays. ``values``: every parameter array (trainable and
    statistics), C-contiguous in ``dtype``, updated in place; ``grads``: an accumulator per
    trainable array; ``adam_m``/``adam_v``: Adam's moments (empty without Adam);
    ``extra``: arrays the layer's steps keep between passes (a loss layer's truths and
    statistics, a dropout's draw counter); ``seed``: the layer's random stream;
    ``net_size``: the network input's (width, height) in pixels."""

    index: int
    dtype: np.dtype
    values: Params
    grads: Params
    adam_m: Params = field(default_factory=dict)
    adam_v: Params = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    seed: int = 0
    net_size: tuple[int, int] = (0, 0)
    #: Allocates a zeroed array (shape, dtype): page-aligned where a device shares it.
    zeros: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.zeros
    #: A loss layer's truth per image: (boxes, 5) rows for [yolo], (classes,) for
    #: [softmax]/[cost]; () for the other layers.
    truth_shape: tuple[int, ...] = ()

    def buffer(self, name: str, shape: tuple[int, ...],
               dtype: np.dtype | type | None = None) -> np.ndarray:
        """``extra[name]``, a zeroed array of ``shape`` (the compute dtype unless given),
        made anew when absent or of another shape (a program for another mini-batch size
        replaces it; the last one built is what the trainer reads)."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        a = self.extra.get(name)
        if a is None or a.shape != tuple(shape) or a.dtype != dtype:
            a = self.extra[name] = self.zeros(tuple(shape), dtype)
        return a

    def truth(self, batch: int) -> np.ndarray:
        """The truths of a mini-batch of ``batch`` images (``extra["truth"]``), which the
        trainer fills before each pass."""
        if not self.truth_shape:
            raise ArgumentError(f"layer {self.index} takes no truths")
        return self.buffer("truth", (batch, *self.truth_shape))

    def arrays(self) -> list[np.ndarray]:
        """Every array a training step may write."""
        return [*self.values.values(), *self.grads.values(), *self.adam_m.values(),
                *self.adam_v.values(), *self.extra.values()]

    def ref(self, name: str, group: str = "value") -> Param:
        """How a device program binds this layer's array ``name`` of ``group`` (GROUPS)."""
        if group not in GROUPS:
            raise ArgumentError(f"group must be one of {GROUPS}, not {group!r}")
        return Param(self.index, name, group)

    def group(self, group: str) -> dict[str, np.ndarray]:
        """The arrays of ``group`` (GROUPS), by name."""
        return {"value": self.values, "grad": self.grads, "adam_m": self.adam_m,
                "adam_v": self.adam_v, "extra": self.extra}[group]


@dataclass(frozen=True)
class ArrayUpdate:
    """What one iteration's update does to trainable array ``name`` of layer ``layer``:
    ``held`` (``dont_update``/``burnin_update``) drops the iteration's gradient instead;
    ``lr_scale`` is the layer's ``learning_rate`` multiplier (SGD); ``clear``: the
    accumulator is zeroed after the update instead of carrying SGD's momentum term (a rank of
    a run across processes whose term another rank carries)."""

    layer: int
    name: str
    held: bool
    lr_scale: float
    clear: bool = False


@dataclass(frozen=True)
class Optimizer:
    """Darknet's update of a gradient summed over ``images`` images: SGD with ``momentum``
    and ``decay``, or Adam (``adam``; ``b1``, ``b2``, ``eps``), from the ``[net]`` values."""

    adam: bool
    images: int
    decay: float
    momentum: float
    b1: float
    b2: float
    eps: float

    @classmethod
    def of(cls, values: Mapping, images: int) -> Optimizer:
        return cls(bool(values["adam"]), images, float(values["decay"]),
                   float(values["momentum"]), float(values["B1"]), float(values["B2"]),
                   float(values["eps"]))


#: The groups a device keeps in one block of memory each (``TrainState.arenas``).
ARENA_GROUPS = ("value", "grad", "adam_m", "adam_v")


class TrainState:
    """The training arrays of every layer (``layers[index]``), in ``dtype``.

    ``params``: the network's parameter arrays; for float32 they are used in place (the
    network's own arrays are trained), for float64 they are copied, and ``write_back`` copies
    the trained values into them. ``adam``: allocate Adam's moments. ``frozen``: indices of
    layers that never train (no accumulators, no moments: ``train_only_bn``). ``zeros``:
    allocates every array (zeroed; default NumPy's): a device that shares host memory
    gives page-aligned ones, and then the parameters are copied into them.

    ``arena``, for a device that keeps the state in memory of its own (``sync`` with it):
    allocates one zeroed block of bytes per group of ``ARENA_GROUPS`` (``arenas``: each a
    flat array of the dtype), whose arrays start on ``alignment``-byte boundaries (the
    parameters are copied into theirs); every other array (``extra``) comes from ``zeros``.
    ``sync(arenas, write)`` makes arenas current on the host (``to_host``)."""

    def __init__(self, specs: Sequence, params: Mapping[int, Params], dtype: np.dtype | type,
                 *, adam: bool = False, frozen: Collection[int] = (),
                 zeros: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
                 arena: Callable[[int], np.ndarray] | None = None, alignment: int = 64,
                 sync: Callable[..., None] | None = None) -> None:
        self.dtype = np.dtype(dtype)
        self._params = params
        self._sync = sync
        self.layers: dict[int, LayerTrainState] = {}
        #: Per group, the block of memory its arrays are views of (only with ``arena``).
        self.arenas: dict[str, np.ndarray] = {}
        allocate = np.zeros if zeros is None else zeros
        trainables = {spec.index: [] if spec.index in frozen else
                      [n for n in spec.trainable_params if n in params.get(spec.index, {})]
                      for spec in specs}
        if arena is not None:
            grouped = self._arena_arrays(specs, params, trainables, adam, arena, alignment)
        for spec in specs:
            layer = params.get(spec.index, {})
            values: Params = {}
            for name, array in layer.items():
                if arena is not None:
                    values[name] = grouped[("value", spec.index, name)]
                elif (zeros is None and self.dtype == np.float32
                        and array.dtype == np.float32 and array.flags.c_contiguous
                        and array.flags.writeable):
                    values[name] = array
                    continue
                else:
                    values[name] = allocate(array.shape, self.dtype)
                np.copyto(values[name], array, casting="unsafe")
                if self.dtype == np.float32:
                    layer[name] = values[name]  # the network trains this array from now
            trainable = trainables[spec.index]

            def like(names: list[str], group: str, index: int = spec.index,
                     values: Params = values) -> Params:
                if arena is not None:
                    return {n: grouped[(group, index, n)] for n in names}
                return {n: allocate(values[n].shape, self.dtype) for n in names}

            state = LayerTrainState(spec.index, self.dtype, values, like(trainable, "grad"),
                                    zeros=allocate)
            if adam:
                state.adam_m, state.adam_v = like(trainable, "adam_m"), like(trainable, "adam_v")
            self.layers[spec.index] = state

    def _arena_arrays(self, specs: Sequence, params: Mapping[int, Params],
                      trainables: Mapping[int, list[str]], adam: bool,
                      arena: Callable[[int], np.ndarray],
                      alignment: int) -> dict[tuple[str, int, str], np.ndarray]:
        """The arrays of every group as views of one block per group, in layer order, each
        starting on an ``alignment``-byte boundary (``arenas`` gets the blocks)."""
        itemsize = self.dtype.itemsize
        layout: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {g: [] for g in ARENA_GROUPS}
        for spec in specs:
            layer = params.get(spec.index, {})
            for name, array in layer.items():
                layout["value"].append((spec.index, name, array.shape))
            for name in trainables[spec.index]:
                for group in ("grad", *(("adam_m", "adam_v") if adam else ())):
                    layout[group].append((spec.index, name, layer[name].shape))
        out: dict[tuple[str, int, str], np.ndarray] = {}
        for group, entries in layout.items():
            if not entries:
                continue
            offsets, end = [], 0
            for _, _, shape in entries:
                offsets.append(end)
                nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
                end += -(-nbytes // alignment) * alignment
            block = arena(max(end, alignment))
            self.arenas[group] = block.view(self.dtype)
            for (index, name, shape), at in zip(entries, offsets, strict=True):
                size = int(np.prod(shape, dtype=np.int64))
                out[(group, index, name)] = self.arenas[group][at // itemsize:
                                                               at // itemsize + size].reshape(shape)
        return out

    def to_host(self, groups: Collection[str] = ARENA_GROUPS, *, write: bool = False) -> None:
        """Makes the arrays of ``groups`` current on the host (a device that keeps them in
        memory of its own copies them back); with ``write`` the host may then change them in
        place, and the device takes the changes at its next use. Nothing to do elsewhere."""
        if self._sync is not None and self.arenas:
            self._sync([self.arenas[g] for g in groups if g in self.arenas], write=write)

    def layer(self, index: int) -> LayerTrainState:
        return self.layers[index]

    def arrays(self) -> list[np.ndarray]:
        return [a for state in self.layers.values() for a in state.arrays()]

    @contextlib.contextmanager
    def arrays_kept(self) -> Iterator[None]:
        """Programs built inside declare their arrays (``LayerTrainState.buffer``) on the
        side: afterwards every layer's ``extra`` holds the same arrays as before."""
        saved = {i: dict(layer.extra) for i, layer in self.layers.items()}
        try:
            yield
        finally:
            for i, extra in saved.items():
                self.layers[i].extra.clear()
                self.layers[i].extra.update(extra)

    def snapshot(self, into: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Copies of every array a step may write (see ``restore``), made in the arrays of
        an earlier snapshot ``into`` where they still fit (a step then allocates nothing)."""
        self.to_host()
        arrays = self.arrays()
        if into is None or len(into) != len(arrays) or any(
                a.shape != b.shape or a.dtype != b.dtype
                for a, b in zip(arrays, into, strict=True)):
            return [a.copy() for a in arrays]
        for a, b in zip(arrays, into, strict=True):
            np.copyto(b, a)
        return into

    def restore(self, snapshot: list[np.ndarray]) -> None:
        """Puts back the arrays of a ``snapshot`` bit for bit (in place: bound steps see it)."""
        self.to_host(write=True)
        for array, saved in zip(self.arrays(), snapshot, strict=True):
            np.copyto(array, saved)

    def zero_grads(self) -> None:
        self.to_host(("grad",), write=True)
        for state in self.layers.values():
            for g in state.grads.values():
                g.fill(0)

    def write_back(self) -> None:
        """Copies trained float64 values into the network's float32 parameter arrays."""
        if self.dtype == np.float32:
            return
        for index, state in self.layers.items():
            for name, array in state.values.items():
                np.copyto(self._params[index][name], array, casting="unsafe")


class HostGuard:
    """A step's guard on the host (``backend.StepGuard``): every array the step may write
    copied before it (the copies reused from step to step), each checked after it."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self._saved: list[np.ndarray] | None = None

    def begin(self) -> None:
        self._saved = self.state.snapshot(self._saved)

    def flags(self) -> tuple[bool, bool]:
        layers = self.state.layers.values()
        return (all(all_finite(g) for layer in layers for g in layer.grads.values()),
                all(all_finite(v) for layer in layers for v in layer.values.values()))

    def restore(self) -> None:
        if self._saved is not None:
            self.state.restore(self._saved)
