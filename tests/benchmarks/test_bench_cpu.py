"""CPU forward of yolov3-tiny at 416x416, batch 1: ours against OpenCV DNN, timed in
alternating rounds (``alternating.py``).

Run with the README's benchmark command. Per-layer medians and peak RSS are printed.
"""

import resource

import numpy as np
import pytest
from alternating import pedantic_alternating

cv2 = pytest.importorskip("cv2")
from shared_paths import GOLDEN, YOLOV3_TINY  # noqa: E402

THREADS = 2


@pytest.fixture(scope="module")
def x():
    return np.fromfile(GOLDEN / "dog_input.bin", "<f4").reshape(1, 3, 416, 416)


@pytest.mark.benchmark(group="yolov3-tiny-416-cpu")
def test_ours_forward_alternating_with_opencv(benchmark, yolov3_tiny, x):
    cv2.setNumThreads(THREADS)
    peer = cv2.dnn.readNetFromDarknet(str(YOLOV3_TINY / "yolov3-tiny.cfg"),
                                      str(YOLOV3_TINY / "yolov3-tiny.weights"))
    names = peer.getUnconnectedOutLayersNames()

    def run_peer():
        peer.setInput(x)
        return peer.forward(names)

    pedantic_alternating(benchmark, lambda: yolov3_tiny.forward(x), run_peer, rounds=30,
                         warmup_rounds=3)
    profile = yolov3_tiny.profile(x, repeats=10)
    times = [1e3 * s for s in profile.layer_seconds(len(yolov3_tiny.layers))]
    print("\nper-layer median ms:")
    for spec, ms in zip(yolov3_tiny.layers, times, strict=True):
        print(f"  {spec.index:3d} {spec.kind:<14s} {ms:7.2f}")
    print(f"  sum {sum(times):.1f} ms; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
