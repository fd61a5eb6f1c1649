"""The devices the tests run on, named once: a test that takes the ``device`` fixture runs on
each of DEVICES, one that takes ``gpu_device`` on each Metal device (GPU_DEVICES); see
tests/conftest.py. Add a device here and every such test runs on it, skipped where the
device is not available."""

from __future__ import annotations

import pytest

# "cpu": the CPU executor; "emu": the Metal executor on the CPU emulator of Metal (the shim);
# "cuda": the Metal executor on an NVIDIA GPU through the cuda shim driver, skipped where none
# is present.
DEVICES = ("cpu", "emu", "cuda")
GPU_DEVICES = tuple(d for d in DEVICES if d != "cpu")

# Why a device is skipped, where the generic "no 'kind' device here" says too little.
_MISSING = {
    "cuda": "no NVIDIA GPU with the CUDA driver and translated kernels here (device 'cuda')",
}


def require(device: str) -> None:
    """Skips the calling test where ``device`` cannot be used in this process: a Metal device
    needs the shim extension built, and the device compiled into it and present."""
    if device == "cpu":
        return
    pytest.importorskip("darknet_metal.metal._shim", reason="the shim extension is not built")
    from darknet_metal import metal

    if not metal.is_available(device):
        pytest.skip(_MISSING.get(device, f"no {device!r} device here"))
