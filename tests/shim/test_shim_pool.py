"""Buffer pool: size classes, reuse, hit/miss counters, peak and empty_cache."""

import pytest

from darknet_metal.errors import DeviceError
from darknet_metal.metal import _shim


@pytest.fixture
def device():
    """A fresh emulator device with two host threads, closed after the test."""
    dev = _shim.Device("emu", emu_threads=2)
    yield dev
    dev.close()


# Classes are m * 2**k with m in 4..7 and at least 256 bytes (computed by hand).
SIZE_CLASSES = [
    (0, 256),
    (1, 256),
    (256, 256),
    (257, 320),
    (320, 320),
    (321, 384),
    (449, 512),
    (1000, 1024),
    (1025, 1280),
    (3000, 3072),
    (4000, 4096),
    (4097, 5120),
    (1_000_000, 1_048_576),
    (1_048_577, 1_310_720),
    (5 * 2**20 + 1, 6 * 2**20),
]


@pytest.mark.parametrize(("nbytes", "expected"), SIZE_CLASSES)
def test_size_class(nbytes, expected):
    assert _shim.size_class(nbytes) == expected


def test_size_class_waste_is_bounded():
    for n in range(257, 70_000, 97):
        c = _shim.size_class(n)
        assert n <= c <= n * 1.25 + 1


def test_buffer_capacity_is_its_class(device):
    b = device.buffer(1025)
    assert b.nbytes == 1025
    assert b.capacity == 1280


def test_release_then_create_reuses_the_same_memory(device):
    a = device.buffer(3000)
    address = a.address
    a.release()
    s = device.stats()
    assert (s["pool_misses"], s["pool_hits"], s["pooled_buffers"], s["live_buffers"]) == (
        1,
        0,
        1,
        0,
    )
    b = device.buffer(2900)  # same class (3072)
    assert b.address == address
    s = device.stats()
    assert (s["pool_misses"], s["pool_hits"], s["pooled_buffers"], s["live_buffers"]) == (
        1,
        1,
        0,
        1,
    )
    c = device.buffer(3100)  # next class: a new allocation
    assert c.address != address
    assert device.stats()["pool_misses"] == 2


def test_garbage_collected_buffer_returns_to_pool(device):
    device.buffer(10_000)  # dropped at once
    s = device.stats()
    assert s["pooled_buffers"] == 1 and s["live_buffers"] == 0
    device.buffer(10_000)
    assert device.stats()["pool_hits"] == 1


def test_allocated_and_peak_bytes(device):
    a = device.buffer(1000)  # 1024
    b = device.buffer(5000)  # 5120
    s = device.stats()
    assert s["allocated_bytes"] == 1024 + 5120
    assert s["live_bytes"] == 1024 + 5120
    assert s["peak_allocated_bytes"] == 1024 + 5120
    a.release()
    b.release()
    s = device.stats()
    # Pooled buffers still hold memory.
    assert s["allocated_bytes"] == 1024 + 5120
    assert s["live_bytes"] == 0
    assert s["pooled_bytes"] == 1024 + 5120
    device.empty_cache()
    s = device.stats()
    assert s["allocated_bytes"] == 0
    assert s["pooled_buffers"] == 0 and s["pooled_bytes"] == 0
    assert s["peak_allocated_bytes"] == 1024 + 5120
    device.reset_peak()
    assert device.stats()["peak_allocated_bytes"] == 0
    c = device.buffer(300)  # 320, a fresh allocation after empty_cache
    s = device.stats()
    assert s["peak_allocated_bytes"] == 320
    assert s["pool_misses"] == 3
    c.release()


def test_empty_cache_keeps_live_buffers(device):
    keep = device.buffer(2048)
    keep.write(bytes(range(256)) * 8)
    device.buffer(4096).release()
    device.empty_cache()
    assert keep.read(dtype="u1").tolist() == list(range(256)) * 8
    assert device.stats()["allocated_bytes"] == 2048


def test_released_buffer_cannot_be_used(device):
    b = device.buffer(64)
    b.release()
    with pytest.raises(DeviceError, match="released"):
        b.read()
    b.release()  # a second release is harmless


def test_closed_device_rejects_use(device):
    b = device.buffer(64)
    device.close()
    with pytest.raises(DeviceError, match="closed"):
        device.buffer(64)
    with pytest.raises(DeviceError, match="closed"):
        b.read()
