"""darknet_metal: Darknet networks (``.cfg`` + ``.weights``) from Python.

``load`` builds a ``Network`` from a cfg and weights, ``load_model`` from a bundled model;
``Network.forward`` and ``Network.detect`` run it on the CPU (``device="cpu"``), an Apple GPU
(``"metal"``), the Metal emulator (``"emu"``) or, to verify the kernels, an NVIDIA GPU running
them translated to CUDA (``"cuda"``); ``darknet_metal.metal`` reports on and manages the GPU
devices. ``preprocess`` makes the input tensor ``detect`` makes, and ``postprocess`` turns an
exported ONNX model's decoded outputs into ``detect``'s detections. Every error raised on
purpose is a ``DarknetMetalError``.
"""

from darknet_metal import metal
from darknet_metal.errors import (
    ArgumentError,
    ArgumentTypeError,
    BindingError,
    CfgError,
    CheckpointError,
    DarknetMetalError,
    DatasetError,
    DependencyError,
    DeviceError,
    ImageError,
    LayerIndexError,
    MemoryLimitError,
    ModelNotFoundError,
    NonFiniteError,
    WeightsError,
)
from darknet_metal.inference.boxes import Detection
from darknet_metal.inference.decoded import postprocess
from darknet_metal.inference.image import preprocess
from darknet_metal.network import Network, load, load_model
from darknet_metal.version import __version__

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BindingError",
    "CfgError",
    "CheckpointError",
    "DarknetMetalError",
    "DatasetError",
    "DependencyError",
    "Detection",
    "DeviceError",
    "ImageError",
    "LayerIndexError",
    "MemoryLimitError",
    "ModelNotFoundError",
    "Network",
    "NonFiniteError",
    "WeightsError",
    "__version__",
    "load",
    "load_model",
    "metal",
    "postprocess",
    "preprocess",
]
