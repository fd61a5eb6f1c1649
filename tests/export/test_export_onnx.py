"""ONNX export, judged by ONNX Runtime's CPU provider (and OpenCV's importer) against
``forward``: the bundled networks, a cfg per layer kind and per activation, batch 1 and a
dynamic batch of 3, float32 and fp16; the decoded boxes against ``decode_yolo``; refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from shared_paths import CFG_DIR, IMAGES, YOLOV3_TINY

import darknet_metal as dm
from darknet_metal.errors import ArgumentError, ExportError
from darknet_metal.inference.boxes import decode_yolo
from darknet_metal.inference.image import load_image, resize_image
from darknet_metal.model.activations import ACTIVATIONS

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def run_onnx(path, x: np.ndarray) -> dict[str, np.ndarray]:
    """The model's outputs by name, run by ONNX Runtime's CPU provider."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"input": x}), strict=True))


def assert_close(got: np.ndarray, want: np.ndarray, label: str) -> None:
    """Within 1e-4 x max|want| + 1e-5 everywhere."""
    assert got.shape == want.shape, (label, got.shape, want.shape)
    bound = 1e-4 * float(np.abs(want).max()) + 1e-5
    worst = float(np.abs(got.astype(np.float64) - want).max())
    assert worst <= bound, (label, worst, bound)


def raw_names(net) -> list[str]:
    heads = net.yolo_layers
    return [f"yolo_{i}" for i in heads] if heads else ["output"]


def check_export(net, tmp_path, batch, x: np.ndarray, label: str) -> None:
    path = tmp_path / f"{label}.onnx"
    net.export_onnx(path, batch=batch)
    got = run_onnx(path, x)
    for name, want in zip(raw_names(net), net.forward(x), strict=True):
        assert_close(got[name], want, f"{label} {name}")


def images(shape, count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((count, *shape), dtype=np.float32)


# -- the bundled networks ----------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    """yolov3-tiny with its real weights at 416; the others from a seed, at 160 (yolov3,
    yolov4) or 416 (yolov4-tiny) to keep the runtimes short."""
    nets = {"yolov3-tiny": dm.load(YOLOV3_TINY / "yolov3-tiny.cfg",
                                   YOLOV3_TINY / "yolov3-tiny.weights",
                                   names=YOLOV3_TINY / "coco.names")}
    for name, size in (("yolov4-tiny", 416), ("yolov3", 160), ("yolov4", 160)):
        nets[name] = dm.load(CFG_DIR / f"{name}.cfg", seed=5, input_size=(size, size))
    return nets


@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny", "yolov3", "yolov4"])
@pytest.mark.parametrize("batch", [1, "dynamic"])
def test_bundled_networks_agree_with_forward(bundled, tmp_path, name, batch):
    net = bundled[name]
    x = images(net.input_shape, 1 if batch == 1 else 3)
    check_export(net, tmp_path, batch, x, f"{name}-{batch}")


def test_a_dynamic_batch_takes_any_batch(bundled, tmp_path):
    net = bundled["yolov4-tiny"]
    path = tmp_path / "dynamic.onnx"
    net.export_onnx(path, batch="dynamic")
    for count in (1, 2):
        x = images(net.input_shape, count, seed=count)
        got = run_onnx(path, x)
        for name, want in zip(raw_names(net), net.forward(x), strict=True):
            assert_close(got[name], want, f"batch {count} {name}")


def test_a_fixed_batch_is_declared_in_the_model(bundled, tmp_path):
    net = bundled["yolov3-tiny"]
    path = tmp_path / "b2.onnx"
    net.export_onnx(path, batch=2)
    model = onnx.load(str(path))
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [2, 3, 416, 416]
    with pytest.raises(Exception, match="(?i)dimension|shape|index"):
        run_onnx(path, images(net.input_shape, 3))


@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny"])
def test_fp16_within_the_fp16_kernels_bound(bundled, tmp_path, name):
    # The fp16 kernels' bound: each output within 1e-2 (relative L2) of float32.
    net = bundled[name]
    path = tmp_path / "half.onnx"
    net.export_onnx(path, fp16=True)
    model = onnx.load(str(path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    x = images(net.input_shape, 1)
    got = run_onnx(path, x.astype(np.float16))
    for out_name, want in zip(raw_names(net), net.forward(x), strict=True):
        half = got[out_name]
        assert half.dtype == np.float16
        error = np.linalg.norm(half.astype(np.float64) - want) / np.linalg.norm(want)
        assert error <= 1e-2, (name, out_name, error)


def test_boxes_are_decode_yolos_candidates(bundled, tmp_path):
    net = bundled["yolov3-tiny"]
    _, h, w = net.input_shape
    x = resize_image(load_image(IMAGES / "dog.jpg"), w, h)[None]
    path = tmp_path / "boxes.onnx"
    net.export_onnx(path, outputs="boxes")
    got = run_onnx(path, x)
    raw = net.forward(x)
    for name, want in zip(raw_names(net), raw, strict=True):
        assert_close(got[name], want, name)
    boxes, objectness, probs = [], [], []
    for out, op in zip(raw, (net.layers[i] for i in net.yolo_layers), strict=True):
        b, o, p = decode_yolo(out[0], op.detection_head, w, h, w, h, thresh=0.0,
                              letterbox=False)
        boxes.append(b)
        objectness.append(o)
        probs.append(p)
    want_boxes = np.concatenate(boxes)
    # Every cell is a candidate at thresh 0 (no objectness underflows to 0 here).
    assert got["boxes"].shape == (1, len(want_boxes), 4)
    assert_close(got["boxes"][0], want_boxes, "boxes")
    assert_close(got["objectness"][0], np.concatenate(objectness), "objectness")
    want_probs = np.concatenate(probs)
    confs = got["confs"][0]
    kept = want_probs > 0
    assert_close(np.where(kept, confs, 0), want_probs, "confs")
    assert np.all(np.abs(confs[~kept]) <= 1e-5)  # decode drops only those at or under 0
    # The dog image's strongest candidates are the golden detections' classes.
    top = set(np.argmax(confs[np.argsort(-confs.max(axis=1))[:20]], axis=1).tolist())
    assert {1, 16} <= top  # bicycle, dog


def test_metadata_names_classes_heads_and_input(bundled, tmp_path):
    net = bundled["yolov3-tiny"]
    path = tmp_path / "meta.onnx"
    net.export_onnx(path, outputs="boxes")
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(props["darknet_metal.classes"])[16] == "dog"
    heads = json.loads(props["darknet_metal.heads"])
    assert [h["mask"] for h in heads] == [[3, 4, 5], [0, 1, 2]]
    assert heads[0]["anchors"][0] == [10, 14] and heads[0]["output"] == "yolo_16"
    shown = json.loads(props["darknet_metal.input"])
    assert (shown["height"], shown["width"], shown["color"]) == (416, 416, "RGB")
    assert set(json.loads(props["darknet_metal.outputs"])) == {"yolo_16", "yolo_23", "boxes",
                                                               "confs", "objectness"}


def test_opencv_runs_the_yolov4_tiny_export(bundled, tmp_path):
    cv2 = pytest.importorskip("cv2")
    net = bundled["yolov4-tiny"]
    path = tmp_path / "cv.onnx"
    net.export_onnx(path)
    reader = cv2.dnn.readNetFromONNX(str(path))
    x = images(net.input_shape, 1)
    reader.setInput(x)
    names = list(reader.getUnconnectedOutLayersNames())
    outs = dict(zip(names, reader.forward(names), strict=True))
    for name, want in zip(raw_names(net), net.forward(x), strict=True):
        assert_close(outs[name], want, f"opencv {name}")


# -- a cfg per layer kind and per activation ------------------------------------------------

NET = "[net]\nwidth={w}\nheight={h}\nchannels={c}\n"


def conv(filters: int, size: int = 3, stride: int = 1, act: str = "leaky", bn: int = 1,
         **more: int) -> str:
    extra = "".join(f"{k}={v}\n" for k, v in more.items())
    return (f"[convolutional]\nbatch_normalize={bn}\nfilters={filters}\nsize={size}\n"
            f"stride={stride}\npad=1\nactivation={act}\n{extra}")


CASES = {
    "conv-groups-dilation": NET.format(w=24, h=20, c=4) + conv(8, groups=2) + conv(
        6, dilation=2, bn=0) + conv(6, size=3, stride_x=2, stride_y=1, act="mish"),
    "maxpool": NET.format(w=26, h=26, c=3) + conv(8) + "[maxpool]\nsize=2\nstride=1\n"
    + "[maxpool]\nsize=3\nstride=2\n" + "[maxpool]\nsize=2\nstride=2\n",
    "maxpool-depth": NET.format(w=10, h=10, c=3) + conv(7)
    + "[maxpool]\nmaxpool_depth=1\nout_channels=3\n",
    "avgpool-connected-softmax": NET.format(w=12, h=12, c=3) + conv(8)
    + "[avgpool]\n" + "[connected]\noutput=10\nactivation=leaky\nbatch_normalize=1\n"
    + "[connected]\noutput=12\nactivation=linear\n" + "[dropout]\nprobability=0.3\n"
    + "[softmax]\ngroups=2\ntemperature=2\n" + "[cost]\n",
    "route-groups": NET.format(w=16, h=16, c=3) + conv(8) + conv(4)
    + "[route]\nlayers=-1,-2\n" + "[route]\nlayers=-1\ngroups=2\ngroup_id=1\n"
    + "[route]\nlayers=-2,-4\ngroups=4\ngroup_id=3\n",
    "shortcut": NET.format(w=16, h=16, c=3) + conv(8) + conv(8)
    + "[shortcut]\nfrom=-2\nactivation=linear\n" + conv(4)
    + "[shortcut]\nfrom=-3,-4\nactivation=leaky\n" + conv(8)
    + "[shortcut]\nfrom=-2,-3\nweights_type=per_feature\nweights_normalization=relu\n"
    + "[shortcut]\nfrom=-4\nweights_type=per_channel\nweights_normalization=softmax\n"
    + "activation=swish\n",
    "upsample": NET.format(w=8, h=8, c=3) + conv(4) + "[upsample]\nstride=2\n"
    + "[upsample]\nstride=2\nscale=0.5\n" + "[upsample]\nstride=-4\n",
    "reorg": NET.format(w=8, h=8, c=3) + conv(8) + "[reorg]\nstride=2\n"
    + "[reorg]\nstride=2\nreverse=1\n" + "[reorg3d]\nstride=2\n"
    + "[reorg3d]\nstride=2\nreverse=1\n",
    "scale-channels-sam": NET.format(w=12, h=12, c=3) + conv(8) + "[avgpool]\n"
    + conv(8, size=1, act="logistic", bn=0) + "[scale_channels]\nfrom=-3\n"
    + conv(8, act="logistic") + "[sam]\nfrom=-2\n" + conv(1, size=1, act="logistic")
    + "[scale_channels]\nfrom=-2\nscale_wh=1\n",
    "yolo": NET.format(w=64, h=64, c=3) + conv(16) + conv(21, size=1, act="linear", bn=0)
    + "[yolo]\nmask=0,1,2\nanchors=10,14,23,27,37,58\nclasses=2\nnum=3\nscale_x_y=1.05\n"
    + conv(21, size=1, act="logistic", bn=0, stride=2)
    + "[yolo]\nmask=0,1,2\nanchors=10,14,23,27,37,58\nclasses=2\nnum=3\nnew_coords=1\n"
    + "scale_x_y=2.0\n",
}


@pytest.mark.parametrize("batch", [1, "dynamic"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layer_kind_agrees_with_forward(tmp_path, case, batch):
    cfg = tmp_path / f"{case}.cfg"
    cfg.write_text(CASES[case])
    net = dm.load(cfg, seed=7)
    x = images(net.input_shape, 1 if batch == 1 else 3, seed=2) * 2 - 0.5
    check_export(net, tmp_path, batch, x, case)


@pytest.mark.parametrize("batch", [1, "dynamic"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_each_activation_agrees_with_forward(tmp_path, act, batch):
    cfg = tmp_path / f"{act}.cfg"
    cfg.write_text(NET.format(w=12, h=12, c=3) + conv(8, act=act, bn=1)
                   + conv(8, act=act, bn=0) + "[connected]\noutput=6\nactivation="
                   + act + "\n")
    net = dm.load(cfg, seed=3)
    # Inputs across every branch of the piecewise activations.
    x = (images(net.input_shape, 1 if batch == 1 else 3, seed=4) - 0.5) * 24
    check_export(net, tmp_path, batch, x, act)


@pytest.mark.parametrize("act", ["mish", "normalize_channels_softmax_maxval"])
def test_the_opset_18_forms_agree_with_forward(tmp_path, act):
    # Opset 18 has Mish, and takes ReduceMax's axes as an input.
    cfg = tmp_path / f"{act}.cfg"
    cfg.write_text(NET.format(w=10, h=10, c=3) + conv(7, act=act)
                   + "[maxpool]\nmaxpool_depth=1\nout_channels=3\n")
    net = dm.load(cfg, seed=3)
    path = tmp_path / "18.onnx"
    net.export_onnx(path, batch="dynamic", opset=18)
    assert onnx.load(str(path)).opset_import[0].version == 18
    x = (images(net.input_shape, 2, seed=4) - 0.5) * 24
    got = run_onnx(path, x)
    assert_close(got["output"], net.forward(x)[0], act)


# -- refusals and options --------------------------------------------------------------------


def test_heads_of_different_classes_are_refused_by_layer_and_nothing_is_written(tmp_path):
    cfg = tmp_path / "heads.cfg"
    cfg.write_text(CASES["yolo"].replace(
        "[convolutional]\nbatch_normalize=0\nfilters=21\nsize=1\nstride=2",
        "[convolutional]\nbatch_normalize=0\nfilters=18\nsize=1\nstride=2").replace(
        "classes=2\nnum=3\nnew_coords=1", "classes=1\nnum=3\nnew_coords=1"))
    net = dm.load(cfg, seed=1)
    out = tmp_path / "refused.onnx"
    with pytest.raises(ExportError, match=r"layer 4 \(yolo\).*classes=2, not 1") as e:
        net.export_onnx(out, outputs="boxes")
    assert (e.value.layer, e.value.kind) == (4, "yolo")
    assert list(tmp_path.iterdir()) == [cfg]
    net.export_onnx(out)  # the raw outputs need no common classes
    assert out.exists()


def test_boxes_need_yolo_layers(tmp_path):
    cfg = tmp_path / "classifier.cfg"
    cfg.write_text(CASES["avgpool-connected-softmax"])
    net = dm.load(cfg, seed=1)
    with pytest.raises(ExportError, match="no"):
        net.export_onnx(tmp_path / "x.onnx", outputs="boxes")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("options, needle", [
    ({"batch": 0}, "batch"), ({"batch": "any"}, "batch"), ({"batch": True}, "batch"),
    ({"outputs": "nms"}, "outputs"), ({"fp16": "yes"}, "fp16"), ({"opset": 12}, "opset"),
    ({"opset": 999}, "opset"),
])
def test_bad_options_name_themselves(bundled, tmp_path, options, needle):
    with pytest.raises(ArgumentError, match=needle):
        bundled["yolov3-tiny"].export_onnx(tmp_path / "x.onnx", **options)
    assert not (tmp_path / "x.onnx").exists()


def test_an_existing_file_is_replaced_whole(bundled, tmp_path):
    path = tmp_path / "old.onnx"
    path.write_bytes(b"old")
    bundled["yolov4-tiny"].export_onnx(path)
    assert onnx.load(str(path)).graph.node
    assert [p.name for p in tmp_path.iterdir()] == ["old.onnx"]  # no temporary left


def test_the_command_writes_a_model_onnx_runtime_runs(tmp_path, capsys):
    from darknet_metal.cli import main

    out = tmp_path / "cli.onnx"
    rc = main(["export", str(YOLOV3_TINY / "yolov3-tiny.cfg"),
               str(YOLOV3_TINY / "yolov3-tiny.weights"), str(out), "--batch", "dynamic",
               "--boxes", "--opset", "17"])
    assert rc == 0 and "wrote" in capsys.readouterr().err
    model = onnx.load(str(out))
    assert model.opset_import[0].version == 17
    got = run_onnx(out, images((3, 416, 416), 2))
    assert set(got) == {"yolo_16", "yolo_23", "boxes", "confs", "objectness"}
    assert got["confs"].shape == (2, 2535, 80) and got["objectness"].shape == (2, 2535)


def test_the_command_refuses_missing_paths(tmp_path, capsys):
    from darknet_metal.cli import main

    assert main(["export", str(tmp_path / "only.onnx")]) == 2
    assert "CFG WEIGHTS OUT.onnx" in capsys.readouterr().err


def test_every_layer_kind_writes_itself_and_is_checked_here():
    import re

    from darknet_metal.ops import OPS
    from darknet_metal.ops.base import Op

    assert [k for k, cls in OPS.items() if cls.emit_onnx is Op.emit_onnx] == []
    checked = {kind for text in CASES.values() for kind in re.findall(r"^\[(\w+)\]", text, re.M)}
    assert set(OPS) <= checked
