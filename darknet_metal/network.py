"""``Network``: a Darknet network loaded from a cfg (and weights), and its executor.

The network is the model (config, layers, parameters, ``seen``) and the executor that runs its
passes on a device. What other parts need of it is public: ``executor`` (built on first use),
``exclusive()`` (one pass or training step at a time), ``params_changed()`` (the parameters
were changed in place). Detection (``inference.Detector``, ``DetectionStream``) and training
(``trainer.Trainer``) are built around a network; ``detect``, ``stream``, ``train_step`` and
the other training calls here are conveniences that hold no state of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from darknet_metal import arguments
from darknet_metal.errors import (
    ArgumentError,
    ArgumentTypeError,
    CfgError,
    DeviceError,
)
from darknet_metal.inference.boxes import Detection, YoloHead
from darknet_metal.inference.detector import Detector, ImageSource
from darknet_metal.inference.stream import DetectionStream
from darknet_metal.model.cfg import NetConfig, Shape, input_shape, parse_cfg
from darknet_metal.model.summary import summary_table
from darknet_metal.model.weights import (
    Params,
    WeightsCoverage,
    WeightsHeader,
    read_weights,
    read_weights_prefix,
    write_weights,
)
from darknet_metal.ops import Op, build_layers, init_params
from darknet_metal.runtime.backend import Backend
from darknet_metal.runtime.memory import (
    PassMemory,
    check_load_memory,
    check_pass_memory,
    format_bytes,
    plan_pass_memory,
)
from darknet_metal.runtime.network_profile import profile_network
from darknet_metal.runtime.pass_ring import PassRing
from darknet_metal.runtime.profile import DevicePeaks, Profile
from darknet_metal.runtime.program import STORAGE, stored_itemsize
from darknet_metal.trainer.schedule import learning_rate
from darknet_metal.trainer.trainer import Gradients, StepReport, Trainer

#: Devices ``load`` accepts: the CPU reference, the Apple GPU, the CPU emulator of the
#: Metal compute model (the same kernels as "metal"), and "cuda": the same kernels translated
#: to CUDA on an NVIDIA GPU (a verification device, not an Apple result).
DEVICES = ("cpu", "metal", "emu", "cuda")


def _read_names(names: str | os.PathLike[str] | Sequence[str] | None) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, (str, os.PathLike)):
        path = os.fspath(names)
        try:
            with open(path, encoding="utf-8") as f:
                return [line.strip() for line in f.read().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise CfgError(f"cannot read class names: {e}", path=path) from None
    return [str(n) for n in names]


class Network:
    """A Darknet network: layers from a cfg, parameters, and a compute backend.

    Build one with ``darknet_metal.load``. ``layers`` lists the ``Op`` of each cfg
    layer (``type``, ``in_shape``, ``out_shape`` as (C, H, W), ``bflops``);
    ``pass_memory``: what a pass plans at each batch (``runtime.memory.check_load_memory``).
    """

    def __init__(self, config: NetConfig, layers: list[Op], params: dict[int, Params], *,
                 header: WeightsHeader, names: list[str] | None, device: str, batch: int,
                 pass_memory: PassMemory, dtype: np.dtype | type = np.float32,
                 precision: str = "fp32") -> None:
        self.config = config
        self.layers = layers
        self._head_indices = _head_indices(layers)
        self._params = params
        self.header = header
        #: Which layers a partial weights file (``load(..., partial=True)``) gave and which
        #: were initialised; None when the parameters came whole from one file or none.
        self.weights_coverage: WeightsCoverage | None = None
        #: Seeds training's random streams (dropout draws); ``load(seed=...)`` sets it.
        self.training_seed = 0
        self.names = names
        self.device = device
        #: The batch size the caller prepared the network for (any batch works in forward).
        self.batch = batch
        self.dtype = _check_dtype(dtype, device)
        _check_device(device)
        #: "fp32", or "fp16" (metal/emu/cuda: activations and parameters held as half,
        #: arithmetic in float; inference only).
        self.precision = _check_precision(precision, device, self.dtype)
        self._executor: Backend | None = None
        # The executor's inference copies (batch norm folded) are older than ``params``.
        self._params_stale = False
        # A network's executor reuses its memory from pass to pass: one pass at a time.
        self._lock = threading.RLock()
        # What a pass plans (``load`` planned it, and checked that a pass at ``batch`` fits).
        self._pass_memory = pass_memory
        # Batch sizes already found to fit: forward checks each new one once.
        self._fitting_batches = {batch}

    @property
    def executor(self) -> Backend:
        """The executor running this network's passes on its device, built on first use (so
        a cfg can be inspected without running it). Its inference copies of the parameters
        may be older than ``params`` after ``params_changed``; ``inference_executor`` brings
        them up to date. Use it under ``exclusive()``."""
        with self._lock:
            if self._executor is None:
                self._executor = _make_backend(self.device, self.layers, self._params,
                                               self.dtype, self.precision)
                self._params_stale = False
            return self._executor

    def inference_executor(self) -> Backend:
        """``executor`` with its inference copies of the parameters rebuilt if the parameters
        changed since they were made (``params_changed``). Use it under ``exclusive()``."""
        with self._lock:
            executor = self.executor
            if self._params_stale:
                self._params_stale = False
                executor.load_params(self.params)
            return executor

    @property
    def params(self) -> dict[int, Params]:
        """The parameters: per layer index, per name, the arrays in ``.weights`` order.
        Current when read: a device that keeps training's parameters in memory of its own
        (``cuda``) copies them back first, so read this again after training steps rather
        than keep arrays from before. Changed in place, call ``params_changed()``."""
        with self._lock:
            if self._executor is not None:
                self._executor.sync_training()
            return self._params

    def params_changed(self) -> None:
        """Says that the host changed ``params`` in place (restored, loaded or averaged
        values): a device that keeps training's arrays takes them before its next step, and
        the executor's inference copies (batch norm folded) are rebuilt before the next
        pass."""
        with self._lock:
            if self._executor is not None:
                self._executor.sync_training(write=True)
            self._params_stale = True

    def params_trained(self) -> None:
        """Says that training changed the parameters on the executor's device: its inference
        copies are rebuilt from them before the next pass."""
        self._params_stale = True

    @property
    def parameter_bytes(self) -> int:
        """Bytes of the parameters (float32 master copies)."""
        return sum(a.nbytes for layer in self._params.values() for a in layer.values())

    def memory_bytes(self, batch: int) -> int:
        """About how many bytes a forward pass at ``batch`` needs: the layer outputs and
        workspaces the executor plans (with reuse), the input and the parameters."""
        return self._pass_memory.with_input(batch, self.input_shape, self.dtype.itemsize,
                                            self.parameter_bytes)

    def check_memory(self, batch: int) -> None:
        """Raise ``MemoryLimitError`` if a pass at ``batch`` needs more memory than the
        machine has (checked before anything is allocated)."""
        check_pass_memory(self.config.path, self.input_shape, batch, self.memory_bytes(batch),
                          self.parameter_bytes)

    def to(self, device: str) -> Network:
        """Moves the network to ``device`` ("cpu", "metal", "emu", "cuda") and returns it.

        The parameters are the same arrays; the old device's buffers are released, so
        outputs of earlier passes still on that device can no longer be read. Raises
        ValueError for an unknown device, DeviceError for one this machine lacks (the
        network then stays where it was)."""
        _check_dtype(self.dtype, device)
        _check_device(device)
        _check_precision(self.precision, device, self.dtype)
        with self.exclusive():
            if device != self.device:
                if self._executor is not None:
                    # What is bound to the old device's memory (a trainer: its state is
                    # written back, its momentum let go) goes first.
                    self._executor.events.closing()
                    self._executor.close()
                    self._executor = None
                self.device = device
        return self

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Holds this network's lock, and on a Metal device that device's lock, for one
        pass or training step: encode, run and read back as a whole (see the thread rules
        in docs/architecture.md). Reentrant."""
        with self._lock:
            if self.device == "cpu":
                yield
                return
            from darknet_metal.metal import device_lock

            with device_lock(self.device):
                yield

    @property
    def input_shape(self) -> Shape:
        """(C, H, W) the network takes, from ``[net]``."""
        return input_shape(self.config)

    @property
    def yolo_layers(self) -> list[int]:
        """Indices of the ``[yolo]`` layers (the detection heads), in cfg order."""
        return list(self._head_indices)

    def forward(self, x: np.ndarray, outputs: Sequence[int] | None = None) -> list[np.ndarray]:
        """Run the network on ``x`` (N, C, H, W) float32 and return layer outputs (copies).

        With ``outputs=None``: one (N, C, H, W) array per ``[yolo]`` layer, holding Darknet's
        ``layer.output`` (logistic applied to x, y, objectness and classes); a network without
        ``[yolo]`` layers (a classifier) gives its last layer's output. With
        ``outputs=[i, ...]``: the outputs of those 0-based cfg layers (``[net]`` not counted);
        negative indices count from the end.
        """
        if self._executor is not None:
            self._executor.phases.mark("prepare")
        if not isinstance(x, np.ndarray):
            raise ArgumentTypeError(f"x must be a NumPy array (N, C, H, W), not "
                                    f"{type(x).__name__}")
        if x.ndim == 3:
            raise ArgumentError(f"x has shape {x.shape}; expected (N, C, H, W): add a batch "
                                "axis with x[None]")
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape or x.shape[0] < 1:
            raise ArgumentError(f"x has shape {x.shape}; this network takes (N, "
                                f"{', '.join(map(str, self.input_shape))})")
        if not np.issubdtype(x.dtype, np.floating):
            raise ArgumentError(f"x has dtype {x.dtype}; expected float32")
        wanted = (self.yolo_layers or [len(self.layers) - 1] if outputs is None
                  else arguments.layer_indices("outputs", outputs, len(self.layers)))
        if x.shape[0] not in self._fitting_batches:
            self.check_memory(x.shape[0])
            self._fitting_batches.add(x.shape[0])
        with self.exclusive():
            # Device backends keep outputs on the device and download only the wanted ones.
            executor = self.inference_executor()
            outs = executor.forward(x, outputs=wanted)
            executor.phases.mark("wait")
            executor.wait()
            executor.phases.mark("read back")
            result = [np.array(outs[i]) for i in wanted]
            executor.phases.stop()
            return result

    def profile(self, x: np.ndarray | None = None, *, train: bool = False,
                truths: Sequence[Any] | None = None, repeats: int = 3,
                peaks: DevicePeaks | bool = True,
                progress: Callable[[str], None] | None = None) -> Profile:
        """Where the time of a forward pass (or, with ``train``, of a training step) goes:
        per kernel dispatch its time, floating-point operations and bytes moved, summed per
        layer and per kernel, with fractions of the device's peaks (``runtime.profile``).

        ``x``: the input (N, C, H, W) float32; default: seeded uniform noise at the
        network's size, ``batch`` images (a training step: the cfg's batch). ``truths``:
        a training step's targets (``Trainer.step``); default: three seeded boxes per image
        (a class id per image for a classifier). ``repeats``: profiled runs, each dispatch's
        time the median over them (after one unprofiled warm-up run). ``peaks``: True for
        the device's copy bandwidth and GEMM rate (``device_peaks``: measured on the
        device's first profile), a ``DevicePeaks`` to use those, False for none.
        ``progress(line)``: told what runs next (a profile on the emulator takes minutes).

        Times are the device's on ``cuda`` and ``metal``, host times on ``emu`` (labelled:
        the emulator is the CPU) and per layer on ``cpu`` (a training step's per layer and
        phase: forward, backward, update). A training profile runs real steps on a copy of
        this network: its own weights are left as they were. Raises ArgumentError for a bad
        input."""
        return profile_network(self, self._twin, x, train=train, truths=truths,
                               repeats=repeats, peaks=peaks, progress=progress)

    def _twin(self) -> Network:
        """A network with this one's cfg, layers and a copy of its parameters, on its
        device, to train without changing this one."""
        params = {i: {k: a.copy() for k, a in p.items()} for i, p in self.params.items()}
        twin = Network(self.config, self.layers, params,
                       header=dataclasses.replace(self.header), names=self.names,
                       device=self.device, batch=self.batch, dtype=self.dtype,
                       precision=self.precision, pass_memory=self._pass_memory)
        twin.training_seed = self.training_seed
        return twin

    def yolo_heads(self) -> list[YoloHead]:
        """What the box decoder needs of each ``[yolo]`` layer."""
        return [self.layers[index].detection_head for index in self.yolo_layers]

    def detect(self, image: ImageSource | Sequence[ImageSource], thresh: float = 0.25,
               nms: float = 0.45) -> list[Detection] | list[list[Detection]]:
        """Detect objects as ``darknet detector test`` does.

        ``image``: a path or an (H, W, 3) uint8 RGB array; returns one ``Detection`` per (box,
        class) with objectness x class probability above ``thresh`` after NMS with IoU
        threshold ``nms``, boxes in pixels of the original image. Or a sequence of them
        (list, tuple): run in passes of ``self.batch`` images (``load(..., batch=N)``), the
        last one shorter; returns one such list per image, in order, each equal to detecting
        that image alone. Raises ``ImageError`` naming an unreadable image (images before it
        have been run), ``CfgError`` for a network that cannot detect.
        """
        return Detector(self, thresh, nms).detect(image)

    def stream(self, frames: Iterable[ImageSource], thresh: float = 0.25, nms: float = 0.45,
               *, batch: int | None = None, depth: int = 2, workers: int = 2) -> DetectionStream:
        """Detections of each of ``frames`` (paths or (H, W, 3) uint8 RGB arrays, from any
        iterable: a list, a generator, a video reader), pipelined: ``workers`` threads read
        and resize the next frames, and boxes are decoded in another thread, while passes of
        ``batch`` frames (default ``self.batch``; the last pass is padded) run; on ``metal``,
        ``emu`` and ``cuda`` up to ``depth`` passes are in flight on the device at once (each
        with its own input and output memory, allocated once). Yields one list of
        ``Detection`` per frame, in order, equal to ``detect(frame, thresh, nms)``.

        Returns a ``DetectionStream`` (an iterator; ``.timings`` gives each pass's
        ``PassTimings``, ``.close()`` stops it early). While it runs, the network is shared
        with other threads pass by pass; do not ``resize`` or move it meanwhile.
        """
        return DetectionStream(self, frames, thresh=thresh, nms=nms, batch=batch, depth=depth,
                               workers=workers)

    def warmup(self, batch: int | None = None, depth: int = 2) -> None:
        """Build now what the first ``detect`` or ``stream`` at ``batch`` images per pass
        (default ``self.batch``) would: the pass's program and memory, the device's pipeline
        states and parameters, and on ``metal``/``emu``/``cuda`` the ``depth`` pass slots a
        stream uses — so that the first frame costs what every other does."""
        batch = arguments.positive_int("batch", self.batch if batch is None else batch)
        depth = arguments.positive_int("depth", depth)
        c, h, w = self.input_shape
        wanted = self.yolo_layers or None
        self.forward(np.zeros((batch, c, h, w), np.float32), outputs=wanted)
        if self.device != "cpu" and wanted:
            with self.exclusive():
                executor = self.inference_executor()
                ring: PassRing | None = executor.hold_pass_ring(batch, wanted, depth)
                if ring is not None:
                    executor.let_go_pass_ring(ring)

    def save_weights(self, path: str | os.PathLike[str]) -> None:
        """Write the parameters (the trained ones after training), the rolling statistics and
        ``seen`` as a Darknet ``.weights`` file (version 0.2.0), atomically."""
        with self._lock:
            write_weights(path, self.layers, self.params, self.header)

    # -- training: conveniences over ``trainer.Trainer.of(self)`` ---------------------------

    def export_onnx(self, path: str | os.PathLike[str], *, batch: int | str = 1,
                    outputs: str = "raw", fp16: bool = False, opset: int | None = None) -> None:
        """Write the network as an ONNX model to ``path`` (see
        ``darknet_metal.export.export_onnx``: ``batch`` an int or ``"dynamic"``,
        ``outputs`` ``"raw"`` or ``"boxes"``, ``fp16``, ``opset``). Needs the ``export``
        extra; raises ExportError naming a layer ONNX cannot express, and writes nothing."""
        from darknet_metal.export import export_onnx

        with self.exclusive():
            export_onnx(self, path, batch=batch, outputs=outputs, fp16=fp16, opset=opset)

    def train_step(self, x: np.ndarray, truths: Sequence[Any], *,
                   reduce: Callable[[float], tuple[int, float]] | None = None,
                   carry_momentum: bool = True) -> StepReport:
        """One Darknet training iteration: ``Trainer.of(self).step`` (see
        ``darknet_metal.trainer.Trainer.step`` for ``x``, ``truths``, ``reduce``,
        ``carry_momentum`` and the errors)."""
        return Trainer.of(self).step(x, truths, reduce, carry_momentum=carry_momentum)

    def accumulate(self, x: np.ndarray, truths: Sequence[Any]) -> float:
        """The forward and backward of ``train_step`` without the update
        (``Trainer.accumulate``). Returns the loss."""
        return Trainer.of(self).accumulate(x, truths)

    def update(self, images: int | None = None) -> float:
        """Darknet's update for the accumulated gradients (``Trainer.update``); returns the
        learning rate it used."""
        return Trainer.of(self).update(images)

    def gradient_buffers(self) -> dict[int, Params]:
        """The gradient accumulators per layer and parameter name
        (``Trainer.gradient_buffers``)."""
        return Trainer.of(self).gradient_buffers()

    def gradient_block(self) -> np.ndarray | None:
        """The gradient accumulators as one contiguous array, or None on the CPU
        (``Trainer.gradient_block``)."""
        return Trainer.of(self).gradient_block()

    def statistic_buffers(self) -> dict[int, Params]:
        """The running statistics training updates (``Trainer.statistic_buffers``)."""
        return Trainer.of(self).statistic_buffers()

    def gradients(self, x: np.ndarray, truths: Sequence[Any]) -> Gradients:
        """Forward and backward over a batch without changing any state
        (``Trainer.gradients``)."""
        return Trainer.of(self).gradients(x, truths)

    @property
    def iteration(self) -> int:
        """Training iterations done: ``seen // batch``."""
        return self.header.seen // int(self.config.net.values["batch"])

    @iteration.setter
    def iteration(self, value: int) -> None:
        value = arguments.non_negative_int("iteration", value)
        self.header.seen = value * int(self.config.net.values["batch"])

    def resize(self, width: int, height: int) -> Network:
        """Changes the network's input size to ``width`` x ``height`` pixels, as Darknet's
        ``random=1`` does between iterations: the parameters (on the device too), rolling
        statistics and training state (accumulators, momentum, moments, counters) are kept;
        the training program of each size is built once and kept (up to
        ``runtime.program_cache.MAX_TRAINING_PROGRAMS``), and bound to memory the previous
        size's frees.
        Raises ``CfgError`` for a size the layers cannot take, ``ArgumentError`` when a
        layer's parameters depend on the size (a ``[connected]`` layer) and
        ``MemoryLimitError`` when training at the new size would not fit; the network is then
        unchanged. Returns the network."""
        size = arguments.size_pair("(width, height)", (width, height))
        with self.exclusive():
            values = self.config.net.values
            old = values["width"], values["height"]
            values["width"], values["height"] = size
            try:
                layers = build_layers(self.config)
                for new, spec in zip(layers, self.layers, strict=True):
                    if new.param_shapes != spec.param_shapes:
                        raise ArgumentError(
                            f"cannot resize to {size[0]}x{size[1]}: the parameters of layer "
                            f"{spec.index} ({spec.kind}) depend on the input size")
            except BaseException:
                values["width"], values["height"] = old
                raise
            old_layers = self.layers
            try:
                self._take_layers(layers)
            except BaseException:
                values["width"], values["height"] = old
                self._take_layers(old_layers)
                raise
        return self

    def _take_layers(self, layers: list[Op]) -> None:
        """Switches every part of the network to ``layers`` (the same network at another
        input size): the executor keeps its parameters, a trainer its state and the programs
        of the sizes seen before."""
        self.layers = layers
        self._head_indices = _head_indices(layers)
        self._pass_memory = plan_pass_memory(layers, stored_itemsize(self.precision, self.dtype))
        self._fitting_batches = set()
        if self._executor is not None:
            self._executor.resize(layers, self._params)
            # A trainer rebinds its programs to the new size (and may refuse it).
            self._executor.events.resized()

    def learning_rate(self, iteration: int) -> float:
        """The learning rate of the update that makes ``iteration`` (Darknet's
        get_current_rate)."""
        return learning_rate(self.config.net.values, iteration)

    def summary(self) -> str:
        """A Darknet-style table of the layers with their shapes and BFLOPs, and the memory a
        pass at the prepared batch size needs."""
        needed = self.memory_bytes(self.batch)
        return (summary_table(self.layers, self.input_shape)
                + f"\nMemory for a batch of {self.batch}: about {format_bytes(needed)} "
                f"({format_bytes(needed - self.parameter_bytes)} of layer outputs and "
                f"workspaces, {format_bytes(self.parameter_bytes)} of parameters)")

    def __repr__(self) -> str:
        return (f"Network({os.path.basename(self.config.path)!r}, layers={len(self.layers)}, "
                f"input={self.input_shape}, device={self.device!r})")


def _head_indices(layers: list[Op]) -> tuple[int, ...]:
    """Indices of the detection heads among ``layers``, in cfg order (read once per set of
    layers: ``forward`` asks on every pass)."""
    return tuple(spec.index for spec in layers if spec.detection_head is not None)


def _check_dtype(dtype: object, device: str) -> np.dtype:
    """The compute dtype: float32, or float64 on the CPU; ArgumentError otherwise."""
    try:
        result = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise ArgumentTypeError(f"dtype must be np.float32 or np.float64, not {dtype!r}") from None
    if result not in (np.float32, np.float64):
        raise ArgumentError(f"dtype must be float32 or float64 (float64 on device='cpu' only), "
                            f"not {result}")
    if result == np.float64 and device != "cpu":
        raise DeviceError(f"device {device!r} computes in float32 only, not float64; use "
                          "device='cpu' for float64")
    return result


def _check_device(device: str) -> None:
    """Raise ArgumentError for an unknown device, DeviceError for one this machine lacks."""
    if not isinstance(device, str):
        raise ArgumentTypeError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device not in DEVICES:
        raise ArgumentError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    if device != "cpu":
        from darknet_metal.metal import get_device

        get_device(device)


def _check_precision(precision: object, device: str, dtype: np.dtype) -> str:
    if precision not in STORAGE:
        raise ArgumentError(f"precision must be one of {', '.join(map(repr, STORAGE))}, "
                            f"not {precision!r}")
    if precision == "fp16" and device == "cpu":
        raise ArgumentError("precision='fp16' runs on the Metal devices ('metal', 'emu', "
                            "'cuda'); the CPU computes in float32 (or float64)")
    if precision == "fp16" and dtype != np.float32:
        raise ArgumentError(f"precision='fp16' needs dtype float32, not {dtype}")
    return str(precision)


def _make_backend(device: str, specs: list[Op], params: dict[int, Params],
                  dtype: np.dtype, precision: str = "fp32") -> Backend:
    if device == "cpu":
        from darknet_metal.runtime.cpu_backend import CpuBackend

        return CpuBackend(specs, params, dtype)
    from darknet_metal.runtime.gpu_backend import GpuBackend

    return GpuBackend(specs, params, dtype, device=device, precision=precision)


def load(cfg: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None, *,
         names: str | os.PathLike[str] | Sequence[str] | None = None, device: str = "cpu",
         batch: int | None = None, subdivisions: int | None = None, seed: int | None = None,
         dtype: np.dtype | type = np.float32,
         input_size: tuple[int, int] | None = None, partial: bool = False,
         precision: str = "fp32") -> Network:
    """Load a Darknet network.

    ``cfg``: the ``.cfg`` path. ``weights``: a ``.weights`` path, or None to initialise the
    parameters as Darknet does (reproducibly with ``seed``). ``names``: a ``.names`` path or a
    list of class names. ``device``: ``"cpu"``, ``"metal"`` (Apple GPU), ``"emu"`` (the Metal
    kernels in the CPU emulator) or ``"cuda"`` (the same kernels translated to CUDA on an
    NVIDIA GPU, for verification); DeviceError when unavailable. ``batch``, ``subdivisions``:
    replace ``[net]``'s, as editing the cfg would (the images of one training iteration, and
    the mini-batches it is split into); ``batch`` is also the size inference is prepared and
    memory-checked for (1 when not given; any batch size works in ``forward``).
    ``dtype``: float32, or float64 for
    gradient checks (CPU only).
    ``input_size``: (width, height) in pixels replacing ``[net]``'s, as editing the cfg would
    (convolutional weights do not depend on it). ``partial``: ``weights`` may hold only the
    first layers (a backbone such as ``yolov4-tiny.conv.29``, or the output of ``darknet-metal
    partial``); the others are initialised as without weights, and ``net.weights_coverage``
    says which came from the file. ``precision``: "fp32", or "fp16" on the Metal devices
    (``metal``/``emu``/``cuda``): weights and activations held as half (about half the device
    memory), every sum and activation computed in float and rounded once per stored value;
    inference only (training raises ``ArgumentError``); every layer must have half-storage
    kernels (``DeviceError`` naming the layers otherwise).
    Raises ``CfgError`` / ``WeightsError`` naming the file and line or layer at fault,
    ``ArgumentError`` / ``ArgumentTypeError`` naming a bad argument, ``DeviceError`` for a
    device this machine lacks (or float64 on a Metal device), ``MemoryLimitError`` when the
    parameters or a pass at ``batch`` need more memory than the machine has (before anything
    large is allocated).
    """
    batch = None if batch is None else arguments.positive_int("batch", batch)
    subdivisions = (None if subdivisions is None
                    else arguments.positive_int("subdivisions", subdivisions))
    size = None if input_size is None else arguments.size_pair("input_size", input_size)
    _check_device(device)
    _check_dtype(dtype, device)
    _check_precision(precision, device, np.dtype(dtype))
    config = parse_cfg(cfg)
    if size is not None:
        config.net.values["width"], config.net.values["height"] = size
    if batch is not None:
        config.net.values["batch"] = batch
    if subdivisions is not None:
        config.net.values["subdivisions"] = subdivisions
    layers = build_layers(config)
    planned = check_load_memory(config.path, layers, batch or 1,
                                stored_itemsize(precision, np.dtype(dtype)),
                                np.dtype(dtype).itemsize)
    params = init_params(layers, seed)
    header = WeightsHeader()
    coverage = None
    if weights is not None:
        if partial:
            header, loaded, coverage = read_weights_prefix(weights, layers)
        else:
            header, loaded = read_weights(weights, layers)
        for index, layer in loaded.items():
            params[index].update(layer)
    net = Network(config, layers, params, header=header, names=_read_names(names),
                  device=device, batch=batch or 1, dtype=dtype, precision=precision,
                  pass_memory=planned)
    if coverage is not None and coverage.initialised:
        net.weights_coverage = coverage
    net.training_seed = seed or 0
    return net


def load_model(name: str, *, device: str = "cpu", batch: int | None = None,
               dtype: np.dtype | type = np.float32, input_size: tuple[int, int] | None = None,
               download: bool = True) -> Network:
    """Load bundled model ``name`` (``darknet_metal.model.bundled.model_names()``: yolov3-tiny,
    yolov4-tiny, yolov3, yolov4) with its pretrained weights and COCO class names.

    The weights come from the cache (``$DARKNET_METAL_HOME``, default
    ``~/.cache/darknet_metal``) and are downloaded there on first use unless ``download`` is
    false; ``darknet_metal.model.bundled.model_files(name)`` gives the three paths. The other
    arguments are ``load``'s. Raises ``ModelNotFoundError`` for an unknown name or weights
    that cannot be had.
    """
    from darknet_metal.model.bundled import get_spec, model_files

    get_spec(name)
    _check_device(device)
    _check_dtype(dtype, device)
    files = model_files(name, download=download)
    return load(files.cfg, files.weights, names=files.names, device=device, batch=batch,
                dtype=dtype, input_size=input_size)
