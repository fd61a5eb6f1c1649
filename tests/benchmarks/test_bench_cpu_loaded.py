"""CPU forward of the four bundled networks at batch 1 beside other work, against OpenCV DNN
and ONNX Runtime beside the same work (yolov3-tiny with its real weights, the others with
seeded weights written in Darknet's format, so both peers run exactly the same network).

The benchmark starts the load itself and stops it at the end: another process doing
multithreaded NumPy matrix products on its default BLAS threads (the case that made spinning
BLAS workers 50x slower), and a loop of C compiles plus a busy loop. Ours and each peer are
timed in alternating rounds under the same load (``alternating.py``): the load's processes
come and go and the scheduler moves threads among them, so rounds taken one side after the
other met different stretches of it (ours/OpenCV 0.49 to 1.08 in three runs of the same tree).
The ratio of medians is printed with the others.
"""

import pytest
from alternating import pedantic_alternating

pytest.importorskip("cv2")
from bundled_networks import benchmark_case, opencv_forward  # noqa: E402
from cpu_loads import standard_loads, start_load, stop_load  # noqa: E402

THREADS = 2
#: (network, input size): the sizes the performance goals name.
NETWORKS = [("yolov3-tiny", 416), ("yolov4-tiny", 416), ("yolov3", 416), ("yolov4", 320)]
ROUNDS = {"yolov3-tiny": 21, "yolov4-tiny": 21, "yolov3": 7, "yolov4": 7}

LOADS = standard_loads()


@pytest.fixture(scope="module", params=LOADS, ids=[name for name, _ in LOADS])
def loaded(request):
    name, scripts = request.param
    procs = start_load(scripts)
    yield name
    stop_load(procs)


@pytest.fixture(scope="module", params=NETWORKS, ids=[f"{n}-{s}" for n, s in NETWORKS])
def network(request, tmp_path_factory):
    """(name, size, cfg, weights, our network, input (1, 3, size, size) float32)."""
    name, size = request.param
    return benchmark_case(tmp_path_factory.mktemp(name), name, size)


def test_ours_loaded_alternating_with_opencv(benchmark, network, loaded):
    name, size, cfg, weights, net, x = network
    benchmark.group = f"{name}-{size}-cpu-beside-{loaded}"
    pedantic_alternating(benchmark, lambda: net.forward(x),
                         opencv_forward(cfg, weights, x, THREADS), rounds=ROUNDS[name])


def test_ours_loaded_alternating_with_onnxruntime(benchmark, network, loaded,
                                                   tmp_path_factory):
    """ONNX Runtime's CPU provider on our export of the same network, with as many threads."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    name, size, _, _, net, x = network
    benchmark.group = f"{name}-{size}-cpu-beside-{loaded}-onnxruntime"
    path = tmp_path_factory.mktemp("onnx") / f"{name}.onnx"
    net.export_onnx(path, opset=18)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    pedantic_alternating(benchmark, lambda: net.forward(x),
                         lambda: session.run(None, {"input": x}), rounds=ROUNDS[name])
