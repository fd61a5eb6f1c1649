"""darknet_metal: Darknet networks (``.cfg`` + ``.weights``) from Python.

``load`` builds a ``Network``; ``Network.forward`` and ``Network.detect`` run it.
"""

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
]
