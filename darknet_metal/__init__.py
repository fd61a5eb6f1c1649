"""darknet_metal: Darknet networks (``.cfg`` + ``.weights``) from Python.

``load`` builds a ``Network``; ``Network.forward`` and ``Network.detect`` run it on the CPU
(``device="cpu"``), an Apple GPU (``"metal"``) or the Metal emulator (``"emu"``);
``darknet_metal.metal`` reports on and manages the GPU devices.
"""

from darknet_metal import metal
from darknet_metal.boxes import Detection
from darknet_metal.errors import (
    CfgError,
    DarknetMetalError,
    DeviceError,
    ImageError,
    ModelNotFoundError,
    WeightsError,
)
from darknet_metal.network import Network, load

__version__ = "0.1.0"

__all__ = [
    "CfgError",
    "DarknetMetalError",
    "Detection",
    "DeviceError",
    "ImageError",
    "ModelNotFoundError",
    "Network",
    "WeightsError",
    "__version__",
    "load",
    "metal",
]
