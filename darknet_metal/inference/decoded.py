"""From an exported model's decoded outputs to the ``Detection``s ``detect`` reports.

A model exported with ``outputs="boxes"`` gives, per image, every cell's candidate before any
threshold: ``boxes`` (K, 4) relative to the network input, ``confs`` (K, classes) and
``objectness`` (K,), K running over the heads, anchors, rows and columns. ``postprocess``
keeps what ``decode_yolo`` keeps (objectness above the threshold), undoes the letterbox and
runs the same NMS in the same order, so its detections are ``detect``'s, given the same
network outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.inference.boxes import (
    Detection,
    correct_boxes,
    detections_from_candidates,
)

__all__ = ["postprocess"]


def _pair(name: str, value: object) -> tuple[int, int]:
    if (not isinstance(value, tuple | list) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1
                   for v in value)):
        raise ArgumentError(f"{name} must be a (width, height) pair of positive ints, "
                            f"not {value!r}")
    return int(value[0]), int(value[1])


def _float32_array(name: str, value: object, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim or not np.issubdtype(array.dtype, np.floating):
        raise ArgumentError(f"{name} must be a {ndim}-dimensional float array (one image's; "
                            f"index the batch first), got shape {array.shape} of "
                            f"{array.dtype}")
    return array.astype(np.float32, copy=False)


def postprocess(
    boxes: np.ndarray,
    confs: np.ndarray,
    objectness: np.ndarray,
    image_size: tuple[int, int],
    *,
    input_size: tuple[int, int],
    letterbox: bool = False,
    thresh: float = 0.25,
    nms: float = 0.45,
    nms_kind: str = "default",
    beta_nms: float = 0.6,
    names: Sequence[str] | None = None,
) -> list[Detection]:
    """One image's detections from an exported model's ``boxes``, ``confs`` and
    ``objectness`` outputs, as ``Network.detect`` makes them from the raw outputs.

    ``boxes`` (K, 4): centre x, centre y, width, height relative to the network input;
    ``confs`` (K, classes): objectness x class probability; ``objectness`` (K,): one image's
    slice of each output (float16 outputs are widened to float32). ``image_size``: the
    original image's (width, height) in pixels, the frame of the returned boxes.
    ``input_size``: the network input's (width, height); ``letterbox``: whether the input
    was letterboxed. ``thresh`` and ``nms`` as ``detect`` takes them; ``nms_kind`` and
    ``beta_nms`` as the cfg's last ``[yolo]`` layer says. The model's
    ``darknet_metal.postprocess`` metadata holds ``input_size``, ``letterbox``,
    ``nms_kind``, ``beta_nms`` and ``names`` under these names.

    Raises ``ArgumentError`` for arrays whose shapes disagree or a bad setting.
    """
    image_w, image_h = _pair("image_size", image_size)
    net_w, net_h = _pair("input_size", input_size)
    boxes = _float32_array("boxes", boxes, 2)
    confs = _float32_array("confs", confs, 2)
    objectness = _float32_array("objectness", objectness, 1)
    k = len(boxes)
    if boxes.shape[1] != 4 or confs.shape[0] != k or objectness.shape != (k,):
        raise ArgumentError(f"boxes {boxes.shape}, confs {confs.shape} and objectness "
                            f"{objectness.shape} must be (K, 4), (K, classes) and (K,) for "
                            f"the same K")
    if (isinstance(thresh, bool) or not isinstance(thresh, int | float | np.floating)
            or not 0 <= thresh <= 1):
        raise ArgumentError(f"thresh must be a number in [0, 1], not {thresh!r}")
    t = np.float32(thresh)
    # decode_yolo's candidates: the cells whose objectness clears the threshold, in order.
    kept = np.flatnonzero(objectness > t)
    candidates = boxes[kept]  # a copy: NMS works in place
    probs = confs[kept]
    probs[~(probs > t)] = 0
    correct_boxes(candidates, net_w, net_h, image_w, image_h, bool(letterbox))
    return detections_from_candidates(candidates, objectness[kept], probs, image_w, image_h,
                                      thresh=thresh, nms=nms, nms_kind=nms_kind,
                                      beta_nms=beta_nms, names=names)
