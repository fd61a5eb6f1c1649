"""The warm-up at load: every network instance of every served version runs one forward pass
of zeros before the server answers ready (so the first request does not pay for building the
executor); the passes and their time are in the version's statistics (``warmup``), apart from
the clients' counts, and on standard error; a network that cannot run is refused at load.

Nothing here is timed against a bound: the warm-up is checked by the passes it ran."""

import json
import urllib.request

import numpy as np
import pytest
from serve_harness import add_micro

from darknet_metal.errors import DeviceError, RepositoryError
from darknet_metal.network import Network
from darknet_metal.serving.metrics import ServingStats
from darknet_metal.serving.repository import read_repository
from darknet_metal.serving.served import load_models


@pytest.fixture()
def forwards(monkeypatch):
    """Every ``Network.forward`` call of the test: (network id, input shape, all zeros,
    outputs asked for)."""
    calls = []
    original = Network.forward

    def counting(self, x, outputs=None):
        calls.append((id(self), x.shape, not np.any(x), outputs))
        return original(self, x, outputs=outputs)

    monkeypatch.setattr(Network, "forward", counting)
    return calls


def test_each_instance_runs_one_pass_of_zeros_at_load(tmp_path, forwards):
    add_micro(tmp_path, config="max_batch_size: 4\ninstance_group [ { count: 2 } ]\n")
    lines = []
    stats = ServingStats("cpu")
    models = load_models(read_repository(tmp_path), "cpu", stats, progress=lines.append)
    try:
        served = models["micro"].latest
        c, h, w = served.network.input_shape
        # Two instances, each once, with one image of zeros and the batcher's outputs; before
        # any request (none was sent).
        assert len(forwards) == 2 and len({call[0] for call in forwards}) == 2
        for _, shape, zeros, outputs in forwards:
            assert shape == (1, c, h, w) and zeros
            assert outputs == list(served.outputs.values())
        assert served.stats.warmed_up
        entry = served.stats.statistics_json()
        assert entry["warmup"]["count"] == 2
        assert entry["warmup"]["ns"] > 0 and entry["warmup"]["seconds"] > 0
        assert entry["warmup"]["seconds"] == entry["warmup"]["ns"] / 1e9
        # The warm-up is not a client's inference: Triton's counts stay at zero.
        assert entry["inference_count"] == 0 and entry["execution_count"] == 0
        assert entry["inference_stats"]["success"]["count"] == 0
        assert any(line.startswith("model micro version 1 warmed up in ")
                   and line.endswith(f"s (a 1x{c}x{h}x{w} pass of zeros per instance)")
                   for line in lines), lines
    finally:
        for model in models.values():
            model.close()


def test_a_network_that_cannot_run_is_refused_at_load(tmp_path, monkeypatch):
    add_micro(tmp_path)

    def failing(self, x, outputs=None):
        raise DeviceError("the device went away")

    monkeypatch.setattr(Network, "forward", failing)
    with pytest.raises(RepositoryError) as caught:
        load_models(read_repository(tmp_path), "cpu", ServingStats("cpu"))
    assert caught.value.path == str(tmp_path / "micro" / "1")
    assert "the warm-up forward pass on cpu failed (DeviceError: the device went away)" \
        in str(caught.value)


def _stats(url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=60) as response:
        return json.loads(response.read())["model_stats"][0]


def _status(url: str, path: str) -> int:
    with urllib.request.urlopen(f"{url}{path}", timeout=60) as response:
        return response.status


def test_the_server_reports_the_warm_up_and_is_ready_after_it(server):
    log = server.log
    announced = log.index(" on http://")
    for name in ("tiny", "micro"):
        line = f"darknet-metal serve: model {name} version 1 warmed up in "
        assert line in log, log
        assert log.index(line) < announced, "warmed up after the address was announced"
        warmup = _stats(server.url, name)["warmup"]
        assert warmup["count"] == 1 and warmup["ns"] > 0 and warmup["seconds"] > 0
        assert _status(server.url, f"/v2/models/{name}/ready") == 200
        assert _status(server.url, f"/v2/models/{name}/versions/1/ready") == 200
    assert _status(server.url, "/v2/health/ready") == 200
