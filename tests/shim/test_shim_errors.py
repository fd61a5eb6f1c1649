"""Every misuse raises DeviceError with the shim's message; the process never dies."""

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from darknet_metal.errors import DeviceError
from darknet_metal.metal import _shim


@pytest.fixture
def device():
    """A fresh emulator device with two host threads, closed after the test."""
    dev = _shim.Device("emu", emu_threads=2)
    yield dev
    dev.close()


ARGS = struct.pack("<If", 64, 1.0)


@pytest.fixture
def bufs(device):
    return [device.buffer(256) for _ in range(3)]


def test_unknown_kernel(device):
    with pytest.raises(DeviceError, match="no kernel named 'gemm_nope_f32'") as e:
        device.dispatch("gemm_nope_f32", ARGS, [], 1, 1)
    assert e.value.kind == "not_found"


def test_threadgroup_over_pipeline_limit(device, bufs):
    with pytest.raises(DeviceError, match=r"1056 threads, more than .*maxTotalThreadsPerThread"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs, 64, (33, 32))
    assert device.stats()["kernels_dispatched"] == 0


def test_buffer_index_beyond_argument_table(device):
    many = [device.buffer(16) for _ in range(31)]  # indices 1..31 with the args at 0
    with pytest.raises(DeviceError, match=r"indices 1\.\.31; valid indices are 0\.\.30"):
        device.dispatch("selftest_axpy_f32", ARGS, many, 64, 64)


def test_unbound_buffer_the_kernel_reads(device, bufs):
    with pytest.raises(DeviceError, match=r"reads \[\[buffer\(3\)\]\] but nothing is bound"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs[:2], 64, 64)


def test_missing_threadgroup_memory_length(device, bufs):
    with pytest.raises(DeviceError, match=r"\[\[threadgroup\(0\)\]\] memory but no length"):
        device.dispatch("selftest_group_sum_f32", struct.pack("<I", 64), bufs[:2], 64, 64)


def test_threadgroup_memory_not_multiple_of_16(device, bufs):
    with pytest.raises(DeviceError, match="multiple of 16"):
        device.dispatch(
            "selftest_group_sum_f32",
            struct.pack("<I", 64),
            bufs[:2],
            64,
            64,
            threadgroup_mem=(100,),
        )


def test_threadgroup_memory_over_device_limit(device, bufs):
    with pytest.raises(DeviceError, match="more than the device's 32768"):
        device.dispatch(
            "selftest_group_sum_f32",
            struct.pack("<I", 64),
            bufs[:2],
            64,
            64,
            threadgroup_mem=(32768 + 16,),
        )


def test_argument_bytes_over_limit(device, bufs):
    with pytest.raises(DeviceError, match="4097 argument bytes"):
        device.dispatch("selftest_axpy_f32", bytes(4097), bufs, 64, 64)


def test_zero_grid_and_bad_shapes(device, bufs):
    with pytest.raises(DeviceError, match="every dimension"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs, 0, 64)
    with pytest.raises(DeviceError, match="1 to 3 dimensions"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs, (1, 1, 1, 1), 64)
    with pytest.raises(DeviceError, match="unknown dispatch mode"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs, 64, 64, mode="waves")


def test_offset_outside_buffer(device, bufs):
    with pytest.raises(DeviceError, match="offset 256 at index 2 is outside"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs, 64, 64, offsets=[0, 256, 0])


def test_foreign_and_released_buffers(device, bufs):
    other = _shim.Device("emu", emu_threads=1)
    with pytest.raises(DeviceError, match="another device"):
        device.dispatch("selftest_axpy_f32", ARGS, [bufs[0], other.buffer(256), bufs[2]], 64, 64)
    bufs[1].release()
    with pytest.raises(DeviceError, match="released"):
        device.dispatch("selftest_axpy_f32", ARGS, bufs, 64, 64)
    with pytest.raises(DeviceError, match="not a Buffer"):
        device.dispatch("selftest_axpy_f32", ARGS, [bufs[0], np.zeros(4), bufs[2]], 64, 64)


def test_read_and_write_out_of_range(device):
    b = device.buffer(100)
    with pytest.raises(DeviceError, match=r"bytes \[96, 104\) are outside the buffer of 100"):
        b.read(dtype=np.float32, shape=(2,), offset=96)
    with pytest.raises(DeviceError, match="outside"):
        b.write(np.zeros(26, np.float32))


def test_wrap_unaligned_memory(device):
    x = _shim.aligned_empty((2048,), np.uint8, device.info["page_size"])[1:]
    with pytest.raises(DeviceError, match="not aligned"):
        _shim.Buffer.wrap(device, x)


def test_metal_unavailable_here_is_a_clear_error():
    if _shim.available("metal"):
        pytest.skip("this build has the Metal driver")
    with pytest.raises(DeviceError, match="Metal driver is not built") as e:
        _shim.Device("metal")
    assert e.value.kind == "unavailable"
    with pytest.raises(DeviceError, match="unknown device kind"):
        _shim.Device("vulkan")


def test_cuda_unavailable_here_says_what_is_missing():
    if _shim.available("cuda"):
        pytest.skip("this machine has an NVIDIA GPU and the CUDA kernels")
    reason = _shim.unavailable_reason("cuda")
    assert reason
    with pytest.raises(DeviceError) as e:
        _shim.Device("cuda")
    assert e.value.kind == "unavailable"
    assert any(word in str(e.value) for word in ("NVIDIA", "nvcc", "CUDA kernels")), str(e.value)


def test_bad_thread_order(device):
    with pytest.raises(DeviceError, match="unknown thread order"):
        device.set_thread_order("sideways")


def test_device_still_works_after_errors(device, bufs):
    for _ in range(3):
        with pytest.raises(DeviceError):
            device.dispatch("selftest_axpy_f32", ARGS, bufs, 64, 4096)
    x = device.upload(np.ones(64, np.float32))
    device.dispatch("selftest_axpy_f32", ARGS, [x, x, bufs[2]], 64, 64)
    np.testing.assert_array_equal(bufs[2].read(shape=(64,)), np.full(64, 2.0, np.float32))


@pytest.mark.parametrize("value", ["sideways", "random:x", "random:"])
def test_bad_order_environment_variable(value):
    code = "from darknet_metal.metal import _shim\n_shim.Device('emu', emu_threads=1)\n"
    env = dict(os.environ, DARKNET_METAL_EMU_ORDER=value)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 1  # a Python exception, not a crash
    assert "DeviceError" in proc.stderr
    assert f"DARKNET_METAL_EMU_ORDER='{value}'" in proc.stderr
