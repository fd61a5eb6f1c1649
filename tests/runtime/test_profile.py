"""Profiles (``Network.profile``, ``darknet-metal profile``): every dispatch of a pass or a
training step timed and labelled with its layer and work. The arithmetic is checked against
Darknet's own count of a convolution's operations (the ops' ``flops``, not the registry's
expressions), bytes against the copy kernel's obvious traffic."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from devices import require

import darknet_metal as dm
from darknet_metal.cli import main
from darknet_metal.metal.dispatch import gemm_args
from darknet_metal.metal.work import NO_LAYER, dispatch_tag, work_of_tag
from darknet_metal.runtime.phases import PHASES, PhaseClock

CFG = """\
[net]
batch=2
subdivisions=1
width=64
height=64
channels=3
learning_rate=0.001
momentum=0.9
decay=0.0005
burn_in=0
max_batches=10
policy=constant

[convolutional]
batch_normalize=1
filters=8
size=3
stride=1
pad=1
activation=leaky

[maxpool]
size=2
stride=2

[convolutional]
batch_normalize=1
filters=16
size=3
stride=1
pad=1
activation=leaky

[route]
layers=-1,-2

[convolutional]
size=1
stride=1
pad=1
filters=21
activation=linear

[yolo]
mask=0,1,2
anchors=10,14, 23,27, 37,58
classes=2
num=3
"""


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "small.cfg"
    path.write_text(CFG, encoding="utf-8")
    return path


def _conv_flops(net, batch):
    return batch * sum(op.flops for op in net.layers if op.kind == "convolutional")


def test_work_of_a_dispatch():
    tag = dispatch_tag("copy_buf_f32", {"n": 1000}, {"n": 1000}, 4)
    assert work_of_tag(tag) == work_of_tag(dispatch_tag("copy_buf_f32", {"n": 1000},
                                                        {"n": 1000}, 4))
    work = work_of_tag(tag)
    assert (work.kernel, work.layer, work.flops, work.bytes) == ("copy_buf_f32", 4, 0, 8000)
    args, sizes = gemm_args(M=8, N=100, K=27, lda=27, ldb=100, ldc=100, bias_mode=0, act=0,
                            slices=3, a_batch_stride=0, b_batch_stride=2700,
                            c_batch_stride=800)
    gemm = work_of_tag(dispatch_tag("gemm_nn_f32", args, sizes))
    assert gemm.flops == 2 * 8 * 100 * 27 * 3 and gemm.layer == NO_LAYER
    assert work_of_tag(0) is None and work_of_tag(10**9) is None


def test_peaks_are_measured_once_per_device():
    require("emu")
    from darknet_metal.metal import get_device
    from darknet_metal.runtime.profile import device_peaks

    device = get_device("emu")
    peaks = device_peaks(device)
    assert peaks.flops_per_second > 0 and peaks.bytes_per_second > 0
    assert "copy_buf_f32" in peaks.source
    assert device_peaks(device) is peaks


def test_inference_profile(gpu_device, cfg):
    net = dm.load(cfg, device=gpu_device, batch=2)
    profile = net.profile(repeats=2)
    assert profile.device == gpu_device and profile.repeats == 2
    assert profile.clock.startswith("host" if gpu_device == "emu" else "device")
    kernels = {d.kernel for d in profile.dispatches}
    assert {"im2col_fwd_f32", "maxpool_fwd_f32", "route_fwd_f32", "yolo_fwd_f32"} <= kernels
    # Every layer ran on the device and is in the profile, labelled with its kind; the
    # dispatches of no layer copy a staged input in and outputs out (cuda).
    layers = [d for d in profile.dispatches if d.layer != NO_LAYER]
    assert {d.layer for d in layers} == {op.index for op in net.layers}
    assert all(d.kind == net.layers[d.layer].kind for d in layers)
    assert {d.kernel for d in profile.dispatches if d.layer == NO_LAYER} <= {"copy_buf_f32"}
    gemm = sum(d.flops for d in profile.dispatches if d.kernel.startswith("gemm"))
    assert gemm == _conv_flops(net, 2)
    assert all(d.seconds > 0 and d.bytes > 0 for d in profile.dispatches)
    rows = profile.by_kernel()
    assert sum(r.dispatches for r in rows) == len(profile.dispatches)
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert [r.seconds for r in rows] == sorted((r.seconds for r in rows), reverse=True)
    assert profile.peaks is not None and profile.peaks.bytes_per_second > 0
    gemm_row = next(r for r in rows if r.name.startswith("gemm"))
    assert gemm_row.compute_fraction == pytest.approx(
        gemm_row.flops / gemm_row.seconds / profile.peaks.flops_per_second)
    layer_seconds = profile.layer_seconds(len(net.layers))
    assert sum(layer_seconds) == pytest.approx(sum(d.seconds for d in layers))
    data = json.loads(profile.to_json())
    assert len(data["dispatches"]) == len(profile.dispatches)
    assert profile.table().splitlines()[0].startswith(f"inference 64x64 batch 2 on {gpu_device}")


def test_training_profile_leaves_the_network_as_it_was(gpu_device, cfg):
    net = dm.load(cfg, device=gpu_device)
    before = {i: {k: a.copy() for k, a in p.items()} for i, p in net.params.items()}
    seen = net.header.seen
    profile = net.profile(train=True, repeats=1, peaks=False)
    assert profile.what.startswith("training step 64x64 batch 2")
    assert profile.peaks is None
    directions = {d.kernel for d in profile.dispatches}
    assert any("_bwd" in k for k in directions) and "sgd_upd_f32" in directions
    assert any(k.startswith("yolo_loss") for k in directions)
    conv = {op.index for op in net.layers if op.kind == "convolutional"}
    assert {d.layer for d in profile.dispatches if d.kernel == "sgd_upd_f32"} == conv
    # Forward GEMMs alone are Darknet's count of the convolutions; backward adds two more.
    gemm = sum(d.flops for d in profile.dispatches if d.kernel.startswith("gemm"))
    assert gemm >= 2 * _conv_flops(net, 2)
    assert net.header.seen == seen
    for i, p in before.items():
        for k, a in p.items():
            np.testing.assert_array_equal(net.params[i][k], a)


def test_host_split_of_a_step_and_of_a_pass(gpu_device, cfg):
    # The wall time of whole calls, split into the host's phases, with the counters of
    # each call: one command buffer and one wait; the driver's copies are the input (and
    # the outputs read) on cuda, nothing where the device shares host memory.
    net = dm.load(cfg, device=gpu_device)
    step = net.profile(train=True, repeats=1, peaks=False)
    host = step.host
    assert host is not None and host.runs >= 5
    assert set(host.phases) == {p.name for p in PHASES}
    assert host.phases["wait"] > 0 and host.phases["encode"] > 0
    assert sum(host.phases.values()) <= host.wall_seconds  # one run's parts, whole
    assert host.other_seconds >= 0
    assert (host.commits, host.waits) == (1, 1)
    x = 2 * 3 * 64 * 64 * 4
    if gpu_device == "cuda":
        assert x <= host.driver_copy_bytes <= x + (1 << 20)
    else:
        assert host.driver_copies == host.driver_copy_bytes == 0
    assert host.dispatches == len(step.dispatches)
    table = step.table()
    assert "host side of a whole call" in table and "on unified memory" in table
    data = json.loads(step.to_json())["host"]
    assert data["phases"]["guard"] == host.phases["guard"] and "unified_memory" in data
    infer = net.profile(repeats=1, peaks=False).host
    assert infer is not None and (infer.commits, infer.waits) == (1, 1)
    assert infer.phases["guard"] == infer.phases["update"] == 0


def test_phase_clock_adds_time_only_while_measuring():
    clock = PhaseClock()
    clock.mark("prepare")
    clock.stop()
    assert all(v == 0 for v in clock.seconds.values())
    with clock.measuring() as seconds:
        clock.mark("prepare")
        time.sleep(0.002)
        clock.mark("wait")
        time.sleep(0.001)
    assert seconds["prepare"] >= 0.002 and seconds["wait"] >= 0.001
    assert seconds["encode"] == 0
    with clock.measuring() as again:  # starts from zero
        pass
    assert all(v == 0 for v in again.values())


def test_cpu_profile_is_per_layer(cfg):
    net = dm.load(cfg, device="cpu")
    profile = net.profile(repeats=1)
    assert [d.layer for d in profile.dispatches] == [op.index for op in net.layers]
    assert profile.clock.startswith("host") and profile.peaks is None
    assert sum(d.flops for d in profile.dispatches if d.kind == "convolutional") == \
        _conv_flops(net, 1)
    assert profile.dispatches[0].kernel == "cpu:convolutional"


def test_cpu_training_profile_times_each_layer_and_phase(cfg):
    net = dm.load(cfg, device="cpu", batch=2, subdivisions=1)
    before = {i: {k: a.copy() for k, a in p.items()} for i, p in net.params.items()}
    profile = net.profile(train=True, repeats=2)
    assert profile.what.startswith("training step") and profile.device == "cpu"
    phases = {(d.layer, d.kernel.rsplit(" ", 1)[1]) for d in profile.dispatches}
    # Every layer runs forward; every layer with parameters is updated; the convolutions
    # (all but none) send their gradient back.
    assert {i for i, phase in phases if phase == "forward"} == {op.index for op in net.layers}
    assert {i for i, phase in phases if phase == "update"} == set(net.params)
    convs = [op.index for op in net.layers if op.kind == "convolutional"]
    assert {i for i, phase in phases if phase == "backward"} >= set(convs)
    assert all(d.seconds >= 0 for d in profile.dispatches)
    # The steps run within the step's call.
    assert 0 < profile.seconds <= profile.wall_seconds
    # Forward FLOPs as in inference (two images); a convolution's backward is its two
    # products, one for the first (whose input takes no gradient).
    forward = {d.layer: d.flops for d in profile.dispatches if d.kernel.endswith("forward")}
    backward = {d.layer: d.flops for d in profile.dispatches
                if d.kernel.endswith("backward") and d.kind == "convolutional"}
    assert sum(forward[i] for i in convs) == _conv_flops(net, 2)
    assert backward[convs[0]] == forward[convs[0]]
    assert all(backward[i] == 2 * forward[i] for i in convs[1:])
    # The profile trained a copy.
    assert all(np.array_equal(a, net.params[i][k]) for i, p in before.items()
               for k, a in p.items())


def test_profile_command(cfg, tmp_path, capsys):
    require("emu")
    out = tmp_path / "p.json"
    assert main(["profile", str(cfg), "--device", "emu", "--repeats", "1", "--json",
                 str(out), "--top", "3"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "inference 64x64 batch 1 on emu" in text and "gemm_nn_f32" in text
    # What runs next is said as it starts (a profile on the emulator takes minutes).
    said = captured.err.splitlines()
    assert said[0].startswith("profiling a forward pass")
    assert "  a warm-up pass (programs, buffers, pipelines) ..." in said
    assert "  profiled run 1 of 1 ..." in said
    assert "  whole call 5 of 5 (the host's split) ..." in said
    data = json.loads(out.read_text())
    assert data["device"] == "emu" and data["by_layer"]
    assert main(["profile", "--device", "emu"]) == 2
    assert "give CFG or --model" in capsys.readouterr().err
    assert main(["profile", str(tmp_path / "missing.cfg"), "--device", "emu"]) == 1
