"""What the GPU executor binds to device memory: programs (``GpuBoundProgram``: a buffer per
planned slot, kernel steps packed as dispatches, host steps wrapped with their transfers),
layer outputs left on the device (``DeviceArray``) and update steps (``DeviceSteps``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from darknet_metal.cpu.executor import StepList
from darknet_metal.cpu.fill import copy_finite
from darknet_metal.errors import DeviceError
from darknet_metal.metal import aligned_empty, registry
from darknet_metal.metal.dispatch import Dispatch, pack
from darknet_metal.metal.work import NO_LAYER, dispatch_tag
from darknet_metal.runtime.memory import MemoryPlan, plan_memory
from darknet_metal.runtime.phases import PhaseClock
from darknet_metal.runtime.program import (
    INPUT,
    STORED_DTYPE,
    HostStep,
    KernelStep,
    Param,
    Program,
    Tensor,
)
from darknet_metal.runtime.staging import check_finite_input, run_staged_passes, stage_in_parts

__all__ = ["DeviceArray", "DeviceParams", "DeviceSteps", "GpuBoundProgram", "HostCall", "Item",
           "item"]

#: A dispatch ready to encode: the packed dispatch, the byte offset of each bound buffer (None:
#: all 0) and its profile tag.
Item = tuple[Dispatch, tuple[int, ...] | None, int]

#: Step lists a program keeps (``GpuBoundProgram.step_list``): a trainer alternates a few.
MAX_STEP_LISTS = 4


def item(kernel: str, buffers: Mapping[str, Any], args: Mapping[str, int | float],
         sizes: Mapping[str, int], offsets: tuple[int, ...] | None = None,
         layer: int = NO_LAYER) -> Item:
    """The ``Item`` of kernel ``kernel`` over ``buffers`` by role (``offsets``: bytes, in the
    registry's binding order)."""
    return (pack(kernel, buffers, args, sizes), offsets,
            dispatch_tag(kernel, args, sizes, layer))


class GuardSteps(Protocol):
    """The device part of a step's guard (``gpu_training.DeviceGuard``): what the step's
    command buffer runs before its passes, after them, and after the update."""

    before: list[Item]
    after_passes: list[Item]
    after_update: list[Item]
    #: Set once a step ran ``before`` (what it keeps is then the step's start).
    kept: bool


class DeviceParams(Protocol):
    """What binding a program needs of its executor: the shim device, the resident
    parameters' buffers, and the pass counter outputs are checked against."""

    device: Any
    generation: int
    #: Where the host's time of a call goes (``runtime.phases``).
    phases: PhaseClock

    def param_buffer(self, ref: Param) -> Any:
        """The device buffer of a resident parameter or training array."""


class DeviceArray:
    """A layer output that stays on the device until read.

    ``shape`` (N, C, H, W), ``dtype`` float32 (what ``numpy()`` returns; an fp16 network's
    outputs are held as half and converted), ``nbytes`` (held on the device). ``numpy()`` or
    ``np.asarray`` downloads it (waiting for the pass that computes it). Valid until the next
    forward pass of the same backend, which reuses the buffer: reading it later raises
    DeviceError.
    """

    __slots__ = ("_backend", "_buffer", "_generation", "_staged", "_stored", "dtype", "shape")

    def __init__(
        self, backend: DeviceParams, buffer: Any, shape: tuple[int, ...], generation: int,
        stored: np.dtype | type = np.float32, staged: np.ndarray | None = None,
    ) -> None:
        self._backend = backend
        self._buffer = buffer
        self._generation = generation
        #: A host array the pass copies the output into (``buffer`` wraps it), or None.
        self._staged = staged
        self._stored = np.dtype(stored)
        self.shape = shape
        self.dtype = np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self._stored.itemsize

    def numpy(self) -> np.ndarray:
        """A new host array with the contents (downloads ``nbytes`` bytes)."""
        if self._generation != self._backend.generation:
            raise DeviceError(
                "this output belongs to an earlier forward pass whose buffers were reused by "
                "a later pass of the same backend (from this thread or another); read outputs "
                "before the next forward, or use Network.forward, which returns copies"
            )
        if self._staged is not None:
            self._buffer.sync()  # waits for the pass; the wrapped array is then current
            out = np.empty(self.shape, self._stored)
            copy_finite(self._staged, out)  # the copy, split across the CPU threads
        else:
            out = np.empty(self.shape, self._stored)
            self._buffer.read_into(out)
        return out if self._stored == np.float32 else out.astype(np.float32)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, device={self._backend.device.kind!r})"


class HostCall:
    """A host step inside a device pass: commit what is encoded, download the step's inputs
    (one wait), run its native steps (bound once to host copies), upload its outputs; counts
    one ``cpu_fallback``."""

    def __init__(self, device: Any, step: HostStep, reads: list[tuple[Any, np.ndarray]],
                 writes: list[tuple[Any, np.ndarray]]) -> None:
        self.device = device
        self.step = step
        self.reads = reads
        self.writes = writes
        self.native = StepList(step.bind([h for _, h in reads], [h for _, h in writes]))

    def __call__(self) -> None:
        self.device.commit()
        for buf, host in self.reads:
            buf.read_into(host)
        self.native.run()
        for buf, host in self.writes:
            buf.write(host)
        self.device.count_fallback(1)


class GpuBoundProgram:
    """A program bound to device memory: a buffer per memory slot, every kernel step packed
    as a dispatch, every host step wrapped with its transfers, and the dispatch lists a pass
    encodes (cut at each host step)."""

    def __init__(self, backend: DeviceParams, program: Program) -> None:
        device = backend.device
        self.device = device
        self.phases = backend.phases
        self.program = program
        self.last_encode_seconds = 0.0
        #: Host arrays the passes stage through, wrapped once (id -> (array, buffer)).
        self.wrapped: dict[int, tuple[np.ndarray, Any]] = {}
        self.memory: MemoryPlan = plan_memory(program)
        self.buffers = [device.buffer(n) for n in self.memory.slot_bytes]
        self.placeholder = device.buffer(4)
        self.lists: list[Any] = []
        #: Whole steps' dispatch lists (``step_list``), oldest first.
        self.step_lists: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._staged_input: np.ndarray | None = None
        self._pass_list: Any = None
        #: Per kept layer, the host array a whole pass copies its output into (``pass_list``).
        self.staged_outputs: dict[int, np.ndarray] = {}
        #: How many streams' pass rings hold this program (a held program is never evicted).
        self.holders = 0
        try:
            self.input_buffer = self.buffer(INPUT)
            #: Per program step: its packed dispatch, or the host call running it.
            self.steps: list[Dispatch | HostCall] = [
                self._pack(backend, step) if isinstance(step, KernelStep)
                else self._host(device, step)
                for step in program.steps
            ]
            #: Per kernel step: its profile tag (``metal.work``).
            self.tags: dict[int, int] = {
                i: dispatch_tag(step.kernel, step.args, step.sizes, step.layer)
                for i, step in enumerate(program.steps) if isinstance(step, KernelStep)
            }
            #: Per step with offsets: the byte offset of each bound buffer, in index order.
            self.offsets: dict[int, tuple[int, ...]] = {
                i: tuple(b.itemsize * step.offsets.get(b.role, 0)
                         for b in registry.kernel(step.kernel).bindings)
                for i, step in enumerate(program.steps)
                if isinstance(step, KernelStep) and step.offsets
            }
            #: What a pass runs, in order: a dispatch list's ``encode`` or a host step.
            self.segments: list[Callable[[], None]] = []
            current = None
            for i, step in enumerate(self.steps):
                if isinstance(step, HostCall):
                    self.segments.append(step)
                    current = None
                    continue
                if current is None:
                    current = device.dispatch_list(len(self.steps))
                    self.lists.append(current)
                    self.segments.append(current.encode)
                current.add(*step, offsets=self.offsets.get(i), tag=self.tags[i])
        except BaseException:
            self.release()
            raise

    @property
    def host_steps(self) -> bool:
        """Whether a pass runs host steps (CPU fallback layers) between its dispatches."""
        return any(isinstance(step, HostCall) for step in self.steps)

    def staged_input(self) -> np.ndarray:
        """The page-aligned host array a whole pass takes its input from (``pass_list``),
        made and wrapped resident on first use: the device reads it in place, or (``cuda``)
        keeps a copy of its own that ``stage_input`` updates part by part."""
        if self._staged_input is None:
            spec = self.program.tensors[INPUT]
            staged = aligned_empty(spec.shape, STORED_DTYPE[self.program.storage],
                                   int(self.device.info["page_size"]))
            self.wrap(staged).set_resident()
            self._staged_input = staged
        return self._staged_input

    def stage_input(self, x: np.ndarray) -> None:
        """Copies a whole pass's float32 input ``x`` (the program's input shape) into
        ``staged_input``, checking it finite in the same read, part by part
        (``stage_in_parts``: each part's upload overlaps the next part's copy).
        ArgumentError (``check_finite_input``) when ``x`` holds NaN or an infinity."""
        staged = self.staged_input()
        if not stage_in_parts(x, staged, self.wrap(staged)):
            check_finite_input(x)

    def pass_list(self, outputs: Sequence[int]) -> Any:
        """One dispatch list of a whole pass: the staged input copied in, every step, and the
        outputs of layers ``outputs`` copied into host arrays of their own
        (``staged_outputs``, wrapped resident: a driver with memory of its own brings one
        back, from page-locked memory, when it is read). Programs without host steps; a driver that
        records lists replays it at once. Made on first use."""
        if self._pass_list is None:
            staged = self.staged_input()
            page = int(self.device.info["page_size"])
            items = [self.copy_item(staged, 0, self.input_buffer, staged.size)]
            items.extend((step, self.offsets.get(i), self.tags[i])
                         for i, step in enumerate(self.steps))
            stored = STORED_DTYPE[self.program.storage]
            for layer in outputs:
                t = Tensor(layer, "output")
                shape = self.program.tensors[t].shape
                n = int(np.prod(shape))
                # Whole pages, wrapped whole: a driver locks them for its copies.
                pages = aligned_empty((-(-n * stored.itemsize // page) * page // stored.itemsize,),
                                      stored, page)
                items.append(self.copy_item(self.buffer(t), 0, pages, n))
                # Only written by the device: it comes back when read, never goes up.
                self.wrap(pages).set_resident()
                self.staged_outputs[layer] = pages[:n].reshape(shape)
            self._pass_list = self._list_of(items)
        return self._pass_list

    def buffer(self, t: Tensor) -> Any:
        return self.buffers[self.memory.slot_of[t]]

    def device_commit_and_wait(self) -> None:
        self.phases.mark("submit")
        self.device.commit()
        self.phases.mark("wait")
        self.device.synchronize()

    def _pack(self, backend: DeviceParams, step: KernelStep) -> Dispatch:
        buffers = {
            role: None if ref is None
            else backend.param_buffer(ref) if isinstance(ref, Param)
            else self.buffer(ref)
            for role, ref in step.buffers.items()
        }
        name, args, bound, grid, group = pack(step.kernel, buffers, step.args, step.sizes)
        # A role the kernel leaves alone still needs a buffer at its index (Metal's
        # validation and the emulator refuse an unbound one).
        bound = tuple(self.placeholder if b is None else b for b in bound)
        return name, args, bound, grid, group

    def _host(self, device: Any, step: HostStep) -> HostCall:
        # One host array per memory owner: a tensor a step reads and writes (a gradient it
        # adds into) or two aliases of one memory must be the same array on the host too.
        owners: dict[Tensor, np.ndarray] = {}

        def host(t: Tensor) -> np.ndarray:
            owner = self.memory.owner[t]
            if owner not in owners:
                owners[owner] = self._host_array(owner)
            return owners[owner].reshape(self.program.tensors[t].shape)

        reads = [(self.buffer(t), host(t)) for t in step.reads]
        writes = [(self.buffer(t), host(t)) for t in step.writes]
        return HostCall(device, step, reads, writes)

    def _host_array(self, t: Tensor) -> np.ndarray:
        spec = self.program.tensors[t]
        return np.empty(spec.shape, np.float32 if spec.dtype is None else spec.dtype)

    def run(self, x: np.ndarray) -> None:
        """One pass on ``x`` (the program's input shape, float32): upload, encode every
        segment, commit and wait. ``last_encode_seconds``: the host's part before the
        commit (upload and encoding; host steps included when there are any)."""
        start = time.perf_counter()
        self.phases.mark("encode")
        self.input_buffer.write(np.ascontiguousarray(x, np.float32))
        for segment in self.segments:
            segment()
        self.last_encode_seconds = time.perf_counter() - start
        self.device_commit_and_wait()

    def run_passes(self, x: np.ndarray, stage_in: Sequence[tuple[np.ndarray, np.ndarray]],
                   stage_out: Sequence[tuple[np.ndarray, np.ndarray]],
                   then: DeviceSteps | None = None, guard: GuardSteps | None = None) -> None:
        """``CpuBackend``'s ``run_passes`` in one command buffer and one wait: every array
        is page-aligned host memory the device shares (the batch ``x`` included: no upload),
        and the staging copies are kernels between the passes. With ``guard``, its
        dispatches before the passes, after them and after ``then``. The whole step is one
        dispatch list, made on the first run with these arrays and replayed after (a driver
        that records lists replays the recording: one launch on ``cuda``)."""
        if any(isinstance(step, HostCall) for step in self.steps):
            # Host steps commit and wait anyway: stage on the host, pass by pass.
            self.phases.mark("encode")
            if guard is not None:
                self._dispatch(guard.before)
            run_staged_passes(self.run, self.program.tensors[INPUT].shape[0], x, stage_in,
                              stage_out)
            self.phases.mark("encode")
            self._dispatch(_after_passes(then, guard))
            self.device_commit_and_wait()
        else:
            start = time.perf_counter()
            self.phases.mark("encode")
            self.step_list(x, stage_in, stage_out, then, guard).encode()
            self.last_encode_seconds = time.perf_counter() - start
            self.device_commit_and_wait()
        if guard is not None:
            guard.kept = True

    def step_list(self, x: np.ndarray, stage_in: Sequence[tuple[np.ndarray, np.ndarray]],
                  stage_out: Sequence[tuple[np.ndarray, np.ndarray]],
                  then: DeviceSteps | None, guard: GuardSteps | None) -> Any:
        """The dispatch list of a whole step (``run_passes``) over these arrays, made once
        and kept (the last ``MAX_STEP_LISTS``)."""
        key = (id(x), x.shape, tuple((id(a), id(b)) for a, b in stage_in),
               tuple((id(a), id(b)) for a, b in stage_out), id(then), id(guard))
        found = self.step_lists.pop(key, None)
        if found is None:
            items: list[Item] = [] if guard is None else list(guard.before)
            m = self.program.tensors[INPUT].shape[0]
            per_image = x[0].size
            for s in range(x.shape[0] // m):
                items.append(self.copy_item(x, s * m * per_image, self.input_buffer,
                                            m * per_image))
                for whole, per_pass in stage_in:
                    items.append(self.copy_item(whole, s * per_pass.size, per_pass,
                                                per_pass.size))
                items.extend((step, self.offsets.get(i), self.tags[i])
                             for i, step in enumerate(self.steps))
                for per_pass, whole in stage_out:
                    items.append(self.copy_item(per_pass, 0, whole, per_pass.size,
                                                s * per_pass.size))
            items.extend(_after_passes(then, guard))
            # What the list binds stays alive with it (a staged array's wrap is the program's).
            found = (self._list_of(items), (x, stage_in, stage_out, then, guard))
            while len(self.step_lists) >= MAX_STEP_LISTS:
                oldest = next(iter(self.step_lists))
                self.step_lists.pop(oldest)[0].close()
        self.step_lists[key] = found
        return found[0]

    def _list_of(self, items: Sequence[Item]) -> Any:
        """A dispatch list of ``items``, in order."""
        lst = self.device.dispatch_list(len(items))
        for dispatch, offsets, tag in items:
            lst.add(*dispatch, offsets=offsets, tag=tag)
        return lst

    def _dispatch(self, items: Sequence[Item]) -> None:
        for dispatch, offsets, tag in items:
            self.device.dispatch(*dispatch, offsets=offsets, tag=tag)

    def wrap(self, array: np.ndarray) -> Any:
        """The device buffer over page-aligned host ``array`` (wrapped on first use, kept
        with the program)."""
        held = self.wrapped.get(id(array))
        if held is None or held[0] is not array:
            buf = self.device.upload(array, zero_copy=True)
            if not buf.wrapped:
                buf.release()
                raise DeviceError("a staged array is not page-aligned")
            held = self.wrapped[id(array)] = (array, buf)
        return held[1]

    def copy_item(self, src: Any, src_at: int, dst: Any, n: int, dst_at: int = 0) -> Item:
        """dst[dst_at:dst_at+n] = src[src_at:src_at+n] (elements of the program's storage
        type) as a kernel; arrays are wrapped, device buffers used as they are."""
        buffers = {"src": src if not isinstance(src, np.ndarray) else self.wrap(src),
                   "dst": dst if not isinstance(dst, np.ndarray) else self.wrap(dst)}
        storage = self.program.storage
        itemsize = STORED_DTYPE[storage].itemsize
        return item(f"copy_buf_{storage}", buffers, {"n": n}, {"n": n},
                    offsets=(itemsize * src_at, itemsize * dst_at))

    def copy(self, src: Any, src_at: int, dst: Any, n: int, dst_at: int = 0) -> None:
        """``copy_item``, dispatched now."""
        self._dispatch([self.copy_item(src, src_at, dst, n, dst_at)])

    def read(self, t: Tensor) -> np.ndarray:
        """A new host array with tensor ``t`` (downloaded after the last ``run``)."""
        out = self._host_array(t)
        self.buffer(self.memory.owner[t]).read_into(out)
        return out

    def release(self) -> None:
        # The lists first: they hold the buffers, which return to the pool once both let go.
        for dispatch_list in self.lists:
            dispatch_list.close()
        self.lists = []
        for lst, _ in self.step_lists.values():
            lst.close()
        self.step_lists = {}
        if self._pass_list is not None:
            self._pass_list.close()
            self._pass_list = None
        self._staged_input = None
        self.staged_outputs = {}
        self.segments = []
        for b in self.buffers:
            b.release()
        self.buffers = []
        self.placeholder.release()
        for _, buf in self.wrapped.values():
            buf.release()
        self.wrapped = {}


def _after_passes(then: DeviceSteps | None, guard: GuardSteps | None) -> list[Item]:
    """What a step runs after its passes: the guard's check of the gradients, the update,
    the guard's check of the parameters."""
    items = [] if guard is None else list(guard.after_passes)
    if then is not None:
        items.extend(then.items)
        if guard is not None:
            items.extend(guard.after_update)
    return items


class DeviceSteps:
    """Kernel steps over parameters and a few named scalar buffers (``items``, also in one
    dispatch list); ``run`` encodes them, commits and waits."""

    def __init__(self, device: Any, scalars: dict[str, Any]) -> None:
        self.device = device
        self.scalars = scalars
        self.list = device.dispatch_list()
        self.items: list[Item] = []

    def add(self, backend: DeviceParams, kernel: str, refs: Mapping[str, Param],
            **args: int | float) -> None:
        roles = registry.kernel(kernel).roles
        buffers = {role: self.scalars[role] if role in self.scalars
                   else backend.param_buffer(refs[role]) for role in roles}
        sizes = {"n": int(args["n"])}
        layer = next(iter(refs.values())).layer if refs else NO_LAYER
        added = item(kernel, buffers, args, sizes, layer=layer)
        self.list.add(*added[0], tag=added[2])
        self.items.append(added)

    def run(self, guard: GuardSteps | None = None) -> None:
        self.list.encode()
        if guard is not None:
            for dispatch, offsets, tag in guard.after_update:
                self.device.dispatch(*dispatch, offsets=offsets, tag=tag)
        self.device.commit()
        self.device.synchronize()

    def release(self) -> None:
        self.list.close()
        for buf in self.scalars.values():
            buf.release()
