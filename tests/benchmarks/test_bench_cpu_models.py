"""CPU forward of the bundled networks at batch 1, random weights: ours against OpenCV DNN.

Each network gets its own benchmark group, ours and OpenCV timed in alternating rounds
(``alternating.py``); the README's benchmark command prints the median ratio of each group.
The weights are drawn with a fixed seed and written in Darknet's format, so OpenCV runs
exactly the same network.
"""

import re

import numpy as np
import pytest
from alternating import pedantic_alternating

cv2 = pytest.importorskip("cv2")
from shared_paths import CFG_DIR  # noqa: E402

import darknet_metal as dm  # noqa: E402

THREADS = 2
#: (cfg, input size): the sizes the performance goals name.
NETWORKS = [("yolov4-tiny", 416), ("yolov3", 416), ("yolov4", 320)]
ROUNDS = {"yolov4-tiny": 20, "yolov3": 8, "yolov4": 8}


def _cfg_at(tmp_path, name, size):
    text = (CFG_DIR / f"{name}.cfg").read_text()
    text = re.sub(r"(?m)^width=\d+", f"width={size}", text)
    text = re.sub(r"(?m)^height=\d+", f"height={size}", text)
    path = tmp_path / f"{name}-{size}.cfg"
    path.write_text(text)
    return path


@pytest.fixture(scope="module", params=NETWORKS, ids=[f"{n}-{s}" for n, s in NETWORKS])
def network(request, tmp_path_factory):
    name, size = request.param
    tmp = tmp_path_factory.mktemp(name)
    cfg = _cfg_at(tmp, name, size)
    net = dm.load(cfg, seed=0)
    weights = tmp / f"{name}.weights"
    net.save_weights(weights)
    x = np.random.default_rng(1).random((1, 3, size, size), dtype=np.float32)
    return name, size, cfg, weights, net, x


def _group(network):
    name, size = network[0], network[1]
    return f"{name}-{size}-cpu"


def test_ours_alternating_with_opencv(benchmark, network):
    name, _, cfg, weights, net, x = network
    benchmark.group = _group(network)
    cv2.setNumThreads(THREADS)
    peer = cv2.dnn.readNetFromDarknet(str(cfg), str(weights))
    names = peer.getUnconnectedOutLayersNames()

    def run_peer():
        peer.setInput(x)
        return peer.forward(names)

    pedantic_alternating(benchmark, lambda: net.forward(x), run_peer, rounds=ROUNDS[name])
