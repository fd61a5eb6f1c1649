"""CPU forward of the bundled networks against ONNX Runtime's CPU provider running our own
export of the same network (``export_onnx``), batch 1 and 4, with the same number of threads.

Each (network, batch) is a benchmark group of its own, ours and the peer timed in alternating
rounds (``alternating.py``); the README's benchmark command prints each group's median ratio
ours/peer. yolov3-tiny
runs with its real weights, the others with seeded weights (the time does not depend on
them). OpenCV DNN is the other peer (``test_bench_cpu_models.py``, ``test_bench_cpu.py``).
"""

import numpy as np
import pytest
from alternating import pedantic_alternating

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
from shared_paths import CFG_DIR, YOLOV3_TINY  # noqa: E402

import darknet_metal as dm  # noqa: E402

THREADS = 2
#: (network, input size): the sizes the performance goals name.
NETWORKS = [("yolov3-tiny", 416), ("yolov4-tiny", 416), ("yolov3", 416), ("yolov4", 320)]
BATCHES = (1, 4)
ROUNDS = {"yolov3-tiny": 20, "yolov4-tiny": 20, "yolov3": 6, "yolov4": 6}

CASES = [(name, size, batch) for name, size in NETWORKS for batch in BATCHES]


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{s}-b{b}" for n, s, b in CASES])
def case(request, tmp_path_factory):
    name, size, batch = request.param
    if name == "yolov3-tiny":
        net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights")
    else:
        net = dm.load(CFG_DIR / f"{name}.cfg", seed=0, input_size=(size, size))
    path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
    # Opset 18 has Mish (yolov4), so the peer runs one operator where opset 13 needs three.
    net.export_onnx(path, batch=batch, opset=18)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).random((batch, 3, size, size), dtype=np.float32)
    return f"{name}-{size}-b{batch}-onnxruntime", ROUNDS[name], net, session, x


def test_ours_alternating_with_onnxruntime(benchmark, case):
    group, rounds, net, session, x = case
    benchmark.group = group
    pedantic_alternating(benchmark, lambda: net.forward(x),
                         lambda: session.run(None, {"input": x}), rounds=rounds)
