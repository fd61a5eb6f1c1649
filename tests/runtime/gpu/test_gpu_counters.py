"""What one forward pass costs on the emulator device, read from the shim's counters: one
upload of the input, one command buffer, one wait, downloads of exactly the requested outputs,
no allocation after the first pass, no CPU fallback; and the outputs agree with the CPU."""

import numpy as np
import pytest
from shared_paths import CFG_DIR, YOLOV3_TINY

from darknet_metal import load, metal
from darknet_metal.errors import DeviceError
from darknet_metal.network import Network
from darknet_metal.ops.conv import forward_splits, gemm_tiles
from darknet_metal.runtime.gpu_backend import GpuBackend
from darknet_metal.runtime.memory import plan_pass_memory

SIZE = (64, 64)


def _expected_dispatches(specs, batch=1):
    """Kernel launches the host contract (shaders/README.md) prescribes for these kinds."""
    count = 0
    for s in specs:
        v = s.values
        if s.kind == "convolutional":
            direct = v["size"] == 1 and v["stride_x"] == v["stride_y"] == 1 and v["padding"] == 0
            count += 1 if direct else 2
            # Split along K: a GEMM over the whole runs, one for a shorter last run, the sum.
            k = s.in_shape[0] * v["size"] ** 2
            splits, run = forward_splits(gemm_tiles(s.out_shape[0], s.out_shape[1] *
                                                    s.out_shape[2]) * batch, k)
            if splits > 1:
                count += 1 + (k % run > 0)
        elif s.kind == "route":
            count += len(s.inputs)
        else:
            assert s.kind in ("maxpool", "upsample", "yolo"), s.kind
            count += 1
    return count


def _networks():
    v3 = load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights", seed=0,
              input_size=SIZE)
    v4 = load(CFG_DIR / "yolov4-tiny.cfg", None, seed=5, input_size=SIZE)
    return {"yolov3-tiny": v3, "yolov4-tiny": v4}


@pytest.fixture(scope="module")
def networks():
    return _networks()


def _on_emu(cpu_net, device="emu"):
    return Network(
        cpu_net.config, cpu_net.layers, cpu_net.params, header=cpu_net.header, names=None,
        device=device, batch=1, pass_memory=plan_pass_memory(cpu_net.layers),
    )


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny"])
def test_counters_per_pass(networks, name, gpu_device):
    cpu_net = networks[name]
    net = _on_emu(cpu_net, gpu_device)
    rng = np.random.default_rng(1)
    x = rng.random((1, 3, SIZE[1], SIZE[0]), dtype=np.float32)
    wanted = cpu_net.yolo_layers
    net.forward(x)  # first pass: plans and allocates
    for _ in range(2):
        x = rng.random(x.shape, dtype=np.float32)
        before = metal.stats(gpu_device)
        outs = net.forward(x)
        d = _delta(before, metal.stats(gpu_device))
        assert d["command_buffers_committed"] == 1
        assert d["waits"] == 1
        assert d["cpu_fallbacks"] == 0
        outputs = sum(4 * int(np.prod(cpu_net.layers[i].out_shape)) for i in wanted)
        if gpu_device == "cuda":
            # Input and outputs travel through page-locked host arrays (whole 4 KiB pages,
            # the only memory the driver locks), copied in and out by a kernel each: the
            # driver's copies are exactly them, nothing else; the input is flushed up as
            # it is staged.
            pages = sum(-(-4 * int(np.prod(cpu_net.layers[i].out_shape)) // 4096) * 4096
                        for i in wanted)
            assert d["bytes_uploaded"] == d["bytes_downloaded"] == 0
            assert d["driver_copy_bytes"] == x.nbytes + pages
            extra = 1 + len(wanted)
        else:
            # Shared memory: the input written in place, the outputs read in place.
            assert d["bytes_uploaded"] == x.nbytes and d["bytes_downloaded"] == outputs
            assert d["driver_copy_bytes"] == 0
            extra = 0
        assert d["pool_misses"] == 0 and d["pool_hits"] == 0
        assert d["live_buffers"] == 0 and d["allocated_bytes"] == 0
        assert d["kernels_dispatched"] == _expected_dispatches(cpu_net.layers) + extra
        for got, want in zip(outs, cpu_net.forward(x), strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_requested_outputs_are_downloaded_alone(networks):
    cpu_net = networks["yolov4-tiny"]
    net = _on_emu(cpu_net)
    x = np.random.default_rng(2).random((2, 3, SIZE[1], SIZE[0]), dtype=np.float32)
    net.forward(x, outputs=[3, 20])
    before = metal.stats("emu")
    route3, conv20 = net.forward(x, outputs=[3, 20])
    d = _delta(before, metal.stats("emu"))
    assert d["bytes_downloaded"] == route3.nbytes + conv20.nbytes
    assert d["waits"] == 1 and d["pool_misses"] == 0
    want3, want20 = cpu_net.forward(x, outputs=[3, 20])
    np.testing.assert_allclose(route3, want3, rtol=0, atol=1e-5 * np.abs(want3).max())
    np.testing.assert_allclose(conv20, want20, rtol=0, atol=1e-4 * np.abs(want20).max())


def test_fallback_layers_run_on_the_cpu(networks):
    cpu_net = networks["yolov4-tiny"]
    backend = GpuBackend(cpu_net.layers, cpu_net.params, device="emu", fallback={3, 15})
    where = {p.index: (p.where, p.reason) for p in backend.coverage()}
    assert where[3][0] == "fallback" and where[15][0] == "fallback" and where[3][1]
    assert all(w == "kernels" for i, (w, _) in where.items() if i not in (3, 15))
    x = np.random.default_rng(3).random((1, 3, SIZE[1], SIZE[0]), dtype=np.float32)
    backend.forward(x, outputs=[37])
    before = metal.stats("emu")
    out = np.asarray(backend.forward(x, outputs=[37])[37])
    d = _delta(before, metal.stats("emu"))
    assert d["cpu_fallbacks"] == 2
    assert d["command_buffers_committed"] == 3  # one before each fallback, one at the end
    want = cpu_net.forward(x, outputs=[37])[0]
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-4 * np.abs(want).max())
    backend.close()


def test_stale_output_raises(networks):
    cpu_net = networks["yolov3-tiny"]
    backend = GpuBackend(cpu_net.layers, cpu_net.params, device="emu")
    x = np.zeros((1, 3, SIZE[1], SIZE[0]), np.float32)
    first = backend.forward(x, outputs=[16])[16]
    backend.forward(x, outputs=[16])
    with pytest.raises(DeviceError, match="earlier forward pass"):
        np.asarray(first)
    backend.close()


def test_close_returns_every_buffer(networks):
    """The prepared dispatch lists hold the bound programs' buffers; closing the backend must
    let go of all of them (none stays live behind a list)."""
    cpu_net = networks["yolov3-tiny"]
    before = metal.stats("emu")["live_buffers"]
    backend = GpuBackend(cpu_net.layers, cpu_net.params, device="emu")
    x = np.zeros((1, 3, SIZE[1], SIZE[0]), np.float32)
    backend.forward(x, outputs=[16])
    backend.forward(np.zeros((2, 3, SIZE[1], SIZE[0]), np.float32), outputs=[23])
    assert metal.stats("emu")["live_buffers"] > before
    backend.close()
    assert metal.stats("emu")["live_buffers"] == before
