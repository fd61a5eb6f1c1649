"""A bounded load test on the loopback interface: 32 concurrent tritonclient clients send
2,000 requests mixed across two models (yolov3-tiny at 64 with dynamic batching, micro
without); no errors, every response equal to the single-request result, dynamic batching
visible in /metrics (executions of more than one image), latency and throughput reported."""

import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

CLIENTS = 32
REQUESTS = 2000
# Every request must be answered within this many seconds, and the whole run within
# DEADLINE: a stuck queue fails the test instead of hanging it.
TIMEOUT = 120
DEADLINE = 600


def _histogram(url: str, name: str, model: str) -> dict[str, float]:
    """Bucket bound -> cumulative count of histogram ``name`` for ``model``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return {s.labels["le"]: s.value for s in family.samples
                    if s.name == f"{name}_bucket" and s.labels["model"] == model}
    raise AssertionError(f"{name} not in /metrics")


def test_two_thousand_requests_from_32_clients(server, reference, capsys):
    rng = np.random.default_rng(2026)
    # A few distinct inputs per model (batches of 1 and 2), with what running each alone gives.
    cases = []
    for name, net in reference.items():
        for n in (1, 1, 2):
            for _ in range(3):
                x = rng.random((n, *net.input_shape), dtype=np.float32)
                cases.append((name, x, net.forward(x), [f"yolo_{i}" for i in net.yolo_layers]))
    before = {model: _histogram(server.url, "darknet_metal_batch_size", model)
              for model in reference}

    latencies: list[float] = []
    failures: list[str] = []
    sent = {model: 0 for model in reference}
    counter = iter(range(REQUESTS))
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        with triton.InferenceServerClient(server.address, network_timeout=TIMEOUT,
                                          connection_timeout=TIMEOUT) as client:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                name, x, want, outputs = cases[(index * 7 + seed) % len(cases)]
                with lock:
                    sent[name] += 1
                tensor = triton.InferInput("images", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                start = time.perf_counter()
                try:
                    result = client.infer(name, [tensor], request_id=str(index))
                    got = [result.as_numpy(out) for out in outputs]
                except Exception as exc:  # every failure is reported, none stops the run
                    failures.append(f"request {index} ({name}): {exc}")
                    continue
                elapsed = time.perf_counter() - start
                if result.get_response().get("id") != str(index):
                    failures.append(f"request {index}: answered as {result.get_response()}")
                for out, g, w in zip(outputs, got, want, strict=True):
                    if not np.array_equal(g, w):
                        failures.append(f"request {index} ({name}) {out}: differs from "
                                        "running it alone")
                with lock:
                    latencies.append(elapsed)

    threads = [threading.Thread(target=client_loop, args=(seed,), daemon=True)
               for seed in range(CLIENTS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, DEADLINE - (time.perf_counter() - started)))
    wall = time.perf_counter() - started
    assert not any(thread.is_alive() for thread in threads), f"not done in {DEADLINE} s"
    assert not failures, failures[:10]
    assert len(latencies) == REQUESTS
    assert server.alive()

    after = {model: _histogram(server.url, "darknet_metal_batch_size", model)
             for model in reference}
    executions = {model: after[model]["+Inf"] - before[model]["+Inf"] for model in reference}
    single = {model: after[model]["1"] - before[model]["1"] for model in reference}
    # Dynamic batching (tiny): fewer executions than requests, some of more than one image...
    assert executions["tiny"] < sent["tiny"] and single["tiny"] < executions["tiny"]
    # ...and without it (micro) one execution per request.
    assert executions["micro"] == sent["micro"]
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    with capsys.disabled():
        print(f"\nload test: {REQUESTS} requests from {CLIENTS} clients in {wall:.1f} s "
              f"({REQUESTS / wall:.0f} requests/s), latency p50 {p50:.1f} ms, p99 {p99:.1f} ms; "
              f"tiny: {executions['tiny']:.0f} executions for {sent['tiny']} requests "
              f"({executions['tiny'] - single['tiny']:.0f} of more than one image); micro: "
              f"{executions['micro']:.0f} for {sent['micro']}")
