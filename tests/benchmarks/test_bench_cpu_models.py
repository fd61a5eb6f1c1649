"""CPU forward of the bundled networks at batch 1, random weights: ours against OpenCV DNN.

Each network gets its own benchmark group, ours and OpenCV timed in alternating rounds
(``alternating.py``); the README's benchmark command prints the median ratio of each group.
The weights are drawn with a fixed seed and written in Darknet's format, so OpenCV runs
exactly the same network.
"""

import pytest
from alternating import pedantic_alternating

pytest.importorskip("cv2")
from bundled_networks import benchmark_case, opencv_forward  # noqa: E402

THREADS = 2
#: (cfg, input size): the sizes the performance goals name.
NETWORKS = [("yolov4-tiny", 416), ("yolov3", 416), ("yolov4", 320)]
ROUNDS = {"yolov4-tiny": 20, "yolov3": 8, "yolov4": 8}


@pytest.fixture(scope="module", params=NETWORKS, ids=[f"{n}-{s}" for n, s in NETWORKS])
def network(request, tmp_path_factory):
    """(name, size, cfg, weights, our network, input (1, 3, size, size) float32)."""
    name, size = request.param
    return benchmark_case(tmp_path_factory.mktemp(name), name, size)


def _group(network):
    name, size = network[0], network[1]
    return f"{name}-{size}-cpu"


def test_ours_alternating_with_opencv(benchmark, network):
    name, _, cfg, weights, net, x = network
    benchmark.group = _group(network)
    pedantic_alternating(benchmark, lambda: net.forward(x),
                         opencv_forward(cfg, weights, x, THREADS), rounds=ROUNDS[name])
