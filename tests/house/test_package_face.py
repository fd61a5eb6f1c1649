"""The names the package's top level hands a user."""

from __future__ import annotations

import importlib
import re
from pathlib import Path


def test_the_package_face():
    dm = importlib.import_module("darknet_metal")
    for name in ("load", "load_model", "Network", "Detection", "CfgError", "WeightsError",
                 "ArgumentError", "DeviceError", "NonFiniteError", "MemoryLimitError", "metal",
                 "preprocess", "postprocess"):
        assert hasattr(dm, name), name


def test_the_version_is_the_one_the_package_metadata_declares():
    dm = importlib.import_module("darknet_metal")
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert declared is not None
    assert dm.__version__ == declared.group(1)
