"""``detect_dataset``: a network's detections for a list of images, as Darknet's map run
collects them (detector threshold 0.005, NMS 0.45 of the kind the last ``[yolo]`` names)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from darknet_metal import arguments
from darknet_metal.boxes import detect_boxes
from darknet_metal.errors import ArgumentTypeError, CfgError, ImageError
from darknet_metal.evaluation.detections import detections_to_array
from darknet_metal.image import load_image, prepare_input

if TYPE_CHECKING:
    from darknet_metal.network import Network

__all__ = ["DatasetDetections", "detect_dataset"]


@dataclass(frozen=True)
class DatasetDetections:
    """Per image, in the order given: ``detections`` (m, 6) float32 arrays ``cx, cy, w, h,
    class, probability`` (normalised; one row per (box, class) above the threshold, in the
    order ``Network.detect`` returns them) and ``image_sizes`` (width, height) in pixels."""

    detections: list[np.ndarray]
    image_sizes: list[tuple[int, int]]


def detect_dataset(
    net: Network,
    images: Sequence[str | os.PathLike[str]],
    *,
    thresh: float = 0.005,
    nms: float = 0.45,
    batch: int = 4,
    progress: bool = True,
) -> DatasetDetections:
    """Run ``net`` over image files and collect what :func:`evaluate` needs.

    Each image is read and prepared as ``Network.detect`` does (stretched to the network
    size, or letterboxed when ``[net]`` has ``letter_box=1``) and ``batch`` images go
    through one forward pass; each image's detections are exactly ``net.detect(path,
    thresh, nms)``'s (decoding, NMS and ordering shared with it). The defaults are Darknet's
    map run: ``thresh`` 0.005, ``nms`` 0.45. ``progress``: a progress bar on stderr.

    Raises ``ImageError`` naming an unreadable image (before any pass when the file is
    missing), ``CfgError`` for a network without ``[yolo]`` layers or not taking 3
    channels, ``ArgumentError`` for bad arguments.
    """
    from darknet_metal.network import Network

    if not isinstance(net, Network):
        raise ArgumentTypeError(f"net must be a darknet_metal.Network, not {type(net).__name__}")
    if isinstance(images, str | bytes | os.PathLike) or not isinstance(images, Sequence):
        raise ArgumentTypeError("images must be a sequence of image paths, not "
                                f"{type(images).__name__}")
    thresh = arguments.number("thresh", thresh, 0.0, 1.0)
    nms = arguments.number("nms", nms, 0.0, 1.0)
    batch = arguments.positive_int("batch", batch)
    if not net.yolo_layers:
        raise CfgError("the network has no [yolo] layer to detect with", path=net.config.path)
    c, h, w = net.input_shape
    if c != 3:
        raise CfgError(f"detection needs a network with channels=3 in [net]; this one takes "
                       f"{c}", path=net.config.path, line=net.config.net.line)
    for i, path in enumerate(images):
        if not isinstance(path, str | os.PathLike):
            raise ArgumentTypeError(f"images[{i}] must be a path, not {type(path).__name__}")
        if not os.path.isfile(path):
            raise ImageError(f"{os.fspath(path)}: no such image file (images[{i}])")

    letterbox = bool(net.config.net.values.get("letter_box"))
    last_yolo = net.layers[net.yolo_layers[-1]].values
    heads = net.yolo_heads()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(images), desc="detect", unit="img", file=sys.stderr)
    detections: list[np.ndarray] = []
    sizes: list[tuple[int, int]] = []
    try:
        for start in range(0, len(images), batch):
            chunk = images[start:start + batch]
            loaded = [load_image(p) for p in chunk]
            x = np.stack([prepare_input(img, w, h, letterbox) for img in loaded])
            outputs = net.forward(x)
            for n, img in enumerate(loaded):
                iw, ih = int(img.shape[2]), int(img.shape[1])
                found = detect_boxes([out[n] for out in outputs], heads, w, h, iw, ih,
                                     thresh=thresh, nms=nms, nms_kind=last_yolo["nms_kind"],
                                     beta_nms=last_yolo["beta_nms"], letterbox=letterbox,
                                     names=net.names)
                detections.append(detections_to_array(found, iw, ih))
                sizes.append((iw, ih))
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return DatasetDetections(detections=detections, image_sizes=sizes)
