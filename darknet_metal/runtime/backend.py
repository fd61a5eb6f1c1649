"""What every executor of network programs offers (``CpuBackend``, ``GpuBackend``), and what
their callers bind to: programs bound to memory, update steps, pass rings.

These protocols are the whole surface the layers above use: ``Network`` runs passes through
``Backend``; a ``Trainer`` builds and runs training programs through it; a detection stream
holds a ``PassRing``. Nothing above reads an executor's own members.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from darknet_metal.model.weights import Params
from darknet_metal.runtime.program import Program, Tensor

if TYPE_CHECKING:
    from darknet_metal.runtime.pass_ring import PassRing
    from darknet_metal.runtime.phases import PhaseClock
    from darknet_metal.runtime.train_state import ArrayUpdate, Optimizer, TrainState


class BoundProgram(Protocol):
    """A program bound to memory on its executor's device: ``program`` with a buffer per
    planned slot (the CPU's arrays, or device buffers)."""

    program: Program

    def run_passes(self, x: np.ndarray, stage_in: Sequence[tuple[np.ndarray, np.ndarray]],
                   stage_out: Sequence[tuple[np.ndarray, np.ndarray]],
                   then: UpdateSteps | None = None, guard: StepGuard | None = None) -> None:
        """One pass per mini-batch of ``x`` (N, C, H, W), staged as ``run_staged_passes``
        says, then ``then``; with ``guard``, its device part (a device's guard keeps and
        checks in the same submission). On a device, all in one submission."""

    def read(self, t: Tensor) -> np.ndarray:
        """A copy of tensor ``t`` (kept by the program) after the last run."""

    def release(self) -> None:
        """Gives the memory back (to the device's pool)."""


class UpdateSteps(Protocol):
    """One parameter update of a training state, bound to its arrays."""

    def run(self, guard: StepGuard | None = None) -> None:
        """Runs the update (and waits for it); with ``guard``, its check of the parameters
        after the update."""

    def release(self) -> None:
        """Gives back what the steps hold on the device."""


class StepGuard(Protocol):
    """What lets a training step leave no trace when it is refused (a NaN or an infinity in
    its gradients or its updated parameters): ``begin`` keeps what the step may change, the
    step runs, ``flags`` says whether the gradients and the parameters came out finite, and
    ``restore`` puts back what ``begin`` kept. A device keeps and checks on the device, in
    the step's own command buffer (``run_passes``' ``guard``)."""

    def begin(self) -> None:
        """Keep what the coming step may change."""

    def flags(self) -> tuple[bool, bool]:
        """(every gradient finite, every parameter finite) after the step."""

    def restore(self) -> None:
        """Put back everything ``begin`` kept."""


class ExecutorListener(Protocol):
    """Something bound to an executor's memory (a ``Trainer``), told when it changes."""

    def executor_resized(self) -> None:
        """The executor took the layers of another input size: rebind (may raise, e.g.
        ``MemoryLimitError``; the executor's caller then resizes back)."""

    def executor_closing(self) -> None:
        """The executor is about to release its memory: save what lives there, let go."""


class Backend(Protocol):
    """Runs a network's layers on one device.

    ``name``: the device ("cpu", "metal", "emu", "cuda"); ``dtype``: the compute dtype. One backend
    serves one caller at a time: its buffers are reused from pass to pass.
    """

    name: str
    dtype: np.dtype
    #: The shim device the backend dispatches to (``darknet_metal.metal._shim.Device``), or
    #: None on the CPU.
    device: Any
    #: Where the host's time of a call goes, phase by phase (``runtime.phases``).
    phases: PhaseClock
    #: The training state's allocator (page-aligned arrays a device uses in place), or None
    #: for NumPy's.
    training_zeros: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None
    #: Copies a float32 batch into a ``training_zeros`` array of its shape and says whether
    #: it is finite, as the device best takes it (part by part where it has memory of its
    #: own); None: a plain copy serves.
    stage_batch: Callable[[np.ndarray, np.ndarray], bool] | None
    #: Where a device wants the training state's parameters, gradients and moments: a block
    #: of bytes per group (``TrainState``'s ``arena``), its arrays starting on
    #: ``training_alignment`` bytes; None: one NumPy array each.
    training_arena: Callable[[int], np.ndarray] | None
    training_alignment: int

    def sync_training(self, arenas: Sequence[np.ndarray] | None = None, *,
                      write: bool = False) -> None:
        """Makes training arenas (None: every one) current on the host; with ``write`` the
        host may change them and the device takes the changes at its next use."""

    def step_guard(self, state: TrainState) -> StepGuard:
        """The guard of a training step over ``state`` on this device."""

    def load_params(self, params: dict[int, Params]) -> None:
        """(Re)build the backend's copies of the parameters from the master copies."""

    def forward(
        self,
        x: np.ndarray,
        timings: list[float] | None = None,
        outputs: Sequence[int] | None = None,
    ) -> list[Any]:
        """Run every layer on ``x`` (N, C, H, W); per layer its output (an array-like valid
        until the next pass) if it is in ``outputs`` (None: all), else None. With
        ``timings``, each layer's wall time in seconds is appended."""

    def wait(self) -> None:
        """Waits until the device has finished the work submitted (nothing on the CPU)."""

    def hold_pass_ring(self, batch: int, outputs: Sequence[int], depth: int) -> PassRing | None:
        """``depth`` pass slots for a stream at ``batch`` images keeping ``outputs``, held
        until ``let_go_pass_ring``; None where passes run one at a time (the CPU)."""

    def let_go_pass_ring(self, ring: PassRing) -> None:
        """Waits for the ring's passes in flight and lets it go."""

    #: Who is told when the executor's owner resizes or closes it (``ExecutorEvents``).
    events: ExecutorEvents

    def resize(self, specs: list[Any], params: dict[int, Params]) -> None:
        """Take ``specs``, the same network's layers at another input size, keeping what
        does not depend on the size (``params``: the master copies)."""

    def build_training_program(self, state: TrainState, batch: int, *, first_backward: int = 0,
                               keep_all: bool = False) -> Program:
        """The program of one training mini-batch of ``batch`` images over ``state``, not
        bound to memory (kept per input size by the executor). ``keep_all``: every layer's
        output and delta stay readable after a run (for ``Trainer.gradients`` and finding
        where a step went non-finite)."""

    def training_program(self, state: TrainState, batch: int, *, first_backward: int = 0,
                         keep_all: bool = False) -> BoundProgram:
        """``build_training_program`` bound to memory."""

    def update_program(self, state: TrainState, updates: Sequence[ArrayUpdate],
                       optimizer: Optimizer, lr: np.ndarray, t: np.ndarray) -> UpdateSteps:
        """One update of ``state`` (``lr``, ``t``: (1,) arrays read when it runs)."""

    def close(self) -> None:
        """Release what the backend holds (it may not be used afterwards)."""


class ExecutorEvents:
    """The listeners of an executor: its owner (``Network``) tells them after a resize and
    before a close. A listener is held weakly (a trainer nobody keeps goes away with its
    memory) unless it was given with ``keep=True`` (the trainer a network's conveniences
    use, which lives as long as the executor)."""

    def __init__(self) -> None:
        self._listeners: list[weakref.ref[ExecutorListener]] = []
        self._kept: list[ExecutorListener] = []

    @property
    def listeners(self) -> list[ExecutorListener]:
        """The listeners still alive, in the order they were given."""
        alive = [listener for ref in self._listeners if (listener := ref()) is not None]
        if len(alive) < len(self._listeners):
            self._listeners = [weakref.ref(listener) for listener in alive]
        return alive

    def listen(self, listener: ExecutorListener, *, keep: bool = False) -> None:
        """Tell ``listener`` from now on; ``keep``: hold it for as long as the executor."""
        if listener not in self.listeners:
            self._listeners.append(weakref.ref(listener))
        if keep and listener not in self._kept:
            self._kept.append(listener)

    def unlisten(self, listener: ExecutorListener) -> None:
        """Stop telling ``listener`` (and holding it)."""
        self._listeners = [ref for ref in self._listeners if ref() is not listener]
        if listener in self._kept:
            self._kept.remove(listener)

    def resized(self) -> None:
        """Each listener rebinds to the executor's new size."""
        for listener in self.listeners:
            listener.executor_resized()

    def closing(self) -> None:
        """Each listener lets go of the executor's memory; none is told again."""
        for listener in self.listeners:
            listener.executor_closing()
        self._listeners = []
        self._kept = []
