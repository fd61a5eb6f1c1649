"""The [yolo] output layer (detection): its forward output and its training loss."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import fill as cpu_fill
from darknet_metal.cpu import yolo as cpu_yolo
from darknet_metal.cpu.step import NativeStep
from darknet_metal.inference.boxes import YoloHead
from darknet_metal.metal import registry
from darknet_metal.model.cfg import Section
from darknet_metal.model.cfg_schema import IOU_LOSSES
from darknet_metal.ops.base import Op, Params, Shape, emit_input_gradient
from darknet_metal.ops.key_dispositions import DATA, IMPLEMENTED, INFERENCE_ONLY
from darknet_metal.ops.loss import emit_device_add_into_input
from darknet_metal.runtime.program import LayerEmitter

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState


#: The [yolo] keys its training loss takes, by the loss step's keyword names.
_LOSS_OPTIONS = ("ignore_thresh", "truth_thresh", "iou_thresh", "iou_thresh_kind", "iou_loss",
                 "iou_normalizer", "obj_normalizer", "cls_normalizer", "max_delta",
                 "label_smooth_eps", "counters_per_class", "new_coords", "focal_loss",
                 "objectness_smooth")


class YoloOp(Op):
    """Logistic on x, y, objectness and classes of each masked anchor (Darknet's
    ``layer.output``); boxes are decoded from it on the host."""

    kind = "yolo"
    short_name = "yolo"
    computes_loss = True
    training_keys = {
        **dict.fromkeys(("jitter", "resize", "random"), DATA),
        **dict.fromkeys(_LOSS_OPTIONS + ("max",), IMPLEMENTED),
        "delta_normalizer": "delta_normalizer is not supported",
        **dict.fromkeys(("embedding_layer", "track_history_size", "sim_thresh",
                         "dets_for_track", "track_ciou_norm"),
                        "tracking embeddings are not supported"),
        **dict.fromkeys(("beta_nms", "nms_kind", "dets_for_show", "map", "show_details"),
                        INFERENCE_ONLY),
    }

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        v = s.values
        expected = len(v["mask"]) * (v["classes"] + 5)
        if shape[0] != expected:
            raise s.error(
                f"the input has {shape[0]} channels but {len(v['mask'])} masked anchors x "
                f"(classes={v['classes']} + 5) need {expected}: set filters={expected} in the "
                "convolutional layer before",
                "classes",
            )
        return cls(s, [s.index - 1], shape, shape)

    @property
    def detection_head(self) -> YoloHead:
        """What the box decoder needs of this layer."""
        v = self.values
        anchors = np.asarray(v["anchors"], np.float64).reshape(-1, 2)[list(v["mask"])]
        return YoloHead(anchors=anchors, classes=v["classes"], new_coords=bool(v["new_coords"]))

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        # Per anchor (x, y, w, h, objectness, classes): logistic on all but w and h unless
        # new_coords, then x, y = v*scale_x_y - (scale_x_y - 1)/2.
        v = self.values
        n, (c, h, w) = len(v["mask"]), self.out_shape
        x = g.node("Reshape", [g.source(self.inputs[0]), g.shape([0, n, c // n, h, w])])
        xy, wh, rest = g.node("Split", [x, g.const([2, 2, c // n - 4], "split")], axis=2,
                              outputs=3)
        if not v["new_coords"]:
            xy, rest = g.node("Sigmoid", [xy]), g.node("Sigmoid", [rest])
        scale = v["scale_x_y"]
        if scale != 1:
            xy = g.add(g.mul(xy, scale), -0.5 * (scale - 1))
        y = g.node("Concat", [xy, wh, rest], axis=2)
        return g.node("Reshape", [y, g.shape([0, c, h, w])])

    def _cpu_step(self, x: np.ndarray, out: np.ndarray, *, exact: bool) -> NativeStep:
        v = self.values
        return cpu_yolo.yolo_step(x, out, len(v["mask"]), v["classes"], v["scale_x_y"],
                                   v["new_coords"], exact=exact)

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        # Inference: the vectorised logistic, as the convolutions' fused activations.
        return [self._cpu_step(sources[0], out, exact=False)]

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # Training: Darknet's scalar logistic, so that the loss and its delta see its bits.
        e.host(e.inputs, [e.output], lambda r, w: [self._cpu_step(r[0], w[0], exact=True)])
        v = self.values
        truths = ts.truth(e.batch)
        stats = ts.buffer("stats", (len(cpu_yolo.YOLO_STAT_NAMES),), np.float64)
        net_w, net_h = ts.net_size
        options = {key: v[key] for key in _LOSS_OPTIONS}
        e.host([e.output], [e.own_delta()], lambda r, w: [cpu_yolo.yolo_loss_step(
            r[0], w[0], truths, stats, anchors=np.reshape(v["anchors"], (-1, 2)),
            mask=v["mask"],
            classes=v["classes"], net_w=net_w, net_h=net_h, max_boxes=truths.shape[1],
            **options)])

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # Darknet's backward_yolo_layer: the delta its forward computed goes to its input.
        emit_input_gradient(e, cpu_fill.add_step)

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # The forward, then Darknet's loss in four dispatches on shared buffers (see
        # shaders/yolo.metal): the delta, then the statistics.
        v = self.values
        anchors, mask, multipliers = cpu_yolo.loss_tables(
            np.reshape(v["anchors"], (-1, 2)), v["mask"], v["classes"],
            v["counters_per_class"], v["max_delta"])
        n, classes = len(mask), v["classes"]
        _, oh, ow = self.out_shape
        truths = ts.truth(e.batch)
        tables = {"anchor_table": anchors, "mask": mask,
                  "multipliers": np.zeros(classes, np.float32) if multipliers is None
                  else multipliers}
        for name, table in tables.items():
            np.copyto(ts.buffer(name, table.shape, table.dtype), table)
        ts.buffer("stats", (len(cpu_yolo.YOLO_STAT_NAMES),), np.float32)
        self.emit_device_forward(e)
        net_w, net_h = ts.net_size
        args = dict(
            batch=e.batch, anchors=n, classes=classes, height=oh, width=ow,
            boxes=truths.shape[1], total=anchors.shape[0] // 2, net_w=net_w, net_h=net_h,
            iou_loss=IOU_LOSSES.index(v["iou_loss"]),
            iou_thresh_kind=IOU_LOSSES.index(v["iou_thresh_kind"]),
            new_coords=int(bool(v["new_coords"])), focal_loss=int(bool(v["focal_loss"])),
            objectness_smooth=int(bool(v["objectness_smooth"])),
            counters=int(multipliers is not None),
            **{key: v[key] for key in ("ignore_thresh", "truth_thresh", "iou_thresh",
                                       "iou_normalizer", "obj_normalizer", "cls_normalizer",
                                       "max_delta", "label_smooth_eps")})
        buffers = {"output": e.output, "truths": ts.ref("truth", "extra"),
                   **{name: ts.ref(name, "extra") for name in tables},
                   "delta": e.own_delta(),
                   "partials": e.tensor("loss_partials", (e.batch * n * oh * ow * 4,)),
                   "images": e.tensor("loss_images", (e.batch * 10,)),
                   "stats": ts.ref("stats", "extra")}
        cells = {"spatial": oh * ow, "anchors": n, "batch": e.batch}
        for name, sizes in (("yolo_loss_bwd_cells_f32", cells),
                            ("yolo_loss_bwd_truths_f32", {"batch": e.batch}),
                            ("yolo_loss_bwd_squares_f32", cells),
                            ("yolo_loss_bwd_stats_f32", {"one": 1})):
            roles = registry.kernel(name).roles
            e.kernel(name, {role: buffers[role] for role in roles}, sizes, **args)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # Darknet's backward_yolo_layer: the delta its forward computed goes to its input.
        emit_device_add_into_input(e, 1.0)

    def emit_device_forward(self, e: LayerEmitter) -> None:
        v = self.values
        oc, oh, ow = self.out_shape
        e.kernel(
            "yolo_fwd_f32",
            {"x": e.inputs[0], "y": e.output},
            {"spatial": oh * ow, "channels": oc, "batch": e.batch},
            batch=e.batch,
            anchors=len(v["mask"]),
            classes=v["classes"],
            spatial=oh * ow,
            new_coords=int(bool(v["new_coords"])),
            scale_x_y=v["scale_x_y"],
        )
