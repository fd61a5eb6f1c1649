"""The CPU benchmark files' comparison as a plain script, for machines without pytest-benchmark.

Runs the bundled networks (``bundled_networks.benchmark_case``: yolov3-tiny with its real
weights, the others seeded) against ONNX Runtime's CPU provider running our export and,
where this OpenCV has the Darknet importer, OpenCV DNN, each with the same number of threads,
in alternating rounds with ``alternating.settle()`` between calls, as
``test_bench_cpu_onnxruntime.py``, ``test_bench_cpu_models.py`` and
``test_bench_cpu_loaded.py`` do; prints one line per case and run with the medians and the
ratios ours/peer.

    python tests/benchmarks/run_peers.py --runs 3
    python tests/benchmarks/run_peers.py --load busy           # beside two busy loops
    python tests/benchmarks/run_peers.py --load numpy-matmul   # the loaded file's loads
    python tests/benchmarks/run_peers.py --load compiles+busy  # (this one needs a C compiler)

Pin it (``taskset -c 2,3``) to measure a given number of cores: the load's processes inherit
the pinning. Needs ``onnxruntime`` and ``onnx``; ``../shared`` as the tests find it.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

TESTS = pathlib.Path(__file__).resolve().parents[1]
# The checkout's package (built in place) where none is installed, and the tests' helpers.
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from alternating import settle  # noqa: E402
from bundled_networks import benchmark_case, opencv_forward  # noqa: E402
from cpu_loads import BUSY, standard_loads, start_load, stop_load  # noqa: E402

#: (network, input size, batch), as the benchmark files take them.
CASES = [("yolov3-tiny", 416, 1), ("yolov3-tiny", 416, 4), ("yolov4-tiny", 416, 1),
         ("yolov4-tiny", 416, 4), ("yolov3", 416, 1), ("yolov4", 320, 1)]
ROUNDS = {"yolov3-tiny": 25, "yolov4-tiny": 25, "yolov3": 7, "yolov4": 7}
#: The loads' processes (``--load``): the loaded benchmark file's, and two busy loops.
LOADS = {"none": [], "busy": [BUSY, BUSY], **dict(standard_loads())}


def time_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each call over ``rounds`` alternating rounds (two untimed
    calls of each first), ``settle()`` before every call."""
    for call in calls.values():
        call()
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            settle()
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of every case (default 1)")
    parser.add_argument("--load", choices=sorted(LOADS), default="none",
                        help="processes running beside the benchmark (default none)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds a case (default: 25 for the tiny networks, 7 others)")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of ONNX Runtime and OpenCV (ours: "
                             "DARKNET_METAL_CPU_THREADS; default 2)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    cases = [case for case in CASES if args.load == "none" or case[2] == 1]
    directory = pathlib.Path(tempfile.mkdtemp(prefix="run-peers-"))
    networks = {}
    for name, size, _ in cases:
        if name not in networks:
            networks[name] = benchmark_case(directory, name, size)[2:5]
    load = start_load(LOADS[args.load])
    try:
        for run in range(1, args.runs + 1):
            for name, size, batch in cases:
                cfg, weights, net = networks[name]
                x = np.random.default_rng(1).random((batch, 3, size, size), dtype=np.float32)
                path = directory / f"{name}-{size}-b{batch}.onnx"
                if not path.exists():
                    net.export_onnx(path, batch=batch, opset=18)
                options = ort.SessionOptions()
                options.intra_op_num_threads = args.threads
                options.inter_op_num_threads = 1
                options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                session = ort.InferenceSession(str(path), options,
                                               providers=["CPUExecutionProvider"])
                calls: dict[str, Callable[[], object]] = {
                    "ours": lambda net=net, x=x: net.forward(x),
                    "ONNX Runtime": lambda session=session, x=x: session.run(None, {"input": x}),
                }
                if batch == 1:
                    try:
                        calls["OpenCV"] = opencv_forward(cfg, weights, x, args.threads)
                    except AttributeError:  # an OpenCV without the Darknet importer
                        pass
                ms = time_rounds(calls, args.rounds or ROUNDS[name])
                peers = [peer for peer in ms if peer != "ours"]
                print(f"load={args.load} run {run} {name}-{size}-b{batch}: "
                      + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()) + " | "
                      + ", ".join(f"ours/{p} {ms['ours'] / ms[p]:.2f}" for p in peers),
                      flush=True)
    finally:
        stop_load(load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
