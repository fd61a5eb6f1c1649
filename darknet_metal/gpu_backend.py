"""The GPU backend: runs ``LayerSpec``s as Metal kernels on ``device="metal"`` or ``"emu"``.

At load it chooses, per layer, the registry kernels that run it or a CPU fallback (with the
reason), builds their pipelines, and uploads the parameters once (batch norm folded exactly as
the CPU backend folds it). Per batch size and set of requested outputs it makes a *plan*: the
buffer of every tensor (``metal.planner``: an output's buffer is reused once its last reader
has run; requested outputs survive the pass), the im2col workspace, and every dispatch with its
arguments packed into a prepared dispatch list of the shim (``Device.plan``: checked once,
encoded by one call). A forward pass then only uploads the input (one write), encodes that
list into one command buffer and commits it once; nothing is allocated after the first pass
of a plan. Outputs stay on the device as ``DeviceArray``s: reading one waits for the pass
(the only wait) and downloads exactly its bytes.

A layer without kernels runs on the CPU: the pass commits what it has encoded, reads the
layer's inputs (one wait), runs the CPU reference layer, uploads its output and continues;
each such layer counts one ``cpu_fallback``. With fallbacks a pass commits once per fallback
plus once at its end.

Training fits this structure without changing it: a training plan keeps every activation a
backward kernel reads (``plan_storage`` with those layers in ``keep``), adds a gradient slot
per tensor planned the same way in reverse order (a gradient buffer freed after the last
backward reader), adds per-parameter gradient and optimizer-state buffers uploaded once beside
the weights, and appends the ``*_bwd_*`` and update dispatches to the same replay list, so one
training step is still one upload of the batch, one command buffer and one wait for the loss.
The master weights would then live on the device and ``load_params`` run only on load/save.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from darknet_metal.errors import DeviceError
from darknet_metal.layers import LayerSpec, Shape
from darknet_metal.metal import encoders, get_device, registry
from darknet_metal.metal.planner import INPUT, plan_storage
from darknet_metal.params import Params, fold_batchnorm

#: Plans kept per backend (one per (batch, requested outputs)); the oldest is freed beyond it.
MAX_PLANS = 4


@dataclass(frozen=True)
class LayerPlacement:
    """Where a layer runs: ``where`` is "kernels", "fallback" or "alias" (an identity layer whose
    output is its input's buffer); ``kernels`` the kernels it dispatches; ``reason`` why it
    falls back (None otherwise)."""

    index: int
    type: str
    where: str
    kernels: tuple[str, ...] = ()
    reason: str | None = None


class DeviceArray:
    """A layer output that stays on the device until read.

    ``shape`` (N, C, H, W), ``dtype`` float32, ``nbytes``. ``numpy()`` or ``np.asarray``
    downloads it (waiting for the pass that computes it). Valid until the next forward pass of
    the same backend, which reuses the buffer: reading it later raises DeviceError.
    """

    __slots__ = ("_backend", "_buffer", "_generation", "dtype", "shape")

    def __init__(
        self, backend: GpuBackend, buffer: Any, shape: tuple[int, ...], generation: int
    ) -> None:
        self._backend = backend
        self._buffer = buffer
        self._generation = generation
        self.shape = shape
        self.dtype = np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 4

    def numpy(self) -> np.ndarray:
        """A new host array with the contents (downloads ``nbytes`` bytes)."""
        if self._generation != self._backend.generation:
            raise DeviceError(
                "this output belongs to an earlier forward pass whose buffers "
                "were reused; read outputs before the next forward"
            )
        out = np.empty(self.shape, np.float32)
        self._buffer.read_into(out)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, device={self._backend.device.kind!r})"


@dataclass
class _Plan:
    batch: int
    buffers: list[Any]
    slot_of: dict[int, int]
    input_buffer: Any
    workspace: Any
    steps: list[Any] = field(default_factory=list)
    layer_ends: list[int] = field(default_factory=list)  # steps index after each layer
    # What a pass runs, in order: the ``encode`` of a prepared dispatch list (a run of kernel
    # steps) or a CPU fallback. Without fallbacks, one list holds the whole pass.
    segments: list[Callable[[], None]] = field(default_factory=list)
    lists: list[Any] = field(default_factory=list)  # the shim Plans behind ``segments``

    def prepare(self, device: Any) -> None:
        """Packs the kernel steps into shim dispatch lists, cut at each CPU fallback."""
        current = None
        for step in self.steps:
            if step[0] is None:
                self.segments.append(step[1])
                current = None
                continue
            if current is None:
                current = device.plan(len(self.steps))
                self.lists.append(current)
                self.segments.append(current.encode)
            current.add(*step)

    def release(self) -> None:
        # The lists first: they hold the buffers, which return to the pool once both let go.
        for dispatch_list in self.lists:
            dispatch_list.close()
        self.lists = []
        self.segments = []
        for b in self.buffers:
            b.release()
        if self.workspace is not None:
            self.workspace.release()


class GpuBackend:
    """Executes a network's layers with Metal kernels on ``device`` ("metal" or "emu").

    Same interface as ``CpuBackend`` (``load_params``, ``forward``) plus ``coverage()``.
    ``gemm``: "auto" (``simdgroup_matrix`` GEMMs when the device has them, else the tiled
    ones; the tiled ones on the emulator, where they are much faster), "simd" or "tiled".
    ``fallback``: layer indices forced onto the CPU (for testing the fallback path).
    """

    def __init__(
        self,
        specs: list[LayerSpec],
        params: dict[int, Params],
        dtype: np.dtype | type = np.float32,
        *,
        device: str = "emu",
        gemm: str = "auto",
        fallback: Collection[int] = (),
    ) -> None:
        if np.dtype(dtype) != np.float32:
            raise DeviceError(
                f"device '{device}' computes in float32 only, not "
                f"{np.dtype(dtype)}; use device='cpu' for float64"
            )
        if gemm not in ("auto", "simd", "tiled"):
            raise ValueError(f"gemm must be 'auto', 'simd' or 'tiled', not {gemm!r}")
        self.name = device
        self.specs = specs
        self.dtype = np.dtype(np.float32)
        self.device = get_device(device)
        info = self.device.info
        if gemm == "auto":
            # The emulator runs simdgroup_matrix with every lane holding the whole 8x8 tile
            # (about 20x slower than the tiled GEMM there): it is a correctness model only.
            self.simd = bool(info["simdgroup_matrix"]) and device != "emu"
        else:
            self.simd = gemm == "simd"
        self.generation = 0
        #: Host seconds spent encoding the last pass (upload, dispatch replay, commit).
        self.last_encode_seconds = 0.0
        self._placements = [self._place(spec, set(fallback)) for spec in specs]
        self._aliases = {p.index for p in self._placements if p.where == "alias"}
        self._params_buffers: list[Any] = []
        self._resources: dict[int, encoders.LayerResources] = {}
        self._cpu: Any = None
        self._plans: OrderedDict[tuple[int, frozenset[int] | None], _Plan] = OrderedDict()
        self.load_params(params)

    # -- load time -------------------------------------------------------------------------

    def _place(self, spec: LayerSpec, forced: set[int]) -> LayerPlacement:
        if spec.kind in registry.IDENTITY_KINDS:
            return LayerPlacement(spec.index, spec.kind, "alias")
        if spec.index in forced:
            return LayerPlacement(
                spec.index, spec.kind, "fallback", reason="CPU fallback requested"
            )
        try:
            names = encoders.layer_kernels(spec, self.simd)
        except KeyError as e:
            return LayerPlacement(spec.index, spec.kind, "fallback", reason=str(e.args[0]))
        max_threads = self.device.info["max_threads_per_threadgroup"]
        for name in names:
            try:
                pipeline = self.device.pipeline_info(name)
            except DeviceError as e:
                return LayerPlacement(
                    spec.index, spec.kind, "fallback", reason=f"kernel {name} unavailable: {e}"
                )
            group = registry.kernel(name).grid.threads_per_group
            if group > min(pipeline["max_total_threads"], max_threads):
                return LayerPlacement(
                    spec.index,
                    spec.kind,
                    "fallback",
                    reason=f"kernel {name} needs {group} threads per threadgroup; the "
                    f"pipeline allows {pipeline['max_total_threads']}",
                )
        return LayerPlacement(spec.index, spec.kind, "kernels", tuple(names))

    def coverage(self) -> list[LayerPlacement]:
        """Per layer: kernels, fallback (with the reason) or alias."""
        return list(self._placements)

    def load_params(self, params: dict[int, Params]) -> None:
        """(Re)upload the inference parameters from the master copies in ``params``."""
        self._drop_plans()
        for b in self._params_buffers:
            b.release()
        self._params_buffers = []
        self._resources = {}
        fallback_specs = []
        for spec, place in zip(self.specs, self._placements, strict=True):
            res = encoders.LayerResources()
            if place.where == "fallback":
                fallback_specs.append(spec)
            elif spec.kind in ("convolutional", "connected"):
                w, b = fold_batchnorm(params[spec.index])
                res.weights = self._upload(w)
                res.biases = self._upload(b)
            elif spec.kind == "shortcut" and spec.values["weights_type"] != "none":
                weights = self._upload(params[spec.index]["weights"])
                res.table = self.device.buffer(4 * len(spec.inputs) * spec.out_shape[0])
                self._params_buffers.append(res.table)
                self.device.dispatch(*encoders.shortcut_table_dispatch(spec, weights, res.table))
            self._resources[spec.index] = res
        self.device.commit()
        self._cpu = None
        if fallback_specs:
            from darknet_metal.cpu_backend import CpuBackend

            self._cpu = CpuBackend(fallback_specs, params, np.float32)

    def _upload(self, array: np.ndarray) -> Any:
        buf = self.device.upload(np.ascontiguousarray(array, np.float32))
        self._params_buffers.append(buf)
        return buf

    # -- planning --------------------------------------------------------------------------

    def _drop_plans(self) -> None:
        while self._plans:
            _, plan = self._plans.popitem(last=False)
            plan.release()

    def _plan(self, batch: int, keep: frozenset[int] | None) -> _Plan:
        key = (batch, keep)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        while len(self._plans) >= MAX_PLANS:
            _, old = self._plans.popitem(last=False)
            old.release()
        storage = plan_storage(self.specs, batch, keep, self._aliases)
        buffers = [self.device.buffer(n) for n in storage.slot_bytes]
        ws_floats = max(
            (
                encoders.im2col_floats(s, batch)
                for s, p in zip(self.specs, self._placements, strict=True)
                if p.where == "kernels"
            ),
            default=0,
        )
        workspace = self.device.buffer(4 * ws_floats) if ws_floats else None
        plan = _Plan(batch, buffers, storage.slot_of, buffers[storage.slot_of[INPUT]], workspace)
        shapes: dict[int, Shape] = {INPUT: self.specs[0].in_shape}
        shapes.update({s.index: s.out_shape for s in self.specs})
        for spec, place in zip(self.specs, self._placements, strict=True):
            ins = [buffers[storage.slot_of[i]] for i in spec.inputs]
            out = buffers[storage.slot_of[spec.index]]
            if place.where == "kernels":
                res = self._resources[spec.index]
                res.workspace = workspace
                plan.steps.extend(
                    encoders.layer_dispatches(
                        spec, batch, ins, [shapes[i] for i in spec.inputs], out, res, self.simd
                    )
                )
            elif place.where == "fallback":
                plan.steps.append(
                    self._fallback_step(spec, batch, ins, [shapes[i] for i in spec.inputs], out)
                )
            plan.layer_ends.append(len(plan.steps))
        try:
            plan.prepare(self.device)
        except BaseException:
            plan.release()
            raise
        self._plans[key] = plan
        return plan

    def _fallback_step(
        self, spec: LayerSpec, batch: int, ins: list[Any], in_shapes: list[Shape], out: Any
    ) -> tuple[None, Callable[[], None]]:
        hosts = [np.empty((batch, *shape), np.float32) for shape in in_shapes]
        result = np.empty((batch, *spec.out_shape), np.float32)
        cpu, device = self._cpu, self.device

        def run() -> None:
            device.commit()
            for buf, host in zip(ins, hosts, strict=True):
                buf.read_into(host)
            cpu.run_layer(spec, hosts, result)
            out.write(result)
            device.count_fallback(1)

        return (None, run)

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
        plan = self._plan(x.shape[0], keep)
        self.generation += 1
        dispatch = self.device.dispatch
        start = time.perf_counter()
        plan.input_buffer.write(x)
        if timings is None:
            for segment in plan.segments:
                segment()
            self.device.commit()
            self.last_encode_seconds = time.perf_counter() - start
        else:
            first = 0
            for end in plan.layer_ends:
                t0 = time.perf_counter()
                for step in plan.steps[first:end]:
                    if step[0] is None:
                        step[1]()
                    else:
                        dispatch(*step)
                self.device.synchronize()
                timings.append(time.perf_counter() - t0)
                first = end
        result: list[DeviceArray | None] = []
        for spec in self.specs:
            if keep is None or spec.index in keep:
                buf = plan.buffers[plan.slot_of[spec.index]]
                result.append(
                    DeviceArray(self, buf, (plan.batch, *spec.out_shape), self.generation)
                )
            else:
                result.append(None)
        return result

    def close(self) -> None:
        """Releases every device buffer this backend holds."""
        self._drop_plans()
        for b in self._params_buffers:
            b.release()
        self._params_buffers = []
