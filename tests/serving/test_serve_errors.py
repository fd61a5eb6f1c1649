"""Bad requests: each answered with its status and a JSON error naming the field, the server
staying up; 1,000 random malformed requests (seeded) with no 500; bodies, inflated bodies
and images over the limits refused with 413."""

import gzip
import http.client
import io
import json
import random
import zlib

import numpy as np
import pytest
from PIL import Image
from serve_harness import TINY_SIZE, ServerProcess, add_micro, add_tiny

# The limits of this file's server: 1 MiB bodies, 1 megapixel images.
MAX_BODY = 2**20


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    repo = tmp_path_factory.mktemp("limited")
    add_tiny(repo)
    add_micro(repo)
    with ServerProcess(repo, "-q", "--max-body-mb", "1", "--max-image-mpixels", "1") as server:
        yield server
    assert server.process.returncode == 0, server.log


class Client:
    """Raw HTTP over one keep-alive connection, reopened after the server closes it."""

    def __init__(self, address: str) -> None:
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.connection = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, dict, bytes]:
        for attempt in range(2):
            try:
                self.connection.request(method, path, body=body, headers=headers or {})
                response = self.connection.getresponse()
                data = response.read()
                if response.getheader("connection", "").lower() == "close":
                    self.reopen()
                return response.status, dict(response.getheaders()), data
            except (ConnectionError, http.client.HTTPException):
                self.reopen()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def reopen(self) -> None:
        self.connection.close()
        self.connection = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def error(self, method, path, body=None, headers=None) -> tuple[int, str]:
        """(status, the JSON error message) of a request that must fail."""
        status, _, data = self.send(method, path, body, headers)
        assert status >= 400, (method, path, data[:200])
        message = json.loads(data)["error"]
        assert isinstance(message, str) and message
        return status, message

    def live(self) -> bool:
        return self.send("GET", "/v2/health/live")[0] == 200


@pytest.fixture(scope="module")
def client(limited):
    c = Client(limited.address)
    yield c
    c.connection.close()


def _request(shape=(1, 3, TINY_SIZE, TINY_SIZE), **changes) -> dict:
    values = np.zeros(shape, np.float32).ravel().tolist()
    tensor = {"name": "images", "datatype": "FP32", "shape": list(shape), "data": values}
    tensor.update(changes.pop("tensor", {}))
    body = {"inputs": [tensor]}
    body.update(changes)
    return body


INFER = "/v2/models/tiny/infer"


@pytest.mark.parametrize("method, path, status, words", [
    ("GET", "/v2/models/nope", 404, "unknown model 'nope'"),
    ("POST", "/v2/models/nope/infer", 404, "unknown model 'nope'"),
    ("GET", "/v2/models/tiny/versions/7/ready", 404, "has no version '7'"),
    ("GET", "/v2/models/tiny/versions/x/config", 404, "has no version 'x'"),
    ("GET", "/v2/models/..%2F..%2Fetc%2Fpasswd/config", 404, "Not Found"),
    ("GET", "/v2/models/%2E%2E/config", 404, "unknown model '..'"),
    ("GET", "/v2/models/tiny/../../../etc/passwd", 404, "Not Found"),
    ("GET", "/nothing/here", 404, "Not Found"),
    ("GET", INFER, 405, "Method Not Allowed"),
    ("POST", "/v2/repository/models/tiny/load", 400, "not supported"),
])
def test_unknown_models_routes_and_methods(client, method, path, status, words):
    got, message = client.error(method, path, b"" if method == "POST" else None)
    assert got == status and words in message


@pytest.mark.parametrize("body, words", [
    (b"{not json", "the request body (9 bytes: b'{not json') is not JSON"),
    (b"[1, 2]", "a JSON list; expected an object"),
    (b"\xff\xfe", "the request body (2 bytes: b'\\xff\\xfe') is not JSON"),
    (b"[" * 100000 + b"]" * 100000,
     "the request body (200000 bytes, starting b'[[[[[[[[[[[[[[[['...) is not JSON (nested too "
     "deeply)"),
    (json.dumps({}).encode(), "inputs: expected a list"),
    (json.dumps({"inputs": []}).encode(), "inputs: expected a list"),
    (json.dumps({"inputs": [1]}).encode(), "inputs[0]: expected a JSON object, not a number"),
    (json.dumps(_request(tensor={"name": "x"})).encode(), "inputs[0].name: \"x\""),
    (json.dumps(_request(tensor={"datatype": "FP16"})).encode(), "inputs[0].datatype"),
    (json.dumps(_request(tensor={"shape": [1, 3, 32, 32]})).encode(), "inputs[0].shape"),
    (json.dumps(_request(tensor={"shape": [1, 3, 64]})).encode(), "inputs[0].shape"),
    (json.dumps(_request(tensor={"shape": [1.0, 3, 64, 64]})).encode(), "inputs[0].shape"),
    (json.dumps(_request(shape=(9, 3, 64, 64))).encode(), "with a batch of 1 to 8"),
    (json.dumps(_request(tensor={"shape": [0, 3, 64, 64], "data": []})).encode(),
     "with a batch of 1 to 8"),
    (json.dumps(_request(tensor={"data": [0.0] * 5})).encode(),
     "inputs[0].data: holds 5 values; shape [1, 3, 64, 64] needs 12288 numbers"),
    (json.dumps(_request(tensor={"data": ["a"] * 12288})).encode(), "not all numbers"),
    (json.dumps(_request(tensor={"data": [[0.0], [0.0, 1.0]]})).encode(),
     "inputs[0].data: not a flat or regularly nested list"),
    (json.dumps(_request(tensor={"data": "zeros"})).encode(), "expected a list of 12288"),
    (json.dumps(_request(tensor={"data": [float("nan")] + [0.0] * 12287})).encode(),
     "inputs[0].data: a NaN or infinite value at index [0, 0, 0, 0]"),
    (json.dumps(_request(tensor={"data": [1e39] + [0.0] * 12287})).encode(),
     "a NaN or infinite value"),
    (json.dumps(_request(id=5)).encode(), "id: expected a string"),
    (json.dumps(_request(parameters=[])).encode(), "parameters: expected a JSON object"),
    (json.dumps(_request(parameters={"binary_data_output": "yes"})).encode(),
     "parameters.binary_data_output: expected true or false"),
    (json.dumps(_request(parameters={"sequence_id": 3})).encode(),
     "parameters.sequence_id: not supported"),
    (json.dumps(_request(outputs=[{"name": "yolo_1"}])).encode(),
     "outputs[0].name: \"yolo_1\" is not an output of this model (yolo_16, yolo_23)"),
    (json.dumps(_request(outputs=[{"name": "yolo_16"}, {"name": "yolo_16"}])).encode(),
     "requested twice"),
    (json.dumps(_request(outputs=[{"name": "yolo_16",
                                   "parameters": {"classification": 3}}])).encode(),
     "outputs[0].parameters.classification: not supported"),
    (json.dumps(_request(outputs={"name": "yolo_16"})).encode(), "outputs: expected a list"),
    (json.dumps(_request(tensor={"parameters": {"shared_memory_region": "r"}})).encode(),
     "shared memory is not supported"),
], ids=lambda value: value[:40] if isinstance(value, str) else "")
def test_bad_json_requests_name_the_field(client, body, words):
    """(Parameter ids are the expected words: the bodies are long.)"""
    status, message = client.error("POST", INFER, body)
    assert status == 400 and words in message, message
    assert client.live()


def _binary(x: np.ndarray, **tensor) -> tuple[bytes, dict]:
    header = {"inputs": [{"name": "images", "datatype": "FP32", "shape": list(x.shape),
                          "parameters": {"binary_data_size": x.nbytes}, **tensor}]}
    text = json.dumps(header).encode()
    return text + x.tobytes(), {"Inference-Header-Content-Length": str(len(text))}


@pytest.mark.parametrize("mutate, words", [
    (lambda body, h: (body[:-4], h), "49148 follow the JSON header"),
    (lambda body, h: (body + b"\0" * 4, h), "49156 follow the JSON header"),
    (lambda body, h: (body, {"Inference-Header-Content-Length": "x"}),
     "Inference-Header-Content-Length: 'x'"),
    (lambda body, h: (body, {"Inference-Header-Content-Length": str(len(body) + 1)}),
     "is not a length within the body"),
    (lambda body, h: (body, {}), "is not JSON"),
])
def test_bad_binary_requests(client, mutate, words):
    x = np.zeros((1, 3, TINY_SIZE, TINY_SIZE), np.float32)
    body, headers = mutate(*_binary(x))
    status, message = client.error("POST", INFER, body, headers)
    assert status == 400 and words in message, message


def test_a_wrong_binary_size_and_data_together(client):
    x = np.zeros((1, 3, TINY_SIZE, TINY_SIZE), np.float32)
    body, headers = _binary(x, parameters={"binary_data_size": 12})
    status, message = client.error("POST", INFER, body, headers)
    assert status == 400 and "binary_data_size: 12; shape [1, 3, 64, 64] of FP32 is" in message
    body, headers = _binary(x, data=[0.0])
    assert "both 'data' and binary_data_size" in client.error("POST", INFER, body, headers)[1]


def test_bodies_over_the_limit_get_413(client):
    big = b"x" * (MAX_BODY + 1)
    status, message = client.error("POST", INFER, big)
    assert status == 413 and f"at most {MAX_BODY}" in message
    # A small gzip body inflating past the limit: refused without inflating it all.
    bomb = gzip.compress(b"\0" * (50 * MAX_BODY))
    assert len(bomb) < MAX_BODY
    status, message = client.error("POST", INFER, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "inflates to more than" in message
    status, message = client.error("POST", INFER, b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and "not gzip data" in message
    truncated = zlib.compress(json.dumps(_request()).encode())[:-10]
    status, message = client.error("POST", INFER, truncated, {"Content-Encoding": "deflate"})
    assert status == 400 and "truncated" in message
    status, message = client.error("POST", INFER, b"{}", {"Content-Encoding": "br"})
    assert status == 415 and "'br' is not supported" in message
    assert client.live()


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("query, body, status, words", [
    ("", b"", 400, "the body is empty"),
    ("", b"GIF89a not really", 400, "the request body (17 bytes, starting b'GIF89a not "
     "reall'...) is not an image Pillow can decode: it starts as a GIF file"),
    ("?thresh=abc", _png(8, 8), 400, "query parameter thresh: 'abc'"),
    ("?nms=1.5", _png(8, 8), 400, "query parameter nms: '1.5'"),
    ("?thresh=nan", _png(8, 8), 400, "query parameter thresh"),
    ("", _png(1001, 1000), 413, "1001x1000 is more than 1000000 pixels"),
])
def test_bad_detect_requests(client, query, body, status, words):
    got, message = client.error("POST", f"/v2/models/tiny/detect{query}", body)
    assert got == status and words in message, message


def _truncated_png() -> bytes:
    """The first half of a PNG of noise (noise, so that half its pixel data is missing)."""
    pixels = np.random.default_rng(3).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()[:len(out.getvalue()) // 2]


@pytest.mark.parametrize("body, words", [
    (b"hello, not an image", ["the request body (19 bytes, starting b'hello, not an im'...)",
                              "is not an image Pillow can decode",
                              "match no image format"]),
    (b"\x00\x01\x02", ["the request body (3 bytes: b'\\x00\\x01\\x02')"]),
    (b"x" * 5000, ["5000 bytes, starting b'xxxxxxxxxxxxxxxx'..."]),
    (_truncated_png(), [f"({len(_truncated_png())} bytes, starting b'\\x89PNG",
                        "it starts as a PNG file, but decoding fails (OSError: "]),
    (json.dumps(_request()).encode(), ["is not an image: it looks like JSON",
                                       "/v2/models/tiny/infer"]),
], ids=["text", "three-bytes", "long", "truncated-png", "json"])
def test_a_body_that_is_not_an_image_is_described_by_its_bytes(client, body, words):
    """The issue: a non-image body's 400 said ``cannot identify image file <_io.BytesIO
    object at 0x...>``, naming the server's memory instead of what the client sent."""
    status, message = client.error("POST", "/v2/models/tiny/detect", body)
    assert status == 400
    assert f"{len(body)} bytes" in message
    for word in words:
        assert word in message, message
    assert "object at 0x" not in message and "BytesIO" not in message, message


def test_an_image_sent_to_infer_is_described_and_pointed_to_detect(client):
    png = _png(8, 8)
    status, message = client.error("POST", INFER, png)
    assert status == 400, message
    assert f"the request body ({len(png)} bytes, starting b'\\x89PNG" in message, message
    assert "is not JSON" in message and "a PNG image goes to the model's /detect" in message


def test_a_good_request_after_the_bad_ones(client):
    status, _, data = client.send("POST", "/v2/models/tiny/detect?thresh=0.5", _png(40, 30))
    assert status == 200
    answer = json.loads(data)
    assert answer["width"] == 40 and answer["height"] == 30
    status, _, data = client.send("POST", INFER, json.dumps(_request()).encode())
    assert status == 200 and json.loads(data)["outputs"][0]["shape"] == [1, 255, 2, 2]


def test_failures_are_counted_as_rejected(client):
    _, _, data = client.send("GET", "/metrics")
    text = data.decode()
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    rejected = [s.value for s in families["nv_inference_request_failure"].samples
                if s.labels == {"model": "tiny", "version": "1", "reason": "REJECTED"}]
    assert rejected and rejected[0] >= 30


# --- the fuzzer ------------------------------------------------------------------------

def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 3, 64, 2**31, -2**63, 10**30])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf")])
    if kind == 4:
        return rng.choice(["", "images", "FP32", "yolo_16", "../x", "\u00e9\u4e2d", "a" * 300])
    if kind == 5:
        return []
    if kind in (6, 7):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(["name", "datatype", "shape", "data", "parameters", "inputs",
                        "outputs", "id", "binary_data_size", "binary_data"]):
            _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutate(rng: random.Random, value, depth: int = 0):
    """``value`` with one part replaced, dropped or added at random."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        choice = rng.randrange(3)
        out = dict(value)
        if choice == 0:
            del out[key]
        elif choice == 1:
            out[key] = _mutate(rng, value[key], depth + 1)
        else:
            out[key] = _random_json(rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        out = list(value)
        i = rng.randrange(len(out))
        choice = rng.randrange(4)
        if choice == 0:
            del out[i]
        elif choice == 1:
            out[i] = _mutate(rng, out[i], depth + 1)
        elif choice == 2:
            out.insert(i, _random_json(rng))
        else:
            out[i] = _random_json(rng)
        return out
    return _random_json(rng)


def _fuzz_case(rng: random.Random, valid_json: dict, valid_binary: tuple[bytes, dict]):
    """One malformed (or, by chance, valid) request: (method, path, body, headers)."""
    path = rng.choice([INFER, "/v2/models/micro/infer", "/v2/models/tiny/versions/1/infer",
                       "/v2/models/tiny/detect", "/v2/models/tiny/detect?thresh=0.3",
                       f"/v2/models/{rng.choice(['tiny', 'x', '..', '%00', 'a/b'])}/infer"])
    kind = rng.randrange(7)
    headers: dict[str, str] = {}
    if kind == 0:  # random bytes
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(2000)))
    elif kind == 1:  # a mutated JSON request
        body = json.dumps(_mutate(rng, _mutate(rng, valid_json))).encode()
    elif kind == 2:  # random JSON
        body = json.dumps(_random_json(rng)).encode()
    elif kind == 3:  # a binary request cut, padded or with a wrong header length
        body, headers = valid_binary
        headers = dict(headers)
        cut = rng.randrange(len(body))
        body = rng.choice([body[:cut], body + body[:cut % 64], body])
        if rng.random() < 0.5:
            headers["Inference-Header-Content-Length"] = rng.choice(
                ["0", "-3", "1e3", str(len(body) * 2), str(rng.randrange(len(body) + 1))])
    elif kind == 4:  # a JSON request cut short
        text = json.dumps(valid_json).encode()
        body = text[:rng.randrange(len(text))]
    elif kind == 5:  # compressed garbage or compressed mutations
        raw = json.dumps(_mutate(rng, valid_json)).encode()
        encoding = rng.choice(["gzip", "deflate", "br", "identity", "gzip, deflate"])
        body = gzip.compress(raw) if rng.random() < 0.5 else raw[:200]
        headers["Content-Encoding"] = encoding
    else:  # images, broken
        png = _png(rng.randrange(1, 60), rng.randrange(1, 60))
        body = png[:rng.randrange(len(png))] if rng.random() < 0.7 else png
        path = f"/v2/models/tiny/detect?thresh={rng.choice(['0.1', '-1', 'x', '', '1'])}"
    return "POST", path, body, headers


@pytest.mark.slow
def test_a_thousand_malformed_requests_cause_no_500(limited, client):
    rng = random.Random(20261123)
    x = np.random.default_rng(1).random((1, 3, TINY_SIZE, TINY_SIZE), dtype=np.float32)
    valid_json = _request(outputs=[{"name": "yolo_16"}], parameters={"binary_data_output": True})
    valid_json["inputs"][0]["data"] = x.ravel().tolist()
    valid_binary = _binary(x)
    statuses: dict[int, int] = {}
    for i in range(1000):
        method, path, body, headers = _fuzz_case(rng, valid_json, valid_binary)
        status, _, data = client.send(method, path, body, headers)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 404, 405, 413, 415), (i, path, status, data[:300])
        if status != 200:
            message = json.loads(data)["error"]
            assert isinstance(message, str), (i, data[:300])
            # What the client sent is described by its bytes, never by a Python object's repr.
            assert "object at 0x" not in message, (i, message)
    assert limited.alive() and client.live()
    assert statuses.get(400, 0) > 500, statuses
