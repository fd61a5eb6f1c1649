"""The GPU executor's training: training programs of kernels over the shared training state
(with CPU steps for layers whose ops have no kernels), and the update kernels.

``GpuTraining`` is the part of ``GpuBackend`` that serves a ``Trainer``; it works on the
executor's device, layers, resident parameters and kept training programs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from darknet_metal.errors import ArgumentError, DeviceError, Unsupported
from darknet_metal.metal import aligned_empty
from darknet_metal.runtime.gpu_program import DeviceSteps, GpuBoundProgram, Item, item
from darknet_metal.runtime.layer import Layer
from darknet_metal.runtime.placement import LayerPlacement
from darknet_metal.runtime.program import LayerEmitter, Param, Program, Tensor, build_program
from darknet_metal.runtime.program_cache import TrainingPrograms
from darknet_metal.runtime.staging import stage_in_parts
from darknet_metal.runtime.train_state import ArrayUpdate, Optimizer, TrainState

__all__ = ["GpuTraining"]


class GpuTraining:
    """Training programs and update steps of a GPU executor (mixed into ``GpuBackend``)."""

    device: Any
    specs: list[Layer]
    simd: bool
    storage: str
    _params: dict[Param, Any]
    _training_programs: TrainingPrograms[tuple[Program, dict[int, str]]]
    _training_state: TrainState | None
    _training_fallback: dict[int, str] | None
    #: The training arenas and their resident wraps (``training_arena``).
    _arenas: list[tuple[np.ndarray, Any]]
    #: The array ``stage_batch`` last staged into and its resident wrap, or None.
    _staged_batch: tuple[np.ndarray, Any] | None
    #: Step guards by training state (``step_guard``).
    _guards: dict[int, DeviceGuard]

    #: The device buffer of a resident parameter or training array (``GpuBackend``'s).
    param_buffer: Callable[[Param], Any]

    def training_zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zeroed page-aligned host array the device uses in place (the training state's
        allocator of kept arrays: truths, statistics, counters)."""
        a = aligned_empty(shape, dtype, int(self.device.info["page_size"]))
        a.fill(0)
        return a

    def stage_batch(self, x: np.ndarray, into: np.ndarray) -> bool:
        """Copies a float32 batch ``x`` into ``into`` (a ``training_zeros`` array of its
        shape that the step's list reads), checking it finite in the same read: where the
        device has memory of its own, part by part, each part going up while the host copies
        the next (``stage_in_parts``; ``into`` is wrapped resident on first use). Whether
        ``x`` is finite."""
        held = self._staged_batch
        if held is None or held[0] is not into:
            buf = self.device.upload(into, zero_copy=True)
            if not buf.wrapped:
                buf.release()
                raise DeviceError("a staged batch is not page-aligned")
            buf.set_resident()
            if held is not None:
                held[1].release()
            held = self._staged_batch = (into, buf)
        return stage_in_parts(x, into, held[1])

    @property
    def training_alignment(self) -> int:
        """Where each array of a training arena starts: a page (the device wraps each)."""
        return int(self.device.info["page_size"])

    def training_arena(self, nbytes: int) -> np.ndarray:
        """A zeroed page-aligned block of ``nbytes`` bytes (whole pages) for a group of the
        training state (parameters, gradients, moments), which the device keeps in memory
        of its own between steps where it has any (``cuda``): the host sees it current
        after ``sync_training``. Wrapped once; the arrays in it are wraps sharing it."""
        page = self.training_alignment
        block = aligned_empty((-(-nbytes // page) * page,), np.uint8, page)
        block.fill(0)
        buf = self.device.upload(block, zero_copy=True)
        buf.set_resident()
        self._arenas.append((block, buf))
        return block

    def sync_training(self, arenas: Sequence[np.ndarray] | None = None, *,
                      write: bool = False) -> None:
        """Makes training arenas (``arenas``, views of blocks from ``training_arena``; None:
        every one) current on the host; with ``write`` the host may change them, and the
        device takes the changes at its next use."""
        for block, buf in self._arenas:
            if arenas is None or any(np.may_share_memory(block, a) for a in arenas):
                buf.sync(write=write)

    def _training_placement(self, state: TrainState, batch: int,
                            first_backward: int) -> dict[int, str]:
        """Layers whose training runs on their CPU steps, with the reason: an op raising
        ``Unsupported`` for its training forward or backward kernels. Found by building
        throwaway programs until no new layer falls back (a backward found unsupported
        moves its forward to the CPU too)."""
        fallback: dict[int, str] = {}
        while True:
            found = dict(fallback)

            def attempt(spec: Layer, e: LayerEmitter, device: Callable[..., None],
                        cpu: Callable[..., None], found: dict[int, str] = found) -> None:
                ts = state.layer(spec.index)
                if spec.index not in found:
                    try:
                        device(e, ts)
                        return
                    except Unsupported as exc:
                        found[spec.index] = str(exc)
                cpu(e, ts)

            build_program(
                self.specs, lambda spec, e: attempt(spec, e, spec.emit_device_train,
                                                    spec.emit_cpu_train),
                batch=batch, keep=(), mode="train", simd=self.simd, param_nbytes=None,
                emit_backward=lambda spec, e: None if spec.values.get("onlyforward")
                else attempt(spec, e, spec.emit_device_backward, spec.emit_cpu_backward),
                clear=_clear_on_device, first_backward=first_backward)
            if found == fallback:
                return fallback
            fallback = found

    def build_training_program(self, state: TrainState, batch: int, *, first_backward: int = 0,
                               keep_all: bool = False) -> Program:
        """The program of one mini-batch of a training iteration (see
        ``cpu_training_program``): each layer's training kernels, binding the training
        state's arrays in place (``LayerTrainState.ref``), or, where its op has none, its
        CPU training steps as host steps inside the device program (each a commit, a wait
        and the transfers of what it reads and writes). Kept per input size
        (``TrainingPrograms``): a size seen before costs nothing to build again."""
        if self.storage != "f32":
            raise DeviceError("training runs in float32; this backend holds half "
                              "(precision='fp16')")
        key = (self.specs[0].in_shape, batch, first_backward, keep_all)
        program, fallback = self._training_programs.get(
            state, key, lambda: self._build_training(state, batch, first_backward, keep_all))
        self._training_state = state
        self._training_fallback = fallback
        return program

    def _build_training(self, state: TrainState, batch: int, first_backward: int,
                        keep_all: bool) -> tuple[Program, dict[int, str]]:
        fallback = self._training_placement(state, batch, first_backward)

        def emit(spec: Layer, e: LayerEmitter, backward: bool) -> None:
            ts = state.layer(spec.index)
            if spec.index in fallback:
                (spec.emit_cpu_backward if backward else spec.emit_cpu_train)(e, ts)
            else:
                (spec.emit_device_backward if backward else spec.emit_device_train)(e, ts)

        program = build_program(
            self.specs, lambda spec, e: emit(spec, e, False), batch=batch,
            keep=None if keep_all else (),
            mode="train", simd=self.simd, param_nbytes=_ParamSizes(self._params, state),
            emit_backward=lambda spec, e: None if spec.values.get("onlyforward")
            else emit(spec, e, True),
            clear=_clear_on_device, first_backward=first_backward, keep_deltas=keep_all)
        return program, fallback

    def training_program(self, state: TrainState, batch: int, *, first_backward: int = 0,
                         keep_all: bool = False) -> GpuBoundProgram:
        """``build_training_program`` bound to device memory (``run(x)`` a mini-batch,
        ``read(tensor)`` a kept delta; ``release()`` returns its memory to the pool)."""
        return GpuBoundProgram(self, self.build_training_program(
            state, batch, first_backward=first_backward, keep_all=keep_all))

    def update_program(self, state: TrainState, updates: Sequence[ArrayUpdate],
                       optimizer: Optimizer, lr: np.ndarray, t: np.ndarray) -> DeviceSteps:
        """One update of ``state`` as kernels on its shared arrays (``lr``, ``t``: (1,)
        page-aligned arrays read when it runs), in one command buffer."""
        o = optimizer
        scalars = {"lr": lr, "t": t}
        steps = DeviceSteps(self.device, {name: self.device.upload(a, zero_copy=True)
                                          for name, a in scalars.items()})
        try:
            for u in updates:
                layer = state.layer(u.layer)
                n = int(layer.values[u.name].size)
                refs = {"param": layer.ref(u.name), "grad_acc": layer.ref(u.name, "grad")}
                if u.held:
                    steps.add(self, "fill_buf_f32", {"x": refs["grad_acc"]}, n=n, value=0.0)
                elif o.adam:
                    steps.add(self, "adam_upd_f32", {
                        **refs, "m": layer.ref(u.name, "adam_m"),
                        "v": layer.ref(u.name, "adam_v")},
                        n=n, batch=o.images, decay=o.decay, b1=o.b1, b2=o.b2, eps=o.eps,
                        lr_scale=1.0)
                else:
                    steps.add(self, "sgd_upd_f32", refs, n=n, batch=o.images,
                              apply_decay=int(u.name == "weights"), decay=o.decay,
                              momentum=o.momentum, lr_scale=u.lr_scale)
                if u.clear and not u.held:
                    steps.add(self, "fill_buf_f32", {"x": refs["grad_acc"]}, n=n, value=0.0)
        except BaseException:
            steps.release()
            raise
        return steps

    def arena_buffer(self, arena: np.ndarray) -> Any:
        """The resident wrap of a training arena (``training_arena``'s block, or a view of
        all of it)."""
        address = arena.__array_interface__["data"][0]
        for block, buf in self._arenas:
            if block.__array_interface__["data"][0] == address:
                return buf
        raise ArgumentError("not a training arena of this device")

    def step_guard(self, state: TrainState) -> DeviceGuard:
        """The guard of a step over ``state`` (``DeviceGuard``), made once per state."""
        guard = self._guards.get(id(state))
        if guard is None or guard.state is not state:
            if guard is not None:
                guard.release()
            guard = self._guards[id(state)] = DeviceGuard(self, state)
        return guard

    def training_coverage(self) -> list[LayerPlacement]:
        """Per layer, where its training steps run (after a training program was built):
        "kernels", or "fallback" with the reason."""
        fallback = self._training_fallback
        if fallback is None:
            raise ArgumentError("no training program has been built yet")
        return [LayerPlacement(spec.index, spec.kind, "fallback", reason=fallback[spec.index])
                if spec.index in fallback else
                LayerPlacement(spec.index, spec.kind, "kernels")
                for spec in self.specs]


def _clear_on_device(e: LayerEmitter, t: Tensor) -> None:
    n = int(np.prod(e.shape(t)))
    e.kernel("fill_buf_f32", {"x": t}, {"n": n}, n=n, value=0.0)


class _ParamSizes(Mapping[Param, int]):
    """Bytes of each array a training program may bind: the inference parameters' buffers
    and the training state's arrays (looked up when bound: kept arrays appear as the ops
    declare them)."""

    def __init__(self, buffers: Mapping[Param, Any], state: TrainState) -> None:
        self.buffers = buffers
        self.state = state

    def __getitem__(self, ref: Param) -> int:
        if not ref.group:
            return int(self.buffers[ref].nbytes)
        return int(self.state.layer(ref.layer).group(ref.group)[ref.name].nbytes)

    def __contains__(self, ref: object) -> bool:
        try:
            self[ref]  # type: ignore[index]
        except (KeyError, AttributeError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[Param]:
        return iter(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)


class DeviceGuard:
    """A step's guard on a device (``backend.StepGuard``), most of it in the step's own
    command buffer: before the passes every training arena (parameters, gradients,
    moments) is copied aside in device memory and two flags are set; after the passes the
    gradients are checked for NaN and infinity (clearing flag 0), after the update the
    parameters (flag 1). The host keeps copies of the small kept arrays only (truths,
    statistics, counters: the device shares them), and reads the two flags (shared too)."""

    def __init__(self, backend: GpuTraining, state: TrainState) -> None:
        device = backend.device
        self.state = state
        self.device = device
        # Shared with the host like the costs: read after the step's wait, no copy asked.
        self.flags_array = backend.training_zeros((2,), np.dtype(np.float32))
        self.flag = device.upload(self.flags_array, zero_copy=True)
        self.saved: list[Any] = []
        self.before: list[Item] = [item("fill_buf_f32", {"x": self.flag},
                                        {"n": 2, "value": 1.0}, {"n": 2})]
        self.after_passes: list[Item] = []
        self.after_update: list[Item] = []
        self._restore: list[Item] = []
        self._extras: list[np.ndarray] | None = None
        self.kept = False
        try:
            for group, arena in state.arenas.items():
                buf = backend.arena_buffer(arena)
                saved = device.buffer(arena.nbytes)
                self.saved.append(saved)
                n = int(arena.size)
                self.before.append(item("copy_buf_f32", {"src": buf, "dst": saved}, {"n": n},
                                        {"n": n}))
                self._restore.append(item("copy_buf_f32", {"src": saved, "dst": buf},
                                          {"n": n}, {"n": n}))
                if group in ("grad", "value"):
                    check = item("finite_buf_f32", {"x": buf, "flag": self.flag}, {"n": n},
                                 {"n": n}, offsets=(0, 0 if group == "grad" else 4))
                    (self.after_passes if group == "grad" else self.after_update).append(check)
        except BaseException:
            self.release()
            raise

    def _kept_arrays(self) -> list[np.ndarray]:
        return [a for layer in self.state.layers.values() for a in layer.extra.values()]

    def begin(self) -> None:
        self.kept = False  # until the step's command buffer has run ``before``
        arrays = self._kept_arrays()
        if self._extras is None or [a.shape for a in arrays] != [a.shape for a in self._extras]:
            self._extras = [a.copy() for a in arrays]
        else:
            for a, b in zip(arrays, self._extras, strict=True):
                np.copyto(b, a)

    def flags(self) -> tuple[bool, bool]:
        grads, values = self.flags_array
        return bool(grads == 1.0), bool(values == 1.0)

    def restore(self) -> None:
        if self.kept:
            for dispatch, offsets, tag in self._restore:
                self.device.dispatch(*dispatch, offsets=offsets, tag=tag)
            self.device.commit()
            self.device.synchronize()
        if self._extras is not None:
            for a, b in zip(self._kept_arrays(), self._extras, strict=False):
                if a.shape == b.shape:
                    np.copyto(a, b)

    def release(self) -> None:
        for buf in (self.flag, *self.saved):
            buf.release()
        self.saved = []
