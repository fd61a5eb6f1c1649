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
from darknet_metal.errors import ArgumentTypeError, ImageError
from darknet_metal.evaluation.detections import detections_to_array
from darknet_metal.inference.detector import Detector

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
    batch = arguments.positive_int("batch", batch)
    detector = Detector(net, thresh, nms)
    for i, path in enumerate(images):
        if not isinstance(path, str | os.PathLike):
            raise ArgumentTypeError(f"images[{i}] must be a path, not {type(path).__name__}")
        if not os.path.isfile(path):
            raise ImageError(f"{os.fspath(path)}: no such image file (images[{i}])")

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(images), desc="detect", unit="img", file=sys.stderr)
    detections: list[np.ndarray] = []
    sizes: list[tuple[int, int]] = []
    try:
        for start in range(0, len(images), batch):
            chunk = [detector.prepare(p) for p in images[start:start + batch]]
            outputs = net.forward(np.stack([item.x for item in chunk]))
            for item, found in zip(chunk, detector.batch_detections(outputs, chunk),
                                   strict=True):
                detections.append(detections_to_array(found, item.width, item.height))
                sizes.append((item.width, item.height))
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return DatasetDetections(detections=detections, image_sizes=sizes)
