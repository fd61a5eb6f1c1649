"""The shim's profiler (``Device.profile_begin``/``profile_end``): one record per dispatch in
encode order, direct and through dispatch lists, each with its kernel, its tag and a time;
misuse raises DeviceError and leaves the device usable."""

import struct

import numpy as np
import pytest
from devices import GPU_DEVICES, require

from darknet_metal.errors import DeviceError
from darknet_metal.metal import _shim

N = 1 << 16


@pytest.fixture(params=GPU_DEVICES)
def device(request):
    require(request.param)
    dev = _shim.Device(request.param, **({"emu_threads": 2} if request.param == "emu" else {}))
    yield dev
    dev.close()


def _axpy(device, x, y, out, alpha, tag):
    device.dispatch("selftest_axpy_f32", struct.pack("<If", N, alpha), [x, y, out], N, 64,
                    tag=tag)


def test_records_follow_encode_order_with_tags(device):
    x = device.upload(np.ones(N, np.float32))
    y = device.upload(np.full(N, 2.0, np.float32))
    out = device.buffer(4 * N)
    sums = device.buffer(4 * (N // 64))
    steps = device.dispatch_list()
    steps.add("selftest_group_sum_f32", struct.pack("<I", N), [out, sums], N, 64,
              threadgroup_mem=(256,), tag=7)
    steps.add("selftest_axpy_f32", struct.pack("<If", N, 1.0), [x, out, out], N, 64, tag=8)
    _axpy(device, x, y, out, 0.5, tag=1)  # before the profile: not in it
    device.profile_begin()
    assert device.profiling
    _axpy(device, x, y, out, 3.0, tag=2)
    steps.encode()
    _axpy(device, x, y, out, 1.0, tag=2**64 - 1)
    records, copies = device.profile_end()
    assert not device.profiling
    assert [(k, t) for k, t, _ in records] == [
        ("selftest_axpy_f32", 2), ("selftest_group_sum_f32", 7), ("selftest_axpy_f32", 8),
        ("selftest_axpy_f32", 2**64 - 1)]
    assert all(ns > 0 for _, _, ns in records)
    assert set(copies) == {"bytes", "ns", "count"}
    # The profiled work ran as it would have: 1*1 + 2 = 3 (axpy y = alpha*x + y into out).
    np.testing.assert_array_equal(out.read(np.float32, N), np.full(N, 3.0, np.float32))
    # A second profile starts empty.
    device.profile_begin()
    assert device.profile_end()[0] == []


def test_misuse_raises_and_leaves_the_device_usable(device):
    with pytest.raises(DeviceError, match="without dm_profile_begin"):
        device.profile_end()
    device.profile_begin()
    with pytest.raises(DeviceError, match="already being taken"):
        device.profile_begin()
    x = device.upload(np.ones(N, np.float32))
    with pytest.raises(DeviceError, match="tag"):
        device.dispatch("selftest_axpy_f32", struct.pack("<If", N, 1.0), [x, x, x], N, 64,
                        tag=-1)
    records, _ = device.profile_end()
    assert records == []


def test_cuda_reports_its_host_copies():
    require("cuda")
    dev = _shim.Device("cuda")
    try:
        x = dev.upload(np.ones(N, np.float32))
        out = dev.buffer(4 * N)
        dev.profile_begin()
        x.write(np.full(N, 2.0, np.float32))  # newer on the host: uploaded at the commit
        _axpy(dev, x, x, out, 1.0, tag=3)
        got = out.read(np.float32, N)  # downloaded for the host
        records, copies = dev.profile_end()
        np.testing.assert_array_equal(got, np.full(N, 4.0, np.float32))
        assert len(records) == 1 and records[0][2] > 0
        assert copies["count"] >= 2 and copies["bytes"] >= 2 * 4 * N and copies["ns"] > 0
    finally:
        dev.close()
