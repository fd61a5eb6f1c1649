"""Dispatches through the emulator driver, checked against NumPy; command-stream counters."""

import struct

import numpy as np
import pytest

from darknet_metal.metal import _shim


@pytest.fixture
def device():
    """A fresh emulator device with two host threads, closed after the test."""
    dev = _shim.Device("emu", emu_threads=2)
    yield dev
    dev.close()


def axpy_args(n: int, alpha: float) -> bytes:
    return struct.pack("<If", n, alpha)


def test_axpy_matches_numpy_with_partial_edge_group(device):
    rng = np.random.default_rng(1)
    n = 1000  # not a multiple of the 64-thread group
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    out = device.buffer(4 * n)
    device.dispatch(
        "selftest_axpy_f32", axpy_args(n, -1.5), [device.upload(x), device.upload(y), out], n, 64
    )
    np.testing.assert_array_equal(out.read(), np.float32(-1.5) * x + y)


def test_buffer_offsets_bind_subranges(device):
    x = np.arange(32, dtype=np.float32)
    bx = device.upload(x)
    out = device.buffer(4 * 8)
    # out[i] = 2 * x[8 + i] + x[16 + i]
    device.dispatch(
        "selftest_axpy_f32", axpy_args(8, 2.0), [bx, bx, out], 8, 8, offsets=[0 + 32, 64, 0]
    )
    np.testing.assert_array_equal(out.read(), 2 * x[8:16] + x[16:24])


def test_threadgroup_memory_group_sums(device):
    rng = np.random.default_rng(2)
    n, group = 300, 64
    x = rng.integers(-8, 8, n).astype(np.float32)  # exact in float32
    groups = -(-n // group)
    sums = device.buffer(4 * groups)
    device.dispatch(
        "selftest_group_sum_f32",
        struct.pack("<I", n),
        [device.upload(x), sums],
        n,
        group,
        threadgroup_mem=(4 * group,),
    )
    expected = np.add.reduceat(x, np.arange(0, n, group))
    np.testing.assert_array_equal(sums.read(), expected)


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_results_do_not_depend_on_thread_order(device, order):
    device.set_thread_order(order, seed=7)
    x = np.arange(200, dtype=np.float32)
    sums = device.buffer(4 * 4)
    device.dispatch(
        "selftest_group_sum_f32",
        struct.pack("<I", 200),
        [device.upload(x), sums],
        200,
        64,
        threadgroup_mem=(256,),
    )
    np.testing.assert_array_equal(
        sums.read(), [x[:64].sum(), x[64:128].sum(), x[128:192].sum(), x[192:].sum()]
    )


def test_zero_copy_wrap_uses_the_array_memory(device):
    page = device.info["page_size"]
    x = _shim.aligned_empty((1024,), np.float32, page)
    x[:] = np.arange(1024, dtype=np.float32)
    out = _shim.aligned_empty((1024,), np.float32, page)
    out[:] = 0
    bx = device.upload(x, zero_copy=True)
    bo = device.upload(out, zero_copy=True)
    assert bx.wrapped and bo.wrapped
    assert bx.address == x.__array_interface__["data"][0]
    before = device.stats()
    device.dispatch("selftest_axpy_f32", axpy_args(1024, 3.0), [bx, bx, bo], 1024, 128)
    bo.sync()
    np.testing.assert_array_equal(out, 4 * x)
    after = device.stats()
    assert after["bytes_uploaded"] == before["bytes_uploaded"]  # nothing was copied
    assert after["allocated_bytes"] == before["allocated_bytes"]


def test_resident_wraps_change_nothing_where_the_device_shares_host_memory(device):
    # On the emulator (as on Metal) the device works in the array itself: the host sees
    # its writes at once, and the device the host's, whatever the coherence calls say.
    page = device.info["page_size"]
    a = _shim.aligned_empty((1024,), np.float32, page)
    a[:] = 3.0
    buf = device.upload(a, zero_copy=True)
    buf.set_resident()
    zeros = device.upload(np.zeros(1024, np.float32))
    sevens = device.upload(np.full(1024, 7.0, np.float32))
    device.dispatch("selftest_axpy_f32", axpy_args(1024, 0.0), [zeros, sevens, buf], 1024, 128)
    device.synchronize()
    np.testing.assert_array_equal(a, 7.0)
    buf.sync(write=True)
    a[:] = 4.0
    out = device.buffer(4 * 1024)
    device.dispatch("selftest_axpy_f32", axpy_args(1024, 1.0), [buf, zeros, out], 1024, 128)
    np.testing.assert_array_equal(out.read(np.float32), 4.0)
    assert device.stats()["driver_copies"] == device.stats()["driver_copy_bytes"] == 0
    plain = device.buffer(64)
    with pytest.raises(_shim.DeviceError, match="does not wrap host memory"):
        plain.set_resident()
    # A flushed range: the device reads host memory in place, nothing to copy; a range
    # outside the buffer, a buffer that wraps nothing and a negative size are refused.
    a[:] = 6.0
    buf.flush(0, a.nbytes)
    device.dispatch("selftest_axpy_f32", axpy_args(1024, 1.0), [buf, zeros, out], 1024, 128)
    np.testing.assert_array_equal(out.read(np.float32), 6.0)
    assert device.stats()["driver_copies"] == 0
    with pytest.raises(_shim.DeviceError, match="outside the buffer"):
        buf.flush(a.nbytes - 4, 8)
    with pytest.raises(_shim.DeviceError, match="does not wrap host memory"):
        plain.flush(0, 4)
    with pytest.raises(_shim.DeviceError, match="must be >= 0"):
        buf.flush(-4, 4)


def test_unaligned_array_is_copied_not_wrapped(device):
    x = np.arange(1025, dtype=np.float32)[1:]  # 4 bytes past an allocation start
    b = device.upload(x, zero_copy=True)
    assert not b.wrapped
    np.testing.assert_array_equal(b.read(), x)


def test_one_commit_per_pass_and_waits_only_on_reads(device):
    n = 256
    x = np.ones(n, np.float32)
    bx = device.upload(x)
    a, b = device.buffer(4 * n), device.buffer(4 * n)
    device.reset_counters()
    for _ in range(3):  # three passes of two dispatches
        device.dispatch("selftest_axpy_f32", axpy_args(n, 1.0), [bx, bx, a], n, 64)
        device.dispatch("selftest_axpy_f32", axpy_args(n, 2.0), [bx, a, b], n, 64)
        device.commit()
    s = device.stats()
    assert s["kernels_dispatched"] == 6
    assert s["command_buffers_committed"] == 3
    assert s["waits"] == 0
    assert s["pipelines_built"] == 1  # once for six dispatches
    np.testing.assert_array_equal(b.read(), np.full(n, 4.0, np.float32))
    assert device.stats()["waits"] == 1
    b.read()  # nothing pending any more
    a.read()
    device.synchronize()
    s = device.stats()
    assert s["waits"] == 1
    assert s["bytes_downloaded"] == 3 * 4 * n
    assert s["encode_ns"] > 0


def test_peak_in_flight_counts_committed_unwaited_command_buffers(device):
    n = 64
    x = device.upload(np.ones(n, np.float32))
    outs = [device.buffer(4 * n) for _ in range(4)]
    device.reset_counters()
    assert device.stats()["peak_in_flight"] == 0
    for out in outs[:3]:  # three command buffers committed, none waited for
        device.dispatch("selftest_axpy_f32", axpy_args(n, 1.0), [x, x, out], n, 64)
        device.commit()
    assert device.stats()["peak_in_flight"] == 3
    outs[0].sync()  # waits for the first only: two stay in flight
    device.reset_counters()
    assert device.stats()["peak_in_flight"] == 2
    device.synchronize()
    for out in outs:  # one at a time: never more than one in flight
        device.dispatch("selftest_axpy_f32", axpy_args(n, 1.0), [x, x, out], n, 64)
        device.commit()
        out.sync()
    s = device.stats()
    assert (s["peak_in_flight"], s["waits"], s["command_buffers_committed"]) == (2, 5, 4)
    device.reset_counters()
    assert device.stats()["peak_in_flight"] == 0


def test_read_commits_pending_work(device):
    out = device.buffer(16)
    x = device.upload(np.arange(4, dtype=np.float32))
    device.reset_counters()
    device.dispatch("selftest_axpy_f32", axpy_args(4, 1.0), [x, x, out], 4, 4)
    np.testing.assert_array_equal(out.read(), [0, 2, 4, 6])
    s = device.stats()
    assert (s["command_buffers_committed"], s["waits"]) == (1, 1)


def test_commit_every_n_dispatches(device):
    x = device.upload(np.zeros(64, np.float32))
    out = device.buffer(256)
    device.reset_counters()
    device.set_commit_every(2)
    for _ in range(5):
        device.dispatch("selftest_axpy_f32", axpy_args(64, 1.0), [x, x, out], 64, 64)
    assert device.stats()["command_buffers_committed"] == 2
    device.synchronize()
    s = device.stats()
    assert (s["command_buffers_committed"], s["waits"]) == (3, 1)


def test_bytes_counted_exactly_and_fallbacks(device):
    device.reset_counters()
    b = device.buffer(1000)
    b.write(np.zeros(250, np.float32))
    b.write(np.zeros(10, np.uint8), offset=990)
    b.read(dtype=np.uint8, shape=(7,), offset=3)
    device.count_fallback()
    device.count_fallback(2)
    s = device.stats()
    assert (s["bytes_uploaded"], s["bytes_downloaded"], s["cpu_fallbacks"]) == (1010, 7, 3)


def test_write_waits_for_queued_readers(device):
    n = 64
    x = device.upload(np.full(n, 2.0, np.float32))
    out = device.buffer(4 * n)
    device.dispatch("selftest_axpy_f32", axpy_args(n, 1.0), [x, x, out], n, 64)
    device.reset_counters()
    x.write(np.zeros(n, np.float32))  # the queued dispatch must still see 2.0
    assert device.stats()["waits"] == 1
    np.testing.assert_array_equal(out.read(), np.full(n, 4.0, np.float32))


def test_pipeline_cache_and_facts(device):
    info = device.pipeline_info("selftest_axpy_f32")
    assert info == {
        "name": "selftest_axpy_f32",
        "max_total_threads": 1024,
        "execution_width": 32,
        "static_tg_memory": 0,
    }
    device.pipeline_info("selftest_axpy_f32")
    assert device.stats()["pipelines_built"] == 1


def test_device_facts(device):
    info = device.info
    assert info["kind"] == "emu"
    assert info["unified_memory"] is True
    assert info["max_threads_per_threadgroup"] == 1024
    assert info["max_threadgroup_memory"] == 32768
    assert info["page_size"] >= 4096 and info["page_size"] & (info["page_size"] - 1) == 0
