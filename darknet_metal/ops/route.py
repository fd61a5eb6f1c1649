"""[route]: the channels of several layers side by side, optionally one group of each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import route as cpu_route
from darknet_metal.cpu.step import NativeStep
from darknet_metal.model.cfg import Section
from darknet_metal.ops.base import Op, Params, Shape
from darknet_metal.ops.key_dispositions import INFERENCE_ONLY
from darknet_metal.runtime.program import LayerEmitter

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState


class RouteOp(Op):
    kind = "route"
    short_name = "route"
    training_keys = {"stream": INFERENCE_ONLY, "wait_stream": INFERENCE_ONLY}

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        v = s.values
        groups, group_id = v["groups"], v["group_id"]
        if not 0 <= group_id < groups:
            raise s.error(f"group_id={group_id} must be in [0, groups={groups})", "group_id")
        sources = list(v["layers"])
        first = shapes[sources[0]]
        channels = 0
        for src in sources:
            c, h, w = shapes[src]
            if (h, w) != first[1:]:
                raise s.error(
                    f"layer {src} output is {h}x{w} but layer {sources[0]} output is "
                    f"{first[1]}x{first[2]}: routed layers must have the same width and height",
                    "layers",
                )
            if c % groups:
                raise s.error(f"groups={groups} does not divide layer {src}'s {c} channels",
                              "groups")
            channels += c // groups
        return cls(s, sources, first, (channels, first[1], first[2]))

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        groups, group_id = self.values["groups"], self.values["group_id"]
        steps = []
        offset = 0
        for part in sources:
            width = part.shape[1] // groups
            steps.append(cpu_route.route_step(part, out, group_id * width, width, offset))
            offset += width
        return steps

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        groups, group_id = self.values["groups"], self.values["group_id"]
        parts = []
        for layer in self.inputs:
            part = g.source(layer)
            if groups > 1:
                width = g.shape_of(layer)[0] // groups
                part = g.node("Slice", [part, g.const([group_id * width], "starts"),
                                        g.const([(group_id + 1) * width], "ends"),
                                        g.const([1], "axes")])
            parts.append(part)
        return g.concat(parts, axis=1)

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        groups, group_id = self.values["groups"], self.values["group_id"]
        offset = 0
        for k, source in enumerate(e.inputs):
            width = e.shape(source)[1] // groups
            into = e.input_delta(k)
            if into is not None:
                e.host([e.delta, into], [into], lambda r, w, start=group_id * width,
                       width=width, offset=offset: [cpu_route.route_backward_step(
                           r[0], w[0], start, width, offset)])
            offset += width

    def _emit_copies(self, e: LayerEmitter, kernel: str, backward: bool) -> None:
        # One dispatch per source: its group's channels to or from the output's run.
        groups, group_id = self.values["groups"], self.values["group_id"]
        oc, oh, ow = self.out_shape
        offset = 0
        for k, source in enumerate(e.inputs):
            src_c = e.shape(source)[1]
            width = src_c // groups
            accumulate = True
            if not backward:
                buffers = {"x": source, "y": e.output}
            elif groups == 1:
                # The whole source's delta is written: its first writer sets it.
                target = e.input_delta_target(k)
                buffers = {"delta": e.delta, "x_grad": None if target is None else target[0]}
                accumulate = target is None or target[1]
            else:
                buffers = {"delta": e.delta, "x_grad": e.input_delta(k)}
            if all(t is not None for t in buffers.values()):
                e.kernel(kernel, buffers,
                         {"spatial": oh * ow, "channels": width, "batch": e.batch},
                         batch=e.batch, spatial=oh * ow, channels=width, src_channels=src_c,
                         src_offset=group_id * width, dst_channels=oc, dst_offset=offset,
                         accumulate=int(accumulate))
            offset += width

    def emit_device_forward(self, e: LayerEmitter) -> None:
        self._emit_copies(e, "route_fwd_f32", backward=False)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        self._emit_copies(e, "route_bwd_f32", backward=True)

    def describe(self) -> str:
        v = self.values
        text = " ".join(str(i) for i in v["layers"])
        if v["groups"] > 1:
            text += f" (group {v['group_id']}/{v['groups']})"
        return text
