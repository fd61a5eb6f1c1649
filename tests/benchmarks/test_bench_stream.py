"""Streams against a plain loop of ``detect`` on the same frames, and ``video`` against
OpenCV DNN on the same clip, in the same run.

- CPU, yolov3-tiny 416: 50 frames (crops of the shared images, 576x432) through
  ``net.stream`` (batch 1, and batch 4) against ``[net.detect(f) for f in frames]``; also
  beside a busy process (one core taken), where the stream's threads compete for the other.
- emu, yolov3-tiny 160: 10 frames, stream (two passes in flight) against the loop.
- CPU, ``detect_video`` on a 50-frame 416x416 clip against OpenCV DNN (2 threads) reading the
  same clip and running the same network with its own blob, forward and NMS.

Throughput ratios are printed as median ratios (ours/peer time: below 1 is faster).
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

cv2 = pytest.importorskip("cv2")
from shared_paths import IMAGES, YOLOV3_TINY  # noqa: E402

import darknet_metal as dm  # noqa: E402

N = 50


def _frames(n: int, size=(576, 432)) -> list[np.ndarray]:
    sources = [np.asarray(Image.open(IMAGES / name).convert("RGB"))
               for name in ("dog.jpg", "coffee.png")]
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        src = sources[i % 2]
        h, w = src.shape[:2]
        top = int(rng.integers(0, h - min(h, size[1]) + 1))
        left = int(rng.integers(0, w - min(w, size[0]) + 1))
        out.append(np.ascontiguousarray(src[top:top + size[1], left:left + size[0]]))
    return out


@pytest.fixture(scope="module")
def frames():
    return _frames(N)


@pytest.fixture(scope="module")
def cpu_net():
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names")
    net.warmup(batch=1)
    net.warmup(batch=4)
    return net


def _fps(benchmark, frames):
    benchmark.extra_info["fps"] = len(frames) / benchmark.stats.stats.median


@pytest.mark.benchmark(group="stream-yolov3-tiny-416-cpu")
def test_ours_stream_cpu(benchmark, cpu_net, frames):
    stream_timings = []

    def run():
        stream = cpu_net.stream(frames, batch=1)
        found = list(stream)
        stream_timings.append(stream.summary())
        return found

    found = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert found == [cpu_net.detect(f) for f in frames]
    _fps(benchmark, frames)
    print(f"\nstream stages (s, last round): {stream_timings[-1]}")


@pytest.mark.benchmark(group="stream-yolov3-tiny-416-cpu")
def test_peer_detect_loop_cpu(benchmark, cpu_net, frames):
    benchmark.pedantic(lambda: [cpu_net.detect(f) for f in frames], rounds=5,
                       warmup_rounds=1)
    _fps(benchmark, frames)


@pytest.mark.benchmark(group="stream-batch4-yolov3-tiny-416-cpu")
def test_ours_stream_batch4_cpu(benchmark, cpu_net, frames):
    benchmark.pedantic(lambda: list(cpu_net.stream(frames, batch=4)), rounds=5,
                       warmup_rounds=1)
    _fps(benchmark, frames)


@pytest.mark.benchmark(group="stream-batch4-yolov3-tiny-416-cpu")
def test_peer_detect_loop_batch4_cpu(benchmark, cpu_net, frames):
    benchmark.pedantic(lambda: [cpu_net.detect(f) for f in frames], rounds=5,
                       warmup_rounds=1)
    _fps(benchmark, frames)


@pytest.fixture
def busy_core():
    proc = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    time.sleep(0.5)
    yield
    proc.kill()
    proc.wait()


@pytest.mark.benchmark(group="stream-yolov3-tiny-416-cpu-loaded")
def test_ours_stream_cpu_loaded(benchmark, cpu_net, frames, busy_core):
    benchmark.pedantic(lambda: list(cpu_net.stream(frames, batch=1)), rounds=5,
                       warmup_rounds=1)
    _fps(benchmark, frames)


@pytest.mark.benchmark(group="stream-yolov3-tiny-416-cpu-loaded")
def test_peer_detect_loop_cpu_loaded(benchmark, cpu_net, frames, busy_core):
    benchmark.pedantic(lambda: [cpu_net.detect(f) for f in frames], rounds=5,
                       warmup_rounds=1)
    _fps(benchmark, frames)


@pytest.fixture(scope="module")
def emu_net():
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names", device="emu", input_size=(160, 160))
    net.warmup(batch=1)
    return net


@pytest.mark.benchmark(group="stream-yolov3-tiny-160-emu")
def test_ours_stream_emu(benchmark, emu_net, frames):
    stream_timings = []

    def run():
        stream = emu_net.stream(frames[:10], batch=1)
        found = list(stream)
        stream_timings.append(stream.summary())
        return found

    benchmark.pedantic(run, rounds=3, warmup_rounds=0)
    _fps(benchmark, frames[:10])
    print(f"\nstream stages on emu (s, last round): {stream_timings[-1]}")


@pytest.mark.benchmark(group="stream-yolov3-tiny-160-emu")
def test_peer_detect_loop_emu(benchmark, emu_net, frames):
    benchmark.pedantic(lambda: [emu_net.detect(f) for f in frames[:10]], rounds=3,
                       warmup_rounds=0)
    _fps(benchmark, frames[:10])


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "clip416.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (416, 416))
    for frame in _frames(N, size=(416, 416)):
        # A frame of another size would be dropped by the writer without a word.
        frame = cv2.resize(frame, (416, 416), interpolation=cv2.INTER_AREA)
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


@pytest.mark.benchmark(group="video-yolov3-tiny-416-cpu")
def test_ours_video(benchmark, cpu_net, clip):
    from darknet_metal.inference.video import detect_video

    report = benchmark.pedantic(lambda: detect_video(cpu_net, clip, progress=False),
                                rounds=3, warmup_rounds=1)
    assert report.frames == N
    benchmark.extra_info["fps"] = N / benchmark.stats.stats.median


@pytest.mark.benchmark(group="video-yolov3-tiny-416-cpu")
def test_peer_opencv_video(benchmark, clip):
    cv2.setNumThreads(2)
    net = cv2.dnn.readNetFromDarknet(str(YOLOV3_TINY / "yolov3-tiny.cfg"),
                                     str(YOLOV3_TINY / "yolov3-tiny.weights"))
    names = net.getUnconnectedOutLayersNames()

    def run():
        capture = cv2.VideoCapture(str(clip))
        frames = 0
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            h, w = frame.shape[:2]
            net.setInput(cv2.dnn.blobFromImage(frame, 1 / 255.0, (416, 416), swapRB=True,
                                               crop=False))
            rows = np.concatenate([o.reshape(-1, o.shape[-1]) for o in net.forward(names)])
            scores = rows[:, 5:] * rows[:, 4:5]
            keep = scores.max(axis=1) > 0.25
            boxes = [[int((x - bw / 2) * w), int((y - bh / 2) * h), int(bw * w), int(bh * h)]
                     for x, y, bw, bh in rows[keep, :4]]
            cv2.dnn.NMSBoxes(boxes, scores[keep].max(axis=1).tolist(), 0.25, 0.45)
            frames += 1
        capture.release()
        return frames

    assert benchmark.pedantic(run, rounds=3, warmup_rounds=1) == N
    benchmark.extra_info["fps"] = N / benchmark.stats.stats.median
