"""The GPU executor: runs a network's programs as Metal kernels on "metal", "emu" or "cuda".

At load it places each layer: its op's kernel steps (``emit_device_forward``), an alias (an
identity layer), or a CPU fallback with the reason (the op raised ``Unsupported``, a kernel's
pipeline is missing or too small, or the caller asked for it). It uploads each op's
``device_params`` once (batch norm folded exactly as on the CPU) and runs its
``emit_device_setup`` kernels. Per (batch, requested outputs) it builds the program, plans its
memory (``darknet_metal.runtime.memory``: a buffer per slot, reused once its last reader has run;
workspaces are planned tensors; requested outputs survive the pass), binds every kernel
step's roles to those buffers and packs the steps into the shim's prepared dispatch lists
(checked once, encoded by one call each). A forward pass then only uploads the input (one
write), encodes the lists into one command buffer and commits it once; nothing is allocated
after the first pass of a program. Outputs stay on the device as ``DeviceArray``s: reading
one waits for the pass (the only wait) and downloads exactly its bytes.

A fallback layer is a host step: the pass commits what it has encoded, reads the layer's
inputs (one wait), runs the op's native CPU steps, uploads its output and continues; each
counts one ``cpu_fallback``, so a pass with fallbacks commits once per fallback plus once at
its end.

Training programs add, per op, what its backward keeps and the gradient tensors (planned the
same way) and the backward kernel steps; the training state (parameters, gradients, moments)
is page-aligned host memory the device uses in place, and the update kernels run after the
passes in the same command buffer, so one training step is one command buffer and one wait.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.errors import ArgumentError, DeviceError, Unsupported
from darknet_metal.metal import get_device, registry
from darknet_metal.metal.dispatch import pack
from darknet_metal.metal.work import dispatch_tag
from darknet_metal.model.cfg import Shape
from darknet_metal.model.weights import Params
from darknet_metal.runtime.backend import ExecutorEvents
from darknet_metal.runtime.gpu_program import DeviceArray, GpuBoundProgram, HostCall
from darknet_metal.runtime.gpu_training import GpuTraining
from darknet_metal.runtime.layer import Layer
from darknet_metal.runtime.pass_ring import PassRing
from darknet_metal.runtime.phases import PhaseClock
from darknet_metal.runtime.placement import LayerPlacement
from darknet_metal.runtime.program import (
    STORAGE,
    STORED_DTYPE,
    KernelStep,
    LayerEmitter,
    Param,
    Program,
    Tensor,
    build_program,
)
from darknet_metal.runtime.program_cache import MAX_PROGRAMS, ProgramCache, TrainingPrograms
from darknet_metal.runtime.staging import check_finite_input

if TYPE_CHECKING:
    from darknet_metal.runtime.train_state import TrainState

#: Input sizes whose layer placements are kept (``GpuBackend.resize``).
MAX_PLACEMENTS = 32


class GpuBackend(GpuTraining):
    """Executes a network's layers with Metal kernels on ``device`` ("metal", "emu" or "cuda").

    Same interface as ``CpuBackend`` (``load_params``, ``forward``, ``close``) plus
    ``coverage()``. ``gemm``: "auto" (``simdgroup_matrix`` GEMMs on a Mac whose GPU has them,
    else the tiled ones: the emulator and the CUDA translation run the 8x8 matrices on lanes,
    a correctness model of Apple's path, several times slower than the tiled GEMM there),
    "simd" or "tiled". ``fallback``: layer indices forced onto the CPU (for testing the
    fallback path).
    """

    def __init__(
        self,
        specs: list[Layer],
        params: dict[int, Params],
        dtype: np.dtype | type = np.float32,
        *,
        device: str = "emu",
        gemm: str = "auto",
        fallback: Collection[int] = (),
        precision: str = "fp32",
    ) -> None:
        if precision not in STORAGE:
            raise ArgumentError(f"precision must be one of {', '.join(STORAGE)}, not "
                                f"{precision!r}")
        if np.dtype(dtype) != np.float32:
            raise DeviceError(
                f"device '{device}' computes in float32 only, not "
                f"{np.dtype(dtype)}; use device='cpu' for float64"
            )
        if gemm not in ("auto", "simd", "tiled"):
            raise ArgumentError(f"gemm must be 'auto', 'simd' or 'tiled', not {gemm!r}")
        self.name = device
        self.specs = specs
        self.dtype = np.dtype(np.float32)
        #: How activations and parameters are held on the device (``precision``).
        self.storage = STORAGE[precision]
        self.stored_dtype = STORED_DTYPE[self.storage]
        self.device = get_device(device)
        info = self.device.info
        if gemm == "auto":
            # The emulator (every lane holding the whole 8x8 tile, about 20x slower than the
            # tiled GEMM) and the CUDA translation (two elements a lane, measured on an H200
            # at 2.5 TFLOP/s where the tiled GEMM does 8) model Apple's simdgroup_matrix for
            # correctness only.
            self.simd = bool(info["simdgroup_matrix"]) and device == "metal"
        else:
            self.simd = gemm == "simd"
        self.generation = 0
        #: Host seconds spent encoding the last pass (upload, dispatch lists, commit).
        self.last_encode_seconds = 0.0
        #: Where the host's time of a call goes (enabled by ``Network.profile``).
        self.phases = PhaseClock()
        self._params: dict[Param, Any] = {}
        self._cpu_states: dict[int, Any] = {}
        #: Bound programs; one a stream's pass ring runs on stays.
        self._programs: ProgramCache[tuple[int, frozenset[int] | None], GpuBoundProgram] = (
            ProgramCache(MAX_PROGRAMS, release=self._release_bound,
                         held=lambda bound: bound.holders > 0))
        self._placements_by_shape: dict[Shape, list[LayerPlacement]] = {}
        self._forced = set(fallback)
        self._placements = self._place(self._forced)
        self._placements_by_shape[specs[0].in_shape] = self._placements
        self._check_half(self._placements)
        self._training_state: TrainState | None = None
        self._training_fallback: dict[int, str] | None = None
        self._training_programs: TrainingPrograms[tuple[Program, dict[int, str]]] = (
            TrainingPrograms())
        self._wrapped: dict[Param, tuple[np.ndarray, Any]] = {}
        self._arenas: list[tuple[np.ndarray, Any]] = []
        self._staged_batch: tuple[np.ndarray, Any] | None = None
        self._guards: dict[int, Any] = {}
        #: Pass rings of streams, by (program, kept outputs, depth).
        self._rings: dict[tuple[int, tuple[int, ...], int], PassRing] = {}
        self.events = ExecutorEvents()
        self.load_params(params)

    # -- load time -------------------------------------------------------------------------

    def _place(self, forced: set[int]) -> list[LayerPlacement]:
        reasons: dict[int, str] = {}

        def probe(spec: Layer, e: LayerEmitter) -> None:
            if spec.output_is_input:
                return
            if spec.index in forced:
                reasons[spec.index] = "CPU fallback requested"
            else:
                try:
                    spec.emit_device_setup(e)
                    spec.emit_device_forward(e)
                    return
                except Unsupported as exc:
                    reasons[spec.index] = str(exc)
            e.host(e.inputs, [e.output], _never_run)

        program = build_program(self.specs, probe, batch=1, keep=None, simd=self.simd,
                                param_nbytes=None, itemsize=self.stored_dtype.itemsize,
                                storage=self.storage)
        kernels: dict[int, list[str]] = {}
        for step in program.steps:
            if isinstance(step, KernelStep) and step.kernel not in kernels.get(step.layer, []):
                kernels.setdefault(step.layer, []).append(step.kernel)
        placements = []
        for spec in self.specs:
            names = tuple(kernels.get(spec.index, ()))
            if spec.output_is_input:
                placements.append(LayerPlacement(spec.index, spec.kind, "alias"))
                continue
            reason = reasons.get(spec.index) or self._pipeline_problem(names)
            if reason is not None:
                placements.append(LayerPlacement(spec.index, spec.kind, "fallback",
                                                 reason=reason))
            else:
                placements.append(LayerPlacement(spec.index, spec.kind, "kernels", names))
        return placements

    def _check_half(self, placements: Sequence[LayerPlacement]) -> None:
        # A CPU fallback would pass half tensors to the CPU layers, which compute in float32.
        if self.storage != "f16":
            return
        off = [p for p in placements if p.where == "fallback"]
        if off:
            raise DeviceError(
                "precision='fp16' needs every layer on the device's half-storage kernels; "
                + "; ".join(f"layer {p.index} ({p.kind}): {p.reason}" for p in off)
                + " (load with precision='fp32')")

    def _pipeline_problem(self, names: Sequence[str]) -> str | None:
        max_threads = self.device.info["max_threads_per_threadgroup"]
        for name in names:
            try:
                pipeline = self.device.pipeline_info(name)
            except DeviceError as e:
                return f"kernel {name} unavailable: {e}"
            group = registry.kernel(name).grid.threads_per_group
            if group > min(pipeline["max_total_threads"], max_threads):
                return (f"kernel {name} needs {group} threads per threadgroup; the pipeline "
                        f"allows {pipeline['max_total_threads']}")
        return None

    def resize(self, specs: list[Layer], params: dict[int, Params]) -> None:
        """Takes the layers of the same network at another input size (``Network.resize``):
        the parameters, which do not depend on the size, stay on the device; the inference
        programs of the old size are freed; the training programs of every size seen are
        kept (``build_training_program``). ``params``: the master copies, read only when a
        layer changes where it runs."""
        old = self._placements
        placements = self._placements_by_shape.get(specs[0].in_shape)
        self.specs = specs
        if placements is None:
            placements = self._place(self._forced)
            self._check_half(placements)
            if len(self._placements_by_shape) >= MAX_PLACEMENTS:
                self._placements_by_shape.clear()
            self._placements_by_shape[specs[0].in_shape] = placements
        self._placements = placements
        if any(a.where != b.where for a, b in zip(old, placements, strict=True)):
            self.load_params(params)
            return
        self._drop_programs()
        if self._cpu_states:
            self.sync_training()  # the master copies are read below
        # CPU fallbacks prepare their parameters for the layer's shapes (Winograd filters).
        self._cpu_states = {i: self.specs[i].prepare_cpu(params.get(i), np.float32)
                            for i in self._cpu_states}

    def coverage(self) -> list[LayerPlacement]:
        """Per layer: kernels, fallback (with the reason) or alias."""
        return list(self._placements)

    def load_params(self, params: dict[int, Params]) -> None:
        """(Re)upload the inference parameters from the master copies in ``params``."""
        self.sync_training()  # training's arrays may be the master copies
        self._drop_programs()
        self._release_params()
        placed = [(spec, place.where) for spec, place in zip(self.specs, self._placements,
                                                              strict=True)]
        self._cpu_states = {spec.index: spec.prepare_cpu(params.get(spec.index), np.float32)
                            for spec, where in placed if where == "fallback"}
        on_device = [spec for spec, where in placed if where == "kernels"]
        on_device_indices = {spec.index for spec in on_device}
        for spec in on_device:
            for name, value in spec.device_params(params.get(spec.index)).items():
                if isinstance(value, np.ndarray):
                    buf = self.device.upload(np.ascontiguousarray(value, self.stored_dtype))
                else:
                    buf = self.device.buffer(int(value))
                self._params[Param(spec.index, name)] = buf
        sizes = {ref: buf.nbytes for ref, buf in self._params.items()}
        setup = build_program(
            self.specs,
            lambda spec, e: spec.emit_device_setup(e) if spec.index in on_device_indices else None,
            batch=1, keep=(), simd=self.simd, param_nbytes=sizes,
            itemsize=self.stored_dtype.itemsize, storage=self.storage,
        )
        for step in setup.steps:
            buffers = {role: None if ref is None else self._params[ref]
                       for role, ref in step.buffers.items()}
            self.device.dispatch(*pack(step.kernel, buffers, step.args, step.sizes),
                                 tag=dispatch_tag(step.kernel, step.args, step.sizes, step.layer))
        self.device.commit()

    def param_buffer(self, ref: Param) -> Any:
        """The device buffer of a parameter, or of a training array (the training state's
        own memory, wrapped once per array)."""
        if not ref.group:
            return self._params[ref]
        array = self._training_state.layer(ref.layer).group(ref.group)[ref.name]
        held = self._wrapped.get(ref)
        if held is None or held[0] is not array:
            if held is not None:
                held[1].release()
            buf = self.device.upload(array, zero_copy=True)
            if not buf.wrapped:
                buf.release()
                raise DeviceError(f"layer {ref.layer}: training array {ref.name!r} "
                                  f"({ref.group}) is not page-aligned, so the device would "
                                  "train a copy of it")
            held = self._wrapped[ref] = (array, buf)
        return held[1]

    def _release_params(self) -> None:
        for b in self._params.values():
            b.release()
        self._params = {}

    # -- programs --------------------------------------------------------------------------

    def _drop_programs(self) -> None:
        self._programs.clear()

    def _release_bound(self, bound: GpuBoundProgram) -> None:
        """Frees a program and the pass rings over it."""
        self._rings = {key: ring for key, ring in self._rings.items() if ring.bound is not bound}
        bound.release()

    def _emit(self, spec: Layer, e: LayerEmitter) -> None:
        where = self._placements[spec.index].where
        if where == "kernels":
            spec.emit_device_forward(e)
        elif where == "fallback":
            size = spec.cpu_workspace(e.batch)
            workspace = np.empty(size, np.float32) if size else None

            def bind(reads: list[np.ndarray], writes: list[np.ndarray]) -> list[Any]:
                return spec.cpu_steps(self._cpu_states[spec.index], reads, writes[0], workspace)

            e.host(e.inputs, [e.output], bind, reason=self._placements[spec.index].reason)

    def _bound(self, batch: int, keep: frozenset[int] | None) -> GpuBoundProgram:
        def bind() -> GpuBoundProgram:
            program = build_program(
                self.specs, self._emit, batch=batch, keep=keep, simd=self.simd,
                param_nbytes={ref: buf.nbytes for ref, buf in self._params.items()},
                itemsize=self.stored_dtype.itemsize, storage=self.storage,
            )
            return GpuBoundProgram(self, program)

        return self._programs.get((batch, keep), bind)

    # -- running ---------------------------------------------------------------------------

    def forward(
        self,
        x: np.ndarray,
        timings: list[float] | None = None,
        outputs: Sequence[int] | None = None,
    ) -> list[DeviceArray | None]:
        """Run every layer on ``x`` (N, C, H, W) and return each layer's output as a
        ``DeviceArray`` (None for outputs not in ``outputs``, whose buffers were reused).

        ``outputs``: the layer indices the caller will read (None: all). With ``timings``,
        the wall time of each layer in seconds (encode, run and wait) is appended to it.
        """
        x = np.ascontiguousarray(x, np.float32)
        keep = None if outputs is None else frozenset(int(i) for i in outputs)
        bound = self._bound(x.shape[0], keep)
        self.generation += 1
        start = time.perf_counter()
        self.phases.mark("prepare")
        # Where the device has memory of its own, a pass's input and kept outputs travel
        # through page-locked host arrays, at the copy engines' rate, the input checked on
        # its way in; where it shares host memory, they are written and read in place.
        whole = (timings is None and self.storage == "f32" and not bound.host_steps
                 and keep is not None and not self.device.info["unified_memory"])
        if whole:
            bound.stage_input(x)
        else:
            check_finite_input(x)
            bound.input_buffer.write(np.ascontiguousarray(x, self.stored_dtype))
        if timings is None:
            self.phases.mark("encode")
            if whole:
                bound.pass_list(sorted(keep)).encode()
            else:
                for segment in bound.segments:
                    segment()
            self.phases.mark("submit")
            self.device.commit()
            self.last_encode_seconds = time.perf_counter() - start
        else:
            dispatch = self.device.dispatch
            first = 0
            for end in bound.program.layer_ends:
                t0 = time.perf_counter()
                for i in range(first, end):
                    step = bound.steps[i]
                    if isinstance(step, HostCall):
                        step()
                    else:
                        dispatch(*step, offsets=bound.offsets.get(i), tag=bound.tags[i])
                self.device.synchronize()
                timings.append(time.perf_counter() - t0)
                first = end
        result: list[DeviceArray | None] = []
        for spec in self.specs:
            if keep is None or spec.index in keep:
                staged = bound.staged_outputs.get(spec.index) if whole else None
                buf = (bound.buffer(Tensor(spec.index, "output")) if staged is None
                       else bound.wrap(staged))
                result.append(
                    DeviceArray(self, buf, (x.shape[0], *spec.out_shape), self.generation,
                                self.stored_dtype, staged=staged)
                )
            else:
                result.append(None)
        return result

    def wait(self) -> None:
        """Waits until the device has finished the work submitted."""
        self.device.synchronize()

    def hold_pass_ring(self, batch: int, outputs: Sequence[int], depth: int) -> PassRing | None:
        """``depth`` pass slots at ``batch`` keeping the outputs of layers ``outputs``, for a
        stream (see ``pass_ring.PassRing``), held until ``let_go_pass_ring``; None when the
        program has host steps (a CPU fallback layer): such passes wait for the device
        anyway and run one at a time through ``forward``."""
        keep = tuple(int(i) for i in outputs)
        bound = self._bound(batch, frozenset(keep))
        if bound.host_steps:
            return None
        ring = self._rings.get((id(bound), keep, depth))
        if ring is None or ring.bound is not bound:
            ring = self._rings[(id(bound), keep, depth)] = PassRing(bound, keep, depth)
        bound.holders += 1
        return ring

    def let_go_pass_ring(self, ring: PassRing) -> None:
        """Waits for the ring's passes in flight and lets its program be evicted again."""
        ring.drain()
        ring.bound.holders -= 1

    def close(self) -> None:
        """Releases every device buffer this backend holds."""
        self._drop_programs()
        self._training_programs.clear()
        self._release_params()
        for _, buf in self._wrapped.values():
            buf.release()
        self._wrapped = {}
        for guard in self._guards.values():
            guard.release()
        self._guards = {}
        if self._staged_batch is not None:
            self._staged_batch[1].release()
            self._staged_batch = None
        # The arenas stay with whoever holds their arrays (the network's parameters): they
        # are brought up to date before the device lets go of them.
        self.sync_training()
        for _, buf in self._arenas:
            buf.release()
        self._arenas = []


def _never_run(reads: list[Any], writes: list[Any]) -> list[Any]:
    raise AssertionError("placement probes are never bound")
