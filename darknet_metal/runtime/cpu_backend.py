"""The CPU executor: runs a network's programs with the Cython layers of ``darknet_metal.cpu``.

Per (batch, requested outputs) it builds the program of host steps, plans its memory
(``darknet_metal.runtime.memory``: buffers reused once their last reader has run, workspaces
included), allocates it once and binds every op's native steps (``cpu_steps``) to it, so a
pass allocates and checks nothing: it is one GIL-free loop over the steps
(``cpu.executor.StepList``), reading the input array in place. Parameters are prepared per op
(``prepare_cpu``: batch norm folded, Winograd filters) in the compute dtype.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import update as cpu_update
from darknet_metal.cpu.checks import check_cpu_kernels_setting
from darknet_metal.cpu.executor import StepList
from darknet_metal.cpu.fill import fill_step
from darknet_metal.errors import ArgumentError
from darknet_metal.model.weights import Params
from darknet_metal.runtime.backend import ExecutorEvents
from darknet_metal.runtime.layer import Layer
from darknet_metal.runtime.memory import plan_memory
from darknet_metal.runtime.phases import PhaseClock
from darknet_metal.runtime.program import INPUT, LayerEmitter, Program, Tensor, build_program
from darknet_metal.runtime.program_cache import MAX_PROGRAMS, ProgramCache, TrainingPrograms
from darknet_metal.runtime.staging import check_finite_input, run_staged_passes
from darknet_metal.runtime.train_state import HostGuard

if TYPE_CHECKING:
    from darknet_metal.runtime.train_state import ArrayUpdate, Optimizer, TrainState

#: Byte alignment of each slot of a program's memory: a cache line. numpy starts large arrays
#: 16 bytes past a page, so every 64-byte vector load of a row would span two cache lines
#: (on Intel's AVX-512 cores such a load costs two).
SLOT_ALIGNMENT = 64


def _aligned_bytes(nbytes: int) -> np.ndarray:
    """An uninitialised (nbytes,) uint8 array starting on a ``SLOT_ALIGNMENT`` boundary."""
    raw = np.empty(nbytes + SLOT_ALIGNMENT, np.uint8)
    skip = -raw.ctypes.data % SLOT_ALIGNMENT
    return raw[skip : skip + nbytes]


class CpuBoundProgram:
    """A CPU program with its memory (every tensor a view of one slot's array) and its
    native steps bound to it."""

    def __init__(self, program: Program, dtype: np.dtype) -> None:
        self.program = program
        memory = plan_memory(program, external={INPUT})
        input_owner = memory.owner[INPUT]
        # Steps reading the input are bound to this stand-in; each pass re-points them at the
        # caller's array.
        self.input_standin = np.empty(program.tensors[INPUT].shape, dtype)
        slots = [_aligned_bytes(n) for n in memory.slot_bytes]
        self.views: dict[Tensor, Any] = {}
        for t, spec in program.tensors.items():
            owner = memory.owner[t]
            if owner == input_owner:
                self.views[t] = self.input_standin.reshape(spec.shape)
            elif owner in memory.slot_of:
                slot = slots[memory.slot_of[owner]]
                view_dtype = dtype if spec.dtype is None else np.dtype(spec.dtype)
                self.views[t] = slot[: spec.nbytes].view(view_dtype).reshape(spec.shape)
        native = []
        #: Per layer: the index in ``steps`` after its last native step.
        self.layer_ends: list[int] = []
        #: Per native step: (its layer, "forward" or "backward"), for a profile.
        self.step_labels: list[tuple[int, str]] = []
        # A training program's last layer_ends entry is the end of its backward.
        forward_end = program.layer_ends[-2] if program.mode == "train" else len(program.steps)
        first = 0
        for end in program.layer_ends:
            for index in range(first, end):
                step = program.steps[index]
                bound = step.bind([self.views[t] for t in step.reads],
                                  [self.views[t] for t in step.writes])
                native.extend(bound)
                phase = "forward" if index < forward_end else "backward"
                self.step_labels.extend([(step.layer, phase)] * len(bound))
            self.layer_ends.append(len(native))
            first = end
        self.steps = StepList(native, self.input_standin)
        self.input_aliases = {t for t in program.tensors if memory.owner[t] == input_owner}
        #: Per layer of the network: the view of its output the program keeps, None for
        #: one it does not keep, or the output's shape for an identity chain back to the
        #: input (the caller's array, reshaped on each pass).
        self.layer_outputs: list[Any] = []
        for index in range(len(program.layer_ends)):
            t = Tensor(index, "output")
            if t not in program.keep:
                self.layer_outputs.append(None)
            elif t in self.input_aliases:
                self.layer_outputs.append(program.tensors[t].shape)
            else:
                self.layer_outputs.append(self.views[t])

    def run(self, x: np.ndarray) -> None:
        """One pass on ``x`` (the program's input shape and dtype), read in place."""
        self.steps.run(x)

    def read(self, t: Tensor) -> np.ndarray:
        """A copy of tensor ``t`` after the last ``run``."""
        return self.views[t].copy()

    def run_passes(self, x: np.ndarray, stage_in: Sequence[tuple[np.ndarray, np.ndarray]],
                   stage_out: Sequence[tuple[np.ndarray, np.ndarray]],
                   then: HostUpdate | None = None, guard: Any = None) -> None:
        """One pass per mini-batch of ``x`` (the program's batch of images each), staged as
        ``backend.run_staged_passes`` says, then ``then`` (a host guard works around it)."""
        run_staged_passes(self.steps.run, self.input_standin.shape[0], x, stage_in, stage_out)
        if then is not None:
            then.run()

    def release(self) -> None:
        """Nothing to give back: the memory goes with the last reference."""


class CpuBackend:
    """Executes a network's layers on the CPU in ``dtype`` (float32 or float64)."""

    name = "cpu"
    #: No shim device: the layers run here.
    device = None
    #: The training state's allocator: NumPy's (nothing shares the arrays).
    training_zeros = None
    #: The batch is copied as it is (``Trainer``'s own copy).
    stage_batch = None
    #: No arenas: each training array is a NumPy array of its own.
    training_arena = None
    training_alignment = 64

    def __init__(
        self, specs: list[Layer], params: dict[int, Params], dtype: np.dtype | type = np.float32
    ) -> None:
        self.specs = specs
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ArgumentError(f"dtype must be float32 or float64, not {self.dtype}")
        check_cpu_kernels_setting()
        self._programs: ProgramCache[tuple[int, frozenset[int] | None], CpuBoundProgram] = (
            ProgramCache(MAX_PROGRAMS))
        #: ``time.monotonic_ns()`` readings at which the last pass's compute started and
        #: finished (without per-layer timings, one GIL-free loop in between).
        self.last_pass_ns: tuple[int, int] = (0, 0)
        self._training_programs: TrainingPrograms[Program] = TrainingPrograms()
        #: The last training program and update made, while their user keeps them: what
        #: ``training_step_seconds`` reads.
        self._timed: list[weakref.ref[Any] | None] = [None, None]
        self.events = ExecutorEvents()
        #: Where the host's time of a call goes (enabled by ``Network.profile``).
        self.phases = PhaseClock()
        self.load_params(params)

    def load_params(self, params: dict[int, Params]) -> None:
        """(Re)build the inference parameters from the master copies in ``params``."""
        self._states = {spec.index: spec.prepare_cpu(params.get(spec.index), self.dtype)
                        for spec in self.specs}
        self._programs.clear()

    def _loaded(self, batch: int, keep: frozenset[int] | None) -> CpuBoundProgram:
        return self._programs.get((batch, keep), lambda: CpuBoundProgram(build_program(
            self.specs,
            lambda spec, e: spec.emit_cpu_forward(e, self._states[spec.index]),
            batch=batch,
            keep=keep,
            itemsize=self.dtype.itemsize,
        ), self.dtype))

    def forward(
        self,
        x: np.ndarray,
        timings: list[float] | None = None,
        outputs: Sequence[int] | None = None,
    ) -> list[np.ndarray | None]:
        """Run every layer on ``x`` (N, C, H, W); per layer its output array if it is in
        ``outputs`` (None: all), else None.

        The returned arrays are reused by the next call: copy what must outlive it. With
        ``timings``, the wall time of each layer in seconds is appended to it.
        """
        check_finite_input(x)
        x = np.ascontiguousarray(x, self.dtype)
        keep = None if outputs is None else frozenset(int(i) for i in outputs)
        loaded = self._loaded(x.shape[0], keep)
        x = x.reshape(loaded.input_standin.shape)
        if timings is None:
            loaded.steps.run(x)
            started = loaded.steps.last_started_ns
        else:
            first = 0
            started = time.monotonic_ns()
            for end in loaded.layer_ends:
                start = time.perf_counter()
                loaded.steps.run(x, first, end)
                timings.append(time.perf_counter() - start)
                first = end
        self.last_pass_ns = (started, loaded.steps.last_finished_ns)
        return [x.reshape(out) if isinstance(out, tuple) else out
                for out in loaded.layer_outputs]

    def wait(self) -> None:
        """Nothing to wait for: a CPU pass is done when ``forward`` returns."""

    def sync_training(self, arenas: Sequence[np.ndarray] | None = None, *,
                      write: bool = False) -> None:
        """Nothing to do: the training state is host memory."""

    def step_guard(self, state: TrainState) -> HostGuard:
        """The guard of a step over ``state``: host copies and host checks."""
        return HostGuard(state)

    def hold_pass_ring(self, batch: int, outputs: Sequence[int], depth: int) -> None:
        """None: a CPU pass runs to its end, so a stream keeps one pass at a time."""
        return None

    def let_go_pass_ring(self, ring: object) -> None:
        """Nothing is held on the CPU."""

    def resize(self, specs: list[Layer], params: dict[int, Params]) -> None:
        """Takes the layers of the same network at another input size (``Network.resize``):
        parameters prepared again for the new shapes (Winograd filters depend on them),
        inference programs of the old size freed, training programs of every size kept."""
        self.specs = specs
        self.load_params(params)

    def build_training_program(self, state: TrainState, batch: int, *, first_backward: int = 0,
                               keep_all: bool = False) -> Program:
        """The program of one mini-batch of ``batch`` images of a training iteration (see
        ``cpu_training_program``), not bound to memory yet; kept per input size
        (``TrainingPrograms``)."""
        key = (self.specs[0].in_shape, batch, first_backward, keep_all)
        return self._training_programs.get(state, key, lambda: cpu_training_program(
            self.specs, state, batch, first_backward=first_backward, keep_all=keep_all,
            itemsize=self.dtype.itemsize))

    def training_program(self, state: TrainState, batch: int, *, first_backward: int = 0,
                         keep_all: bool = False) -> CpuBoundProgram:
        """``build_training_program`` bound to ``state``'s arrays and to planned memory
        (``views[Tensor(i, "delta")]`` reads a kept delta after a run)."""
        bound = CpuBoundProgram(self.build_training_program(
            state, batch, first_backward=first_backward, keep_all=keep_all), self.dtype)
        self._timed[0] = weakref.ref(bound)
        return bound

    def update_program(self, state: TrainState, updates: Sequence[ArrayUpdate],
                       optimizer: Optimizer, lr: np.ndarray, t: np.ndarray) -> HostUpdate:
        """The native steps of one update of ``state`` (``lr``, ``t``: (1,) arrays read when
        they run: the learning rate and Darknet's batch number)."""
        native = []
        labels = []
        o = optimizer
        for u in updates:
            layer = state.layer(u.layer)
            value, grad = layer.values[u.name], layer.grads[u.name]
            if u.held:
                # The iteration's gradient is dropped, not saved up: Darknet's CUDA build
                # keeps adding into a held layer's accumulator and applies every held
                # iteration's gradient at once in its first update.
                native.append(fill_step(grad))
            elif o.adam:
                native.append(cpu_update.adam_update_step(
                    value, grad, layer.adam_m[u.name], layer.adam_v[u.name], lr, t, o.decay,
                    o.b1, o.b2, o.eps, o.images))
            else:
                native.append(cpu_update.sgd_update_step(
                    value, grad, lr, o.decay, o.momentum, o.images, u.name == "weights",
                    u.lr_scale))
            if u.clear and not u.held:
                native.append(fill_step(grad))
            labels.extend([(u.layer, "update")] * (len(native) - len(labels)))
        update = HostUpdate(StepList(native), labels)
        self._timed[1] = weakref.ref(update)
        return update

    def training_step_seconds(self) -> dict[tuple[int, str], float]:
        """Seconds per (layer, "forward" | "backward" | "update") of the native steps of the
        last training program and update this backend made, run since the last call (the
        sums start again at 0). Empty before any training program."""
        out: dict[tuple[int, str], float] = {}
        for ref in self._timed:
            timed = None if ref is None else ref()
            if timed is None:
                continue
            for label, seconds in zip(timed.step_labels, timed.steps.take_step_seconds(),
                                      strict=True):
                out[label] = out.get(label, 0.0) + seconds
        return out

    def close(self) -> None:
        """Frees the planned memory."""
        self._programs.clear()
        self._training_programs.clear()


class HostUpdate:
    """An update's native steps (``backend.UpdateSteps``): run in the caller's thread,
    without the GIL; a host guard checks after it, on the host."""

    def __init__(self, steps: StepList, step_labels: list[tuple[int, str]]) -> None:
        self.steps = steps
        #: Per native step: (its layer, "update").
        self.step_labels = step_labels

    def run(self, guard: Any = None) -> None:
        self.steps.run()

    def release(self) -> None:
        """Nothing held beyond the arrays."""


def cpu_training_program(specs: Sequence[Layer], state: TrainState, batch: int, *,
                         first_backward: int = 0, keep_all: bool = False,
                         **options: Any) -> Program:
    """The program of one mini-batch of ``batch`` images of a training iteration from the
    ops' CPU training steps (bound to ``state``'s arrays): each op's training forward, then
    the backward from the last layer to ``first_backward``. ``keep_all``: every layer's
    output and delta stay readable after a run. ``options``: more ``build_program`` arguments."""
    return build_program(
        specs,
        lambda spec, e: spec.emit_cpu_train(e, state.layer(spec.index)),
        batch=batch,
        keep=None if keep_all else (),
        mode="train",
        # Darknet's onlyforward: the layer's backward does not run (nor send gradients on).
        emit_backward=lambda spec, e: None if spec.values.get("onlyforward")
        else spec.emit_cpu_backward(e, state.layer(spec.index)),
        clear=clear_on_host,
        first_backward=first_backward,
        keep_deltas=keep_all,
        **options,
    )


def clear_on_host(e: LayerEmitter, t: Tensor) -> None:
    """Zeroes tensor ``t`` with a host step (a training program's ``clear``)."""
    e.host([], [t], lambda reads, writes: [fill_step(writes[0])])
