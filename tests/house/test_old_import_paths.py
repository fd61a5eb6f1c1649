"""The module paths users imported before the package was laid out in subpackages still work
for one release: each hands on the new module's public names and warns once."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

OLD_PATHS = {
    "darknet_metal.models": ("darknet_metal.model.bundled", "model_names"),
    "darknet_metal.cfg": ("darknet_metal.model.cfg", "parse_cfg"),
    "darknet_metal.activations": ("darknet_metal.model.activations", "ACTIVATIONS"),
    "darknet_metal.video": ("darknet_metal.inference.video", "detect_video"),
    "darknet_metal.detection_json": ("darknet_metal.inference.detection_json",
                                     "write_detections_json"),
    "darknet_metal.loading": ("darknet_metal.training.loading", "Loader"),
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_warns_and_hands_on_the_new_names(old):
    new, name = OLD_PATHS[old]
    # A fresh interpreter: the warning is given when the module is first imported.
    code = (f"import warnings\nwarnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n"
            f"    import {old} as old\n"
            f"import {new} as new\n"
            f"assert old.{name} is new.{name}\n"
            f"assert sorted(old.__all__) == sorted(new.__all__)\n"
            f"assert [w.category.__name__ for w in seen if '{old}' in str(w.message)]"
            f" == ['DeprecationWarning'], [str(w.message) for w in seen]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_package_face_is_unchanged():
    dm = importlib.import_module("darknet_metal")
    for name in ("load", "load_model", "Network", "Detection", "CfgError", "WeightsError",
                 "ArgumentError", "DeviceError", "NonFiniteError", "MemoryLimitError", "metal"):
        assert hasattr(dm, name), name
