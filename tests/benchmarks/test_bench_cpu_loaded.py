"""CPU forward of yolov3-tiny 416 beside other work, against OpenCV DNN and ONNX Runtime beside
the same work.

The benchmark starts the load itself and stops it at the end: another process doing
multithreaded NumPy matrix products on its default BLAS threads (the case that made spinning
BLAS workers 50x slower), and a loop of C compiles plus a busy loop. Ours and each peer are
timed in alternating rounds under the same load (``alternating.py``): the load's processes
come and go and the scheduler moves threads among them, so rounds taken one side after the
other met different stretches of it (ours/OpenCV 0.49 to 1.08 in three runs of the same tree).
The ratio of medians is printed with the others.
"""

import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from alternating import pedantic_alternating

cv2 = pytest.importorskip("cv2")
from shared_paths import GOLDEN, YOLOV3_TINY  # noqa: E402

import darknet_metal as dm  # noqa: E402

THREADS = 2
ROUNDS = 21

_MATMUL = "import numpy as np\na = np.random.rand(1500, 1500)\nwhile True:\n    a @ a\n"
_BUSY = "while True:\n    pass\n"
_COMPILE = (
    "import subprocess, tempfile, os\n"
    "d = tempfile.mkdtemp()\n"
    "src = os.path.join(d, 'x.c')\n"
    "open(src, 'w').write('int f(int x){return x*x;}\\n' * 2000)\n"
    "while True:\n"
    "    subprocess.run(['{cc}', '-O2', '-c', src, '-o', os.path.join(d, 'x.o')])\n"
)


def _start(scripts):
    procs = [subprocess.Popen([sys.executable, "-c", s], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for s in scripts]
    time.sleep(1.0)  # let the load reach its steady state
    return procs


def _stop(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _loads():
    cc = shutil.which("gcc") or shutil.which("cc")
    loads = [("numpy-matmul", [_MATMUL])]
    if cc:
        loads.append(("compiles+busy", [_COMPILE.replace("{cc}", cc), _BUSY]))
    return loads


LOADS = _loads()


@pytest.fixture(scope="module", params=LOADS, ids=[name for name, _ in LOADS])
def loaded(request):
    name, scripts = request.param
    procs = _start(scripts)
    yield name
    _stop(procs)


@pytest.fixture(scope="module")
def x():
    return np.fromfile(GOLDEN / "dog_input.bin", "<f4").reshape(1, 3, 416, 416)


@pytest.fixture(scope="module")
def ours():
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights")
    return net


@pytest.fixture(scope="module")
def peer():
    cv2.setNumThreads(THREADS)
    net = cv2.dnn.readNetFromDarknet(str(YOLOV3_TINY / "yolov3-tiny.cfg"),
                                     str(YOLOV3_TINY / "yolov3-tiny.weights"))
    return net, net.getUnconnectedOutLayersNames()


def test_ours_loaded_alternating_with_opencv(benchmark, loaded, ours, peer, x):
    net, names = peer
    benchmark.group = f"yolov3-tiny-416-cpu-beside-{loaded}"

    def run_peer():
        net.setInput(x)
        return net.forward(names)

    pedantic_alternating(benchmark, lambda: ours.forward(x), run_peer, rounds=ROUNDS)


@pytest.fixture(scope="module")
def onnxruntime_peer(ours, tmp_path_factory):
    """ONNX Runtime's CPU provider on our export of the same network, with as many threads."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    path = tmp_path_factory.mktemp("onnx") / "yolov3-tiny.onnx"
    ours.export_onnx(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_ours_loaded_alternating_with_onnxruntime(benchmark, loaded, ours, onnxruntime_peer,
                                                   x):
    benchmark.group = f"yolov3-tiny-416-cpu-beside-{loaded}-onnxruntime"
    pedantic_alternating(benchmark, lambda: ours.forward(x),
                         lambda: onnxruntime_peer.run(None, {"input": x}), rounds=ROUNDS)
