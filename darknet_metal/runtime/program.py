"""Programs: what one pass of a network runs, as typed steps over named tensors.

A ``Program`` is built per (batch size, tensors that must survive the pass, mode) from the
layers of a network (the ops of ``darknet_metal.ops``, seen through ``ProgramLayer``): each
declares the tensors it produces (``Tensor(layer, role)``: its ``"output"``, a
``"workspace"``, in training what its backward keeps and its ``"delta"``) and emits steps
that read and write them:

- ``KernelStep``: one registry kernel with every buffer bound by its role name to a tensor or
  a resident parameter (``Param(layer, name)``). Which tensors it reads and writes follows
  from the roles' directions in the registry (``in``, ``out``, ``inout``), so a swapped
  binding shows up as a read of a tensor nothing has written yet.
- ``HostStep``: native CPU steps (``darknet_metal.cpu.step``) bound to NumPy arrays of the
  tensors it declares it reads and writes (every CPU layer, and a layer that cannot run on a
  device).

Executors (``CpuBackend``, ``GpuBackend``) run programs; ``runtime.memory`` plans where every
tensor lives. Mode "inference" is a forward pass; mode "train" adds each layer's delta,
the training forward and the backward (``emit_backward``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from darknet_metal.errors import ArgumentError, BindingError, Unsupported
from darknet_metal.model.cfg import Shape


class ProgramLayer(Protocol):
    """What building a program needs of a layer (``runtime.layer.Layer`` extends it):
    ``index``; ``inputs``, the layers it reads (-1: the network input); ``out_shape`` (C, H,
    W); whether its output is its first input (``output_is_input``) and whether, in training,
    its delta is that input's (``delta_is_input_delta``)."""

    index: int
    inputs: list[int]
    out_shape: Shape
    output_is_input: bool
    delta_is_input_delta: bool


#: Program modes.
MODES = ("inference", "train")


class Tensor(NamedTuple):
    """A tensor of a pass: ``role`` of layer ``layer`` (-1: the network input)."""

    layer: int
    role: str


class Param(NamedTuple):
    """An array resident on the device: ``name`` of layer ``layer``. ``group`` "" is an
    inference parameter (what ``device_params`` gives: batch norm folded); a training
    array is one of ``runtime.train_state.GROUPS`` ("value", "grad", ...), the layer's
    ``LayerTrainState`` array of that name."""

    layer: int
    name: str
    group: str = ""


#: The network input, (N, C, H, W).
INPUT = Tensor(-1, "output")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's full shape (batch axis first for activations) and element size in bytes.

    ``alias_of``: the tensor whose memory this one is (an identity layer's output);
    ``dtype``: a NumPy dtype name for a tensor not of the program's element type (maxpool's
    "int32" argmax indexes), else None."""

    id: Tensor
    shape: tuple[int, ...]
    itemsize: int
    alias_of: Tensor | None = None
    dtype: str | None = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(frozen=True)
class KernelStep:
    """One dispatch of registry kernel ``kernel``.

    ``buffers``: role name -> ``Tensor``, ``Param`` or None (a role the kernel does not read
    with these arguments); ``args``: the fields of its argument struct; ``sizes``: its grid
    axes. ``reads``/``writes``: the tensors bound to ``in``/``inout`` and ``out``/``inout``
    roles (whole: the planner keeps a tensor alive whatever part a step touches).
    ``offsets``: per role, elements into its buffer where the kernel's view starts (one
    image of a batch tensor); absent roles start at 0."""

    layer: int
    kernel: str
    buffers: Mapping[str, Tensor | Param | None]
    args: Mapping[str, int | float]
    sizes: Mapping[str, int]
    reads: tuple[Tensor, ...]
    writes: tuple[Tensor, ...]
    offsets: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HostStep:
    """Work on the host over the tensors it declares: ``bind(reads, writes)`` gets one NumPy
    array per tensor, in the order given, and returns the native steps (``NativeStep``) that
    compute the writes from the reads; an executor binds once and runs them every pass.
    ``reason``: why a device program runs this layer on the host (None in CPU programs)."""

    layer: int
    reads: tuple[Tensor, ...]
    writes: tuple[Tensor, ...]
    bind: Callable[[list[Any], list[Any]], Sequence[Any]]
    reason: str | None = None


Step = KernelStep | HostStep


#: ``precision`` (``load``, ``GpuBackend``) -> how a device program stores float tensors.
STORAGE = {"fp32": "f32", "fp16": "f16"}
#: How a program stores float tensors -> the NumPy dtype of what it stores.
STORED_DTYPE = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}


def stored_itemsize(precision: str, dtype: np.dtype) -> int:
    """Bytes per stored element of a network of ``precision`` computing in ``dtype``: half
    storage's 2, else the compute dtype's."""
    return STORED_DTYPE["f16"].itemsize if STORAGE[precision] == "f16" else dtype.itemsize


@dataclass
class Program:
    """The steps of one pass, in order, and every tensor they use.

    ``keep``: tensors readable after the pass. ``layer_ends[i]``: the index in ``steps`` after
    layer ``i``'s last step (for per-layer timing); a training program has one more entry,
    the end of its backward."""

    batch: int
    mode: str
    tensors: dict[Tensor, TensorSpec]
    keep: frozenset[Tensor]
    steps: list[Step] = field(default_factory=list)
    layer_ends: list[int] = field(default_factory=list)
    #: How float tensors are stored on a device: "f32", or "f16" (half: the kernels are the
    #: registry's ``_f16`` twins).
    storage: str = "f32"

    def owner(self, t: Tensor) -> Tensor:
        """The tensor whose memory ``t`` is (``t`` itself unless it is an alias)."""
        spec = self.tensors[t]
        while spec.alias_of is not None:
            spec = self.tensors[spec.alias_of]
        return spec.id


class LayerEmitter:
    """What an op sees while it emits one layer's steps into a program (see ``build_program``).

    ``batch``; ``inputs``: the tensors of the layer's inputs (``spec.inputs`` order);
    ``output``: the layer's output tensor; ``simd``: the device has ``simdgroup_matrix``;
    ``storage``: the element type of the program's tensors ("f32", "f16")."""

    def __init__(self, builder: _Builder, spec: ProgramLayer) -> None:
        self._builder = builder
        self.spec = spec
        self.batch = builder.batch
        self.simd = builder.simd
        self.storage = builder.storage
        self.inputs = tuple(Tensor(i, "output") for i in spec.inputs)
        self.output = Tensor(spec.index, "output")
        #: The gradient of the pass's loss with respect to ``output`` (training programs):
        #: Darknet's ``l.delta``, (batch, *out_shape).
        self.delta = Tensor(spec.index, "delta")

    def own_delta(self) -> Tensor:
        """``delta``, declared for a step of this layer's forward that writes it whole (a loss
        layer's); its backward then runs."""
        return self._builder.declare_delta(self.spec.index)

    def input_delta(self, k: int) -> Tensor | None:
        """The delta of input ``k`` (``spec.inputs`` order), for a backward step to add into:
        declared and cleared to zero on first use, since every consumer of a layer adds its
        part. None for the network input (no gradient is computed for it) and for layers below
        the program's first trained layer."""
        return self._builder.input_delta(self.spec.inputs[k])

    def input_delta_target(self, k: int) -> tuple[Tensor, bool] | None:
        """The delta of input ``k`` for a backward whose steps write every element of it:
        ``(delta, accumulate)``. When an earlier step has written the delta, ``accumulate``
        is True and the steps add into it; when they are its first writer, it is False, the
        delta is not cleared, and the steps must set every element (as adding to zero
        would). None as for ``input_delta``."""
        return self._builder.input_delta_target(self.spec.inputs[k])

    def shape(self, t: Tensor) -> tuple[int, ...]:
        """Full shape of a declared tensor."""
        return self._builder.tensors[t].shape

    def tensor(self, role: str, shape: Sequence[int], dtype: str | None = None) -> Tensor:
        """Declares tensor ``(layer, role)`` of ``shape`` (full shape, elements), of the
        program's element type or of NumPy dtype ``dtype`` ("int32")."""
        return self._builder.declare(Tensor(self.spec.index, role), tuple(shape), dtype=dtype)

    def kernel(
        self,
        name: str,
        buffers: Mapping[str, Tensor | Param | None],
        sizes: Mapping[str, int],
        *,
        offsets: Mapping[str, int] | None = None,
        **args: int | float,
    ) -> None:
        """Appends a dispatch of ``name`` with buffers bound by role (``offsets``: elements
        into a role's buffer where the kernel's view starts). Raises ``BindingError``
        (before anything is encoded) for a missing or unknown role, a buffer smaller than the
        kernel touches past its offset, or a read of a tensor no earlier step has written."""
        self._builder.kernel(self.spec.index, name, buffers, sizes, args, offsets or {})

    def host(
        self,
        reads: Iterable[Tensor],
        writes: Iterable[Tensor],
        bind: Callable[[list[Any], list[Any]], Sequence[Any]],
        reason: str | None = None,
    ) -> None:
        """Appends a host step (see ``HostStep``)."""
        self._builder.host(HostStep(self.spec.index, tuple(reads), tuple(writes), bind, reason))


class _Sized:
    """Stands in for a buffer of ``nbytes`` when kernel bindings are checked at build time."""

    __slots__ = ("name", "nbytes")

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes


class _Builder:
    def __init__(
        self,
        specs: Sequence[ProgramLayer],
        batch: int,
        mode: str,
        keep: Iterable[Tensor],
        itemsize: int,
        simd: bool,
        param_nbytes: Mapping[Param, int] | None,
        storage: str = "f32",
    ) -> None:
        self.specs = specs
        self.batch = batch
        self.itemsize = itemsize
        self.storage = storage
        self.simd = simd
        self.param_nbytes = param_nbytes
        self.tensors: dict[Tensor, TensorSpec] = {}
        self.written: set[Tensor] = set()  # owners of the tensors some step has written
        self.owner: dict[Tensor, Tensor] = {}
        self.program = Program(batch, mode, self.tensors, frozenset(keep), storage=storage)
        self.declare(INPUT, (batch, *specs[0].in_shape))
        self.written.add(INPUT)
        self.clear: Callable[[LayerEmitter, Tensor], None] | None = None
        self.first_backward = 0
        self.emitting: LayerEmitter | None = None

    def declare_delta(self, layer: int) -> Tensor:
        t = Tensor(layer, "delta")
        if t not in self.tensors:
            spec = self.specs[layer]
            if spec.delta_is_input_delta:
                # The op's backward works in place on its input's delta ([dropout]).
                self.declare(t, (self.batch, *spec.out_shape),
                             alias_of=self.declare_delta(spec.inputs[0]))
            else:
                self.declare(t, (self.batch, *spec.out_shape))
        return t

    def input_delta(self, layer: int) -> Tensor | None:
        if layer < self.first_backward or layer < 0:
            return None
        spec = self.specs[layer]
        if spec.delta_is_input_delta and self.input_delta(spec.inputs[0]) is None:
            return None
        t = self.declare_delta(layer)
        if self.owner[t] not in self.written:
            if self.clear is None or self.emitting is None:
                raise BindingError(f"layer {layer}: a delta is used outside a training program")
            self.clear(self.emitting, self.owner[t])
            if self.owner[t] not in self.written:
                raise BindingError(f"layer {layer}: clearing its delta wrote nothing")
        return t

    def input_delta_target(self, layer: int) -> tuple[Tensor, bool] | None:
        if layer < self.first_backward or layer < 0:
            return None
        t = self.declare_delta(layer) if not self.specs[layer].delta_is_input_delta else None
        if t is not None and self.owner[t] == t and t not in self.written:
            return t, False
        # Written already, or an alias (dropout's in-place delta): add into it, cleared first.
        delta = self.input_delta(layer)
        return None if delta is None else (delta, True)

    def declare(self, t: Tensor, shape: tuple[int, ...], alias_of: Tensor | None = None,
                dtype: str | None = None) -> Tensor:
        if t in self.tensors:
            raise BindingError(f"layer {t.layer} declares tensor {t.role!r} twice")
        itemsize = self.itemsize if dtype is None else np.dtype(dtype).itemsize
        self.tensors[t] = TensorSpec(t, shape, itemsize, alias_of, dtype)
        self.owner[t] = t if alias_of is None else self.owner[alias_of]
        return t

    def _check_reads(self, layer: int, what: str, reads: Iterable[Tensor]) -> None:
        for t in reads:
            if t not in self.tensors:
                raise BindingError(f"layer {layer}: {what} reads undeclared tensor {t}")
            if self.owner[t] not in self.written:
                raise BindingError(
                    f"layer {layer}: {what} reads tensor {t} before any step writes it "
                    "(are two buffer roles swapped?)"
                )

    def _mark_written(self, writes: Iterable[Tensor]) -> None:
        # Kept by owner: an alias holds its owner's values.
        self.written.update(self.owner[t] for t in writes)

    def kernel(
        self,
        layer: int,
        name: str,
        buffers: Mapping[str, Tensor | Param | None],
        sizes: Mapping[str, int],
        args: Mapping[str, int | float],
        offsets: Mapping[str, int],
    ) -> None:
        from darknet_metal.metal import registry

        if self.storage == "f16":
            if name not in registry.HALF_TWINS:
                raise Unsupported(f"no half-storage (fp16) kernel for {name} yet")
            name = registry.half_name(name)
        k = registry.kernel(name)
        for role, offset in offsets.items():
            if buffers.get(role) is None or offset < 0:
                raise BindingError(f"{name}: offset {offset} for role {role!r}, which is "
                                   f"{'unbound' if buffers.get(role) is None else 'bound'}")
        stand_ins: dict[str, Any] = {}
        for role, ref in buffers.items():
            skipped = k.binding(role).itemsize * offsets.get(role, 0)
            if isinstance(ref, Tensor):
                if ref not in self.tensors:
                    raise BindingError(f"{name}: role {role!r} is bound to undeclared {ref}")
                stand_ins[role] = _Sized(str(ref), self.tensors[ref].nbytes - skipped)
            elif isinstance(ref, Param) and self.param_nbytes is None:
                stand_ins[role] = _Sized(str(ref), 1 << 62)  # sizes not known yet: unchecked
            elif isinstance(ref, Param):
                if ref not in self.param_nbytes:
                    raise BindingError(f"{name}: role {role!r} is bound to unknown {ref}")
                stand_ins[role] = _Sized(str(ref), self.param_nbytes[ref] - skipped)
            else:
                stand_ins[role] = ref
        k.bind(stand_ins, args, sizes)
        read_roles, written_roles = k.accesses(args, sizes)
        reads = tuple(t for role in read_roles if isinstance(t := buffers.get(role), Tensor))
        writes = tuple(t for role in written_roles if isinstance(t := buffers.get(role), Tensor))
        self._check_reads(layer, f"kernel {name}", reads)
        self.program.steps.append(
            KernelStep(layer, name, dict(buffers), dict(args), dict(sizes), reads, writes,
                       dict(offsets))
        )
        self._mark_written(writes)

    def host(self, step: HostStep) -> None:
        self._check_reads(step.layer, "host step", step.reads)
        for t in step.writes:
            if t not in self.tensors:
                raise BindingError(f"layer {step.layer}: host step writes undeclared tensor {t}")
        self.program.steps.append(step)
        self._mark_written(step.writes)


def build_program(
    specs: Sequence[ProgramLayer],
    emit: Callable[[ProgramLayer, LayerEmitter], None],
    *,
    batch: int,
    keep: Iterable[int] | None,
    mode: str = "inference",
    itemsize: int = 4,
    simd: bool = False,
    param_nbytes: Mapping[Param, int] | None = None,
    storage: str = "f32",
    emit_backward: Callable[[ProgramLayer, LayerEmitter], None] | None = None,
    clear: Callable[[LayerEmitter, Tensor], None] | None = None,
    first_backward: int = 0,
    keep_deltas: bool = False,
) -> Program:
    """The program of one pass of ``specs`` at ``batch``.

    For each layer in order, its output is declared ((batch, *out_shape), or an alias of its
    first input for ops whose output is their input) and ``emit(spec, emitter)`` appends its
    steps. ``keep``: layer indices whose outputs survive the pass (None: all). ``itemsize``:
    bytes per element; ``storage``: "f16" runs every kernel step as its half-storage twin
    (an op emitting a kernel without one raises ``errors.Unsupported``); ``simd``: passed to the
    ops; ``param_nbytes``: sizes of the device
    parameters kernel steps may bind (for the binding checks; None: not known yet, so their
    sizes are not checked).

    ``mode="train"`` (one mini-batch of a training iteration): ``emit`` appends each layer's
    training forward (a loss layer's writes its ``own_delta``), then, from the last layer to
    ``first_backward``, ``emit_backward(spec, emitter)`` appends the backward of every layer
    whose delta some step has written (a layer nothing sends a gradient to has none to pass
    on), adding into its inputs' deltas (``LayerEmitter.input_delta``), which ``clear(emitter,
    delta)`` zeroes before their first use. ``keep_deltas``: every delta survives the pass.
    """
    if mode not in MODES:
        raise ArgumentError(f"mode must be one of {MODES}, not {mode!r}")
    training = mode == "train"
    if training and (emit_backward is None or clear is None):
        raise ArgumentError("a training program needs emit_backward and clear")
    kept = [s.index for s in specs] if keep is None else list(keep)
    b = _Builder(
        specs, batch, mode, [Tensor(i, "output") for i in kept], itemsize, simd, param_nbytes,
        storage,
    )
    b.clear = clear
    b.first_backward = first_backward
    for spec in specs:
        emitter = LayerEmitter(b, spec)
        if spec.output_is_input:
            b.declare(emitter.output, (batch, *spec.out_shape), alias_of=emitter.inputs[0])
        else:
            b.declare(emitter.output, (batch, *spec.out_shape))
        b.emitting = emitter
        emit(spec, emitter)
        b.program.layer_ends.append(len(b.program.steps))
    if training:
        for spec in reversed(specs[first_backward:]):
            delta = Tensor(spec.index, "delta")
            if delta not in b.tensors or b.owner[delta] not in b.written:
                continue
            emitter = LayerEmitter(b, spec)
            b.emitting = emitter
            emit_backward(spec, emitter)
        b.program.layer_ends.append(len(b.program.steps))
        if keep_deltas:
            deltas = frozenset(t for t in b.tensors if t.role == "delta")
            b.program.keep = b.program.keep | deltas
    return b.program
