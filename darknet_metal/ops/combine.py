"""Layers that combine two or more layers' outputs: [shortcut], [scale_channels], [sam].

Their activation runs after the combination (no kernel of theirs fuses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cfg import Section
from darknet_metal.cpu import combine as cpu_combine
from darknet_metal.cpu.step import NativeStep
from darknet_metal.ops.activation import (
    activation_input,
    activation_steps_after,
    emit_activation_after,
    emit_cpu_activation_gradient,
    emit_cpu_activation_train,
    emit_device_activation_gradient,
    emit_device_activation_train,
)
from darknet_metal.ops.base import LayerSpec, Params, Shape, Unsupported
from darknet_metal.program import LayerEmitter, Param, Tensor

if TYPE_CHECKING:
    from darknet_metal.training.state import LayerTrainState

_NORMALIZATION = {"none": 0, "relu": 1, "softmax": 2}


def _input_deltas(e: LayerEmitter) -> tuple[list[Tensor], list[Tensor]]:
    """The deltas of the layer's inputs for its backward to add into, and those of them the
    step reads (adds to): an input that gets no gradient (below the first trained layer, or
    the network input) gets a scratch tensor the step writes and nothing reads."""
    deltas, read = [], []
    for k, source in enumerate(e.inputs):
        delta = e.input_delta(k)
        if delta is None:
            deltas.append(e.tensor(f"unused_gradient_{k}", e.shape(source)))
        else:
            deltas.append(delta)
            read.append(delta)
    return deltas, read


def _describe_from(spec: LayerSpec) -> str:
    src = spec.values["from"]
    return "from " + (" ".join(map(str, src)) if isinstance(src, list) else str(src))


class _Combining(LayerSpec):
    """What the combining kinds share: their kernel (``combine``), then the activation, which
    no kernel of theirs fuses; in training the kernel writes the activation's input, and the
    backward (``combine_backward``) adds into every input's delta."""

    def combine(self, sources: list[np.ndarray], out: np.ndarray,
                weights: np.ndarray | None) -> list[NativeStep]:
        """The steps writing ``out`` from ``sources`` (the inputs' outputs, in order)."""
        raise NotImplementedError

    def combine_backward(self, delta: np.ndarray, sources: list[np.ndarray],
                         grads: list[np.ndarray], ts: LayerTrainState) -> list[NativeStep]:
        """The steps adding the gradients of ``delta`` (after the activation's) into each
        input's delta ``grads`` (and the weights' accumulator in ``ts``)."""
        raise NotImplementedError

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        # state is the weights array itself (or None): the steps read it on every pass.
        return [*self.combine(sources, out, state),
                *activation_steps_after(out, self.activation, fused=False)]

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        weights = ts.values.get("weights")
        pre = activation_input(e, self.activation)
        e.host(e.inputs, [pre], lambda r, w: self.combine(r, w[0], weights))
        emit_cpu_activation_train(e, self.activation, pre)

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_cpu_activation_gradient(e, self.activation,
                                     Tensor(self.index, "activation_input"))
        grads, read = _input_deltas(e)
        n = len(e.inputs)
        e.host([e.delta, *e.inputs, *read], grads,
               lambda r, w: self.combine_backward(r[0], r[1:n + 1], w, ts))

    # -- device ------------------------------------------------------------------------------

    def emit_device_combine(self, e: LayerEmitter, out: Tensor) -> None:
        """The kernel steps writing ``out`` from the inputs (inference parameters)."""
        raise NotImplementedError

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor]) -> None:
        """The kernel steps adding the gradients of ``e.delta`` (after the activation's)
        into each input's delta ``grads``."""
        raise NotImplementedError

    def emit_device_forward(self, e: LayerEmitter) -> None:
        self.emit_device_combine(e, e.output)
        emit_activation_after(e, self.activation, fused=False)

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        if ts.values:
            raise Unsupported(f"no training kernels for a weighted [{self.kind}] yet")
        pre = activation_input(e, self.activation)
        self.emit_device_combine(e, pre)
        emit_device_activation_train(e, self.activation, pre)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        if ts.values:
            raise Unsupported(f"no training kernels for a weighted [{self.kind}] yet")
        emit_device_activation_gradient(e, self.activation,
                                        Tensor(self.index, "activation_input"))
        grads = []
        for k, source in enumerate(e.inputs):
            delta = e.input_delta(k)
            if delta is None:
                # An input that gets no gradient: a zeroed scratch the kernels add into.
                delta = e.tensor(f"unused_gradient_{k}", e.shape(source))
                n = int(np.prod(e.shape(source)))
                e.kernel("fill_buf_f32", {"x": delta}, {"n": n}, n=n, value=0.0)
            grads.append(delta)
        self.emit_device_combine_backward(e, grads)


class ShortcutOp(_Combining):
    """x plus the ``from=`` layers, optionally weighted per input or per (input, channel)."""

    kind = "shortcut"
    short_name = "shortcut"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
        v = s.values
        sources = list(v["from"])
        for src in sources:
            if shapes[src][1:] != shape[1:]:
                raise s.error(
                    f"layer {src} output is {shapes[src][1]}x{shapes[src][2]} but the input is "
                    f"{shape[1]}x{shape[2]}: shortcut layers must have the same width and height",
                    "from",
                )
        params: dict[str, tuple[int, ...]] = {}
        if v["weights_type"] == "per_feature":
            params["weights"] = (len(sources) + 1,)
        elif v["weights_type"] == "per_channel":
            params["weights"] = (len(sources) + 1, shape[0])
        return cls(s, [s.index - 1, *sources], shape, shape, params)

    @property
    def weighted(self) -> bool:
        return "weights" in self.param_shapes

    def init_params(self, rng: np.random.Generator) -> Params:
        return {name: np.ones(shape, np.float32) for name, shape in self.param_shapes.items()}

    def prepare_cpu(self, params: Params | None, dtype: np.dtype) -> Any:
        return np.ascontiguousarray(params["weights"], dtype) if self.weighted else None

    def device_params(self, params: Params | None) -> dict[str, np.ndarray | int]:
        if not self.weighted:
            return {}
        table_bytes = 4 * len(self.inputs) * self.out_shape[0]
        return {"weights": np.ascontiguousarray(params["weights"], np.float32),
                "table": table_bytes}

    def emit_device_setup(self, e: LayerEmitter) -> None:
        # The normalised weight table, once per load rather than once per pass.
        if not self.weighted:
            return
        v = self.values
        channels = self.out_shape[0]
        e.kernel(
            "shortcut_weights_fwd_f32",
            {"weights": Param(self.index, "weights"), "table": Param(self.index, "table")},
            {"channels": channels},
            n_inputs=len(self.inputs),
            channels=channels,
            per_channel=int(v["weights_type"] == "per_channel"),
            normalization=_NORMALIZATION[v["weights_normalization"]],
        )

    def combine(self, sources: list[np.ndarray], out: np.ndarray,
                weights: np.ndarray | None) -> list[NativeStep]:
        v = self.values
        return cpu_combine.shortcut_step(sources[0], sources[1:], weights, v["weights_type"],
                                         v["weights_normalization"], out)

    def combine_backward(self, delta: np.ndarray, sources: list[np.ndarray],
                         grads: list[np.ndarray], ts: LayerTrainState) -> list[NativeStep]:
        v = self.values
        return cpu_combine.shortcut_backward_step(
            delta, sources[0], sources[1:], ts.values.get("weights"), v["weights_type"],
            v["weights_normalization"], grads[0], grads[1:], ts.grads.get("weights"))

    def emit_device_combine(self, e: LayerEmitter, out: Tensor) -> None:
        oc, oh, ow = self.out_shape
        # Unweighted, the kernel never reads its table, but Metal needs every buffer it
        # declares bound: x stands in.
        table = Param(self.index, "table") if self.weighted else e.inputs[0]
        for i, source in enumerate(e.inputs[1:]):
            e.kernel(
                "shortcut_fwd_f32",
                {"x": e.inputs[0] if i == 0 else out, "source": source, "table": table,
                 "y": out},
                {"spatial": oh * ow, "channels": oc, "batch": e.batch},
                batch=e.batch,
                channels=oc,
                spatial=oh * ow,
                src_channels=e.shape(source)[1],
                source=i + 1,
                first=int(i == 0),
                weighted=int(self.weighted),
            )

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor]) -> None:
        # One dispatch per input, x first: where one array receives two inputs' gradients
        # they add in the CPU's order.
        oc, oh, ow = self.out_shape
        for row, (source, grad) in enumerate(zip(e.inputs, grads, strict=True)):
            src_c = e.shape(source)[1]
            e.kernel("shortcut_bwd_f32", {"delta": e.delta, "table": None, "grad": grad},
                     {"spatial": oh * ow, "channels": min(oc, src_c), "batch": e.batch},
                     batch=e.batch, channels=oc, spatial=oh * ow, src_channels=src_c, row=row,
                     weighted=0)

    def describe(self) -> str:
        return _describe_from(self)


class ScaleChannelsOp(_Combining):
    """Layer ``from``'s output scaled per channel (or per pixel, ``scale_wh``) by the input."""

    kind = "scale_channels"
    short_name = "scale_channels"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
        src = s.values["from"]
        target = shapes[src]
        want = (1, *target[1:]) if s.values["scale_wh"] else (target[0], 1, 1)
        if shape != want:
            raise s.error(f"the previous layer's output {shape} cannot scale layer {src}'s "
                          f"{target}: expected {want}", "from")
        return cls(s, [s.index - 1, src], shape, target)

    def combine(self, sources: list[np.ndarray], out: np.ndarray,
                weights: np.ndarray | None) -> list[NativeStep]:
        # The previous layer holds the factors, the from= layer what they scale.
        return [cpu_combine.scale_channels_step(sources[1], sources[0], out,
                                                self.values["scale_wh"])]

    def combine_backward(self, delta: np.ndarray, sources: list[np.ndarray],
                         grads: list[np.ndarray], ts: LayerTrainState) -> list[NativeStep]:
        return [cpu_combine.scale_channels_backward_step(delta, sources[1], sources[0],
                                                         grads[1], grads[0],
                                                         self.values["scale_wh"])]

    def _args(self, batch: int) -> dict[str, int]:
        oc, oh, ow = self.out_shape
        return dict(batch=batch, channels=oc, spatial=oh * ow,
                    scale_wh=int(bool(self.values["scale_wh"])))

    def emit_device_combine(self, e: LayerEmitter, out: Tensor) -> None:
        args = self._args(e.batch)
        e.kernel("scale_channels_fwd_f32",
                 {"x_from": e.inputs[1], "scale": e.inputs[0], "y": out},
                 {"spatial": args["spatial"], "channels": args["channels"], "batch": e.batch},
                 **args)

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor]) -> None:
        args = self._args(e.batch)
        e.kernel("scale_channels_bwd_f32",
                 {"delta": e.delta, "scale": e.inputs[0], "x_from_grad": grads[1]},
                 {"spatial": args["spatial"], "channels": args["channels"], "batch": e.batch},
                 **args)
        factors = e.batch * (args["spatial"] if args["scale_wh"] else args["channels"])
        e.kernel("scale_channels_bwd_scale_f32",
                 {"delta": e.delta, "x_from": e.inputs[1], "scale_grad": grads[0]},
                 {"factors": factors}, **args)

    def describe(self) -> str:
        return _describe_from(self)


class SamOp(_Combining):
    """Spatial attention: layer ``from``'s output times the input, elementwise."""

    kind = "sam"
    short_name = "sam"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
        src = s.values["from"]
        if shapes[src] != shape:
            raise s.error(f"layer {src} output {shapes[src]} differs from the input {shape}",
                          "from")
        return cls(s, [s.index - 1, src], shape, shape)

    def combine(self, sources: list[np.ndarray], out: np.ndarray,
                weights: np.ndarray | None) -> list[NativeStep]:
        return [cpu_combine.sam_step(sources[1], sources[0], out)]

    def combine_backward(self, delta: np.ndarray, sources: list[np.ndarray],
                         grads: list[np.ndarray], ts: LayerTrainState) -> list[NativeStep]:
        return [cpu_combine.sam_backward_step(delta, sources[1], sources[0], grads[1],
                                              grads[0])]

    def emit_device_combine(self, e: LayerEmitter, out: Tensor) -> None:
        n = e.batch * self.out_size
        e.kernel("sam_fwd_f32", {"x_from": e.inputs[1], "x": e.inputs[0], "y": out},
                 {"n": n}, n=n)

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor]) -> None:
        n = e.batch * self.out_size
        e.kernel("sam_bwd_f32", {"delta": e.delta, "x_from": e.inputs[1], "x": e.inputs[0],
                                 "x_from_grad": grads[1], "x_grad": grads[0]}, {"n": n}, n=n)

    def describe(self) -> str:
        return _describe_from(self)
