"""Output layers: [softmax] (classifiers) and [yolo] (detection)."""

from __future__ import annotations

from typing import Any

import numpy as np

from darknet_metal.boxes import YoloHead
from darknet_metal.cfg import Section
from darknet_metal.cpu import heads as cpu_heads
from darknet_metal.cpu.step import NativeStep
from darknet_metal.ops.base import LayerSpec, Shape
from darknet_metal.program import LayerEmitter
from darknet_metal.training.keys import DATA, IMPLEMENTED, INFERENCE_ONLY


class SoftmaxOp(LayerSpec):
    kind = "softmax"
    short_name = "softmax"
    training_keys = {
        "tree": "hierarchical softmax is not supported",
        "spatial": "spatial softmax is not supported",
        "noloss": IMPLEMENTED,
    }

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
        inputs = shape[0] * shape[1] * shape[2]
        if inputs % s.values["groups"]:
            raise s.error(f"groups={s.values['groups']} does not divide the {inputs} inputs",
                          "groups")
        return cls(s, [s.index - 1], shape, shape)

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        return [cpu_heads.softmax_step(sources[0], out, self.values["groups"],
                                       self.values["temperature"])]

    def emit_device_forward(self, e: LayerEmitter) -> None:
        groups = self.values["groups"]
        rows = e.batch * groups
        e.kernel("softmax_fwd_f32", {"x": e.inputs[0], "y": e.output}, {"rows": rows},
                 rows=rows, n=self.out_size // groups, temperature=self.values["temperature"])


class YoloOp(LayerSpec):
    """Logistic on x, y, objectness and classes of each masked anchor (Darknet's
    ``layer.output``); boxes are decoded from it on the host."""

    kind = "yolo"
    short_name = "yolo"
    training_keys = {
        **dict.fromkeys(("jitter", "resize", "random"), DATA),
        **dict.fromkeys(("max", "max_delta", "counters_per_class", "label_smooth_eps",
                         "iou_normalizer", "obj_normalizer", "cls_normalizer", "iou_loss",
                         "ignore_thresh", "truth_thresh", "iou_thresh"), IMPLEMENTED),
        **dict.fromkeys(("objectness_smooth", "focal_loss", "delta_normalizer",
                         "iou_thresh_kind"), "this [yolo] loss option is not supported"),
        **dict.fromkeys(("embedding_layer", "track_history_size", "sim_thresh",
                         "dets_for_track", "track_ciou_norm"),
                        "tracking embeddings are not supported"),
        **dict.fromkeys(("beta_nms", "nms_kind", "dets_for_show", "map", "show_details"),
                        INFERENCE_ONLY),
    }

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> LayerSpec:
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

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        v = self.values
        return [cpu_heads.yolo_step(sources[0], out, len(v["mask"]), v["classes"],
                                    v["scale_x_y"], v["new_coords"])]

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
