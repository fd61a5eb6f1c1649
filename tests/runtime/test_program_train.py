"""Training programs: forward, then backward in reverse over the layers that get a gradient.

The steps here are stand-ins (host steps that bind nothing); what is checked is the program's
shape: which deltas exist, when they are cleared, the order of the backward, what the memory
planner keeps, and the errors.
"""

from __future__ import annotations

import pytest

from darknet_metal.errors import ArgumentError, BindingError
from darknet_metal.model.cfg import parse_cfg_text
from darknet_metal.ops import build_layers
from darknet_metal.runtime.memory import plan_memory
from darknet_metal.runtime.program import INPUT, HostStep, Tensor, build_program

# 0 conv -> 1 conv -> 2 maxpool -> 3 route 1 (layer 2 feeds nothing) -> 4 dropout
# -> 5 conv (the head's input) -> 6 yolo; 7 route 0 -> 8 conv (a branch no loss reads).
CFG = """[net]
width=16
height=16
channels=3
batch=2

[convolutional]
filters=4
size=3
activation=leaky

[convolutional]
filters=4
size=3
activation=mish

[maxpool]
size=2
stride=2

[route]
layers=1

[dropout]
probability=0.5

[convolutional]
filters=24
size=1
activation=linear

[yolo]
mask=0,1,2
anchors=1,1, 2,2, 3,3
classes=3
num=3

[route]
layers=0

[convolutional]
filters=2
size=1
activation=linear
"""


def _specs():
    return build_layers(parse_cfg_text(CFG))


def _nothing(reads, writes):
    return []


def _build(specs, first_backward=0, keep_deltas=False):
    log: list[tuple[str, int, Tensor | None]] = []

    def forward(spec, e):
        e.host(e.inputs, [e.output], _nothing)
        if spec.kind == "yolo":
            e.host([e.output], [e.own_delta()], _nothing)
            log.append(("loss", spec.index, e.delta))

    def backward(spec, e):
        log.append(("backward", spec.index, None))
        targets = [e.input_delta(k) for k in range(len(spec.inputs))]
        for t in targets:
            log.append(("into", spec.index, t))
        written = [t for t in targets if t is not None]
        e.host([e.delta, *e.inputs, *written], written, _nothing)

    def clear(e, t):
        log.append(("clear", e.spec.index, t))
        e.host([], [t], _nothing)

    program = build_program(specs, forward, batch=2, keep=(), mode="train",
                            emit_backward=backward, clear=clear,
                            first_backward=first_backward, keep_deltas=keep_deltas)
    return program, log


def test_backward_runs_in_reverse_over_the_layers_a_loss_reaches():
    program, log = _build(_specs())
    order = [layer for what, layer, _ in log if what == "backward"]
    # 8, 7 (no loss behind them) and 2 (nothing reads the maxpool) get no backward.
    assert order == [6, 5, 4, 3, 1, 0]
    into = {layer: t for what, layer, t in log if what == "into"}
    assert into[0] is None  # nothing is computed for the network input
    assert into[3] == Tensor(1, "delta") and into[5] == Tensor(4, "delta")


def test_each_delta_is_cleared_once_before_anything_adds_into_it():
    program, log = _build(_specs())
    cleared = [t for what, _, t in log if what == "clear"]
    assert len(cleared) == len(set(cleared))
    # The dropout's delta is its input's (route 3's): one clear for both.
    assert program.owner(Tensor(4, "delta")) == program.owner(Tensor(3, "delta"))
    assert Tensor(4, "delta") not in cleared or Tensor(3, "delta") not in cleared
    steps = program.steps
    for t in cleared:
        first = next(i for i, s in enumerate(steps) if program.owner(t) in
                     {program.owner(w) for w in s.writes})
        assert steps[first].reads == (), f"{t} was written before it was cleared"
    # The loss layer's delta is written by its forward, never cleared.
    assert Tensor(6, "delta") not in cleared


def test_the_planner_keeps_forward_outputs_for_the_backward_and_reuses_the_rest():
    specs = _specs()
    program, _ = _build(specs)
    plan = plan_memory(program, external={INPUT})
    total = sum(spec.nbytes for spec in program.tensors.values() if spec.alias_of is None)
    assert sum(plan.slot_bytes) < total
    # Layer 0's output is read by layer 1's backward (its input): alive until then, so no
    # other tensor written in between shares its slot.
    steps = program.steps
    last_read = max(i for i, s in enumerate(steps) if Tensor(0, "output") in s.reads)
    first_write = min(i for i, s in enumerate(steps) if Tensor(0, "output") in s.writes)
    slot = plan.slot_of[Tensor(0, "output")]
    for i in range(first_write + 1, last_read):
        for t in steps[i].writes:
            o = program.owner(t)
            if o != Tensor(0, "output") and o in plan.slot_of:
                assert plan.slot_of[o] != slot, (i, t)


def test_first_backward_and_kept_deltas():
    program, log = _build(_specs(), first_backward=3, keep_deltas=True)
    order = [layer for what, layer, _ in log if what == "backward"]
    assert order == [6, 5, 4, 3]
    assert {layer: t for what, layer, t in log if what == "into"}[3] is None
    assert Tensor(5, "delta") in program.keep and Tensor(4, "delta") in program.keep


def test_errors():
    specs = _specs()
    with pytest.raises(ArgumentError, match="emit_backward and clear"):
        build_program(specs, lambda s, e: None, batch=1, keep=(), mode="train")

    def forward(spec, e):
        e.host(e.inputs, [e.output], _nothing)
        if spec.index == 1:
            e.input_delta(0)

    with pytest.raises(BindingError, match="outside a training program"):
        build_program(specs, forward, batch=1, keep=())


def test_host_steps_carry_their_binding():
    program, _ = _build(_specs())
    assert all(isinstance(s, HostStep) and s.bind is _nothing for s in program.steps)
    assert len(program.layer_ends) == len(_specs()) + 1
