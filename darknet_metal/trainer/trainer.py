"""One Darknet training iteration: mini-batches forward and backward, then the update.

``Trainer`` owns a network's training state (``TrainState``: parameters, gradient
accumulators, Adam moments, kept arrays), the bound training program of one mini-batch
(``batch // subdivisions`` images, the cfg's meaning of batch) and the bound update steps;
the network keeps only the model (parameters, ``seen``) and its executor. ``Trainer.of(net)``
is the trainer ``Network.train_step`` and the other conveniences use. An iteration (``step``)
is Darknet's ``train_network``: per mini-batch the training forward (losses and their deltas
included) and the backward, which add into the gradient accumulators; then the update with
the iteration's learning rate. Every part of an iteration runs as native steps without the
GIL; Python only splits the batch, copies the truths in and reads the costs out.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from darknet_metal.cpu import update as cpu_update
from darknet_metal.cpu.fill import copy_finite
from darknet_metal.cpu.yolo import YOLO_STAT_NAMES, check_truths
from darknet_metal.errors import ArgumentError, MemoryLimitError, NonFiniteError
from darknet_metal.model.cfg import NetConfig
from darknet_metal.model.weights import Params, WeightsHeader
from darknet_metal.ops import Op
from darknet_metal.runtime.backend import Backend, BoundProgram, StepGuard, UpdateSteps
from darknet_metal.runtime.memory import format_bytes, physical_memory, plan_memory
from darknet_metal.runtime.program import INPUT, Program, Tensor
from darknet_metal.runtime.train_state import ArrayUpdate, Optimizer, TrainState
from darknet_metal.trainer.keys import check_training_keys
from darknet_metal.trainer.schedule import learning_rate


def _one_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a trainer's call under its network's ``exclusive()``: one pass or step of a
    network at a time, whichever thread asks."""

    @functools.wraps(method)
    def exclusive(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        with self.net.exclusive():
            return method(self, *args, **kwargs)

    return exclusive


class TrainableNetwork(Protocol):
    """What training needs of a network (``darknet_metal.Network`` has it): the model (cfg,
    layers, parameters, the header's ``seen``, compute dtype, precision, input shape, the
    seed of training's random streams), its executor, one step at a time (``exclusive``),
    ``params_trained`` after an update (``params_changed`` after the host changed them)."""

    config: NetConfig
    layers: list[Op]
    params: dict[int, Params]
    header: WeightsHeader
    dtype: np.dtype
    precision: str
    training_seed: int

    @property
    def input_shape(self) -> tuple[int, int, int]: ...

    @property
    def executor(self) -> Backend: ...

    def exclusive(self) -> AbstractContextManager[None]: ...

    def params_changed(self) -> None: ...

    def params_trained(self) -> None: ...


@dataclass
class HeadReport:
    """One ``[yolo]`` layer's statistics over an iteration's mini-batches (see
    ``cpu.yolo``): Darknet V5's verbose line (avg_iou, count, class_loss, iou_loss,
    total_loss, per image of the last mini-batch) and the classic ones (avg_obj, avg_noobj,
    avg_class_prob, recall50, recall75)."""

    layer: int
    values: dict[str, float]

    def __getattr__(self, name: str) -> float:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class StepReport:
    """What one iteration did: ``loss`` (Darknet's ``train_network`` return value),
    ``learning_rate`` (the rate the update used), ``iteration`` (after the step), and
    ``heads`` (per ``[yolo]`` layer)."""

    loss: float
    learning_rate: float
    iteration: int
    heads: list[HeadReport] = field(default_factory=list)


@dataclass
class Gradients:
    """Forward and backward without an update (``Network.gradients``): ``loss``;
    ``params[layer][name]``: the gradient of every trainable array summed over the batch, in
    Darknet's sign (minus the gradient of the loss); ``deltas[layer]``: each layer's delta
    after the backward, for the last mini-batch: Darknet's ``l.delta`` after
    ``backward_network`` (the golden files' ``{type}_delta``). For most kinds that is the
    gradient of the loss with respect to the layer's output; a convolution's backward first
    multiplies it by its activation's derivative and, with batch norm, takes it back through
    the normalisation, so its entry is with respect to the raw convolution output (Darknet's
    ``conv_delta``, not the ``conv_delta_in`` its backward starts from)."""

    loss: float
    params: dict[int, Params]
    deltas: dict[int, np.ndarray]


class Trainer:
    """Trains ``net`` on its device: ``step`` (one iteration), ``accumulate`` and ``update``
    (its two halves), ``gradients`` (without changing anything), the gradient and statistic
    buffers. ``seed`` seeds training's random streams (dropout draws). Follows the network to
    other input sizes (``Network.resize``) with the same training state; when the network
    moves to another device (``Network.to``) the state is written back into ``net.params``
    and this trainer is done (``Trainer.of`` makes a new one: momentum and moments start
    again). Calls wait for other passes and steps of the same network (``net.exclusive()``).

    Raises ``ArgumentError`` for a network loaded with precision fp16, ``CfgError`` at the
    line of a cfg key training does not support, ``MemoryLimitError`` when a training pass
    would not fit."""

    @classmethod
    def of(cls, net: TrainableNetwork) -> Trainer:
        """The trainer of ``net`` that ``Network.train_step`` and the other conveniences use:
        made on first use (seeded by ``load(seed=...)``) and held by the network's executor
        for as long as it lives; after the network moved to another device, a new one.
        Trainers made with ``Trainer(net)`` are others: each lives while its caller keeps
        it."""
        with net.exclusive():
            events = net.executor.events
            for listener in events.listeners:
                if isinstance(listener, Trainer) and listener.kept:
                    return listener
            trainer = cls(net, seed=net.training_seed)
            trainer.kept = True
            events.listen(trainer, keep=True)
            return trainer

    def __init__(self, net: TrainableNetwork, *, seed: int = 0) -> None:
        if net.precision != "fp32":
            raise ArgumentError(
                f"training runs in float32; this network was loaded with precision="
                f"{net.precision!r} (load it with precision='fp32' to train)")
        values = net.config.net.values
        check_training_keys(net.config)
        self.net = net
        self.values = values
        self.batch = int(values["batch"])
        self.subdivisions = int(values["subdivisions"])
        if self.batch % self.subdivisions:
            raise ArgumentError(f"batch={self.batch} is not a multiple of "
                                f"subdivisions={self.subdivisions}")
        self.mini_batch = self.batch // self.subdivisions
        self.adam = bool(values["adam"])
        specs = net.layers
        self.specs = specs
        self.frozen = _frozen(specs)
        #: The executor the state and programs are bound to (None once it closed).
        self.executor: Backend | None = net.executor
        backend = self.executor
        # A device that shares host memory gets page-aligned arrays it uses in place; one
        # that keeps memory of its own keeps parameters, gradients and moments there.
        self.state = TrainState(specs, net.params, net.dtype, adam=self.adam,
                                frozen=self.frozen, zeros=backend.training_zeros,
                                arena=backend.training_arena,
                                alignment=backend.training_alignment,
                                sync=backend.sync_training)
        dtype = self.state.dtype
        self.heads = [s.index for s in specs if s.detection_head is not None]
        self.loss_layers = self.heads or [s.index for s in specs
                                          if s.computes_loss and not s.values.get("noloss")]
        self.truth_shape = self._truth_shape()
        for spec in specs:
            layer = self.state.layer(spec.index)
            layer.seed = (seed * 1_000_003 + spec.index) % 2**64
            if spec.index in self.loss_layers:
                layer.truth_shape = self.truth_shape
        self.first_backward = max(_first_backward(specs), len(self.frozen))
        #: Input sizes whose training pass is known to fit in memory.
        self._fitting: set[tuple[int, ...]] = set()
        self.program: BoundProgram | None = None
        self._gradient_program: BoundProgram | None = None
        self._bind()
        #: Whether this is the network's own trainer (``of``), held by its executor.
        self.kept = False
        backend.events.listen(self)
        # The learning rate and Darknet's batch number of the update, read when it runs.
        zeros = backend.training_zeros or np.zeros
        self.lr, self.t = zeros((1,), dtype), zeros((1,), dtype)
        self._updates: dict[tuple[int, tuple[int, ...]], UpdateSteps] = {}
        self._staged_x: np.ndarray | None = None
        #: Batch arrays made by ``batch_array`` (a loader's): staged in place.
        self._batch_arrays: dict[int, weakref.ref[np.ndarray]] = {}
        #: What ``step`` keeps to undo a refused step, and checks after it.
        self.guard: StepGuard = backend.step_guard(self.state)

    # -- memory ---------------------------------------------------------------------------

    def memory_bytes(self, mini_batch: int) -> int:
        """About how many bytes training needs at ``mini_batch`` images per pass: the
        planned memory of a pass (outputs, deltas, what the backward keeps, workspaces),
        the training state (parameters, accumulators, moments) and a mini-batch of input."""
        program = self._executor_in_use().build_training_program(self.state, mini_batch,
                                                 first_backward=self.first_backward)
        return self._bytes(program, mini_batch)

    def _bytes(self, program: Program, mini_batch: int) -> int:
        planned = sum(plan_memory(program, external={INPUT}).slot_bytes)
        # A device's step guard keeps a copy of every arena.
        state = sum(a.nbytes for a in self.state.arrays()) + sum(
            a.nbytes for a in self.state.arenas.values())
        c, h, w = self.net.input_shape
        return planned + state + mini_batch * c * h * w * self.state.dtype.itemsize

    def _check_memory(self, program: Program) -> None:
        """MemoryLimitError unless a pass of ``program`` (one mini-batch at the network's
        size) fits in this machine's memory; the advice names subdivisions that would."""
        available = physical_memory()
        size = self.net.input_shape
        if available is None or size in self._fitting:
            return
        need = self._bytes(program, self.mini_batch)
        if need <= available:
            self._fitting.add(size)
            return
        # Two more programs for the per-image cost; they must not replace the arrays the
        # kept programs were built with.
        with self.state.arrays_kept():
            one, two = self.memory_bytes(1), self.memory_bytes(2)
        per_image = two - one

        def needed(m: int) -> int:
            return one + per_image * (m - 1)

        fits = [s for s in range(self.subdivisions, self.batch + 1)
                if self.batch % s == 0 and needed(self.batch // s) <= available]
        advice = (f"subdivisions={fits[0]} ({self.batch // fits[0]} images per pass) would "
                  "fit" if fits else "even one image per pass does not fit: lower width and "
                  "height")
        raise MemoryLimitError(
            f"{self.net.config.path}: a training pass of {self.mini_batch} images "
            f"(batch={self.batch}, subdivisions={self.subdivisions}) at {size[2]}x{size[1]} "
            f"needs about {format_bytes(need)}, more than this machine's "
            f"{format_bytes(available)}; {advice}", needed=need, available=available)

    # -- programs -------------------------------------------------------------------------

    def _bind(self) -> None:
        """Builds (or takes the kept) training program for the network's current size,
        checks that it fits, frees the programs bound so far and binds it."""
        c, h, w = self.net.input_shape
        for layer in self.state.layers.values():
            layer.net_size = (w, h)
        program = self._executor_in_use().build_training_program(self.state, self.mini_batch,
                                                      first_backward=self.first_backward)
        self._check_memory(program)
        self.release()
        self.program = self._executor_in_use().training_program(self.state, self.mini_batch,
                                                     first_backward=self.first_backward)
        # What the passes stage through, made once per shape (a rolled-back step restores
        # them too).
        for index in self.loss_layers:
            layer = self.state.layer(index)
            layer.buffer("truth_batch", (self.batch, *layer.truth_shape))
            cost = self._cost_array(index)
            layer.buffer("cost_batch", (self.subdivisions, *cost.shape), cost.dtype)

    def _executor_in_use(self) -> Backend:
        if self.executor is None:
            raise ArgumentError("this trainer's network moved to another device; make a new "
                                "Trainer (Trainer.of(net))")
        return self.executor

    def executor_resized(self) -> None:
        """Follows the network to its new input size (``Network.resize``, after its
        executor's): the training state is kept; the program of the new size is built, or
        taken from those of the sizes seen before, and bound to memory the old one frees."""
        self.specs = self.net.layers
        self._bind()

    def executor_closing(self) -> None:
        """The network leaves its device (``Network.to``): the state goes back into
        ``net.params`` and the device memory is let go; this trainer is done."""
        self.state.write_back()
        self.release()
        self._updates = {}
        self.executor = None

    def release(self) -> None:
        """Frees the memory of the bound programs (the device's returns to its pool)."""
        for loaded in (self.program, self._gradient_program):
            if loaded is not None:
                loaded.release()
        self.program = self._gradient_program = None

    # -- truths ---------------------------------------------------------------------------

    def _truth_shape(self) -> tuple[int, ...]:
        """A truth per image: (boxes, 5) rows for detectors, every head reading the same
        truths; (classes,) targets for classifiers."""
        if self.heads:
            return max(self.specs[i].values["max"] for i in self.heads), 5
        return (self.specs[self.loss_layers[0]].out_size if self.loss_layers else 0,)

    def check_batch(self, x: np.ndarray, truths: Any, share: bool = False
                    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """``x`` as a C-contiguous (batch, C, H, W) array of the compute dtype, and the truths
        as one array per image; raises ``ArgumentError`` naming the image and row at fault.
        ``share``: ``x`` may be a share of the batch (whole mini-batches, up to ``batch``)."""
        c, h, w = self.net.input_shape
        if not isinstance(x, np.ndarray):
            raise ArgumentError(f"x must be a numpy array, not {type(x).__name__}")
        rows = x.shape[0] if x.ndim == 4 else -1
        a_share = (share and tuple(x.shape[1:]) == (c, h, w) and 0 < rows <= self.batch
                   and rows % self.mini_batch == 0)
        if not a_share and x.shape != (self.batch, c, h, w):
            share_rule = (f", or a share of whole mini-batches of {self.mini_batch}"
                          if share else "")
            raise ArgumentError(f"x must have shape {(self.batch, c, h, w)} (batch={self.batch} "
                                f"images at the network's size{share_rule}), not {x.shape}")
        if x.dtype != self.state.dtype or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, self.state.dtype)
        if isinstance(truths, np.ndarray) and truths.ndim >= 1 and not self.heads:
            truths = list(truths)
        if not isinstance(truths, Sequence) or len(truths) != x.shape[0]:
            raise ArgumentError(f"truths must be a sequence of {x.shape[0]} arrays (one per "
                                "image)")
        if not self.heads:
            return x, [self._class_row(i, np.asarray(t, dtype=np.float64))
                       for i, t in enumerate(truths)]
        out = []
        for i, t in enumerate(truths):
            a = np.asarray(t, dtype=np.float64)
            a = a.reshape(-1, 5) if a.size else np.zeros((0, 5))
            if a.shape[0] > self.truth_shape[0]:
                raise ArgumentError(f"truths[{i}] has {a.shape[0]} boxes, more than the "
                                    f"[yolo] max={self.truth_shape[0]}")
            out.append(a)
        # Every box of the batch checked at once; the first image at fault, if any, again
        # on its own for its message.
        boxes = np.concatenate(out) if out else np.zeros((0, 5))
        classes = self.specs[self.heads[0]].values["classes"]
        with np.errstate(invalid="ignore"):
            wrong = (~(np.abs(boxes) <= np.finfo(self.state.dtype).max).all(axis=1)
                     | (boxes[:, 3] <= 0) | (boxes[:, 4] <= 0)
                     | (boxes[:, 0] < 0) | (boxes[:, 0] >= classes)
                     | (boxes[:, 0] != np.floor(boxes[:, 0]))
                     | (boxes[:, 1:3] < 0).any(axis=1) | (boxes[:, 1:3] > 1).any(axis=1))
        if wrong.any():
            first = int(np.searchsorted(np.cumsum([a.shape[0] for a in out]),
                                        int(np.argmax(wrong)), side="right"))
            self._check_image_truths(first, out[first], classes)
        return x, out

    def _check_image_truths(self, i: int, a: np.ndarray, classes: int) -> None:
        """ArgumentError naming image ``i``'s first bad row (class, centre, size)."""
        try:
            check_truths(a[None].astype(self.state.dtype), classes, self.truth_shape[0])
        except ArgumentError as e:
            raise ArgumentError(f"truths[{i}]: {e}") from None
        if a.shape[0] and (a[:, 3:5] <= 0).any():
            row = int(np.argmax((a[:, 3:5] <= 0).any(axis=1)))
            raise ArgumentError(f"truths[{i}] row {row}: width and height must be > 0")

    def _class_row(self, i: int, a: np.ndarray) -> np.ndarray:
        classes = self.truth_shape[0]
        if a.ndim == 0:
            k = float(a)
            if not (k.is_integer() and 0 <= k < classes):
                raise ArgumentError(f"truths[{i}]: class id {a} is not in [0, {classes})")
            row = np.zeros(classes)
            row[int(k)] = 1
            return row
        if a.shape != (classes,) or not np.isfinite(a).all():
            raise ArgumentError(f"truths[{i}] must be a class id or {classes} finite targets")
        return a

    # -- passes ---------------------------------------------------------------------------

    def _cost_array(self, index: int) -> np.ndarray:
        """The array a loss layer's pass leaves its cost in (``_cost`` reads it)."""
        extra = self.state.layer(index).extra
        for name in ("stats", "loss", "errors"):
            if name in extra:
                return extra[name]
        raise ArgumentError(f"layer {index} has no cost array")

    @staticmethod
    def _cost(array: np.ndarray) -> float:
        # [yolo]: the statistics, cost first; [softmax]/[cost]: the per-element losses.
        if array.ndim == 1:
            return float(array[0])
        return float(array.sum(dtype=np.float64))

    def batch_array(self, shape: tuple[int, ...],
                    memory: np.ndarray | None = None) -> np.ndarray:
        """A zeroed array for a batch of ``shape`` that ``step`` stages in place: a device
        reads it where it is (on ``cuda``, from page-locked memory), no copy is made. A
        loader's workers write their batches into such arrays (``Loader(allocate=...)``):
        images scaled to [0, 1], so ``step`` takes them as finite without reading them
        again (fill one yourself and a NaN is yours to keep out). ``memory``: a float32,
        C-contiguous array of ``shape`` starting at ``training_alignment`` (a page on a
        GPU) to use instead of new memory (shared memory that loader processes write
        into); it is returned as is."""
        executor = self._executor_in_use()
        if memory is None:
            array = (executor.training_zeros or np.zeros)(tuple(shape), self.state.dtype)
        else:
            if (not isinstance(memory, np.ndarray) or memory.shape != tuple(shape)
                    or memory.dtype != self.state.dtype or not memory.flags.c_contiguous
                    or not memory.flags.writeable):
                raise ArgumentError(
                    f"memory must be a writable C-contiguous {self.state.dtype} array of shape "
                    f"{tuple(shape)}, not {getattr(memory, 'dtype', type(memory).__name__)} "
                    f"{getattr(memory, 'shape', '')}")
            alignment = executor.training_alignment
            if memory.ctypes.data % alignment:
                raise ArgumentError(f"memory must start on a multiple of {alignment} bytes "
                                    "(a page on a GPU: the device reads it in place)")
            array = memory
        self._batch_arrays = {key: ref for key, ref in self._batch_arrays.items()
                              if ref() is not None}
        self._batch_arrays[id(array)] = weakref.ref(array)
        return array

    def _stage(self, x: np.ndarray, truths: list[np.ndarray]) -> _Staged:
        """The batch where the device reads it (``x`` itself when ``batch_array`` made it,
        else a copy), checked finite in the same read, and the truths in their staging
        arrays; nothing of the training state changes (a refused batch leaves no trace)."""
        made = self._batch_arrays.get(id(x))
        if made is not None and made() is x:
            # A loader's batch: images scaled to [0, 1], finite by construction.
            staged, finite = x, True
        else:
            executor = self._executor_in_use()
            if self._staged_x is None or self._staged_x.shape != x.shape:
                zeros = executor.training_zeros or np.zeros
                self._staged_x = zeros(x.shape, x.dtype)
            staged = self._staged_x
            if executor.stage_batch is not None and x.dtype == np.float32:
                finite = executor.stage_batch(x, staged)
            else:
                finite = _finite_copy(x, staged)
        if not finite:
            raise ArgumentError("x holds NaN or infinite values")
        m = self.mini_batch
        stage_in, stage_out, costs = [], [], []
        for index in self.loss_layers:
            layer = self.state.layer(index)
            truth = layer.extra["truth_batch"]
            truth.fill(0)
            for j, t in enumerate(truths):
                if self.heads:
                    truth[j, : t.shape[0]] = t
                else:
                    truth[j] = t
            stage_in.append((truth, layer.truth(m)))
            stage_out.append((self._cost_array(index), layer.extra["cost_batch"]))
            costs.append(layer.extra["cost_batch"])
        return _Staged(staged, stage_in, stage_out, costs)

    def _passes(self, x: np.ndarray, truths: list[np.ndarray], loaded: BoundProgram,
                stats: dict[int, list[np.ndarray]] | None = None) -> float:
        """``_stage`` then ``_run``, without an update."""
        self._executor_in_use().phases.mark("prepare")
        return self._run(self._stage(x, truths), loaded, stats)

    def _run(self, staged: _Staged, loaded: BoundProgram,
             stats: dict[int, list[np.ndarray]] | None = None, then: UpdateSteps | None = None,
             guard: StepGuard | None = None) -> float:
        """Every mini-batch of a staged batch through ``loaded``, then ``then`` (update
        steps), with ``guard``'s device part, as one submission; each pass's cost staged out.
        Returns the loss (Darknet's mean over the loss layers, per image)."""
        m = self.mini_batch
        passes = staged.x.shape[0] // m
        executor = self._executor_in_use()
        loaded.run_passes(staged.x, staged.stage_in, staged.stage_out, then, guard)
        executor.phases.mark("read back")
        costs = staged.costs
        total = 0.0
        for sub in range(passes):
            if costs:
                total += float(np.mean([self._cost(c[sub]) for c in costs]))
            if stats is not None:
                for index, c in zip(self.loss_layers, costs, strict=True):
                    if index in self.heads:
                        stats.setdefault(index, []).append(c[sub].astype(np.float64))
        return total / (passes * m)

    def gradient_buffers(self) -> dict[int, Params]:
        """The gradient accumulators (Darknet's ``*_updates``), per layer and parameter name:
        the arrays ``accumulate`` adds into and ``update`` reads, writable in place (to sum
        them across processes): current on the host, and what the host writes reaches the
        device before its next step."""
        self.state.to_host(("grad",), write=True)
        return {i: layer.grads for i, layer in self.state.layers.items() if layer.grads}

    def gradient_block(self) -> np.ndarray | None:
        """Every gradient accumulator as one contiguous float array (with zeros between the
        arrays), where the device keeps them so (``metal``, ``emu``, ``cuda``): current on
        the host and writable in place as ``gradient_buffers``; None on the CPU, whose
        accumulators are separate arrays."""
        block = self.state.arenas.get("grad")
        if block is None:
            return None
        self.state.to_host(("grad",), write=True)
        return block

    def statistic_buffers(self) -> dict[int, Params]:
        """The running statistics training updates (batch norm's ``rolling_mean`` and
        ``rolling_variance``), per layer and name: the arrays the passes write, writable in
        place (to average them across processes; call ``net.params_changed()`` after)."""
        self.state.to_host(("value",), write=True)
        found: dict[int, Params] = {}
        for spec in self.specs:
            values = self.state.layer(spec.index).values
            kept = {name: values[name] for name in spec.statistics if name in values}
            if kept:
                found[spec.index] = kept
        return found

    @_one_at_a_time
    def accumulate(self, x: np.ndarray, truths: Any) -> float:
        """Forward and backward over the mini-batches of ``x`` (the batch, or a share of whole
        mini-batches), adding into the gradient accumulators; advances ``seen`` by the
        images given. Returns the loss."""
        x, truths = self.check_batch(x, truths, share=True)
        loss = self._passes(x, truths, self.program)
        self.net.header.seen += x.shape[0]
        return loss

    def _held(self, iteration: int) -> tuple[int, ...]:
        """Layers whose update waits at ``iteration`` (Darknet's CUDA update rules):
        ``dont_update=N`` for iterations 1..N, ``burnin_update=k`` while ``k*burn_in`` is
        above the iteration."""
        burn_in = int(self.values["burn_in"])
        return tuple(s.index for s in self.specs if self.state.layer(s.index).grads and (
            int(s.values.get("dont_update", 0)) >= iteration
            or int(s.values.get("burnin_update", 0)) * burn_in > iteration))

    def _update_steps(self, images: int, held: tuple[int, ...],
                      clear: bool = False) -> UpdateSteps:
        steps = self._updates.get((images, held, clear))
        if steps is None:
            updates = [ArrayUpdate(
                spec.index, name, spec.index in held,
                float(spec.values.get("learning_rate", 1.0)) if spec.learning_rate_scaled
                else 1.0, clear)
                for spec in self.specs for name in self.state.layer(spec.index).grads]
            steps = self._executor_in_use().update_program(
                self.state, updates, Optimizer.of(self.values, images), self.lr, self.t)
            self._updates[(images, held, clear)] = steps
        return steps

    @_one_at_a_time
    def update(self, images: int | None = None) -> float:
        """Darknet's update for a gradient summed over ``images`` images (default: batch):
        the iteration advances by one and the update uses its learning rate, returned."""
        images = self.batch if images is None else int(images)
        if images < 1:
            raise ArgumentError(f"images must be >= 1, not {images}")
        iteration = self.net.header.seen // self.batch
        rate = self._set_rate(iteration)
        self._update_steps(images, self._held(iteration)).run()
        self.state.write_back()
        self.net.params_trained()
        return rate

    def _set_rate(self, iteration: int) -> float:
        """The learning rate of the update making ``iteration``, and Darknet's batch number,
        into the arrays the update steps read."""
        rate = learning_rate(self.values, iteration)
        self.lr[0] = rate
        self.t[0] = iteration
        return rate

    @_one_at_a_time
    def step(self, x: np.ndarray, truths: Any,
             reduce: Callable[[float], tuple[int, float]] | None = None, *,
             carry_momentum: bool = True) -> StepReport:
        """One Darknet training iteration on ``x`` (batch, C, H, W) float32 at the network's
        size, batch = the cfg's ``batch`` (split into ``subdivisions`` mini-batches).

        ``reduce``, to train one network across processes (``training.distributed``'s
        ``Collective.step`` uses it): ``x`` is then this process's share of the batch (whole
        mini-batches); ``reduce(loss)`` is called after its passes, sums the accumulators
        (``gradient_buffers()``) over the processes in place and returns ``(images, mean
        loss)``: the update divides by the images of every process and ``seen`` advances by
        them. (The accumulators carry SGD's momentum term from the last update: it must be
        in one process's accumulators only, as ``Collective.step`` arranges:
        ``carry_momentum=False`` zeroes them after the update, with the update on the device,
        on the other processes.)

        ``truths``: per image a (k, 5) array of boxes (class, cx, cy, w, h), normalised to
        [0, 1] (k may be 0), for networks with ``[yolo]`` heads; for networks ending in
        ``[softmax]``/``[cost]``, per image a class id or a row of ``classes`` targets.
        Returns the ``StepReport``. Raises ``ArgumentError`` naming the image and row of a bad
        truth, ``CfgError`` at the line of a cfg key training does not support,
        ``NonFiniteError`` (nothing changed) when the step produces NaN or infinity.
        """
        phases = self._executor_in_use().phases
        phases.mark("prepare")
        x, truths = self.check_batch(x, truths, share=reduce is not None)
        staged = self._stage(x, truths)
        guard = self.guard
        phases.mark("guard")
        guard.begin()
        seen = self.net.header.seen
        try:
            stats: dict[int, list[np.ndarray]] = {}
            iteration = seen // self.batch + 1
            phases.mark("update")
            rate = self._set_rate(iteration)
            if reduce is None:
                # The passes, the update and the guard's copies and checks in one submission
                # (one wait on a device); restored if anything is not finite.
                update = self._update_steps(self.batch, self._held(iteration))
                loss = self._run(staged, self.program, stats, then=update, guard=guard)
                self.net.header.seen += self.batch
            else:
                loss = self._run(staged, self.program, stats, guard=guard)
                phases.mark("all-reduce")
                images, loss = reduce(loss)
                phases.mark("update")
                self._update_steps(images, self._held(iteration),
                                   clear=not carry_momentum).run(guard)
                self.net.header.seen += images
            phases.mark("guard")
            gradients_finite, parameters_finite = guard.flags()
            fault = (f"the loss is {loss}" if not np.isfinite(loss) else None
                     if gradients_finite else self._non_finite_array("gradients"))
            if fault is not None:
                # Where it went wrong is found from the state the step started from.
                guard.restore()
                self.net.header.seen = seen
                raise self._located(fault, x, truths)
            if not parameters_finite:
                found = self._non_finite_array("parameters")
                layer, message = found if found is not None else (
                    None, "NaN or infinity in the updated parameters")
                raise NonFiniteError(f"{message}; the step was undone", layer=layer)
        except BaseException:
            phases.stop()
            guard.restore()
            self.net.header.seen = seen
            raise
        phases.mark("update")
        self.state.write_back()
        self.net.params_trained()
        report = StepReport(loss, rate, self.net.header.seen // self.batch,
                            [HeadReport(i, _head_stats(stats[i])) for i in self.heads])
        phases.stop()
        return report

    def _non_finite_array(self, what: str) -> tuple[int, str] | None:
        """(layer, what is wrong) of the first layer with a NaN or infinity in its
        ``what`` ("gradients" or "parameters"), or None."""
        self.state.to_host(("grad",) if what == "gradients" else ("value",))
        for spec in self.specs:
            layer = self.state.layer(spec.index)
            arrays = layer.grads if what == "gradients" else layer.values
            for name, a in arrays.items():
                if not cpu_update.all_finite(a):
                    return spec.index, (f"layer {spec.index} ({spec.kind}): NaN or infinity "
                                        f"in its {name} "
                                        f"{'gradient' if what == 'gradients' else 'values'}")
        return None

    def _kept_program(self) -> BoundProgram:
        """The training program whose every output and delta stays readable after a run."""
        if self._gradient_program is None:
            self._gradient_program = self._executor_in_use().training_program(
                self.state, self.mini_batch, first_backward=self.first_backward,
                keep_all=True)
        return self._gradient_program

    def _located(self, fault: str | tuple[int, str], x: np.ndarray,
                 truths: list[np.ndarray]) -> NonFiniteError:
        """The error for a step whose loss or gradients are not finite (``fault``: the loss
        message, or (layer, message) of the first gradient), naming where it went wrong:
        the mini-batches run again (changing nothing) until one has a layer whose output is
        not finite (the first in the forward), or else whose delta is not (the first the
        backward reached)."""
        message, layer = (fault, None) if isinstance(fault, str) else (fault[1], fault[0])
        loaded = self._kept_program()
        m = self.mini_batch
        saved = self.state.snapshot()
        try:
            for start in range(0, x.shape[0], m):
                self.state.zero_grads()
                self._passes(x[start:start + m], truths[start:start + m], loaded)
                found = self._first_non_finite(loaded)
                if found is not None:
                    spec, what = found
                    return NonFiniteError(
                        f"{message}: layer {spec.index} ({spec.kind}) is the first whose "
                        f"{what} is not finite (images {start} to {start + m - 1} of the "
                        "batch); the step was undone", layer=spec.index)
        finally:
            self.state.restore(saved)
        return NonFiniteError(f"{message}; the step was undone", layer=layer)

    def _first_non_finite(self, loaded: BoundProgram) -> tuple[Op, str] | None:
        """The first layer of the last run whose output is not finite, in forward order, or
        else the first whose delta is not, in the order the backward ran (last layer
        first)."""
        tensors = loaded.program.tensors
        for spec in self.specs:
            out = Tensor(spec.index, "output")
            if out in tensors and not np.isfinite(loaded.read(out)).all():
                return spec, "output"
        for spec in reversed(self.specs):
            delta = Tensor(spec.index, "delta")
            if delta in tensors and not np.isfinite(loaded.read(delta)).all():
                return spec, "delta"
        return None

    @_one_at_a_time
    def gradients(self, x: np.ndarray, truths: Any) -> Gradients:
        """Forward and backward without the update, changing nothing."""
        x, truths = self.check_batch(x, truths)
        loaded = self._kept_program()
        saved = self.state.snapshot()
        try:
            self.state.zero_grads()
            loss = self._passes(x, truths, loaded)
            self.state.to_host(("grad",))
            params = {i: {n: g.copy() for n, g in layer.grads.items()}
                      for i, layer in self.state.layers.items() if layer.grads}
            deltas = {}
            for spec in self.specs:
                t = Tensor(spec.index, "delta")
                if t in loaded.program.tensors:
                    deltas[spec.index] = loaded.read(t)
        finally:
            self.state.restore(saved)
        return Gradients(loss, params, deltas)


def _first_backward(specs: Sequence) -> int:
    """Darknet's ``stopbackward``: its backward loop stops at the last layer that sets it,
    before running that layer's backward."""
    first = 0
    for spec in specs:
        if spec.values.get("stopbackward"):
            first = spec.index + 1
    return first


def _frozen(specs: Sequence) -> range:
    """Darknet's ``train_only_bn``: the last layer that sets it and every layer before it
    keep their parameters (only batch norm's rolling statistics change, in the forward)."""
    last = max((s.index for s in specs if s.values.get("train_only_bn")), default=-1)
    return range(last + 1)


def _head_stats(per_pass: list[np.ndarray]) -> dict[str, float]:
    last = per_pass[-1]
    return {name: float(last[k]) for k, name in enumerate(YOLO_STAT_NAMES)}


@dataclass
class _Staged:
    """A batch staged for the passes: ``x`` where the device reads it, the truths' staging
    pairs (whole batch -> per pass), the costs' (per pass -> whole batch), the cost arrays."""

    x: np.ndarray
    stage_in: list[tuple[np.ndarray, np.ndarray]]
    stage_out: list[tuple[np.ndarray, np.ndarray]]
    costs: list[np.ndarray]


def _finite_copy(x: np.ndarray, into: np.ndarray | None) -> bool:
    """Copies ``x`` into ``into`` (None: none) and says whether ``x`` is finite, reading it
    once (float32: split across the CPU threads)."""
    if x.dtype == np.float32:
        return copy_finite(x, into)
    if into is not None:
        np.copyto(into, x)
    return bool(np.isfinite(x).all())
