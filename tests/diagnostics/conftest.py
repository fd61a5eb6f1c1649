"""The parity and doctor tests run on the emulator device, so they need the shim extension."""

import pytest

pytest.importorskip("darknet_metal.metal._shim", reason="the shim extension is not built")
