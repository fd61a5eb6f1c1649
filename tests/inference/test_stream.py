"""``Network.detect`` on sequences (passes of the network's batch) and ``Network.stream``
(pipelined): each frame's detections equal detecting it alone — exactly on the CPU, within
1e-5 on emu — in order, for batches that do not divide the frames, streams of one frame and
any number of workers; on emu the passes stay in flight as configured, wait once per pass
read and allocate nothing after the first frame."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from devices import GPU_DEVICES, require
from PIL import Image
from shared_paths import IMAGES, YOLOV3_TINY
from training_golden import TRAIN

import darknet_metal as dm
from darknet_metal import metal
from darknet_metal.errors import ArgumentError, ArgumentTypeError, ImageError

MICRO = TRAIN / "micro-v4-sgd"


def _frames(n, seed=3):
    """n varied RGB frames (uint8 arrays of several sizes) cut from the shared images."""
    rng = np.random.default_rng(seed)
    sources = [np.asarray(Image.open(IMAGES / "dog.jpg").convert("RGB")),
               np.asarray(Image.open(IMAGES / "coffee.png").convert("RGB"))]
    frames = []
    for i in range(n):
        src = sources[i % 2]
        h, w = src.shape[:2]
        top, left = rng.integers(0, h // 4), rng.integers(0, w // 4)
        frames.append(np.ascontiguousarray(src[top:top + h * 3 // 4, left:left + w * 3 // 4]))
    return frames


def _same(got, want, exact, where=""):
    assert len(got) == len(want), where
    for g, w in zip(got, want, strict=True):
        if exact:
            assert g == w, where
            continue
        assert (g.class_id, g.name) == (w.class_id, w.name), where
        np.testing.assert_allclose(
            [g.confidence, g.objectness, g.left, g.top, g.width, g.height],
            [w.confidence, w.objectness, w.left, w.top, w.width, w.height],
            rtol=1e-5, atol=1e-5 * max(1.0, abs(w.width), abs(w.height)), err_msg=where)


@pytest.fixture(scope="module")
def tiny():
    """yolov3-tiny with its COCO weights at 160x160 on the CPU, prepared for passes of 3."""
    return dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                   names=YOLOV3_TINY / "coco.names", input_size=(160, 160), batch=3)


@pytest.fixture(scope="module")
def micro_emu():
    """micro-v4-sgd (two [yolo] heads, 128x128) on emu, initialised with a seed (batch-norm
    statistics 0 and 1): untrained, it reports ~1,900 finite boxes per frame to compare."""
    return dm.load(MICRO / "micro-v4-sgd.cfg", seed=1, device="emu", batch=2)


def test_detect_on_a_list_equals_detecting_one_by_one(tiny):
    frames = _frames(7)
    images = [*frames[:3], IMAGES / "dog.jpg", str(IMAGES / "coffee.png"), *frames[3:]]
    alone = [tiny.detect(image) for image in images]
    assert sum(map(len, alone)) > 10
    together = tiny.detect(images)  # 9 images in passes of 3, 3, 3
    assert len(together) == len(images)
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        _same(got, want, exact=True, where=f"image {i}")
    assert tiny.detect(images[:4]) == alone[:4]  # a last pass of 1
    assert tiny.detect(tuple(images[:2])) == alone[:2]
    assert tiny.detect([]) == []


@pytest.mark.parametrize("batch,depth,workers", [(1, 2, 2), (2, 1, 1), (3, 3, 4), (4, 2, 1)])
def test_a_stream_equals_detecting_one_by_one_on_the_cpu(tiny, batch, depth, workers):
    frames = _frames(7)
    alone = [tiny.detect(frame) for frame in frames]
    stream = tiny.stream(iter(frames), batch=batch, depth=depth, workers=workers)
    got = list(stream)
    assert got == alone
    assert sum(t.frames for t in stream.timings) == len(frames)
    assert len(stream.timings) == -(-len(frames) // batch)
    for t in stream.timings:
        assert min(t.prepare, t.upload, t.encode, t.device, t.readback, t.postprocess) >= 0
        assert t.device > 0 and t.prepare > 0


def test_streams_of_one_frame_and_of_none(tiny):
    frame = _frames(1)[0]
    assert list(tiny.stream([frame])) == [tiny.detect(frame)]
    assert list(tiny.stream([frame], batch=5)) == [tiny.detect(frame)]
    assert list(tiny.stream([])) == []


def test_thresholds_and_a_generator_of_paths(tiny):
    paths = [IMAGES / "dog.jpg", IMAGES / "coffee.png"] * 2

    def frames():
        yield from paths

    got = list(tiny.stream(frames(), thresh=0.5, nms=0.3))
    assert got == [tiny.detect(p, thresh=0.5, nms=0.3) for p in paths]


def test_a_bad_frame_raises_naming_it_and_the_stream_stops(tiny, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    frames = [IMAGES / "dog.jpg", broken, IMAGES / "coffee.png"]
    stream = tiny.stream(frames, batch=1)
    with pytest.raises(ImageError, match="broken.jpg"):
        list(stream)
    with pytest.raises(ImageError, match="broken.jpg"):
        tiny.detect(frames)
    with pytest.raises(ArgumentTypeError, match=r"images\[1\]"):
        tiny.detect([IMAGES / "dog.jpg", 3])
    for bad in ({"batch": 0}, {"depth": 0}, {"workers": 0}, {"thresh": 2}):
        with pytest.raises(ArgumentError):
            tiny.stream(frames, **bad)
    # The network is still whole.
    assert tiny.detect(IMAGES / "dog.jpg") == tiny.detect(str(IMAGES / "dog.jpg"))


def test_closing_a_stream_early_stops_its_threads(tiny):
    before = threading.active_count()
    stream = tiny.stream(_frames(12), batch=1)
    first = next(stream)
    assert first == tiny.detect(_frames(12)[0])
    stream.close()
    assert threading.active_count() == before
    with pytest.raises(StopIteration):
        next(stream)


@pytest.mark.parametrize("batch,depth", [(1, 2), (2, 3), (3, 1)])
def test_a_stream_on_emu_equals_detecting_one_by_one(micro_emu, batch, depth):
    frames = _frames(5)
    alone = [micro_emu.detect(frame, thresh=0.005) for frame in frames]
    assert sum(map(len, alone)) > 20
    got = list(micro_emu.stream(frames, thresh=0.005, batch=batch, depth=depth))
    for i, (g, w) in enumerate(zip(got, alone, strict=True)):
        _same(g, w, exact=False, where=f"frame {i}")
    listed = micro_emu.detect(frames, thresh=0.005)  # passes of 2, the last of 1
    for i, (g, w) in enumerate(zip(listed, alone, strict=True)):
        _same(g, w, exact=False, where=f"image {i}")


@pytest.fixture(scope="module", params=GPU_DEVICES)
def micro_gpu(request):
    """micro-v4-sgd as micro_emu, on each Metal device."""
    require(request.param)
    return dm.load(MICRO / "micro-v4-sgd.cfg", seed=1, device=request.param, batch=2)


def test_stream_counters_on_a_gpu(micro_gpu):
    # 20 frames, one per pass, two passes in flight: one wait per frame read, never more
    # than two command buffers in flight, no allocation after the first frame.
    frames = _frames(20)
    micro_gpu.warmup(batch=1, depth=2)
    kind = micro_gpu.device
    device = metal.get_device(kind)
    device.reset_counters()
    before = metal.stats(kind)
    stream = micro_gpu.stream(frames, thresh=0.005, batch=1, depth=2)
    got = [next(stream)]
    after_first = metal.stats(kind)
    got += list(stream)
    after = metal.stats(kind)
    assert len(got) == 20
    assert after["waits"] - before["waits"] == 20
    assert after["command_buffers_committed"] - before["command_buffers_committed"] == 20
    assert after["peak_in_flight"] == 2
    assert after["pool_misses"] == before["pool_misses"]
    assert after["allocated_bytes"] == after_first["allocated_bytes"] == before["allocated_bytes"]
    assert after["bytes_uploaded"] == before["bytes_uploaded"]  # inputs are read in place
    # One pass in flight at a time when asked.
    device.reset_counters()
    list(micro_gpu.stream(frames[:4], thresh=0.005, batch=1, depth=1))
    assert metal.stats(kind)["peak_in_flight"] == 1


def test_streams_and_detections_from_threads_on_one_network(micro_emu):
    frames = _frames(6)
    serial = [micro_emu.detect(frame, thresh=0.005) for frame in frames]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def run(i):
        try:
            start.wait()
            if i % 2:
                results[i] = list(micro_emu.stream(frames, thresh=0.005, batch=1 + i % 3))
            else:
                results[i] = [micro_emu.detect(frame, thresh=0.005) for frame in frames]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in range(4):
        for n, (g, w) in enumerate(zip(results[i], serial, strict=True)):
            _same(g, w, exact=False, where=f"thread {i} frame {n}")


def test_a_stream_of_yolov3_tiny_on_emu_equals_its_detections_one_by_one():
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names", input_size=(96, 96), device="emu",
                  batch=2)
    frames = [IMAGES / "dog.jpg", *_frames(2), IMAGES / "coffee.png"]
    alone = [net.detect(frame, thresh=0.1) for frame in frames]
    assert sum(map(len, alone)) >= 4
    for got in (list(net.stream(frames, thresh=0.1, depth=2)), net.detect(frames, thresh=0.1)):
        for i, (g, w) in enumerate(zip(got, alone, strict=True)):
            _same(g, w, exact=False, where=f"frame {i}")


def test_a_stream_with_a_cpu_fallback_layer_runs_pass_by_pass(micro_emu):
    # A layer forced onto the CPU puts host steps in the program: no pass ring, the passes run
    # whole one after another, with the same detections.
    from darknet_metal.runtime.gpu_backend import GpuBackend

    net = dm.load(MICRO / "micro-v4-sgd.cfg", seed=1, device="emu")
    net._executor = GpuBackend(net.layers, net.params, device="emu", fallback={3})
    assert any(p.where == "fallback" for p in net.executor.coverage())
    frames = _frames(4)
    alone = [micro_emu.detect(frame, thresh=0.005) for frame in frames]
    device = metal.get_device("emu")
    device.reset_counters()
    got = list(net.stream(frames, thresh=0.005, batch=1, depth=3))
    assert metal.stats("emu")["peak_in_flight"] <= 1
    for i, (g, w) in enumerate(zip(got, alone, strict=True)):
        _same(g, w, exact=False, where=f"frame {i}")
