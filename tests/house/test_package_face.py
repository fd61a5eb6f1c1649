"""The names the package's top level hands a user."""

from __future__ import annotations

import importlib


def test_the_package_face():
    dm = importlib.import_module("darknet_metal")
    for name in ("load", "load_model", "Network", "Detection", "CfgError", "WeightsError",
                 "ArgumentError", "DeviceError", "NonFiniteError", "MemoryLimitError", "metal",
                 "preprocess", "postprocess"):
        assert hasattr(dm, name), name
