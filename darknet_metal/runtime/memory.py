"""The memory plan of a program: which slot of memory holds each tensor, on any backend.

A tensor lives from the first step that writes it to the last step that reads or writes it;
tensors a program keeps live to the end of the pass. Two tensors whose lifetimes do not
overlap may share a slot, so a slot freed after a step holds a tensor first written by a later
step (never one written by the same step: a step's inputs, outputs and workspaces are live
together). Aliases (an identity layer's output) share their owner's slot. The plan is pure
bookkeeping: executors allocate one buffer (device memory or a NumPy array) per slot.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from darknet_metal.errors import MemoryLimitError
from darknet_metal.runtime.program import INPUT, Program, Tensor, build_program

if TYPE_CHECKING:
    from darknet_metal.runtime.layer import Layer


@dataclass(frozen=True)
class MemoryPlan:
    """Where each tensor of a program lives.

    ``slot_bytes[s]``: bytes slot ``s`` needs (its largest tensor); ``slot_of[t]``: the slot
    of tensor ``t`` (aliases included; tensors in ``external`` have none); ``owner[t]``: the
    tensor whose memory ``t`` is."""

    slot_bytes: tuple[int, ...]
    slot_of: dict[Tensor, int]
    owner: dict[Tensor, Tensor]

    @property
    def total_bytes(self) -> int:
        return sum(self.slot_bytes)


def plan_memory(program: Program, external: Collection[Tensor] = ()) -> MemoryPlan:
    """Assign the tensors of ``program`` to reusable slots.

    ``external``: tensors whose memory the executor provides (e.g. the caller's input array
    on the CPU); they get no slot. Tensors are placed largest first, each in the smallest
    slot none of whose tensors lives at the same time as it (lifetimes are closed step
    ranges), else in a new slot of its size.
    """
    owner = {t: program.owner(t) for t in program.tensors}
    end = len(program.steps)
    first: dict[Tensor, int] = {}
    last: dict[Tensor, int] = {}
    for t in owner.values():
        if t.layer < 0:  # the network input exists before the first step
            first[t] = last[t] = -1
    for i, step in enumerate(program.steps):
        for t in (*step.reads, *step.writes):
            o = owner[t]
            first.setdefault(o, i)
            last[o] = i
    for t in program.keep:
        o = owner[t]
        first.setdefault(o, end)  # a kept tensor no step touches still gets memory
        last[o] = end

    # Largest first (a slot never grows): placing tensors in step order and growing slots
    # to fit planned a yolov4-tiny training pass 26% larger. Ties keep step order, so the
    # plan is deterministic.
    order = sorted((t for t in first if t not in external),
                   key=lambda t: (-program.tensors[t].nbytes, first[t], last[t]))
    sizes: list[int] = []
    lives: list[list[tuple[int, int]]] = []
    slot_of: dict[Tensor, int] = {}
    for t in order:
        a, b = first[t], last[t]
        slot = None
        for s in sorted(range(len(sizes)), key=lambda s: (sizes[s], s)):
            if all(b < a2 or b2 < a for a2, b2 in lives[s]):
                slot = s
                break
        if slot is None:
            slot = len(sizes)
            sizes.append(program.tensors[t].nbytes)
            lives.append([])
        lives[slot].append((a, b))
        slot_of[t] = slot
    for t, o in owner.items():
        if o in slot_of:
            slot_of[t] = slot_of[o]
    return MemoryPlan(tuple(sizes), slot_of, owner)


@dataclass(frozen=True)
class PassMemory:
    """Bytes the CPU executor plans for one inference pass that keeps only the detection
    outputs (layer outputs and workspaces, the input excluded): what running the network
    costs beyond its parameters, at batch 1 and 2; it grows by their difference per image."""

    one: int
    two: int

    def at(self, batch: int) -> int:
        """About the bytes of a pass at ``batch`` images."""
        return self.one + (self.two - self.one) * (batch - 1)

    def with_input(self, batch: int, input_shape: tuple[int, int, int], input_itemsize: int,
                   parameter_bytes: int) -> int:
        """About the bytes a pass at ``batch`` images of ``input_shape`` (C, H, W, stored at
        ``input_itemsize`` bytes) needs with the input and ``parameter_bytes`` of
        parameters: what the memory checks compare with the machine's."""
        return (self.at(batch) + math.prod(input_shape) * batch * input_itemsize
                + parameter_bytes)


def plan_pass_memory(specs: Sequence[Layer], itemsize: int = 4) -> PassMemory:
    """The ``PassMemory`` of ``specs`` with ``itemsize``-byte activations: plans the programs
    of batch 1 and 2; allocates nothing."""
    keep = [s.index for s in specs if s.detection_head is not None] or [specs[-1].index]

    def planned(batch: int) -> int:
        program = build_program(specs, lambda s, e: s.emit_cpu_forward(e, None), batch=batch,
                                keep=keep, itemsize=itemsize)
        return plan_memory(program, external={INPUT}).total_bytes

    return PassMemory(planned(1), planned(2))


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def format_bytes(n: int) -> str:
    """``n`` bytes in KiB, MiB or GiB, one decimal."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_pass_memory(source: str, input_shape: tuple[int, int, int], batch: int,
                      needed: int, parameter_bytes: int) -> None:
    """MemoryLimitError naming ``source`` (the cfg) when a pass at ``batch`` images of
    ``input_shape`` (C, H, W) (``needed`` bytes with the parameters) needs more memory than
    this machine has."""
    available = physical_memory()
    if available is None or needed <= available:
        return
    c, h, w = input_shape
    raise MemoryLimitError(
        f"{source}: the network needs about {format_bytes(needed)} for a batch "
        f"of {batch} at {w}x{h} ({format_bytes(needed - parameter_bytes)} of layer "
        f"outputs and workspaces, {format_bytes(parameter_bytes)} of parameters), "
        f"more than this machine's {format_bytes(available)}: lower width and height in "
        "[net] (or pass input_size=(W, H) to load) or use a smaller batch",
        needed=needed, available=available,
    )


def check_load_memory(source: str, layers: Sequence[Layer], batch: int,
                      itemsize: int, input_itemsize: int) -> PassMemory:
    """Before any parameter is allocated: MemoryLimitError naming ``source`` (the cfg) when
    the float32 parameters alone (a cfg asking for billions of filters; naming the layer
    holding the most), or they with a pass at ``batch`` (a network's ``memory_bytes``:
    tensors stored at ``itemsize`` bytes, the input at ``input_itemsize``), need more memory
    than this machine has. Returns the pass's planned memory (checked only where the
    machine's memory is known)."""
    sizes = [(spec, 4 * sum(int(np.prod(shape, dtype=object)) for shape in
                            spec.param_shapes.values())) for spec in layers]
    parameters = sum(size for _, size in sizes)
    available = physical_memory()
    if available is not None and parameters > available:
        largest, most = max(sizes, key=lambda pair: pair[1])
        raise MemoryLimitError(
            f"{source}: the parameters need about {format_bytes(parameters)}, more than "
            f"this machine's {format_bytes(available)}; layer {largest.index} "
            f"[{largest.kind}] alone holds {format_bytes(most)}",
            needed=parameters, available=available,
        )
    planned = plan_pass_memory(layers, itemsize)
    if available is not None:
        # The first layer reads the network input.
        shape = layers[0].in_shape
        check_pass_memory(source, shape, batch,
                          planned.with_input(batch, shape, input_itemsize, parameters),
                          parameters)
    return planned
