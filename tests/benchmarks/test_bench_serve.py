"""``darknet-metal serve`` under load, yolov3-tiny at 416 on the CPU, through the real
tritonclient HTTP client (binary tensors) on the loopback interface.

- Throughput and p99 latency at 1, 8, 16 and 32 concurrent clients, with dynamic batching
  (``max_batch_size: 8``, 5 ms queue delay; "ours") against the same server without it
  ("peer": each request runs alone); at 16 clients also beside a busy process (one Python
  spin loop taking a core).
- The server's overhead per request: ``POST /v2/models/yolov3-tiny/detect`` with dog.jpg's
  bytes from one client on a keep-alive connection ("ours") against ``net.detect`` on the
  same file in this process ("peer"); the difference of the medians is the overhead.

Each round sends ``REQUESTS`` requests; ``extra_info`` holds requests/s, p50 and p99 (ms).
The server runs in its own process and shares this machine's two cores with the clients.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

triton = pytest.importorskip("tritonclient.http")
from serve_harness import ServerProcess, add_tiny  # noqa: E402
from shared_paths import IMAGES, YOLOV3_TINY  # noqa: E402

import darknet_metal as dm  # noqa: E402

REQUESTS = 48
SIZE = 416


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repo = tmp_path_factory.mktemp("bench-serve")
    add_tiny(repo, "batched", size=SIZE, config="max_batch_size: 8\n"
             "dynamic_batching { max_queue_delay_microseconds: 5000 }\n")
    add_tiny(repo, "alone", size=SIZE, config="max_batch_size: 8\n")
    add_tiny(repo, "yolov3-tiny", size=SIZE, config="max_batch_size: 1\n")
    with ServerProcess(repo, "-q") as server:
        yield server


def _load(server, model: str, clients: int, x: np.ndarray) -> tuple[float, list[float]]:
    """``REQUESTS`` infer requests from ``clients`` threads (one connection each); returns
    the wall time and each request's latency, in seconds."""
    latencies: list[float] = []
    lock = threading.Lock()
    remaining = iter(range(REQUESTS))

    def client_loop() -> None:
        with triton.InferenceServerClient(server.address, network_timeout=300) as client:
            tensor = triton.InferInput("images", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            while True:
                with lock:
                    if next(remaining, None) is None:
                        return
                start = time.perf_counter()
                client.infer(model, [tensor])
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, latencies


def _measure(benchmark, server, model: str, clients: int) -> None:
    x = np.random.default_rng(0).random((1, 3, SIZE, SIZE), dtype=np.float32)
    _load(server, model, clients, x)  # warm up: every batch size the batcher will form
    all_latencies: list[float] = []

    def run():
        wall, latencies = _load(server, model, clients, x)
        all_latencies.extend(latencies)
        return wall

    benchmark.pedantic(run, rounds=3, warmup_rounds=0)
    assert len(all_latencies) == 3 * REQUESTS
    p50, p99 = np.percentile(all_latencies, [50, 99]) * 1e3
    benchmark.extra_info.update(requests_per_s=REQUESTS / benchmark.stats.stats.median,
                                p50_ms=float(p50), p99_ms=float(p99), clients=clients)
    print(f"\n{model} x{clients}: {REQUESTS / benchmark.stats.stats.median:.1f} requests/s, "
          f"p50 {p50:.0f} ms, p99 {p99:.0f} ms")


@pytest.mark.parametrize("clients", [1, 8, 16, 32])
def test_ours_dynamic_batching(benchmark, servers, clients):
    benchmark.group = f"serve-yolov3-tiny-416-cpu-{clients}-clients"
    _measure(benchmark, servers, "batched", clients)


@pytest.mark.parametrize("clients", [1, 8, 16, 32])
def test_peer_no_batching(benchmark, servers, clients):
    benchmark.group = f"serve-yolov3-tiny-416-cpu-{clients}-clients"
    _measure(benchmark, servers, "alone", clients)


@pytest.fixture()
def busy_core():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spin.kill()
    spin.wait()


@pytest.mark.benchmark(group="serve-yolov3-tiny-416-cpu-16-clients-busy")
def test_ours_dynamic_batching_busy(benchmark, servers, busy_core):
    _measure(benchmark, servers, "batched", 16)


@pytest.mark.benchmark(group="serve-yolov3-tiny-416-cpu-16-clients-busy")
def test_peer_no_batching_busy(benchmark, servers, busy_core):
    _measure(benchmark, servers, "alone", 16)


@pytest.fixture(scope="module")
def dog_bytes():
    return (IMAGES / "dog.jpg").read_bytes()


@pytest.mark.benchmark(group="serve-overhead-yolov3-tiny-416-detect")
def test_ours_detect_over_http(benchmark, servers, dog_bytes):
    host, port = servers.address.rsplit(":", 1)
    # One keep-alive connection, as a client sending many requests holds.
    connection = http.client.HTTPConnection(host, int(port), timeout=60)

    def detect():
        connection.request("POST", "/v2/models/yolov3-tiny/detect", body=dog_bytes)
        response = connection.getresponse()
        assert response.status == 200
        return response.read()

    detect()
    body = benchmark.pedantic(detect, rounds=30, warmup_rounds=3)
    connection.close()
    assert b'"dog"' in body


@pytest.mark.benchmark(group="serve-overhead-yolov3-tiny-416-detect")
def test_peer_detect_in_process(benchmark):
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names")
    net.warmup(batch=1)
    found = benchmark.pedantic(lambda: net.detect(str(IMAGES / "dog.jpg")), rounds=30,
                               warmup_rounds=3)
    assert any(d.name == "dog" for d in found)
