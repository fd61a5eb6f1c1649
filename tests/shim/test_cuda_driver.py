"""The 'cuda' driver's own rules, on an NVIDIA GPU (skipped without one): host memory wrapped
in overlapping pieces stays one device copy, host writes and reads see the device's work,
and what a Mac would refuse is refused here too."""

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from devices import require

from darknet_metal.errors import DeviceError
from darknet_metal.metal import _shim


@pytest.fixture(scope="module")
def cuda():
    require("cuda")
    from darknet_metal import metal

    return metal.get_device("cuda")


def _axpy(device, n, alpha, x, y, out):
    device.dispatch("selftest_axpy_f32", struct.pack("<If", n, alpha), [x, y, out], n, 64)


def test_overlapping_wraps_are_one_device_copy(cuda):
    page = cuda.info["page_size"]
    a = _shim.aligned_empty((4096,), np.float32, page)
    a[:] = 0.0
    zeros = cuda.upload(np.zeros(4096, np.float32))
    ones = cuda.upload(np.ones(4096, np.float32))
    small = _shim.Buffer.wrap(cuda, a[:1024])
    _axpy(cuda, 1024, 0.0, zeros, ones, small)  # small = 1
    cuda.synchronize()
    np.testing.assert_array_equal(a[:1024], 1.0)
    whole = _shim.Buffer.wrap(cuda, a)  # covers small: small moves onto whole's copy
    a[1024:] = 2.0  # the host writes the rest while nothing uses it
    out = cuda.buffer(4 * 4096)
    _axpy(cuda, 1024, 0.0, zeros, ones, small)
    _axpy(cuda, 1024, 3.0, ones, zeros, small)  # small = 3, then read through whole, one
    _axpy(cuda, 4096, 1.0, whole, zeros, out)   # command buffer, no wait between
    got = out.read(np.float32)
    np.testing.assert_array_equal(got[:1024], 3.0)
    np.testing.assert_array_equal(got[1024:], 2.0)
    inner = _shim.Buffer.wrap(cuda, a[2048:3072])  # inside whole: an alias
    _axpy(cuda, 1024, 0.0, zeros, ones, inner)
    cuda.synchronize()
    np.testing.assert_array_equal(a[2048:3072], 1.0)
    for b in (inner, small, whole, out, zeros, ones):
        b.release()


def test_a_host_write_between_passes_reaches_the_device(cuda):
    x = cuda.buffer(4 * 300)
    out = cuda.buffer(4 * 300)
    zeros = cuda.upload(np.zeros(300, np.float32))
    for k in range(3):
        x.write(np.full(300, float(k), np.float32))
        x.write(np.float32([9.0]), offset=4 * 299)  # a partial write keeps the rest
        _axpy(cuda, 300, 2.0, x, zeros, out)
        want = np.full(300, 2.0 * k, np.float32)
        want[299] = 18.0
        np.testing.assert_array_equal(out.read(np.float32), want)


def test_resident_wrapped_memory_is_copied_only_when_asked(cuda):
    # The training state's contract on 'cuda': the device keeps its own copy; the host sees
    # the device's changes after sync(), the device the host's after sync(write=True), and
    # nothing is copied at commits and waits.
    page = cuda.info["page_size"]
    a = _shim.aligned_empty((1 << 16,), np.float32, page)  # whole pages: page-locked
    a[:] = 3.0
    buf = _shim.Buffer.wrap(cuda, a)
    buf.set_resident()
    n = a.size
    zeros = cuda.upload(np.zeros(n, np.float32))
    sevens = cuda.upload(np.full(n, 7.0, np.float32))
    out = cuda.buffer(4 * n)
    _axpy(cuda, n, 2.0, buf, zeros, out)  # the first use takes the host's contents
    np.testing.assert_array_equal(out.read(np.float32), 6.0)
    before = cuda.stats()
    _axpy(cuda, n, 0.0, zeros, sevens, buf)  # buf = 7 on the device
    cuda.synchronize()
    assert cuda.stats()["driver_copy_bytes"] - before["driver_copy_bytes"] < a.nbytes
    np.testing.assert_array_equal(a, 3.0)  # not brought back at the wait
    buf.sync()
    np.testing.assert_array_equal(a, 7.0)
    a[:] = 9.0  # changed without saying so: the device keeps its copy
    _axpy(cuda, n, 1.0, buf, zeros, out)
    np.testing.assert_array_equal(out.read(np.float32), 7.0)
    buf.sync(write=True)
    a[:] = 4.0
    _axpy(cuda, n, 1.0, buf, zeros, out)
    np.testing.assert_array_equal(out.read(np.float32), 4.0)
    for b in (buf, zeros, sevens, out):
        b.release()


def test_a_flushed_range_goes_up_alone(cuda):
    # How a pass's input is staged on 'cuda': the host writes part of a resident wrap and
    # flushes it; that range goes up before the next commit (and only it), the rest of the
    # device's copy stays as it was.
    page = cuda.info["page_size"]
    a = _shim.aligned_empty((1 << 16,), np.float32, page)
    a[:] = 3.0
    buf = _shim.Buffer.wrap(cuda, a)
    buf.set_resident()
    n = a.size
    zeros = cuda.upload(np.zeros(n, np.float32))
    out = cuda.buffer(4 * n)
    _axpy(cuda, n, 1.0, buf, zeros, out)  # the first use takes the host's contents
    np.testing.assert_array_equal(out.read(np.float32), 3.0)
    buf.sync()
    a[:] = 5.0
    before = cuda.stats()
    buf.flush(4 * 1000, 4 * 2000)  # elements [1000, 3000)
    _axpy(cuda, n, 1.0, buf, zeros, out)
    cuda.synchronize()
    moved = cuda.stats()["driver_copy_bytes"] - before["driver_copy_bytes"]
    assert 4 * 2000 <= moved < 4 * 3000, moved  # the range and the arguments
    want = np.full(n, 3.0, np.float32)
    want[1000:3000] = 5.0
    np.testing.assert_array_equal(out.read(np.float32), want)
    with pytest.raises(DeviceError, match="outside the buffer"):
        buf.flush(4 * n - 4, 8)
    plain = cuda.buffer(64)
    with pytest.raises(DeviceError, match="does not wrap host memory"):
        plain.flush(0, 4)
    for b in (buf, zeros, out, plain):
        b.release()


def test_a_dispatch_list_is_replayed_with_the_buffers_contents_of_each_commit(cuda):
    # A whole list is recorded once (a CUDA graph) and replayed: each encode computes with
    # what the buffers hold then, counts every dispatch, and a dispatch added later runs too.
    n = 4096
    x = cuda.buffer(4 * n)
    y = cuda.upload(np.ones(n, np.float32))
    mid = cuda.buffer(4 * n)
    out = cuda.buffer(4 * n)
    lst = cuda.dispatch_list()
    lst.add("selftest_axpy_f32", struct.pack("<If", n, 2.0), [x, y, mid], n, 64)
    lst.add("selftest_axpy_f32", struct.pack("<If", n, 3.0), [mid, y, out], n, 64)
    for k in range(4):
        x.write(np.full(n, float(k), np.float32))
        before = cuda.stats()["kernels_dispatched"]
        lst.encode()
        np.testing.assert_array_equal(out.read(np.float32), 3.0 * (2.0 * k + 1) + 1)
        assert cuda.stats()["kernels_dispatched"] - before == 2
    lst.add("selftest_axpy_f32", struct.pack("<If", n, -1.0), [out, y, out], n, 64)
    x.write(np.zeros(n, np.float32))
    lst.encode()
    np.testing.assert_array_equal(out.read(np.float32), -(3.0 * 1 + 1) + 1)
    lst.close()
    for b in (x, y, mid, out):
        b.release()


def test_barrier_kernels_need_whole_threadgroups(cuda):
    x = cuda.upload(np.ones(100, np.float32))
    sums = cuda.buffer(4 * 2)
    with pytest.raises(DeviceError, match="whole threadgroups"):
        cuda.dispatch("selftest_group_sum_f32", struct.pack("<I", 100), [x, sums], 100, 64,
                      threadgroup_mem=(256,))
    cuda.dispatch("selftest_group_sum_f32", struct.pack("<I", 100), [x, sums], 128, 64,
                  threadgroup_mem=(256,))
    np.testing.assert_array_equal(sums.read(np.float32), [64.0, 36.0])


def test_apple_limits_are_reported_and_kept(cuda):
    info = cuda.info
    assert info["max_threadgroup_memory"] == 32768 and info["max_threads_per_threadgroup"] == 1024
    assert "CUDA" in info["name"] and info["kind"] == "cuda"
    x = cuda.upload(np.ones(64, np.float32))
    sums = cuda.buffer(4)
    with pytest.raises(DeviceError, match="threadgroup memory"):
        cuda.dispatch("selftest_group_sum_f32", struct.pack("<I", 64), [x, sums], 64, 64,
                      threadgroup_mem=(32768 + 16,))



def _device_name(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """What a new process with ``env`` added (and no GPU choice of this one's) says of its
    cuda device."""
    clean = {k: v for k, v in os.environ.items() if k not in (
        "DARKNET_METAL_CUDA_DEVICE", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
        "PMIX_LOCAL_RANK", "SLURM_LOCALID")}
    code = "import darknet_metal.metal as m; print(m.device_name('cuda'))"
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_each_rank_of_a_machine_takes_the_gpu_of_its_local_rank(cuda):
    """Under mpirun the GPU is the rank's place on its machine modulo the GPUs visible;
    DARKNET_METAL_CUDA_DEVICE overrides it, and a number that is not a GPU is an error
    naming the variable."""
    torch = pytest.importorskip("torch", reason="counts the GPUs")
    visible = torch.cuda.device_count()
    plain = _device_name({})
    assert plain.returncode == 0 and "CUDA device 0" in plain.stdout, plain.stderr
    for rank in (1, 2, 3):
        ranked = _device_name({"OMPI_COMM_WORLD_LOCAL_RANK": str(rank)})
        assert ranked.returncode == 0, ranked.stderr
        assert f"CUDA device {rank % visible}," in ranked.stdout, ranked.stdout
    chosen = _device_name({"OMPI_COMM_WORLD_LOCAL_RANK": "1",
                           "DARKNET_METAL_CUDA_DEVICE": "0"})
    assert "CUDA device 0," in chosen.stdout, chosen.stderr
    wrong = _device_name({"DARKNET_METAL_CUDA_DEVICE": "99"})
    assert wrong.returncode != 0
    assert "DARKNET_METAL_CUDA_DEVICE=99 is not a GPU of this machine" in wrong.stderr
