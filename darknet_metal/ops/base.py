"""The base of every op: one class per Darknet layer kind, owning everything about that kind.

An ``Op`` is one layer of a network: the op of its kind bound to its cfg section and
shapes. Its class says, for the kind (Darknet's forward/backward/update trio, with room for
the last two beside the first):

- shapes: ``build`` checks a section against its input shapes (``CfgError`` at the section)
  and gives the output shape, the parameter shapes and the FLOPs;
- parameters: ``param_shapes`` in ``.weights`` order, ``stored_params`` (what a file holds),
  ``init_params`` (Darknet's initialisation), ``trainable_params`` and ``statistics``;
- the CPU forward: ``prepare_cpu`` (inference copies of the parameters), ``cpu_workspace``
  and ``cpu_steps``: the Cython layers' native steps bound to the layer's arrays, which the
  CPU executor runs as one GIL-free loop;
- the GPU forward: ``device_params`` (arrays to upload), ``emit_device_setup`` (kernels run
  once when they load) and ``emit_device_forward`` (the kernel steps of a pass, buffers bound
  by registry role), or ``Unsupported`` with the reason it cannot run on a device;
- export: ``emit_onnx``, the layer as ONNX operators (``export.graph``);
- presentation: ``describe`` for the summary table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from darknet_metal.cpu.step import NativeStep
from darknet_metal.errors import Unsupported
from darknet_metal.model.activations import ACTIVATION_ID
from darknet_metal.model.cfg import Section, Shape
from darknet_metal.model.weights import Params
from darknet_metal.runtime.program import LayerEmitter, Tensor

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState

__all__ = ["Op", "Params", "Shape", "Unsupported", "as_rows", "emit_device_input_gradient",
           "emit_input_gradient", "positive"]


class Op:
    """One network layer (see the module docstring). Built by ``build`` of its op class.

    ``index``: 0-based layer index; ``inputs``: indices of the layers whose outputs it reads
    (-1: the network input), the first being the "main" input; ``in_shape``/``out_shape``:
    (C, H, W) of one image; ``param_shapes``: name -> shape in ``.weights`` order;
    ``flops``: floating point operations for one image, counted as Darknet does.
    """

    #: The cfg section kind this op runs.
    kind: ClassVar[str] = ""
    #: Short name in the summary table.
    short_name: ClassVar[str] = ""
    #: The output is the first input itself (no step, no memory of its own).
    output_is_input: ClassVar[bool] = False
    #: In training, the layer's delta is its input's (its backward works on it in place).
    delta_is_input_delta: ClassVar[bool] = False
    #: What training does with the kind's own keys (``darknet_metal.trainer.keys``): key ->
    #: IMPLEMENTED, DATA, NO_EFFECT, INFERENCE_ONLY, or the reason a non-default value is
    #: refused. Keys not listed shape the network and train as they infer.
    training_keys: ClassVar[Mapping[str, str]] = {}
    #: A loss layer: its training forward compares with the truths and writes its delta.
    computes_loss: ClassVar[bool] = False
    #: Whether Darknet scales this kind's learning rate by the layer's ``learning_rate`` key
    #: (``[connected]`` layers ignore it).
    learning_rate_scaled: ClassVar[bool] = True
    #: Parameters that are running statistics, not trained.
    statistics: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        section: Section,
        inputs: list[int],
        in_shape: Shape,
        out_shape: Shape,
        param_shapes: dict[str, tuple[int, ...]] | None = None,
        flops: int = 0,
    ) -> None:
        self.index = section.index
        self.section = section
        self.inputs = inputs
        self.in_shape = in_shape
        self.out_shape = out_shape
        self.param_shapes = param_shapes or {}
        self.flops = flops

    # -- shapes ----------------------------------------------------------------------------

    @classmethod
    def build(cls, section: Section, shape: Shape, shapes: list[Shape]) -> Op:
        """The layer of ``section`` whose previous layer outputs ``shape``; ``shapes`` are
        the output shapes of every earlier layer. Raises ``CfgError`` at the section."""
        return cls(section, [section.index - 1], shape, shape)

    @property
    def values(self) -> dict[str, Any]:
        """The section's typed key values."""
        return self.section.values

    @property
    def activation(self) -> int:
        """Activation id (see ``darknet_metal.model.activations``); linear for kinds without one."""
        return ACTIVATION_ID[self.values.get("activation", "linear")]

    @property
    def out_size(self) -> int:
        c, h, w = self.out_shape
        return c * h * w

    @property
    def bflops(self) -> float:
        """Billions of floating point operations for one image, as Darknet's summary prints."""
        return self.flops / 1e9

    @property
    def detection_head(self) -> Any:
        """The ``boxes.YoloHead`` the box decoder reads from this layer's output, or None for
        layers that are not detection heads."""
        return None

    # -- parameters ------------------------------------------------------------------------

    def stored_params(self, *, reading: bool = True) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the arrays a ``.weights`` file holds for this layer, in file
        order. ``reading``: as Darknet reads them (some keys skip arrays when loading)."""
        return list(self.param_shapes.items())

    def stored_transposed(self, name: str) -> bool:
        """Whether files whose version marks transposed matrices hold ``name`` transposed."""
        return False

    @property
    def trainable_params(self) -> tuple[str, ...]:
        """Names of the parameters training updates."""
        return tuple(n for n in self.param_shapes if n not in self.statistics)

    def init_params(self, rng: np.random.Generator) -> Params:
        """Darknet's initial values for a network without weights (float32)."""
        return {name: np.zeros(shape, np.float32) for name, shape in self.param_shapes.items()}

    # -- CPU -------------------------------------------------------------------------------

    def prepare_cpu(self, params: Params | None, dtype: np.dtype) -> Any:
        """What ``cpu_steps`` needs of the parameters, in ``dtype`` (None by default)."""
        return None

    def cpu_workspace(self, batch: int) -> int:
        """Elements of scratch memory ``cpu_steps`` needs at ``batch`` (0: none)."""
        return 0

    def cpu_steps(
        self, state: Any, sources: list[np.ndarray], out: np.ndarray, workspace: np.ndarray | None
    ) -> list[NativeStep]:
        """The native steps of the inference forward on the CPU, bound to ``sources`` (one
        (N, C, H, W) array per input), ``out`` (N, *out_shape) and ``workspace`` (of
        ``cpu_workspace(N)`` elements, or None); arguments are checked here, so running the
        steps cannot fail."""
        raise NotImplementedError(f"{type(self).__name__}.cpu_steps")

    def emit_cpu_forward(self, e: LayerEmitter, state: Any) -> None:
        """The CPU program's steps for this layer: one host step binding ``cpu_steps``."""
        size = self.cpu_workspace(e.batch)
        writes = [e.output]
        if size:
            writes.append(e.tensor("workspace", (size,)))

        def bind(reads: list[np.ndarray], written: list[np.ndarray]) -> list[NativeStep]:
            return self.cpu_steps(state, reads, written[0], written[1] if size else None)

        e.host(e.inputs, writes, bind)

    # -- CPU training ----------------------------------------------------------------------

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        """The CPU steps of this layer's training forward on one mini-batch, over the live
        parameters ``ts.values``; a loss layer also writes its ``own_delta`` (Darknet's
        delta, target minus prediction). By default the inference forward."""
        self.emit_cpu_forward(e, self.prepare_cpu(ts.values, ts.dtype))

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        """The CPU steps of this layer's backward, run once ``e.delta`` holds the gradient of
        its output: add its parameters' gradients into ``ts.grads`` and its inputs' into
        ``e.input_delta(k)`` (None: not needed). Raises ``Unsupported`` for a kind that
        cannot be trained."""
        raise Unsupported(f"[{self.kind}] layers cannot be trained")

    # -- GPU -------------------------------------------------------------------------------

    def device_params(self, params: Params | None) -> dict[str, np.ndarray | int]:
        """Arrays the device kernels bind as ``Param(index, name)``: float32 arrays to
        upload, or a byte count for a buffer ``emit_device_setup`` fills."""
        return {}

    def emit_device_setup(self, e: LayerEmitter) -> None:
        """Kernel steps run once after ``device_params`` are uploaded (none by default)."""

    def emit_device_forward(self, e: LayerEmitter) -> None:
        """The kernel steps of this layer's inference forward. Raises ``Unsupported``."""
        raise Unsupported(f"no Metal kernels for layer kind {self.kind!r}")

    # -- GPU training ----------------------------------------------------------------------

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        """The kernel steps of this layer's training forward, binding its training arrays
        as ``ts.ref(name, group)``. By default the inference forward, for the ops whose CPU
        training forward is their inference forward (no parameters to train). Raises
        ``Unsupported`` (before emitting anything) where there are no such kernels."""
        if type(self).emit_cpu_train is not Op.emit_cpu_train:
            raise Unsupported(f"no training-forward kernels for [{self.kind}] yet")
        self.emit_device_forward(e)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        """The kernel steps of this layer's backward (as ``emit_cpu_backward``, with
        kernels). Raises ``Unsupported`` (before emitting anything) where there are none."""
        raise Unsupported(f"no backward kernels for [{self.kind}] yet")

    # -- export ----------------------------------------------------------------------------

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        """The layer in ONNX: nodes reading ``g.source(i)`` for each of its inputs, with the
        inference parameters ``params``; returns the value holding its output, (N, C, H, W)
        as ``forward`` gives it. Raises ``ExportError`` (``g.refuse``) for what ONNX cannot
        express here."""
        raise g.refuse("this layer kind has no ONNX form")

    # -- presentation ----------------------------------------------------------------------

    def describe(self) -> str:
        """The parameters column of the summary table."""
        return ""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(index={self.index}, in={self.in_shape}, "
                f"out={self.out_shape})")


def emit_input_gradient(e: LayerEmitter, make: Callable[..., NativeStep],
                        saved: Sequence[Tensor] = ()) -> None:
    """Backward of a layer whose one input's gradient follows from its delta (and the
    ``saved`` tensors of its forward): ``make(delta, *saved, into)`` is the native step adding
    it into that input's delta; nothing when the input gets no gradient."""
    into = e.input_delta(0)
    if into is not None:
        e.host([e.delta, *saved, into], [into], lambda r, w: [make(*r[:-1], w[0])])


def emit_device_input_gradient(e: LayerEmitter, kernel: str, sizes: Mapping[str, int],
                               saved: Mapping[str, Tensor] | None = None,
                               **args: int | float) -> None:
    """``emit_input_gradient`` with a kernel: ``kernel`` reads ``delta`` (and the ``saved``
    tensors by role) and adds into ``x_grad``, the input's delta; nothing when the input
    gets no gradient."""
    into = e.input_delta(0)
    if into is not None:
        e.kernel(kernel, {"delta": e.delta, **(saved or {}), "x_grad": into}, sizes, **args)


def as_rows(a: np.ndarray) -> np.ndarray:
    """An (N, C, 1, 1) tensor (a connected layer's, a loss layer's input) as the (N, C) rows
    its kernels take."""
    return a.reshape(a.shape[0], -1)


def positive(section: Section, shape: Shape, what: str) -> Shape:
    """``shape``, or a CfgError if any dimension is below 1."""
    if min(shape) < 1:
        raise section.error(f"{what} gives an empty output shape {shape} (C, H, W)")
    return shape
