"""device="cuda" (the Metal kernels translated to CUDA on an NVIDIA GPU, a verification device)
where it is absent: every way of choosing it fails with one DeviceError that names the device
and what is missing, and points at device='emu'; the test fixtures skip it with one line."""

from __future__ import annotations

import pytest
from devices import require

import darknet_metal as dm
from darknet_metal import metal
from darknet_metal.errors import DeviceError

TINY_CFG = """\
[net]
width=32
height=32
channels=3

[convolutional]
filters=4
size=3
stride=1
pad=1
activation=leaky
"""


def _cuda_available() -> bool:
    try:
        return metal.is_available("cuda")
    except Exception:  # any failure to ask is "not available"
        return False


needs_no_cuda = pytest.mark.skipif(
    _cuda_available(), reason="device 'cuda' is available here: nothing is missing to report"
)


def _assert_names_what_is_missing(message: str) -> None:
    assert "device 'cuda' is not available: " in message, message
    # The shim's reason (or that the extension lacks the kind) comes before the advice.
    reason = message.split("is not available: ", 1)[1].split(". It needs", 1)[0]
    assert reason.strip(), message
    assert "NVIDIA GPU" in message and "nvcc" in message, message
    assert "device='emu'" in message, message


@pytest.fixture
def tiny_cfg(tmp_path):
    path = tmp_path / "tiny.cfg"
    path.write_text(TINY_CFG, encoding="utf-8")
    return path


def test_cuda_is_a_device_everywhere_one_is_chosen():
    from darknet_metal.network import DEVICES

    assert "cuda" in metal.KINDS and "cuda" in DEVICES
    assert metal.device_lock("cuda") is not metal.device_lock("emu")


@needs_no_cuda
def test_load_on_absent_cuda_names_what_is_missing(tiny_cfg):
    pytest.importorskip("darknet_metal.metal._shim", reason="the shim extension is not built")
    with pytest.raises(DeviceError) as info:
        dm.load(tiny_cfg, device="cuda")
    assert isinstance(info.value, dm.DarknetMetalError)
    _assert_names_what_is_missing(str(info.value))
    with pytest.raises(DeviceError) as direct:
        metal.get_device("cuda")
    assert str(direct.value) == str(info.value)
    assert not metal.is_available("cuda")


@needs_no_cuda
def test_fixtures_skip_absent_cuda_with_one_line():
    pytest.importorskip("darknet_metal.metal._shim", reason="the shim extension is not built")
    with pytest.raises(pytest.skip.Exception) as info:
        require("cuda")
    assert str(info.value.msg) == (
        "no NVIDIA GPU with the CUDA driver and translated kernels here (device 'cuda')")


class _Shim:
    """A shim whose cuda device is missing: ``available`` answers or raises as told, and
    ``Device("cuda")`` raises the shim's reason."""

    def __init__(self, available):
        self._available = available
        self.created = []

    def available(self, kind):
        return self._available(kind)

    def Device(self, kind):  # the shim's class
        self.created.append(kind)
        raise DeviceError("libcuda.so.1 not found (no NVIDIA driver)")


def test_the_shims_reason_is_in_the_message(monkeypatch):
    shim = _Shim(lambda kind: False)
    monkeypatch.setattr(metal, "_load_shim", lambda: shim)
    monkeypatch.setattr(metal, "_devices", {})
    with pytest.raises(DeviceError) as info:
        metal.get_device("cuda")
    assert shim.created == ["cuda"]  # created anyway, for the reason
    _assert_names_what_is_missing(str(info.value))
    assert "libcuda.so.1 not found (no NVIDIA driver). It needs" in str(info.value)


@pytest.mark.parametrize("error", [DeviceError, KeyError, ValueError])
def test_an_extension_without_the_kind_is_not_available(monkeypatch, error):
    def available(kind):
        raise error(f"unknown device kind {kind!r}")

    shim = _Shim(available)
    monkeypatch.setattr(metal, "_load_shim", lambda: shim)
    monkeypatch.setattr(metal, "_devices", {})
    assert not metal.is_available("cuda")
    with pytest.raises(DeviceError) as info:
        metal.get_device("cuda")
    _assert_names_what_is_missing(str(info.value))
    assert "built without the 'cuda' kind" in str(info.value)


@needs_no_cuda
def test_doctor_on_absent_cuda_fails_saying_why(capsys):
    pytest.importorskip("darknet_metal.metal._shim", reason="the shim extension is not built")
    from darknet_metal.cli import main

    assert main(["doctor", "--device", "cuda"]) == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("device 'cuda' unavailable")]
    _assert_names_what_is_missing(line)
