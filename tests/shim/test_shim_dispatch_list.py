"""Prepared dispatch lists (``Device.dispatch_list``): the same results and counters as separate
dispatches, checked against NumPy; every misuse raises DeviceError when added or encoded."""

import gc
import struct

import numpy as np
import pytest

from darknet_metal.errors import DeviceError
from darknet_metal.metal import _shim

N = 300  # not a multiple of the 64-thread group
COUNTERS = ("kernels_dispatched", "command_buffers_committed", "waits", "bytes_downloaded")


@pytest.fixture
def device():
    """A fresh emulator device with two host threads, closed after the test."""
    dev = _shim.Device("emu", emu_threads=2)
    yield dev
    dev.close()


def axpy(n: int, alpha: float) -> bytes:
    return struct.pack("<If", n, alpha)


def _inputs():
    rng = np.random.default_rng(5)
    x = rng.integers(-8, 8, N).astype(np.float32)  # sums stay exact in float32
    y = rng.integers(-8, 8, N).astype(np.float32)
    return x, y


def _steps(device, x, y):
    """Buffers and four dispatches: a = 2x + y; b = -a + x (offset view of x shifted by 8
    elements over the first N - 8); group sums of b (threadgroup memory); a = 0.5b + a."""
    bx, by = device.upload(x), device.upload(y)
    a, b = device.buffer(4 * N), device.buffer(4 * N)
    sums = device.buffer(4 * 5)
    b.write(np.zeros(N, np.float32))
    steps = [
        (("selftest_axpy_f32", axpy(N, 2.0), [bx, by, a], N, 64), {}),
        (
            ("selftest_axpy_f32", axpy(N - 8, -1.0), [a, bx, b], N - 8, 32),
            {"offsets": [0, 32, 0]},
        ),
        (
            ("selftest_group_sum_f32", struct.pack("<I", N), [b, sums], N, 64),
            {"threadgroup_mem": (256,)},
        ),
        (("selftest_axpy_f32", axpy(N, 0.5), [b, a, a], N, (16, 2)), {}),
    ]
    return steps, a, b, sums


def _expected(x, y):
    a = np.float32(2) * x + y
    b = np.zeros(N, np.float32)
    b[: N - 8] = -a[: N - 8] + x[8:]
    sums = np.add.reduceat(b, np.arange(0, N, 64))
    return np.float32(0.5) * b + a, b, sums


def _delta(before, after):
    return {k: after[k] - before[k] for k in COUNTERS}


def test_dispatch_list_matches_separate_dispatches_and_numpy(device):
    x, y = _inputs()
    want_a, want_b, want_sums = _expected(x, y)

    steps, a, b, sums = _steps(device, x, y)
    before = device.stats()
    for args, kwargs in steps:
        device.dispatch(*args, **kwargs)
    device.commit()
    separate = [a.read(), b.read(), sums.read()]
    d_separate = _delta(before, device.stats())

    steps, a, b, sums = _steps(device, x, y)
    dlist = device.dispatch_list()
    for args, kwargs in steps:
        dlist.add(*args, **kwargs)
    assert len(dlist) == 4
    before = device.stats()
    dlist.encode()
    device.commit()
    listed = [a.read(), b.read(), sums.read()]
    d_list = _delta(before, device.stats())

    for got_sep, got_list, want in zip(separate, listed, (want_a, want_b, want_sums), strict=True):
        np.testing.assert_array_equal(got_list, want)
        np.testing.assert_array_equal(got_sep, want)
    assert d_list == d_separate
    assert d_list["kernels_dispatched"] == 4
    assert d_list["command_buffers_committed"] == 1


def test_each_encode_replays_the_list(device):
    x, y = _inputs()
    bx, acc = device.upload(x), device.upload(y)
    dlist = device.dispatch_list(1)
    dlist.add("selftest_axpy_f32", axpy(N, 3.0), [bx, acc, acc], N, 64)  # acc += 3x
    before = device.stats()
    for _ in range(3):
        dlist.encode()
    device.commit()
    np.testing.assert_array_equal(acc.read(), y + np.float32(9) * x)
    d = _delta(before, device.stats())
    assert d["kernels_dispatched"] == 3 and d["command_buffers_committed"] == 1
    assert d["waits"] == 1


def test_argument_bytes_are_copied_when_added(device):
    x, y = _inputs()
    out = device.buffer(4 * N)
    args = bytearray(axpy(N, 2.0))
    dlist = device.dispatch_list()
    dlist.add("selftest_axpy_f32", args, [device.upload(x), device.upload(y), out], N, 64)
    args[4:8] = struct.pack("<f", 100.0)
    dlist.encode()
    np.testing.assert_array_equal(out.read(), np.float32(2) * x + y)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_commit_every_splits_like_separate_dispatches(device, every):
    x, y = _inputs()
    bx, by, out = device.upload(x), device.upload(y), device.buffer(4 * N)
    device.set_commit_every(every)
    device.dispatch("selftest_axpy_f32", axpy(N, 1.0), [bx, by, out], N, 64)  # one open
    dlist = device.dispatch_list()
    for _ in range(5):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), [bx, by, out], N, 64)
    before = device.stats()
    dlist.encode()
    d = _delta(before, device.stats())
    # Six dispatches in a row commit after every `every`-th one; the first was encoded (and,
    # with every=1, committed) before the counters were read.
    assert d["command_buffers_committed"] == 6 // every - 1 // every
    assert d["kernels_dispatched"] == 5
    np.testing.assert_array_equal(out.read(), x + y)


def test_encode_time_is_counted(device):
    x, y = _inputs()
    dlist = device.dispatch_list()
    dlist.add(
        "selftest_axpy_f32",
        axpy(N, 1.0),
        [device.upload(x), device.upload(y), device.buffer(4 * N)],
        N,
        64,
    )
    before = device.stats()["encode_ns"]
    dlist.encode()
    assert device.stats()["encode_ns"] > before


def test_empty_dispatch_list_encodes_nothing(device):
    dlist = device.dispatch_list()
    before = device.stats()
    dlist.encode()
    device.commit()
    assert _delta(before, device.stats()) == dict.fromkeys(COUNTERS, 0)


# -- errors ------------------------------------------------------------------------------------


@pytest.fixture
def bufs(device):
    return [device.buffer(4 * N) for _ in range(3)]


def test_invalid_dispatches_are_refused_when_added(device, bufs):
    dlist = device.dispatch_list()
    with pytest.raises(DeviceError, match="no kernel named 'nope_f32'"):
        dlist.add("nope_f32", axpy(N, 1.0), bufs, N, 64)
    with pytest.raises(DeviceError, match="maxTotalThreadsPerThreadgroup"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs, N, (33, 32))
    with pytest.raises(DeviceError, match=r"reads \[\[buffer\(3\)\]\] but nothing is bound"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs[:2], N, 64)
    with pytest.raises(DeviceError, match=r"\[\[threadgroup\(0\)\]\] memory but no length"):
        dlist.add("selftest_group_sum_f32", struct.pack("<I", N), bufs[:2], N, 64)
    with pytest.raises(DeviceError, match="outside the buffer"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs, N, 64, offsets=[0, 4 * N, 0])
    with pytest.raises(DeviceError, match="unknown dispatch mode"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs, N, 64, mode="waves")
    released = device.buffer(16)
    released.release()
    with pytest.raises(DeviceError, match="released"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), [bufs[0], released, bufs[2]], N, 64)
    other = _shim.Device("emu", emu_threads=1)
    with pytest.raises(DeviceError, match="another device"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), [bufs[0], other.buffer(16), bufs[2]], N, 64)
    other.close()
    assert len(dlist) == 0
    before = device.stats()
    dlist.encode()
    assert device.stats()["kernels_dispatched"] == before["kernels_dispatched"]


def test_released_buffer_fails_the_encode_cleanly(device, bufs):
    x, y = _inputs()
    bufs[0].write(x)
    bufs[1].write(y)
    dlist = device.dispatch_list()
    dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs, N, 64)
    dlist.add("selftest_axpy_f32", axpy(N, 1.0), [bufs[2], bufs[1], bufs[0]], N, 64)
    capacity = bufs[2].capacity
    live = device.stats()["live_buffers"]
    bufs[2].release()
    before = device.stats()
    with pytest.raises(
        DeviceError,
        match=r"dispatch 1 \(kernel 'selftest_axpy_f32'\) was "
        "released",
    ):
        dlist.encode()
    assert device.stats()["kernels_dispatched"] == before["kernels_dispatched"]
    # The dispatch list still holds the memory: the pool must not hand it to anyone else.
    assert device.stats()["live_buffers"] == live
    fresh = device.buffer(capacity)
    assert device.stats()["pool_hits"] == before["pool_hits"]
    fresh.release()
    dlist.close()
    s = device.stats()
    assert s["live_buffers"] == live - 1
    again = device.buffer(capacity)  # now the released buffer (or `fresh`) comes back
    assert device.stats()["pool_hits"] == s["pool_hits"] + 1
    again.release()


def test_dispatch_list_keeps_its_buffers_alive(device):
    x, y = _inputs()
    dlist = device.dispatch_list()
    out = device.buffer(4 * N)
    # The input buffers have no other reference: the dispatch list must keep them.
    dlist.add("selftest_axpy_f32", axpy(N, 1.0), [device.upload(x), device.upload(y), out], N, 64)
    gc.collect()
    dlist.encode()
    np.testing.assert_array_equal(out.read(), x + y)


def test_closed_dispatch_list_and_closed_device(device, bufs):
    dlist = device.dispatch_list()
    dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs, N, 64)
    dlist.close()
    assert dlist.closed and len(dlist) == 0
    with pytest.raises(DeviceError, match="dispatch list was closed"):
        dlist.encode()
    with pytest.raises(DeviceError, match="dispatch list was closed"):
        dlist.add("selftest_axpy_f32", axpy(N, 1.0), bufs, N, 64)

    dev = _shim.Device("emu", emu_threads=1)
    held = [dev.buffer(4 * N) for _ in range(3)]
    live_list = dev.dispatch_list()
    live_list.add("selftest_axpy_f32", axpy(N, 1.0), held, N, 64)
    dev.close()
    with pytest.raises(DeviceError, match="closed"):
        live_list.encode()
    live_list.close()  # after its device: frees only the dispatch list
    with pytest.raises(DeviceError, match="closed"):
        dev.dispatch_list()


def test_negative_capacity(device):
    with pytest.raises(DeviceError, match="capacity"):
        device.dispatch_list(-1)
