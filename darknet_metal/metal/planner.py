"""Buffer lifetimes of one forward pass: which device buffer holds each layer's output.

A pass writes every layer's output once and reads it until its last reader; after that its
buffer can hold a later output. Outputs the caller asked for (``keep``) survive to the end of
the pass. Identity layers (dropout, cost) write nothing: their output *is* their input's
buffer. The plan is pure bookkeeping (no device): ``plan_storage`` returns slot sizes and the
slot of every tensor, and the scheduler allocates one device buffer per slot.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from darknet_metal.layers import LayerSpec

#: Tensor id of the network input (as in ``LayerSpec.inputs``).
INPUT = -1


@dataclass(frozen=True)
class StoragePlan:
    """Where each tensor lives during one pass.

    ``slot_bytes[s]`` is the size in bytes slot ``s`` needs (the largest tensor it holds);
    ``slot_of[t]`` is the slot of tensor ``t`` (a layer index, or ``INPUT``);
    ``owner[t]`` is the tensor whose buffer ``t`` shares (``t`` itself except for aliases).
    """

    slot_bytes: tuple[int, ...]
    slot_of: dict[int, int]
    owner: dict[int, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.slot_bytes)


def plan_storage(
    specs: Sequence[LayerSpec],
    batch: int,
    keep: Collection[int] | None,
    aliases: Collection[int],
    itemsize: int = 4,
) -> StoragePlan:
    """Assign the tensors of a pass at batch size ``batch`` to reusable slots.

    ``keep``: layer indices whose outputs must be readable after the pass (None: all).
    ``aliases``: indices of layers whose output is their first input (no kernel, no buffer).
    A slot freed by a tensor's last reader is reused by a later output; the output of a layer
    never shares a slot with that layer's inputs. Best fit: the smallest free slot large
    enough, else the largest free slot (grown), else a new slot.
    """
    owner: dict[int, int] = {INPUT: INPUT}
    for spec in specs:
        owner[spec.index] = owner[spec.inputs[0]] if spec.index in aliases else spec.index
    end = len(specs)
    last_use: dict[int, int] = {}
    for spec in specs:
        for t in spec.inputs:
            last_use[owner[t]] = spec.index
    kept = [s.index for s in specs] if keep is None else list(keep)
    for t in kept:
        last_use[owner[t]] = end

    def nbytes(t: int, spec: LayerSpec | None) -> int:
        shape = specs[0].in_shape if spec is None else spec.out_shape
        return batch * shape[0] * shape[1] * shape[2] * itemsize

    sizes: list[int] = []
    free: list[int] = []
    slot_of: dict[int, int] = {}
    frees_at: dict[int, list[int]] = {}

    def assign(t: int, need: int) -> None:
        fitting = [s for s in free if sizes[s] >= need]
        if fitting:
            slot = min(fitting, key=lambda s: (sizes[s], s))
        elif free:
            slot = max(free, key=lambda s: (sizes[s], -s))
            sizes[slot] = need
        else:
            slot = len(sizes)
            sizes.append(need)
        if slot in free:
            free.remove(slot)
        slot_of[t] = slot
        # A tensor nobody reads is still written: it frees right after its own layer.
        frees_at.setdefault(last_use.get(t, t), []).append(slot)

    assign(INPUT, nbytes(INPUT, None))
    for spec in specs:
        if owner[spec.index] == spec.index:
            assign(spec.index, nbytes(spec.index, spec))
        free.extend(frees_at.pop(spec.index, []))
    for t, o in owner.items():
        slot_of[t] = slot_of[o]
    return StoragePlan(tuple(sizes), slot_of, owner)
