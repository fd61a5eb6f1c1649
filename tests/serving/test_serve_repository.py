"""Reading a model repository: configs parsed by protobuf's text parser, completed from the
cfg where they leave inputs and outputs out, and every fault a RepositoryError naming the
file and the field."""

import pytest
from serve_harness import TINY_SIZE, add_micro, add_tiny

import darknet_metal as dm
from darknet_metal.errors import CfgError, RepositoryError
from darknet_metal.serving.metrics import ServingStats
from darknet_metal.serving.model_config import config_json
from darknet_metal.serving.repository import complete_config, read_repository
from darknet_metal.serving.served import load_models


def _load(repo):
    return load_models(read_repository(repo), "cpu", ServingStats("cpu"))


def _complete(repo):
    """Read ``repo`` and complete each config from its latest version, as serving does."""
    sources = read_repository(repo)
    for source in sources:
        for files in reversed(source.versions):
            complete_config(source, dm.load(files.cfg, files.weights), files)
    return {source.name: source for source in sources}


def test_a_config_without_inputs_and_outputs_is_completed_from_the_cfg(tmp_path):
    add_tiny(tmp_path, config="max_batch_size: 2\n")
    add_micro(tmp_path, config=None)  # no config.pbtxt at all
    sources = _complete(tmp_path)
    tiny = config_json(sources["tiny"].config)
    assert tiny["name"] == "tiny" and tiny["max_batch_size"] == 2
    assert [(t["name"], t["data_type"], t["format"], t["dims"]) for t in tiny["input"]] == [
        ("images", "TYPE_FP32", "FORMAT_NCHW", [3, TINY_SIZE, TINY_SIZE])]
    assert [(t["name"], t["dims"]) for t in tiny["output"]] == [
        ("yolo_16", [255, 2, 2]), ("yolo_23", [255, 4, 4])]
    micro = config_json(sources["micro"].config)
    # Without max_batch_size the request's batch is part of the shape (-1: any).
    assert micro["max_batch_size"] == 0
    assert micro["input"][0]["dims"] == [-1, 3, 128, 128]
    assert sources["micro"].queue_delay_us is None and sources["micro"].instance_count == 1


def test_a_complete_consistent_config_is_taken_as_written(tmp_path):
    add_tiny(tmp_path, config=f"""
name: "tiny"
backend: "darknet"
max_batch_size: 4
input [ {{ name: "images" data_type: TYPE_FP32 format: FORMAT_NCHW
          dims: [ 3, {TINY_SIZE}, {TINY_SIZE} ] }} ]
output [ {{ name: "yolo_23" data_type: TYPE_FP32 dims: [ 255, 4, 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 preferred_batch_size: [ 2, 4 ] }}
instance_group [ {{ count: 2 kind: KIND_CPU }}, {{ count: 1 }} ]
version_policy {{ all {{ }} }}
parameters {{ key: "thresh" value {{ string_value: "0.4" }} }}
""")
    add_tiny(tmp_path, config=None, version=3)
    tiny = _complete(tmp_path)["tiny"]
    assert [out.name for out in tiny.config.output] == ["yolo_23"]
    assert tiny.queue_delay_us == 500 and tiny.preferred_batch_sizes == (2, 4)
    assert tiny.instance_count == 3
    assert [v.version for v in tiny.versions] == [1, 3]
    assert tiny.parameter("thresh") == "0.4" and tiny.parameter("nms") is None


def test_the_latest_version_is_served_by_default(tmp_path):
    for version in (1, 2, 10):
        add_tiny(tmp_path, config=None if version > 1 else "max_batch_size: 1\n",
                 version=version)
    (tmp_path / "tiny" / "notes").mkdir()  # not a version: ignored
    (tmp_path / "tiny" / "010").mkdir()  # a leading zero: not a version either
    [source] = read_repository(tmp_path)
    assert [v.version for v in source.versions] == [10]
    (tmp_path / "tiny" / "config.pbtxt").write_text(
        "version_policy { latest { num_versions: 2 } }")
    assert [v.version for v in read_repository(tmp_path)[0].versions] == [2, 10]
    (tmp_path / "tiny" / "config.pbtxt").write_text(
        "version_policy { specific { versions: [1, 2] } }")
    assert [v.version for v in read_repository(tmp_path)[0].versions] == [1, 2]


def test_models_load_with_their_instances(tmp_path):
    add_tiny(tmp_path, config="instance_group [ { count: 2 } ]\nmax_batch_size: 2\n")
    models = _load(tmp_path)
    try:
        version = models["tiny"].latest
        assert len(version.batcher._threads) == 2
        assert version.outputs == {"yolo_16": 16, "yolo_23": 23}
    finally:
        for model in models.values():
            model.close()


def _error(tmp_path, config: str | None = None, *, setup=None) -> RepositoryError:
    if setup is None:
        add_tiny(tmp_path, config=config)
    else:
        setup(tmp_path)
    with pytest.raises(RepositoryError) as caught:
        _complete(tmp_path)
    return caught.value


@pytest.mark.parametrize("config, field, words", [
    ('name: "other"', "name", "differs from the model's folder name 'tiny'"),
    ('backend: "onnxruntime"', "backend", "runs Darknet networks"),
    ("max_batch_size: -1", "max_batch_size", "outside 0..256"),
    ("dynamic_batching { }", "dynamic_batching", "needs max_batch_size above 0"),
    ("max_batch_size: 4 dynamic_batching { preferred_batch_size: [8] }",
     "dynamic_batching.preferred_batch_size[0]", "8 is outside 1..max_batch_size (4)"),
    ("max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 99999999 }",
     "dynamic_batching.max_queue_delay_microseconds", "outside"),
    ("instance_group [ { count: 20 } ]", "instance_group", "20 instances"),
    ('parameters { key: "colour" value { string_value: "red" } }', "parameters[colour]",
     "unknown parameter"),
    ('parameters { key: "precision" value { string_value: "fp8" } }',
     "parameters[precision]", "'fp8'"),
    ('parameters { key: "thresh" value { string_value: "2" } }', "parameters[thresh]",
     "a number in [0, 1]"),
    ("sequence_batching { }", "sequence_batching", "not supported"),
    ("version_policy { specific { versions: [4] } }", "version_policy.specific.versions",
     "[4] have no folder"),
    ("version_policy { latest { num_versions: 0 } }",
     "version_policy.latest.num_versions", "at least 1"),
    ('max_batch_size: 1 input [ { name: "x" data_type: TYPE_FP32 dims: [3, 64, 64] } ]',
     "input[0].name", "'x': the input is named 'images'"),
    ('max_batch_size: 1 input [ { name: "images" data_type: TYPE_UINT8 dims: [3, 64, 64] } ]',
     "input[0].data_type", "TYPE_FP32"),
    ('max_batch_size: 1 input [ { name: "images" data_type: TYPE_FP32 dims: [3, 416, 416] } ]',
     "input[0].dims", "[3, 416, 416] contradicts the network, which takes [3, 64, 64]"),
    ('max_batch_size: 1 input [ { name: "images" data_type: TYPE_FP32 format: FORMAT_NHWC '
     'dims: [3, 64, 64] } ]',
     "input[0].format", "FORMAT_NCHW"),
    ('max_batch_size: 1 output [ { name: "yolo_3" data_type: TYPE_FP32 dims: [255, 2, 2] } ]',
     "output[0].name", "'yolo_3' is not one of the network's outputs (yolo_16, yolo_23)"),
    ('max_batch_size: 1 output [ { name: "yolo_16" data_type: TYPE_FP32 dims: [85, 2, 2] } ]',
     "output[0].dims", "[85, 2, 2] contradicts the network's [255, 2, 2]"),
    ('max_batch_size: 1 output [ { name: "yolo_16" data_type: TYPE_FP32 dims: [255, 2, 2] }, '
     '{ name: "yolo_16" data_type: TYPE_FP32 dims: [255, 2, 2] } ]',
     "output[1].name", "listed twice"),
])
def test_a_config_fault_names_the_file_and_field(tmp_path, config, field, words):
    error = _error(tmp_path, config)
    assert error.path == str(tmp_path / "tiny" / "config.pbtxt")
    assert error.field == field
    assert words in str(error)
    assert f"field '{field}'" in str(error)


def test_a_contradiction_names_the_cfg_it_contradicts(tmp_path):
    error = _error(tmp_path, 'input [ { name: "images" data_type: TYPE_FP32 dims: [3, 64, 64] } ]')
    assert str(tmp_path / "tiny" / "1" / "yolov3-tiny.cfg") in str(error)
    # Without max_batch_size the dims hold the batch too, and the message says so.
    assert "without max_batch_size the dims include the batch" in str(error)


def test_an_older_version_contradicting_the_completed_config(tmp_path):
    def setup(repo):
        add_tiny(repo, config="version_policy { all { } }", version=1, size=96)
        add_tiny(repo, config=None, version=2)
    error = _error(tmp_path, setup=setup)
    assert error.field == "input[0].dims"
    assert str(tmp_path / "tiny" / "1" / "yolov3-tiny.cfg") in str(error)


@pytest.mark.parametrize("text, line, words", [
    ("max_batch_size: 2\nbogus: 3\n", 2, 'no field named "bogus"'),
    ('max_batch_size: "two"\n', 1, "Couldn't parse integer"),
    ("dynamic_batching {\n", None, "Expected"),
])
def test_a_malformed_config_names_the_line(tmp_path, text, line, words):
    error = _error(tmp_path, text)
    assert error.path == str(tmp_path / "tiny" / "config.pbtxt")
    assert error.line == line or line is None
    assert words in str(error)


def test_a_config_that_is_not_text(tmp_path):
    add_tiny(tmp_path, config=None)
    (tmp_path / "tiny" / "config.pbtxt").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(RepositoryError, match="not UTF-8"):
        read_repository(tmp_path)


def test_repository_faults_name_the_folder(tmp_path):
    with pytest.raises(RepositoryError, match="model repository not found"):
        read_repository(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RepositoryError, match="is a folder"):
        read_repository(tmp_path / "file")
    with pytest.raises(RepositoryError, match="no models"):
        read_repository(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RepositoryError, match="not a model") as caught:
        read_repository(tmp_path)
    assert caught.value.path == str(tmp_path / "empty")


def test_version_folder_faults(tmp_path):
    folder = add_tiny(tmp_path, config="max_batch_size: 1\n")
    (folder / "yolov3-tiny.weights").unlink()
    with pytest.raises(RepositoryError, match="no .weights files") as caught:
        read_repository(tmp_path)
    assert caught.value.path == str(folder)
    (folder / "a.weights").write_bytes(b"")
    (folder / "b.weights").write_bytes(b"")
    with pytest.raises(RepositoryError, match=r"2 \(a.weights, b.weights\) .weights files"):
        read_repository(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.pbtxt").write_text("max_batch_size: 1\n")
    with pytest.raises(RepositoryError, match="no version folder"):
        read_repository(tmp_path / ".." / tmp_path.name)


def test_bad_network_files_name_the_file(tmp_path):
    folder = add_tiny(tmp_path, config="max_batch_size: 1\n")
    (folder / "yolov3-tiny.cfg").write_text("[net]\nwidth=64\nheight=64\n[bogus]\n")
    with pytest.raises(CfgError) as caught:
        _load(tmp_path)
    assert str(folder / "yolov3-tiny.cfg") in str(caught.value)


def test_fp16_refused_on_the_cpu_names_the_parameter(tmp_path):
    add_tiny(tmp_path, config='parameters { key: "precision" value { string_value: "fp16" } }')
    with pytest.raises(RepositoryError) as caught:
        _load(tmp_path)
    assert caught.value.field == "parameters[precision]"
