"""The host's share of a pass or a training step, split into phases: where a call's wall time
goes apart from the device's own work (``Network.profile`` reports it).

A ``PhaseClock`` belongs to an executor; the executor and the trainer mark the phase they are
entering (``mark``), and while the clock is enabled the seconds between marks are added to the
phase that was running. Disabled (always, outside a profile), a mark is one attribute test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["PHASES", "Phase", "PhaseClock"]


@dataclass(frozen=True)
class Phase:
    """One phase of a call on the host: ``name``, what it does, and whether it exists on a
    device whose memory the host shares (Apple's unified memory) or only where the device
    has memory of its own (``cuda``)."""

    name: str
    what: str
    unified_memory: bool


#: The phases, in the order a training step runs them.
PHASES = (
    Phase("prepare", "checks the batch and its truths and stages them for the device", True),
    Phase("guard", "what lets a refused step leave no trace: the snapshot before it and the "
          "finiteness checks after it", True),
    Phase("encode", "records the dispatches (prepared lists, staging copies, the update)",
          True),
    Phase("submit", "commits the command buffer (cuda: the driver's uploads and launches)",
          True),
    Phase("wait", "waits for the device (cuda: and the driver's downloads)", True),
    Phase("read back", "reads the loss, the statistics and the outputs asked for", True),
    Phase("all-reduce", "sums the gradients over the processes of a run across processes "
          "(MPI): the exchange, and on cuda their copies to the host and back", True),
    Phase("update", "the host's part of the update: the learning rate, the write-back, the "
          "report", True),
)

_NAMES = tuple(p.name for p in PHASES)


class PhaseClock:
    """Host seconds per phase (``seconds``), accumulated while ``enabled``. ``mark(name)``
    ends the running phase and starts ``name``; ``stop()`` ends the running one. Calls on one
    executor run one at a time, so one clock serves them all."""

    __slots__ = ("_current", "_since", "enabled", "seconds")

    def __init__(self) -> None:
        self.enabled = False
        self.seconds: dict[str, float] = dict.fromkeys(_NAMES, 0.0)
        self._current: str | None = None
        self._since = 0.0

    def mark(self, name: str) -> None:
        """Enter phase ``name`` (one of ``PHASES``)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._current is not None:
            self.seconds[self._current] += now - self._since
        self._current, self._since = name, now

    def stop(self) -> None:
        """End the running phase."""
        if not self.enabled:
            return
        if self._current is not None:
            self.seconds[self._current] += time.perf_counter() - self._since
        self._current = None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[dict[str, float]]:
        """Enables the clock from zero for the block; yields the per-phase seconds, complete
        when the block ends."""
        self.seconds = dict.fromkeys(_NAMES, 0.0)
        self._current = None
        self.enabled = True
        try:
            yield self.seconds
        finally:
            self.stop()
            self.enabled = False
