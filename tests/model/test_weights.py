"""Reading and writing .weights files: exact sizes, clear errors, atomic writes, fuzzing."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_paths import CFG_DIR, YOLOV3_TINY

import darknet_metal as dm
from darknet_metal.model.cfg import parse_cfg_text
from darknet_metal.model.weights import read_weights, weights_file_size
from darknet_metal.ops import build_layers

CFG = YOLOV3_TINY / "yolov3-tiny.cfg"
WEIGHTS = YOLOV3_TINY / "yolov3-tiny.weights"

SMALL_CFG = """
[net]
width=8
height=8
channels=3

[convolutional]
batch_normalize=1
filters=4
size=3
stride=1
pad=1
activation=leaky

[convolutional]
filters=4
size=1
stride=1
activation=linear

[shortcut]
from=-2
weights_type=per_channel
activation=linear

[connected]
output=5
activation=relu
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    cfg = d / "small.cfg"
    cfg.write_text(SMALL_CFG)
    return cfg


def test_yolov3_tiny_size_is_exact():
    specs = build_layers(parse_cfg_text(CFG.read_text(), str(CFG)))
    assert weights_file_size(specs) == os.path.getsize(WEIGHTS) == 35434956


def test_header_and_seen_are_read():
    specs = build_layers(parse_cfg_text(CFG.read_text(), str(CFG)))
    header, params = read_weights(WEIGHTS, specs)
    raw = np.fromfile(WEIGHTS, "<i4", 3)
    assert (header.major, header.minor, header.revision) == tuple(raw)
    assert header.seen == int(np.fromfile(WEIGHTS, "<u8", 1, offset=12)[0])
    # First array of the file: biases of layer 0 (16 filters) right after the 20-byte header.
    np.testing.assert_array_equal(params[0]["biases"], np.fromfile(WEIGHTS, "<f4", 16, offset=20))


def test_layout_of_every_parameter_kind(small, tmp_path):
    """Write arrays 0, 1, 2, ... and check each lands where Darknet's order puts it."""
    net = dm.load(small)
    total = (weights_file_size(net.layers) - 20) // 4
    path = tmp_path / "ramp.weights"
    with open(path, "wb") as f:
        f.write(np.array([0, 2, 0], "<i4").tobytes() + np.array([77], "<u8").tobytes())
        f.write(np.arange(total, dtype="<f4").tobytes())
    net = dm.load(small, path)
    p = net.params
    # conv 0: biases[4], scales[4], mean[4], var[4], weights[4*27]
    np.testing.assert_array_equal(p[0]["biases"], [0, 1, 2, 3])
    np.testing.assert_array_equal(p[0]["scales"], [4, 5, 6, 7])
    np.testing.assert_array_equal(p[0]["rolling_variance"], [12, 13, 14, 15])
    assert p[0]["weights"].shape == (4, 27) and p[0]["weights"][1, 0] == 16 + 27
    # conv 1 (no BN): biases[4], weights[4*4]
    start = 16 + 108
    np.testing.assert_array_equal(p[1]["biases"], np.arange(start, start + 4))
    # shortcut per_channel: (2 inputs) x 4 channels
    start += 4 + 16
    np.testing.assert_array_equal(p[2]["weights"].ravel(), np.arange(start, start + 8))
    # connected: biases[5], weights[5*256] (no BN)
    start += 8
    np.testing.assert_array_equal(p[3]["biases"], np.arange(start, start + 5))
    assert p[3]["weights"][0, 0] == start + 5 and p[3]["weights"].shape == (5, 256)
    assert net.header.seen == 77


def test_old_header_with_32bit_seen(small, tmp_path):
    net = dm.load(small, seed=1)
    new = tmp_path / "new.weights"
    net.save_weights(new)
    body = new.read_bytes()[20:]
    old = tmp_path / "old.weights"
    old.write_bytes(np.array([0, 1, 0, 5], "<i4").tobytes() + body)
    again = dm.load(small, old)
    assert again.header.seen == 5
    for i in net.params:
        for name in net.params[i]:
            np.testing.assert_array_equal(again.params[i][name], net.params[i][name])


@pytest.mark.parametrize("cut", [1, 4, 1000, 35434956 - 21])
def test_truncated_file_names_the_layer(tmp_path, cut):
    path = tmp_path / "short.weights"
    path.write_bytes(WEIGHTS.read_bytes()[:-cut])
    with pytest.raises(dm.WeightsError, match=r"short\.weights: layer \d+: file ends inside") as e:
        dm.load(CFG, path)
    assert e.value.layer is not None


def test_extended_file_is_rejected(tmp_path):
    path = tmp_path / "long.weights"
    path.write_bytes(WEIGHTS.read_bytes() + b"\0" * 8)
    with pytest.raises(dm.WeightsError, match="8 bytes left after the last layer"):
        dm.load(CFG, path)


def test_garbage_and_missing_files(tmp_path):
    garbage = tmp_path / "garbage.weights"
    garbage.write_bytes(b"GIF89a" + bytes(range(256)) * 10)
    with pytest.raises(dm.WeightsError, match="not a Darknet weights header"):
        dm.load(CFG, garbage)
    with pytest.raises(dm.WeightsError, match="cannot read"):
        dm.load(CFG, tmp_path / "missing.weights")
    empty = tmp_path / "empty.weights"
    empty.write_bytes(b"")
    with pytest.raises(dm.WeightsError, match="too short"):
        dm.load(CFG, empty)


def test_non_finite_and_negative_variance(small, tmp_path):
    net = dm.load(small, seed=2)
    path = tmp_path / "w.weights"
    net.save_weights(path)
    data = bytearray(path.read_bytes())
    nan_at = 20 + 4 * 2  # layer 0 bias 2
    data[nan_at:nan_at + 4] = np.array([np.nan], "<f4").tobytes()
    bad = tmp_path / "nan.weights"
    bad.write_bytes(bytes(data))
    with pytest.raises(dm.WeightsError, match="layer 0: convolutional 'biases' holds NaN"):
        dm.load(small, bad)
    data = bytearray(path.read_bytes())
    var_at = 20 + 4 * 12
    data[var_at:var_at + 4] = np.array([-1.0], "<f4").tobytes()
    bad.write_bytes(bytes(data))
    with pytest.raises(dm.WeightsError, match="negative"):
        dm.load(small, bad)


def test_wrong_cfg_for_the_weights(tmp_path):
    with pytest.raises(dm.WeightsError, match="is this the cfg these weights were trained"):
        dm.load(CFG_DIR / "yolov4-tiny.cfg", WEIGHTS)


def test_save_is_atomic_and_replaces(small, tmp_path):
    net = dm.load(small, seed=3)
    path = tmp_path / "out.weights"
    path.write_bytes(b"old contents")
    net.save_weights(path)
    assert path.stat().st_size == weights_file_size(net.layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.weights"]
    with pytest.raises(OSError):
        net.save_weights(tmp_path / "no-such-dir" / "x.weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.weights"]


def test_seeded_init_is_reproducible_and_darknet_scaled(small):
    a, b, c = dm.load(small, seed=5), dm.load(small, seed=5), dm.load(small, seed=6)
    np.testing.assert_array_equal(a.params[0]["weights"], b.params[0]["weights"])
    assert not np.array_equal(a.params[0]["weights"], c.params[0]["weights"])
    # Darknet: U(-s, s) with s = sqrt(2 / (size*size*c)) = sqrt(2/27) for layer 0.
    w = a.params[0]["weights"]
    assert np.abs(w).max() <= np.sqrt(2 / 27) and np.abs(w).max() > 0.9 * np.sqrt(2 / 27)
    np.testing.assert_array_equal(a.params[0]["scales"], 1.0)
    np.testing.assert_array_equal(a.params[2]["weights"], 1.0)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), keep=st.integers(0, 3000))
def test_fuzz_loader_raises_only_weights_error(small, tmp_path, data, keep):
    net = dm.load(small, seed=0)
    good = tmp_path / "good.weights"
    if not good.exists():
        net.save_weights(good)
    blob = good.read_bytes()
    path = tmp_path / "fuzz.weights"
    # Half the cases: a real file with a tail replaced; the rest: arbitrary bytes.
    path.write_bytes(blob[:keep] + data if keep % 2 else data)
    try:
        loaded = dm.load(small, path)
    except dm.WeightsError:
        return
    assert path.stat().st_size == weights_file_size(loaded.layers, loaded.header)


# -- backbones: the first layers of a file (Darknet's partial and load_weights_upto) --------


def test_partial_writes_the_first_layers_of_the_real_file(tmp_path):
    from darknet_metal.cli import main

    out = tmp_path / "yolov3-tiny.conv.15"
    assert main(["partial", str(CFG), str(WEIGHTS), str(out), "15"]) == 0
    full, cut = WEIGHTS.read_bytes(), out.read_bytes()
    # The arrays are the real file's first bytes after the header, byte for byte; the
    # header is version 0.2.0 with seen = 0 (Darknet's partial resets it).
    assert len(cut) < len(full)
    assert cut[20:] == full[20:len(cut)]
    assert np.frombuffer(cut[:20], "<i4", 3).tolist() == [0, 2, 0]
    assert np.frombuffer(cut[12:20], "<u8")[0] == 0
    # 15 layers of yolov3-tiny: 9 convolutions (layers 0-14 alternate conv and maxpool, then
    # 12-14 are convolutions) with batch norm: biases, scales, mean, variance, weights.
    specs = build_layers(parse_cfg_text(CFG.read_text()))
    conv = [s for s in specs[:15] if s.param_shapes]
    assert [s.index for s in conv] == [0, 2, 4, 6, 8, 10, 12, 13, 14]
    floats = sum(4 * s.values["filters"] + s.values["filters"] * s.in_shape[0]
                 * s.values["size"] ** 2 for s in conv)
    assert len(cut) == 20 + 4 * floats
    assert not list(tmp_path.glob(".*.tmp"))


def test_training_from_a_backbone_loads_it_and_initialises_the_rest(tmp_path):
    out = tmp_path / "yolov3-tiny.conv.15"
    dm.load(CFG, WEIGHTS)  # the full file reads
    from darknet_metal.cli import main

    assert main(["partial", str(CFG), str(WEIGHTS), str(out), "15"]) == 0
    with pytest.raises(dm.WeightsError, match=r"layer 15: .*partial=True"):
        dm.load(CFG, out)
    full = dm.load(CFG, WEIGHTS)
    net = dm.load(CFG, out, partial=True, seed=3)
    fresh = dm.load(CFG, seed=3)
    coverage = net.weights_coverage
    assert coverage.loaded == [0, 2, 4, 6, 8, 10, 12, 13, 14]
    assert coverage.initialised == [15, 18, 21, 22]
    assert "loaded the parameters of 9 layers (0, 2, 4, 6, 8, 10, 12-14), initialised 4 " \
           "(15, 18, 21-22)" in coverage.describe()
    for i, params in net.params.items():
        want = full.params[i] if i < 15 else fresh.params[i]
        for name, a in params.items():
            np.testing.assert_array_equal(a, want[name], err_msg=f"{i} {name}")
    # A whole file loaded with partial=True: nothing initialised, no coverage to report.
    assert dm.load(CFG, WEIGHTS, partial=True).weights_coverage is None


@pytest.mark.parametrize("where", ["inside an array", "between arrays of a layer"])
def test_a_backbone_cut_inside_a_layer_names_it(tmp_path, where):
    specs = build_layers(parse_cfg_text(CFG.read_text()))
    end = 20 + 4 * sum(int(np.prod(shape)) for s in specs[:4] for _, shape in
                       s.stored_params())
    # Layer 4 stores biases, scales, rolling mean and variance (16 floats each), weights.
    cut = end + (4 * 10 if where == "inside an array" else 4 * 16)
    path = tmp_path / "cut.weights"
    path.write_bytes(WEIGHTS.read_bytes()[:cut])
    with pytest.raises(dm.WeightsError, match="layer 4: file ends inside convolutional"):
        dm.load(CFG, path, partial=True)


def test_partial_errors(tmp_path, capsys):
    from darknet_metal.cli import main

    out = tmp_path / "x.weights"
    assert main(["partial", str(CFG), str(WEIGHTS), str(out), "25"]) == 1
    assert "layer count must be in [1, 24]" in capsys.readouterr().err
    short = tmp_path / "short.weights"
    short.write_bytes(WEIGHTS.read_bytes()[:1000])
    assert main(["partial", str(CFG), str(short), str(out), "15"]) == 1
    assert "short.weights: layer 0: file ends inside" in capsys.readouterr().err
    assert main(["partial", str(CFG), str(WEIGHTS), str(out), "0"]) == 1
    assert "N (how many layers to keep): must be at least 1" in capsys.readouterr().err
    header = tmp_path / "header.weights"
    header.write_bytes(WEIGHTS.read_bytes()[:20])
    with pytest.raises(dm.WeightsError, match="holds no layer's parameters"):
        dm.load(CFG, header, partial=True)
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_whole_weights_of_another_head_are_refused_with_the_way_out(tmp_path):
    # The COCO weights for a 3-class yolov3-tiny: the heads differ, so the file holds more
    # than this network's layers; Darknet would read on, misaligned. The message points to
    # partial.
    text = CFG.read_text().replace("classes=80", "classes=3").replace("filters=255",
                                                                       "filters=24")
    cfg = tmp_path / "three.cfg"
    cfg.write_text(text)
    with pytest.raises(dm.WeightsError, match="darknet-metal partial"):
        dm.load(cfg, WEIGHTS, partial=True)
