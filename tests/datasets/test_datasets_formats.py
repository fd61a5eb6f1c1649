"""Reading datasets: Darknet ``.data`` files (as ``read_data_cfg`` in Darknet's
``src-lib/option_list.cpp``), image lists (``get_paths`` in ``src-lib/data.cpp``), label files
(``read_boxes`` there), names files (``load_names`` in ``src-lib/weights.cpp``) and the
ultralytics dataset YAML layout (``check_det_dataset``, ``img2label_paths``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from darknet_metal.datasets import Sample, load_dataset, read_boxes
from darknet_metal.errors import DarknetMetalError, DatasetError


def _touch(path: Path, data: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _messages(problems, severity):
    return [str(p) for p in problems if p.severity == severity]


@pytest.fixture
def darknet_set(tmp_path):
    """A .data dataset with three images (labels beside them), names and lists."""
    root = tmp_path / "set"
    for name in ("a", "b", "c"):
        _touch(root / "img" / f"{name}.jpg")
        _touch(root / "img" / f"{name}.txt", b"0 0.5 0.5 0.2 0.2\n")
    _touch(root / "train.txt", b"img/a.jpg\nimg/b.jpg\n")
    _touch(root / "valid.txt", b"img/c.jpg\n")
    _touch(root / "obj.names", b"cat\ndog\n")
    return root


# --- .data files --------------------------------------------------------------------------


def test_data_file_syntax_as_darknet_reads_it(darknet_set, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the paths are relative to the .data file's folder
    data = _touch(darknet_set / "obj.data", (
        b"# a comment\r\n"
        b"   ; another comment\r\n"
        b"\r\n"
        b"  classes   =   2  \r\n"
        b"train: train.txt\r\n"           # ':' separates as '=' does
        b"valid\t=\tvalid.txt\r\n"
        b"names = obj.names\r\n"
        b"backup = backup/\r\n"
        b"eval = coco\r\n"                 # another command's key: kept, no warning
    ))
    ds = load_dataset(data)
    assert ds.classes == 2 and ds.names == ["cat", "dog"]
    assert [s.image.name for s in ds.train] == ["a.jpg", "b.jpg"]
    assert [s.image.name for s in ds.valid] == ["c.jpg"]
    assert ds.train[0] == Sample(darknet_set / "img/a.jpg", darknet_set / "img/a.txt")
    assert ds.train[1].source == darknet_set / "train.txt" and ds.train[1].line == 2
    assert ds.options["eval"] == "coco"
    # backup/ does not exist anywhere: resolved where Darknet would look (the working dir)
    assert ds.backup == tmp_path / "backup"
    assert list(ds.problems) == []


def test_duplicate_key_first_wins_with_a_warning(darknet_set):
    data = _touch(darknet_set / "obj.data", (
        f"classes = 2\ntrain = {darknet_set}/train.txt\nnames = {darknet_set}/obj.names\n"
        f"train = {darknet_set}/valid.txt\nvalid = {darknet_set}/valid.txt\n"
        "colour = blue\n"
    ).encode())
    ds = load_dataset(data)
    assert [s.image.name for s in ds.train] == ["a.jpg", "b.jpg"]  # line 2 wins (option_find)
    warnings = _messages(ds.problems, "warning")
    assert warnings == [
        f"{data}:4: duplicate key 'train': the first, at line 2, is used (as Darknet does)",
        f"{data}:6: unknown key 'colour' (Darknet's keys: classes, train, valid, names, "
        "backup, test, labels, results, eval, map, difficult, top, leaves)",
    ]


def test_relative_paths_prefer_the_working_directory(darknet_set, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    _touch(other / "train.txt", b"x/y.jpg\n")
    data = _touch(darknet_set / "obj.data", b"classes=2\ntrain=train.txt\nvalid=valid.txt\n"
                  b"names=obj.names\n")
    monkeypatch.chdir(other)
    ds = load_dataset(data)
    assert [s.image for s in ds.train] == [other / "x/y.jpg"]  # cwd's train.txt, as Darknet
    assert [s.image.name for s in ds.valid] == ["c.jpg"]  # only beside the .data file


def test_data_file_errors_name_file_and_line(darknet_set):
    data = _touch(darknet_set / "obj.data", (
        b"classes = two\n"
        b"train = train.txt\n"
        b"this line has no separator\n"
        b"valid = missing.txt # old list\n"
        b"names = obj.names\n"
    ))
    with pytest.raises(DatasetError) as info:
        load_dataset(data)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DarknetMetalError)
    assert info.value.path == str(data) and info.value.line == 1
    assert str(info.value).startswith(f"{data}:1: classes = two: not an integer (and 2 more")

    ds = load_dataset(data, strict=False)
    errors = _messages(ds.problems, "error")
    assert errors[0] == f"{data}:1: classes = two: not an integer"
    assert errors[1] == f"{data}:3: not a 'key = value' line: 'this line has no separator'"
    assert errors[2].startswith(f"{data}:4: valid = missing.txt # old list: image list not "
                                "found (a '#' after a value is part of it")
    assert len(errors) == 3


def test_names_count_must_match_classes(darknet_set):
    data = _touch(darknet_set / "obj.data", f"classes = 3\ntrain = {darknet_set}/train.txt\n"
                  f"names = {darknet_set}/obj.names\n".encode())
    ds = load_dataset(data, strict=False)
    assert _messages(ds.problems, "error") == [
        f"{data}:3: the names file has 2 names but classes = 3"
    ]


def test_missing_keys_follow_darknet_defaults(darknet_set):
    data = _touch(darknet_set / "obj.data", f"train = {darknet_set}/train.txt\n"
                  f"names = {darknet_set}/obj.names\n".encode())
    ds = load_dataset(data)
    assert ds.classes == 2  # counted from the names
    assert ds.valid == ds.train and ds.valid_is_train  # train_detector: valid defaults to train
    assert ds.backup is None
    assert len(_messages(ds.problems, "warning")) == 2

    bare = _touch(darknet_set / "bare.data", f"classes=2\nvalid={darknet_set}/valid.txt\n".encode())
    ds = load_dataset(bare)
    assert ds.names == ["0", "1"] and ds.train == [] and len(ds.valid) == 1

    nothing = _touch(darknet_set / "nothing.data", b"classes=2\n")
    with pytest.raises(DatasetError, match="neither 'train' nor 'valid'"):
        load_dataset(nothing)


def test_names_file_as_darknet_reads_it(darknet_set):
    names = _touch(darknet_set / "obj.names", b" cat \r\n\r\ndog\n\n\n")
    data = _touch(darknet_set / "obj.data", f"classes=3\ntrain={darknet_set}/train.txt\n"
                  f"names={names}\n".encode())
    ds = load_dataset(data)
    # A blank line between names is a class (as in load_names); trailing ones are dropped.
    assert ds.names == ["cat", "", "dog"]
    assert [w for w in _messages(ds.problems, "warning") if w.startswith(str(names))] == [
        f"{names}:2: blank line: counts as a class with an empty name"
    ]


def test_missing_data_file_raises(tmp_path):
    with pytest.raises(DatasetError, match=r"missing\.data: \.data file not found"):
        load_dataset(tmp_path / "missing.data", strict=False)
    with pytest.raises(DatasetError, match="is a folder"):
        load_dataset(tmp_path, strict=False)


# --- image lists --------------------------------------------------------------------------


def test_image_list_lines(darknet_set, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _touch(darknet_set / "train.txt", b"img/a.jpg\r\n\r\n  img/b.jpg \t\r\n#img/c.jpg\r\nimg/c.jpg")
    data = _touch(darknet_set / "obj.data", f"classes=2\ntrain={darknet_set}/train.txt\n"
                  f"valid={darknet_set}/valid.txt\nnames={darknet_set}/obj.names\n".encode())
    ds = load_dataset(data)
    assert [(s.image.name, s.line) for s in ds.train] == [
        ("a.jpg", 1), ("b.jpg", 3), ("c.jpg", 4), ("c.jpg", 5),
    ]  # no comments: '#img/c.jpg' is a path
    # Found nowhere: named where Darknet looks (the working directory), reported as missing
    assert ds.train[2].image == tmp_path / "#img/c.jpg"
    assert _messages(ds.problems, "warning") == [
        f"{darknet_set / 'train.txt'}:2: blank line skipped (Darknet reads it as an image path)"
    ]


def test_empty_image_list_is_an_error(darknet_set):
    _touch(darknet_set / "valid.txt", b"\n")
    data = _touch(darknet_set / "obj.data", f"classes=2\ntrain={darknet_set}/train.txt\n"
                  f"valid={darknet_set}/valid.txt\nnames={darknet_set}/obj.names\n".encode())
    with pytest.raises(DatasetError, match="valid.txt: the image list has no images"):
        load_dataset(data)


def test_older_darknet_label_folders_are_found(tmp_path):
    image = _touch(tmp_path / "VOC/JPEGImages/0005.jpg")
    label = _touch(tmp_path / "VOC/labels/0005.txt", b"1 0.5 0.5 0.1 0.1\n")
    _touch(tmp_path / "list.txt", f"{image}\n".encode())
    data = _touch(tmp_path / "voc.data", f"classes=2\ntrain={tmp_path}/list.txt\n".encode())
    ds = load_dataset(data)
    assert ds.train[0].labels == label
    # When the V5 file (beside the image) exists too, V5's rule wins.
    beside = _touch(tmp_path / "VOC/JPEGImages/0005.txt")
    assert load_dataset(data).train[0].labels == beside


# --- label files --------------------------------------------------------------------------


def test_read_boxes_values(tmp_path):
    label = _touch(tmp_path / "a.txt", b"0 0.5 0.5 0.25 0.125\r\n\r\n  2\t0.1 0.2 0.2 0.4  \n"
                   b"1 0.9999995 0.5 0.000001 1.0000009\n")
    boxes = read_boxes(label, classes=3)
    expected = np.array([[0, 0.5, 0.5, 0.25, 0.125], [2, 0.1, 0.2, 0.2, 0.4],
                         [1, 0.9999995, 0.5, 0.000001, 1.0000009]], np.float32)
    assert boxes.dtype == np.float32 and boxes.shape == (3, 5)
    np.testing.assert_array_equal(boxes, expected)
    assert read_boxes(Sample(tmp_path / "a.jpg", label)).shape == (3, 5)


def test_read_boxes_of_a_missing_file_is_no_objects(tmp_path):
    boxes = read_boxes(tmp_path / "none.txt")
    assert boxes.shape == (0, 5) and boxes.dtype == np.float32
    assert read_boxes(_touch(tmp_path / "empty.txt")).shape == (0, 5)


BAD_LINES = [
    (b"0 0.5 0.5 0.2", "4 values, expected 5 (class cx cy w h): '0 0.5 0.5 0.2'"),
    (b"0 0.5 0.5 0.2 0.2 0.9", "6 values, expected 5 (class cx cy w h) (Darknet would read "
     "the extra values as the next box): '0 0.5 0.5 0.2 0.2 0.9'"),
    (b"1.0 0.5 0.5 0.2 0.2", "class id '1.0' is not an integer"),
    (b"cat 0.5 0.5 0.2 0.2", "class id 'cat' is not an integer"),
    (b"-1 0.5 0.5 0.2 0.2", "class id -1 is negative"),
    (b"3 0.5 0.5 0.2 0.2", "class id 3 is out of range: the dataset has 3 classes (ids 0..2)"),
    (b"0 0.5 half 0.2 0.2", "cy 'half' is not a number"),
    (b"0 nan 0.5 0.2 0.2", "cx is nan: must be a finite number"),
    (b"0 0.5 0.5 inf 0.2", "width is inf: must be a finite number"),
    (b"0 0.5 0.5 -0.1 0.2", "width is -0.1: a box must have a size > 0"),
    (b"0 0.5 0.5 0 0", "width is 0 and height is 0: a box must have a size > 0"),
    (b"0 0.05 0.5 0.2 0.2", "box outside the image by 0.05 on the left (cx=0.05 cy=0.5 w=0.2 "
     "h=0.2)"),
    (b"0 0.5 0.45 0.2 1.2", "box outside the image by 0.15 at the top, 0.05 at the bottom "
     "(cx=0.5 cy=0.45 w=0.2 h=1.2)"),
    (b"0 0.9 0.5 0.200004 0.2", "box outside the image by 2e-06 on the right (cx=0.9 cy=0.5 "
     "w=0.200004 h=0.2)"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_read_boxes_faults(tmp_path, line, message):
    label = _touch(tmp_path / "l.txt", b"0 0.5 0.5 0.1 0.1\n\n" + line + b"\n")
    with pytest.raises(DatasetError) as info:
        read_boxes(label, classes=3)
    assert info.value.path == str(label) and info.value.line == 3
    assert str(info.value) == f"{label}:3: {message}"


# --- ultralytics YAML ---------------------------------------------------------------------


@pytest.fixture
def yolo_root(tmp_path):
    root = tmp_path / "coco8"
    for split, names in (("train", ["b", "a", "sub/c"]), ("val", ["v"])):
        for name in names:
            _touch(root / "images" / split / f"{name}.jpg")
            _touch(root / "labels" / split / f"{name}.txt", b"0 0.5 0.5 0.2 0.2\n")
    _touch(root / "images" / "train" / "notes.md")
    return root


def test_yaml_folders_and_names_mapping(yolo_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yml = _touch(tmp_path / "coco8.yaml", b"path: coco8  # root\ntrain: images/train\n"
                 b"val: images/val\ntest:\nnames:\n  0: person\n  1: bicycle\n")
    ds = load_dataset(yml)
    assert ds.format == "ultralytics" and ds.names == ["person", "bicycle"] and ds.classes == 2
    assert [s.image.relative_to(yolo_root).as_posix() for s in ds.train] == [
        "images/train/a.jpg", "images/train/b.jpg", "images/train/sub/c.jpg"]  # sorted, recursive
    assert ds.train[2].labels == yolo_root / "labels/train/sub/c.txt"
    assert [s.image.name for s in ds.valid] == ["v.jpg"] and ds.test == []
    assert ds.backup is None and list(ds.problems) == []
    assert read_boxes(ds.train[0]).shape == (1, 5)


def test_yaml_list_files_and_lists_of_both(yolo_root, tmp_path):
    _touch(yolo_root / "extra.txt", b"./images/val/v.jpg\n\n" +
           str(yolo_root / "images/train/a.jpg").encode() + b"\nimages/train/readme.md\n")
    yml = _touch(yolo_root / "data.yml", b"train: [images/train, extra.txt]\nval: extra.txt\n"
                 b"nc: 1\nnames: [thing]\n")
    ds = load_dataset(yml)  # no 'path': the YAML's folder is the root
    assert [s.image.relative_to(yolo_root).as_posix() for s in ds.train] == [
        "images/train/a.jpg", "images/train/a.jpg", "images/train/b.jpg",
        "images/train/sub/c.jpg", "images/val/v.jpg"]
    assert [s.labels.relative_to(yolo_root).as_posix() for s in ds.valid] == [
        "labels/train/a.txt", "labels/val/v.txt"]
    assert _messages(ds.problems, "warning") == [
        f"{yolo_root / 'extra.txt'}:4: not an image extension, skipped: images/train/readme.md"
    ] * 2  # read once per set


def test_yaml_names_list_defaults_and_errors(yolo_root):
    def load(text: str, strict: bool = False):
        return load_dataset(_touch(yolo_root / "d.yaml", text.encode()), strict=strict)

    assert load("train: images/train\nval: images/val\nnc: 2\n").names == ["class_0", "class_1"]
    names_by_id = "train: images/train\nval: images/val\nnames: {'0': a, '1': b}\n"
    assert load(names_by_id).names == ["a", "b"]
    ds = load("train: images/train\nvalidation: images/val\nnames: [a]\n")
    assert [s.image.name for s in ds.valid] == ["v.jpg"]  # 'validation' read as 'val'

    path = yolo_root / "d.yaml"
    cases = [
        ("train: images/train\nval: images/val\nnc: 3\nnames: [a, b]\n",
         f"{path}:3: nc is 3 but names has 2 names"),
        ("train: images/train\nval: images/val\nnames: {0: a, 2: b}\n",
         f"{path}:3: names: ids must be 0..1, got [0, 2]"),
        ("train: images/train\nnames: [a]\n",
         f"{path}: no 'val' images: 'train' and 'val' are required in a dataset YAML"),
        ("train: images/train\nval: images/nope\nnames: [a]\n",
         f"{path}:2: val: {yolo_root / 'images/nope'} does not exist"),
        ("train: images/train\nval: images/val\n",
         f"{path}: neither 'names' nor 'nc' is given: the number of classes is unknown"),
    ]
    for text, message in cases:
        assert [str(p) for p in load(text).problems.errors] == [message], text
    with pytest.raises(DatasetError) as info:
        load("train: [images/train\nval: x\n")
    assert info.value.line is not None and "not valid YAML" in str(info.value)


# --- arbitrary bytes ----------------------------------------------------------------------


_FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@pytest.mark.slow
@settings(max_examples=150, **_FUZZ)
@given(st.binary(max_size=200) | st.text(alphabet="0123456789 .-+eEnaif\t\r\n#", max_size=120)
       .map(str.encode))
def test_label_files_raise_only_dataset_errors(tmp_path, data):
    label = _touch(tmp_path / "fuzz.txt", data)
    try:
        boxes = read_boxes(label, classes=4)
    except DatasetError as exc:
        assert exc.path == str(label) and exc.line is not None
    else:
        assert boxes.dtype == np.float32 and boxes.ndim == 2 and boxes.shape[1] == 5
        assert np.isfinite(boxes).all() and (boxes[:, 3:] > 0).all()


@pytest.mark.slow
@settings(max_examples=100, **_FUZZ)
@given(st.binary(max_size=200) | st.text(alphabet="ctrainvldsmeb=:#; \t\r\n0123./", max_size=120)
       .map(str.encode))
def test_data_files_raise_only_dataset_errors(tmp_path, data):
    path = _touch(tmp_path / "fuzz.data", data)
    try:
        ds = load_dataset(path, strict=False)
    except DatasetError as exc:
        assert exc.path == str(path)
    else:
        assert all(p.severity in ("error", "warning") for p in ds.problems)
