"""``Detector``: what every detection path shares — an image made into the network's input,
and one image's ``[yolo]`` outputs made into detections, as ``darknet detector test`` does.

``Network.detect`` (one image or a sequence in batches), ``Network.stream`` and
``evaluation.detect_dataset`` all go through it, so their results agree image for image.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from darknet_metal import arguments
from darknet_metal.errors import ArgumentTypeError, CfgError
from darknet_metal.inference.boxes import Detection, detect_boxes
from darknet_metal.inference.image import load_image, prepare_input

if TYPE_CHECKING:
    from darknet_metal.inference.boxes import YoloHead
    from darknet_metal.model.cfg import NetConfig, Shape

__all__ = ["DetectingNetwork", "Detector", "ImageSource", "PreparedImage", "check_images",
           "is_image_sequence"]

#: One image as the detection calls take it: a path, or an (H, W, 3) uint8 RGB array (also
#: gray (H, W) / (H, W, 1) and RGBA (H, W, 4), see ``image.load_image``).
ImageSource = str | os.PathLike[str] | np.ndarray


def is_image_sequence(images: object) -> bool:
    """Whether ``images`` is several images (a list, tuple or other sequence of them) rather
    than one path or array."""
    return (isinstance(images, Sequence)
            and not isinstance(images, str | bytes | os.PathLike | np.ndarray))


class DetectingNetwork(Protocol):
    """What detection needs of a network (``darknet_metal.Network`` has it): its cfg, input
    shape (C, H, W), layers (their ``values``), class names, the batch it is prepared for,
    its ``[yolo]`` layers and heads, and ``forward``."""

    config: NetConfig
    layers: Sequence[Any]
    names: list[str] | None
    batch: int

    @property
    def input_shape(self) -> Shape: ...

    @property
    def yolo_layers(self) -> list[int]: ...

    def yolo_heads(self) -> list[YoloHead]: ...

    def forward(self, x: np.ndarray, outputs: Sequence[int] | None = None
                ) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the network: ``x`` (C, H, W) float32 at the network's size, and
    the original ``width`` and ``height`` in pixels (the detections' frame)."""

    x: np.ndarray
    width: int
    height: int


class Detector:
    """Prepares images for ``net`` and decodes its ``[yolo]`` outputs, with ``thresh``
    (objectness x class probability) and ``nms`` (IoU threshold; 0 = none) as
    ``Network.detect`` documents them. Holds no state between images: one may be shared by
    threads.

    Raises ``CfgError`` for a network without ``[yolo]`` layers or not taking 3 channels,
    ``ArgumentError`` for thresholds outside [0, 1].
    """

    def __init__(self, net: DetectingNetwork, thresh: float = 0.25, nms: float = 0.45) -> None:
        if not net.yolo_layers:
            raise CfgError("the network has no [yolo] layer to detect with",
                           path=net.config.path)
        self.thresh = arguments.number("thresh", thresh, 0.0, 1.0)
        self.nms = arguments.number("nms", nms, 0.0, 1.0)
        c, self.height, self.width = net.input_shape
        if c != 3:
            raise CfgError(f"detection needs a network with channels=3 in [net]; this one "
                           f"takes {c}", path=net.config.path, line=net.config.net.line)
        self.letterbox = bool(net.config.net.values.get("letter_box"))
        self.heads = net.yolo_heads()
        self.outputs = net.yolo_layers
        last_yolo = net.layers[net.yolo_layers[-1]].values
        self.nms_kind = last_yolo["nms_kind"]
        self.beta_nms = last_yolo["beta_nms"]
        self.names = net.names
        self.net = net

    def detect(self, image: ImageSource | Sequence[ImageSource]
               ) -> list[Detection] | list[list[Detection]]:
        """``Network.detect``: one image's detections, or per image of a sequence its
        detections, run in passes of ``net.batch`` images (the last one shorter)."""
        if not is_image_sequence(image):
            prepared = self.prepare(image)  # type: ignore[arg-type]
            outputs = self.net.forward(prepared.x[None], outputs=self.outputs)
            return self.detections([out[0] for out in outputs], prepared.width,
                                   prepared.height)
        images = list(image)  # type: ignore[arg-type]
        check_images(images)
        found: list[list[Detection]] = []
        for start in range(0, len(images), self.net.batch):
            chunk = [self.prepare(item) for item in images[start:start + self.net.batch]]
            outputs = self.net.forward(np.stack([item.x for item in chunk]),
                                       outputs=self.outputs)
            found += self.batch_detections(outputs, chunk)
        return found

    def prepare(self, image: ImageSource) -> PreparedImage:
        """Read (a path) or convert (an array) ``image`` and stretch or letterbox it to the
        network's size. Raises ``ImageError`` naming the file or the array."""
        planar = load_image(image)
        x = prepare_input(planar, self.width, self.height, self.letterbox)
        return PreparedImage(x=x, width=int(planar.shape[2]), height=int(planar.shape[1]))

    def detections(self, outputs: Sequence[np.ndarray], width: int,
                   height: int) -> list[Detection]:
        """One image's detections from its ``[yolo]`` outputs (one (C, H, W) array per head,
        in network order), boxes in pixels of a ``width`` x ``height`` image."""
        return detect_boxes(outputs, self.heads, self.width, self.height, width, height,
                            thresh=self.thresh, nms=self.nms, nms_kind=self.nms_kind,
                            beta_nms=self.beta_nms, letterbox=self.letterbox,
                            names=self.names)

    def batch_detections(self, outputs: Sequence[np.ndarray],
                         images: Sequence[PreparedImage]) -> list[list[Detection]]:
        """Per image of a pass, its detections: ``outputs`` holds one (N, C, H, W) array per
        head for the N ``images``."""
        return [self.detections([out[n] for out in outputs], image.width, image.height)
                for n, image in enumerate(images)]


def check_images(images: Iterable[object], what: str = "images") -> None:
    """Raise ``ArgumentTypeError`` naming the first entry that is neither a path nor an
    array."""
    for i, image in enumerate(images):
        if not isinstance(image, str | os.PathLike | np.ndarray):
            raise ArgumentTypeError(f"{what}[{i}] must be an image path or array, not "
                                    f"{type(image).__name__}")
