"""The darknet_metal.metal API on the emulator device, device errors, and the memory planner."""

import gc
import sys

import numpy as np
import pytest
from shared_paths import YOLOV3_TINY

import darknet_metal as dm
from darknet_metal import metal
from darknet_metal.metal import _shim
from darknet_metal.model.cfg import parse_cfg
from darknet_metal.ops import build_layers
from darknet_metal.runtime.memory import plan_memory
from darknet_metal.runtime.program import HostStep, Program, Tensor, TensorSpec

#: The network input, as layer indices count it (``Op.inputs``).
INPUT = -1


def plan_storage(specs, batch, keep, aliases):
    """The memory plan of a program with one step per layer (reading its inputs, writing its
    output; layers in ``aliases`` output their first input), keyed by layer index."""
    def out(i):
        return Tensor(i, "output")

    tensors = {out(INPUT): TensorSpec(out(INPUT), (batch, *specs[0].in_shape), 4)}
    steps = []
    for s in specs:
        alias = out(s.inputs[0]) if s.index in aliases else None
        tensors[out(s.index)] = TensorSpec(out(s.index), (batch, *s.out_shape), 4, alias)
        if alias is None:
            steps.append(HostStep(s.index, tuple(out(i) for i in s.inputs), (out(s.index),),
                                  lambda r, w: None))
    kept = [s.index for s in specs] if keep is None else keep
    program = Program(batch, "inference", tensors, frozenset(out(i) for i in kept), steps)
    memory = plan_memory(program)

    class ByLayer:
        slot_bytes = memory.slot_bytes
        slot_of = {t.layer: slot for t, slot in memory.slot_of.items()}
        owner = {t.layer: o.layer for t, o in memory.owner.items()}

    return ByLayer

STAT_KEYS = {
    "kernels_dispatched",
    "command_buffers_committed",
    "waits",
    "bytes_uploaded",
    "bytes_downloaded",
    "pool_hits",
    "pool_misses",
    "cpu_fallbacks",
    "encode_ns",
}


def test_emu_is_available_and_shared():
    assert metal.is_available("emu")
    assert metal.get_device("emu") is metal.get_device("emu")
    assert "emulator" in metal.device_name("emu").lower()
    assert metal.recommended_max_memory("emu") >= 0
    assert STAT_KEYS <= set(metal.stats("emu"))


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac may have Metal")
def test_metal_unavailable_off_macos():
    assert not metal.is_available("metal")
    with pytest.raises(dm.DeviceError, match="emu"):
        metal.device_name("metal")
    with pytest.raises(dm.DeviceError, match="device='emu'"):
        dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", device="metal")


def test_unknown_devices():
    with pytest.raises(dm.DeviceError, match="unknown device"):
        metal.stats("gpu")
    with pytest.raises(ValueError, match="unknown device"):
        dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", device="gpu")


def test_float64_is_refused_on_emu():
    # Refused by load itself, not at the first forward.
    with pytest.raises(dm.DeviceError, match="float32 only"):
        dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", device="emu", dtype=np.float64)
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", dtype=np.float64)
    with pytest.raises(dm.DeviceError, match="float32 only"):
        net.to("emu")
    assert net.device == "cpu"


def test_memory_statistics_follow_buffers():
    dev = metal.get_device("emu")
    metal.synchronize("emu")
    metal.empty_cache("emu")
    metal.reset_peak_memory_stats("emu")
    base = metal.memory_allocated("emu")
    assert metal.max_memory_allocated("emu") == base
    nbytes = 3 << 20
    buf = dev.buffer(nbytes)
    grown = metal.memory_allocated("emu")
    assert grown - base == _shim.size_class(nbytes)
    buf.release()  # back to the pool: still held by the driver
    assert metal.memory_allocated("emu") == grown
    metal.empty_cache("emu")
    assert metal.memory_allocated("emu") == base
    assert metal.max_memory_allocated("emu") == grown
    metal.reset_peak_memory_stats("emu")
    assert metal.max_memory_allocated("emu") == base


def test_stats_count_one_upload_and_download():
    dev = metal.get_device("emu")
    before = metal.stats("emu")
    a = np.arange(1000, dtype=np.float32)
    buf = dev.upload(a)
    out = buf.read()
    after = metal.stats("emu")
    buf.release()
    np.testing.assert_array_equal(out, a)
    assert after["bytes_uploaded"] - before["bytes_uploaded"] == 4000
    assert after["bytes_downloaded"] - before["bytes_downloaded"] == 4000


def test_planner_reuses_buffers_safely():
    specs = build_layers(parse_cfg(YOLOV3_TINY / "yolov3-tiny.cfg"))
    keep = {16, 23}
    plan = plan_storage(specs, 2, keep, aliases=())
    assert len(plan.slot_bytes) < len(specs) // 2  # buffers are reused
    # Simulate the pass: a slot may be overwritten only when nobody will read its tensor.
    last_read = {}
    for s in specs:
        for t in s.inputs:
            last_read[t] = s.index
    holder = {plan.slot_of[INPUT]: INPUT}
    for s in specs:
        slot = plan.slot_of[s.index]
        assert slot not in {plan.slot_of[t] for t in s.inputs}, s.index
        prev = holder.get(slot)
        if prev is not None:
            assert prev not in keep and last_read.get(prev, prev) <= s.index, (s.index, prev)
        holder[slot] = s.index
        c, h, w = s.out_shape
        assert plan.slot_bytes[slot] >= 2 * c * h * w * 4
    for t in keep:
        assert holder[plan.slot_of[t]] == t


def test_planner_aliases_identity_layers():
    specs = build_layers(parse_cfg(YOLOV3_TINY / "yolov3-tiny.cfg"))
    plan = plan_storage(specs, 1, None, aliases={5})
    assert plan.owner[5] == 4 and plan.slot_of[5] == plan.slot_of[4]
    # keep=None: every layer output survives, in its own slot (layer 5 shares layer 4's).
    assert len({plan.slot_of[s.index] for s in specs}) == len(specs) - 1


def test_network_to_moves_between_devices():
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", seed=2, input_size=(64, 64))
    x = np.random.default_rng(4).random((1, 3, 64, 64), dtype=np.float32)
    on_cpu = net.forward(x)
    gc.collect()  # networks of earlier tests release their buffers now, not mid-test
    live = metal.stats("emu")["live_buffers"]
    assert net.to("emu") is net and net.device == "emu"
    on_emu = net.forward(x)
    assert metal.stats("emu")["live_buffers"] > live
    for got, want in zip(on_emu, on_cpu, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="unknown device"):
        net.to("tpu")
    assert net.device == "emu"
    net.to("cpu")
    assert metal.stats("emu")["live_buffers"] == live  # the device's buffers were released
    np.testing.assert_array_equal(net.forward(x)[0], on_cpu[0])
