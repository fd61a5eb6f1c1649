"""``PassRing``: forward passes kept in flight on a Metal device (or the emulator) for streams.

Each of ``depth`` slots owns a page-aligned host input batch and a host array per kept output
(the ``[yolo]`` layers), all wrapped once so the device reads and writes them in place: no
upload, no download, no allocation per pass. A pass copies its slot's input into the
program's input buffer with a kernel, runs the program's dispatch lists, copies the kept
outputs into its slot and is committed without waiting. Passes run in commit order on the
device's one queue, so they may share the program's other memory; only what the host touches
while the device works — inputs and outputs — needs a copy per slot. The host fills slot
k + 1 and reads slot k - 1 while pass k runs; reading a slot waits for its pass only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.metal import aligned_empty
from darknet_metal.runtime.program import INPUT, STORED_DTYPE, Tensor

if TYPE_CHECKING:
    from darknet_metal.runtime.gpu_program import GpuBoundProgram

__all__ = ["PassRing"]


class PassRing:
    """``depth`` (>= 1) pass slots over ``bound`` (a program without host steps), keeping
    the outputs of layers ``outputs``. Used from one thread at a time, under the network's
    and the device's locks."""

    def __init__(self, bound: GpuBoundProgram, outputs: Sequence[int], depth: int) -> None:
        if depth < 1:
            raise ArgumentError(f"depth must be at least 1, not {depth}")
        self.bound = bound
        self.depth = depth
        page = int(bound.device.info["page_size"])
        program = bound.program
        stored = STORED_DTYPE[program.storage]
        self.kept = [Tensor(i, "output") for i in outputs]
        self.inputs = [aligned_empty(program.tensors[INPUT].shape, stored, page)
                       for _ in range(depth)]
        self.outputs = [[aligned_empty(program.tensors[t].shape, stored, page)
                         for t in self.kept] for _ in range(depth)]
        # Wrap every slot array now: a stream allocates nothing after its first pass.
        for slot in range(depth):
            bound.wrap(self.inputs[slot])
            for out in self.outputs[slot]:
                bound.wrap(out)
        self.started = [False] * depth

    @property
    def batch(self) -> int:
        return int(self.inputs[0].shape[0])

    def start(self, slot: int) -> float:
        """Encode and commit the pass on ``inputs[slot]`` (already filled); returns the host
        seconds spent encoding. The slot must have been finished since it was last started."""
        if self.started[slot]:
            raise ArgumentError(f"pass slot {slot} is still in flight")
        began = time.perf_counter()
        bound = self.bound
        x = self.inputs[slot]
        bound.copy(x, 0, bound.input_buffer, x.size)
        for segment in bound.segments:
            segment()
        for t, out in zip(self.kept, self.outputs[slot], strict=True):
            bound.copy(bound.buffer(t), 0, out, out.size)
        bound.device.commit()
        self.started[slot] = True
        return time.perf_counter() - began

    def finish(self, slot: int) -> tuple[list[np.ndarray], float, float]:
        """Wait for the pass in ``slot`` and return float32 copies of its kept outputs, with
        the seconds spent waiting for the device and copying them out."""
        if not self.started[slot]:
            raise ArgumentError(f"pass slot {slot} was not started")
        began = time.perf_counter()
        self.bound.wrap(self.outputs[slot][0]).sync()
        waited = time.perf_counter()
        self.started[slot] = False
        copies = [out.astype(np.float32) for out in self.outputs[slot]]
        return copies, waited - began, time.perf_counter() - waited

    def drain(self) -> None:
        """Wait for every pass still in flight (their outputs are dropped)."""
        for slot in range(self.depth):
            if self.started[slot]:
                self.bound.wrap(self.outputs[slot][0]).sync()
                self.started[slot] = False
