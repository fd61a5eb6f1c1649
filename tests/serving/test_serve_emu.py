"""The server on ``emu`` (the Metal kernels in the CPU emulator): tritonclient's infer,
alone and dynamically batched, within 1e-5 of ``Network.forward`` on emu for each request
alone; the device's memory and pool counters in /metrics."""

import concurrent.futures
import urllib.request

import numpy as np
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MICRO_DIR, ServerProcess, add_micro

import darknet_metal as dm

pytest.importorskip("darknet_metal.metal._shim", reason="the shim extension is not built")


@pytest.fixture(scope="module")
def emu_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("emu")
    add_micro(repo, config="max_batch_size: 4\n"
              "dynamic_batching { max_queue_delay_microseconds: 200000 }\n")
    with ServerProcess(repo, "-q", device="emu") as server:
        yield server
    assert server.process.returncode == 0, server.log


def test_infer_on_emu_matches_forward_alone(emu_server):
    net = dm.load(MICRO_DIR / "micro-v4-sgd.cfg", MICRO_DIR / "init.weights", device="emu")
    rng = np.random.default_rng(5)
    xs = [rng.random((n, *net.input_shape), dtype=np.float32) for n in (1, 2, 1, 1, 3)]
    want = [net.forward(x) for x in xs]
    names = [f"yolo_{i}" for i in net.yolo_layers]

    def infer(x):
        with triton.InferenceServerClient(emu_server.address, network_timeout=300) as client:
            tensor = triton.InferInput("images", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer("micro", [tensor])
            return [result.as_numpy(name) for name in names]

    with concurrent.futures.ThreadPoolExecutor(len(xs)) as pool:
        got = list(pool.map(infer, xs))
    for outs, expected in zip(got, want, strict=True):
        for out, w in zip(outs, expected, strict=True):
            assert out.shape == w.shape
            np.testing.assert_allclose(out, w, rtol=0, atol=1e-5)

    with urllib.request.urlopen(f"{emu_server.url}/metrics", timeout=60) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    buckets = {s.labels["le"]: s.value for s in families["darknet_metal_batch_size"].samples
               if s.name.endswith("_bucket")}
    # 8 images in 5 concurrent requests with a 0.2 s delay: fewer executions than requests.
    assert buckets["+Inf"] < len(xs)
    assert families["darknet_metal_device_allocated_bytes"].samples[0].value > 0
    assert families["darknet_metal_device_pool_misses"].samples[0].value > 0
