"""Layers that combine two or more layers' outputs: [shortcut], [scale_channels], [sam].

Their activation runs after the combination (no kernel of theirs fuses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import combine as cpu_combine
from darknet_metal.cpu.step import NativeStep
from darknet_metal.model.cfg import Section
from darknet_metal.ops.activation import (
    activation_input,
    activation_steps_after,
    emit_activation_after,
    emit_cpu_activation_gradient,
    emit_cpu_activation_train,
    emit_device_activation_gradient,
    emit_device_activation_train,
)
from darknet_metal.ops.base import Op, Params, Shape
from darknet_metal.runtime.program import LayerEmitter, Param, Tensor

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState

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


def _describe_from(spec: Op) -> str:
    src = spec.values["from"]
    return "from " + (" ".join(map(str, src)) if isinstance(src, list) else str(src))


class _Combining(Op):
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

    def onnx_combine(self, g: OnnxGraph, params: Params | None) -> str:
        """The combination of the inputs in ONNX, before the activation."""
        raise NotImplementedError

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        return g.activation(self.onnx_combine(g, params), self.activation)

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

    def emit_device_combine(self, e: LayerEmitter, out: Tensor,
                            ts: LayerTrainState | None) -> None:
        """The kernel steps writing ``out`` from the inputs: with the inference parameters,
        or the live training ones of ``ts``."""
        raise NotImplementedError

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor],
                                     ts: LayerTrainState) -> None:
        """The kernel steps adding the gradients of ``e.delta`` (after the activation's)
        into each input's delta ``grads`` (and the weights' accumulator in ``ts``)."""
        raise NotImplementedError

    def emit_device_forward(self, e: LayerEmitter) -> None:
        self.emit_device_combine(e, e.output, None)
        emit_activation_after(e, self.activation, fused=False)

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        pre = activation_input(e, self.activation)
        self.emit_device_combine(e, pre, ts)
        emit_device_activation_train(e, self.activation, pre)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
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
        self.emit_device_combine_backward(e, grads, ts)


class ShortcutOp(_Combining):
    """x plus the ``from=`` layers, optionally weighted per input or per (input, channel)."""

    kind = "shortcut"
    short_name = "shortcut"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
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

    def _table_args(self) -> dict[str, int]:
        v = self.values
        return dict(n_inputs=len(self.inputs), channels=self.out_shape[0],
                    per_channel=int(v["weights_type"] == "per_channel"),
                    normalization=_NORMALIZATION[v["weights_normalization"]])

    def _emit_table(self, e: LayerEmitter, weights: Param, table: Param | Tensor) -> None:
        # The normalised weights per (input, channel).
        args = self._table_args()
        e.kernel("shortcut_weights_fwd_f32", {"weights": weights, "table": table},
                 {"channels": args["channels"]}, **args)

    def emit_device_setup(self, e: LayerEmitter) -> None:
        # Once per load rather than once per pass.
        if self.weighted:
            self._emit_table(e, Param(self.index, "weights"), Param(self.index, "table"))

    def normalized_weights(self, weights: np.ndarray) -> np.ndarray:
        """(inputs, channels) float32 factors of the inputs (the previous layer first), from
        the stored weights as ``shortcut_step`` normalises them (one column for
        per_feature)."""
        n = len(self.inputs)
        w = np.asarray(weights, np.float32).reshape(n, -1)
        norm = self.values["weights_normalization"]
        if norm == "relu":
            w = np.maximum(w, np.float32(0))
            return w / (np.float32(1e-4) + w.sum(axis=0, dtype=np.float32))
        if norm == "softmax":
            e = np.exp(w - w.max(axis=0))
            return e / (np.float32(1e-4) + e.sum(axis=0, dtype=np.float32))
        return w

    def onnx_combine(self, g: OnnxGraph, params: Params | None) -> str:
        c = self.out_shape[0]
        table = self.normalized_weights(params["weights"]) if self.weighted else None
        total = ""
        for k, layer in enumerate(self.inputs):
            term = g.source(layer)
            # Darknet adds the first min(C, C_k) channels of each source.
            ck = g.shape_of(layer)[0]
            if k and ck > c:
                term = g.node("Slice", [term, g.const([0], "starts"), g.const([c], "ends"),
                                        g.const([1], "axes")])
            elif k and ck < c:
                term = g.node("Pad", [term, g.const([0, 0, 0, 0, 0, c - ck, 0, 0], "pads")],
                              mode="constant")
            if table is not None:
                factor = table[k].reshape(-1, 1, 1) if table.shape[1] > 1 else table[k, 0]
                term = g.node("Mul", [term, g.const(factor, "weight")])
            total = term if not total else g.node("Add", [total, term])
        return total

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

    def emit_device_combine(self, e: LayerEmitter, out: Tensor,
                            ts: LayerTrainState | None) -> None:
        oc, oh, ow = self.out_shape
        table: Param | Tensor | None = None
        if self.weighted and ts is None:
            table = Param(self.index, "table")
        elif self.weighted:
            # Training: the table of this pass's weights, kept for the backward.
            table = e.tensor("table", (len(self.inputs) * oc,))
            self._emit_table(e, ts.ref("weights"), table)
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

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor],
                                     ts: LayerTrainState) -> None:
        # One dispatch per input, x first: where one array receives two inputs' gradients
        # they add in the CPU's order. Weighted: then each input's weight gradient, summed
        # per pixel, then over images and channels; through the normalisation's exact
        # derivative when there is one.
        oc, oh, ow = self.out_shape
        table = Tensor(self.index, "table") if self.weighted else None
        for row, (source, grad) in enumerate(zip(e.inputs, grads, strict=True)):
            src_c = e.shape(source)[1]
            e.kernel("shortcut_bwd_f32", {"delta": e.delta, "table": table, "grad": grad},
                     {"spatial": oh * ow, "channels": min(oc, src_c), "batch": e.batch},
                     batch=e.batch, channels=oc, spatial=oh * ow, src_channels=src_c, row=row,
                     weighted=int(self.weighted))
        if not self.weighted:
            return
        args = self._table_args()
        normalized = args["normalization"] != 0
        acc = (e.tensor("weight_gradient_raw", (len(self.inputs) * oc,)) if normalized
               else ts.ref("weights", "grad"))
        partial = e.tensor("weight_partial", (e.batch * oc,))
        for row, source in enumerate(e.inputs):
            src_c = e.shape(source)[1]
            e.kernel("shortcut_bwd_dot_f32",
                     {"delta": e.delta, "input": source, "partial": partial},
                     {"channels": min(oc, src_c), "batch": e.batch},
                     batch=e.batch, channels=oc, spatial=oh * ow, src_channels=src_c, row=row,
                     weighted=1)
            e.kernel("shortcut_bwd_weights_f32", {"partial": partial, "acc": acc},
                     {"columns": oc if args["per_channel"] else 1},
                     batch=e.batch, channels=oc, src_channels=src_c, row=row,
                     per_channel=args["per_channel"], accumulate=int(not normalized))
        if normalized:
            e.kernel("shortcut_bwd_norm_f32",
                     {"weights": ts.ref("weights"), "g": acc,
                      "weight_grad": ts.ref("weights", "grad")},
                     {"columns": oc if args["per_channel"] else 1}, **args)

    def describe(self) -> str:
        return _describe_from(self)


class ScaleChannelsOp(_Combining):
    """Layer ``from``'s output scaled per channel (or per pixel, ``scale_wh``) by the input."""

    kind = "scale_channels"
    short_name = "scale_channels"

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        src = s.values["from"]
        target = shapes[src]
        want = (1, *target[1:]) if s.values["scale_wh"] else (target[0], 1, 1)
        if shape != want:
            raise s.error(f"the previous layer's output {shape} cannot scale layer {src}'s "
                          f"{target}: expected {want}", "from")
        return cls(s, [s.index - 1, src], shape, target)

    def onnx_combine(self, g: OnnxGraph, params: Params | None) -> str:
        # The scale (N, C, 1, 1), or (N, 1, H, W) with scale_wh, broadcasts over x_from.
        return g.node("Mul", [g.source(self.inputs[1]), g.source(self.inputs[0])])

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

    def emit_device_combine(self, e: LayerEmitter, out: Tensor,
                            ts: LayerTrainState | None) -> None:
        args = self._args(e.batch)
        e.kernel("scale_channels_fwd_f32",
                 {"x_from": e.inputs[1], "scale": e.inputs[0], "y": out},
                 {"spatial": args["spatial"], "channels": args["channels"], "batch": e.batch},
                 **args)

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor],
                                     ts: LayerTrainState) -> None:
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
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        src = s.values["from"]
        if shapes[src] != shape:
            raise s.error(f"layer {src} output {shapes[src]} differs from the input {shape}",
                          "from")
        return cls(s, [s.index - 1, src], shape, shape)

    def onnx_combine(self, g: OnnxGraph, params: Params | None) -> str:
        return g.node("Mul", [g.source(self.inputs[1]), g.source(self.inputs[0])])

    def combine(self, sources: list[np.ndarray], out: np.ndarray,
                weights: np.ndarray | None) -> list[NativeStep]:
        return [cpu_combine.sam_step(sources[1], sources[0], out)]

    def combine_backward(self, delta: np.ndarray, sources: list[np.ndarray],
                         grads: list[np.ndarray], ts: LayerTrainState) -> list[NativeStep]:
        return [cpu_combine.sam_backward_step(delta, sources[1], sources[0], grads[1],
                                              grads[0])]

    def emit_device_combine(self, e: LayerEmitter, out: Tensor,
                            ts: LayerTrainState | None) -> None:
        n = e.batch * self.out_size
        e.kernel("sam_fwd_f32", {"x_from": e.inputs[1], "x": e.inputs[0], "y": out},
                 {"n": n}, n=n)

    def emit_device_combine_backward(self, e: LayerEmitter, grads: list[Tensor],
                                     ts: LayerTrainState) -> None:
        n = e.batch * self.out_size
        e.kernel("sam_bwd_f32", {"delta": e.delta, "x_from": e.inputs[1], "x": e.inputs[0],
                                 "x_from_grad": grads[1], "x_grad": grads[0]}, {"n": n}, n=n)

    def describe(self) -> str:
        return _describe_from(self)
