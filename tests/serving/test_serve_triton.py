"""The real tritonclient HTTP client against ``darknet-metal serve``: health, metadata,
config, repository index, statistics, and ``infer`` with JSON and binary tensors giving
exactly what ``Network.forward`` gives on the same input."""

import gzip
import json
import urllib.request

import numpy as np
import pytest
import tritonclient.http as triton
from serve_harness import TINY_SIZE
from tritonclient.utils import InferenceServerException


@pytest.fixture()
def client(server):
    with triton.InferenceServerClient(server.address, network_timeout=120) as c:
        yield c


def _images(n, size, seed):
    return np.random.default_rng(seed).random((n, 3, size, size), dtype=np.float32)


def _infer(client, model, x, *, binary_in=True, outputs=None, binary_out=True, **kwargs):
    tensor = triton.InferInput("images", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary_in)
    wanted = (None if outputs is None else
              [triton.InferRequestedOutput(name, binary_data=binary_out) for name in outputs])
    return client.infer(model, [tensor], outputs=wanted, **kwargs)


def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "darknet-metal"
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata_and_readiness(client, reference):
    for name, net in reference.items():
        assert client.is_model_ready(name)
        assert client.is_model_ready(name, model_version="1")
        meta = client.get_model_metadata(name)
        assert meta["name"] == name and meta["versions"] == ["1"]
        assert meta["inputs"] == [{"name": "images", "datatype": "FP32",
                                   "shape": [-1, *net.input_shape]}]
        assert [o["name"] for o in meta["outputs"]] == [f"yolo_{i}" for i in net.yolo_layers]
        for out, i in zip(meta["outputs"], net.yolo_layers, strict=True):
            assert out["shape"] == [-1, *net.layers[i].out_shape]
    assert not client.is_model_ready("tiny", model_version="2")
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope")


def test_config_is_completed_from_the_cfg(client):
    config = client.get_model_config("tiny")
    assert config["name"] == "tiny"
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 20000
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["input"][0]["dims"] == [3, TINY_SIZE, TINY_SIZE]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert [(o["name"], o["dims"]) for o in config["output"]] == [
        ("yolo_16", [255, TINY_SIZE // 32, TINY_SIZE // 32]),
        ("yolo_23", [255, TINY_SIZE // 16, TINY_SIZE // 16])]
    micro = client.get_model_config("micro", model_version="1")
    assert "dynamic_batching" not in micro or not micro["dynamic_batching"]
    assert micro["max_batch_size"] == 4


def test_repository_index(client):
    index = client.get_model_repository_index()
    assert sorted((m["name"], m["version"], m["state"]) for m in index) == [
        ("micro", "1", "READY"), ("tiny", "1", "READY")]


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_equals_forward_bit_for_bit(client, reference, binary_in, binary_out):
    for seed, (name, net) in enumerate(reference.items()):
        x = _images(3, net.input_shape[1], seed)
        want = net.forward(x)
        names = [f"yolo_{i}" for i in net.yolo_layers]
        result = _infer(client, name, x, binary_in=binary_in, outputs=names,
                        binary_out=binary_out, request_id=f"r{seed}")
        assert result.get_response()["id"] == f"r{seed}"
        assert result.get_response()["model_version"] == "1"
        for out_name, expected in zip(names, want, strict=True):
            got = result.as_numpy(out_name)
            assert got.dtype == np.float32 and got.shape == expected.shape
            assert np.array_equal(got, expected), out_name


def test_infer_without_outputs_listed_answers_all_in_binary(client, reference):
    x = _images(1, TINY_SIZE, 7)
    result = _infer(client, "tiny", x, model_version="1")
    net = reference["tiny"]
    for i, expected in zip(net.yolo_layers, net.forward(x), strict=True):
        assert "binary_data_size" in result.get_output(f"yolo_{i}")["parameters"]
        assert np.array_equal(result.as_numpy(f"yolo_{i}"), expected)


def test_one_output_of_two(client, reference):
    x = _images(2, TINY_SIZE, 8)
    result = _infer(client, "tiny", x, outputs=["yolo_23"])
    assert result.get_output("yolo_16") is None
    assert np.array_equal(result.as_numpy("yolo_23"), reference["tiny"].forward(x)[1])


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_requests_and_responses(client, reference, compression):
    x = _images(2, TINY_SIZE, 9)
    result = _infer(client, "tiny", x, request_compression_algorithm=compression,
                    response_compression_algorithm=compression)
    net = reference["tiny"]
    for i, expected in zip(net.yolo_layers, net.forward(x), strict=True):
        assert np.array_equal(result.as_numpy(f"yolo_{i}"), expected)


def test_gzip_answer_when_asked(server):
    request = urllib.request.Request(f"{server.url}/metrics",
                                     headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert b"nv_inference_count" in gzip.decompress(response.read())


def test_statistics_count_the_inferences(client):
    before = client.get_inference_statistics("micro")["model_stats"][0]
    x = _images(2, 128, 10)
    for _ in range(3):
        _infer(client, "micro", x)
    after = client.get_inference_statistics("micro", model_version="1")["model_stats"][0]
    assert after["name"] == "micro" and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == 6
    assert after["execution_count"] - before["execution_count"] == 3
    success = after["inference_stats"]["success"]
    assert success["count"] - before["inference_stats"]["success"]["count"] == 3
    assert success["ns"] > before["inference_stats"]["success"]["ns"]
    assert any(b["batch_size"] == 2 for b in after["batch_stats"])
    everything = client.get_inference_statistics()["model_stats"]
    assert sorted(s["name"] for s in everything) == ["micro", "tiny"]


def test_detect_route_matches_net_detect(server, reference):
    from shared_paths import IMAGES

    net = reference["tiny"]
    body = (IMAGES / "dog.jpg").read_bytes()
    request = urllib.request.Request(f"{server.url}/v2/models/tiny/detect?thresh=0.02&nms=0.45",
                                     data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    want = net.detect(str(IMAGES / "dog.jpg"), thresh=0.02, nms=0.45)
    assert answer["width"] == 768 and answer["height"] == 576
    got = [(d["class_id"], d["confidence"], d["left"], d["top"], d["width"], d["height"])
           for d in answer["detections"]]
    assert got == [(d.class_id, d.confidence, d.left, d.top, d.width, d.height) for d in want]
    assert want, "yolov3-tiny at 64 finds nothing above 0.02 in dog.jpg"
