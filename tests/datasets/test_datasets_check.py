"""``check_dataset`` and ``darknet-metal check-data``: a generated set with faults of every
kind reports each one with its file and line in one run; a clean set reports nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from darknet_metal.cli import main
from darknet_metal.datasets import check_dataset, load_dataset, make_shapes
from darknet_metal.errors import DatasetError


@pytest.fixture(scope="module")
def clean_set(tmp_path_factory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("clean") / "shapes", train=90, valid=10,
                       size=(64, 48), seed=3)


@pytest.fixture
def broken_set(tmp_path) -> dict[str, object]:
    """100 images: a truncated JPEG, a bad class id, a box beyond the image, a missing label
    file, and the images of a line listed twice."""
    data = make_shapes(tmp_path / "shapes", train=90, valid=10, size=(64, 48), seed=3)
    images = data.parent / "images"
    truncated = images / "train_00005.jpg"
    content = truncated.read_bytes()
    truncated.write_bytes(content[: len(content) // 2])

    bad_class = images / "train_00010.txt"
    lines = bad_class.read_text().splitlines(keepends=True)
    lines.append("7 0.5 0.5 0.2 0.2\n")
    bad_class.write_text("".join(lines))
    bad_class_line = len(lines)

    outside = images / "valid_00003.txt"
    outside.write_text("1 0.95 0.5 0.2 0.25\n" + outside.read_text())

    missing = images / "train_00020.txt"
    missing.unlink()
    train_list = data.parent / "train.txt"
    with open(train_list, "a") as f:
        f.write(f"{images / 'train_00001.jpg'}\n")
    return {"data": data, "truncated": truncated, "bad_class": bad_class,
            "bad_class_line": bad_class_line, "outside": outside, "missing": missing,
            "train_list": train_list}


def test_clean_set_reports_nothing(clean_set, capsys):
    report = check_dataset(load_dataset(clean_set))
    assert report.ok and report.problems == []
    assert report.sets["train"].images == 90 and report.sets["valid"].images == 10
    # Boxes per class equal the label files' own count, read independently here.
    counts = [0, 0, 0]
    for label in (clean_set.parent / "images").glob("*.txt"):
        for line in label.read_text().splitlines():
            counts[int(line.split()[0])] += 1
    train_and_valid = [sum(x) for x in zip(report.sets["train"].boxes_per_class,
                                           report.sets["valid"].boxes_per_class, strict=True)]
    assert train_and_valid == counts

    assert main(["check-data", str(clean_set), "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"dataset: {clean_set} (darknet, 3 classes)"
    assert out[-1] == "0 errors, 0 warnings"


def test_every_fault_in_one_run(broken_set, capsys):
    s = broken_set
    assert main(["check-data", str(s["data"])]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    problems = [line for line in lines if line.startswith(("error: ", "warning: "))]
    train_list = s["train_list"]
    expected_errors = [
        f"error: {train_list}:6: cannot decode image (OSError: image file is truncated",
        f"error: {s['bad_class']}:{s['bad_class_line']}: class id 7 is out of range: the "
        "dataset has 3 classes (ids 0..2)",
        f"error: {s['outside']}:1: box outside the image by 0.05 (3.2 px) on the right "
        "(cx=0.95 cy=0.5 w=0.2 h=0.25)",
    ]
    for start in expected_errors:
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    assert f"warning: {train_list}:21: no label file {s['missing']}: read as an image without " \
           "objects" in problems
    assert f"warning: {train_list}:91: image listed again in train (first at " \
           f"{train_list}:2): {s['data'].parent / 'images/train_00001.jpg'}" in problems
    assert len(problems) == 5
    assert lines[-1] == "3 errors, 2 warnings"
    assert "checking images" in captured.err  # progress on stderr, never on stdout


def test_json_report(broken_set, capsys):
    assert main(["check-data", str(broken_set["data"]), "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert captured.err == ""
    assert report["ok"] is False and report["errors"] == 3 and report["warnings"] == 2
    assert report["names"] == ["circle", "square", "triangle"]
    assert report["sets"]["train"]["images"] == 91
    assert report["sets"]["train"]["missing_labels"] == 1
    by_file = {(p["file"], p["line"]): p for p in report["problems"]}
    assert by_file[(str(broken_set["outside"]), 1)]["severity"] == "error"
    assert by_file[(str(broken_set["bad_class"]), broken_set["bad_class_line"])]["message"] \
        .startswith("class id 7")


def test_report_raises_for_training(broken_set):
    report = check_dataset(load_dataset(broken_set["data"]), workers=1)
    with pytest.raises(DatasetError, match=r"image file is truncated.*\(and 2 more errors"):
        report.raise_for_errors()


def test_loading_errors_are_in_the_report(tmp_path, capsys):
    names = tmp_path / "obj.names"
    names.write_text("a\nb\n")
    image = tmp_path / "x.png"
    Image.new("RGB", (20, 10)).save(image)
    (tmp_path / "x.txt").write_text("0 0.5 0.5 0.02 0.5\n")  # 0.4 px wide
    (tmp_path / "list.txt").write_text(f"{image}\n")
    data = tmp_path / "obj.data"
    data.write_text(f"classes = 3\ntrain = {tmp_path}/list.txt\nvalid = {tmp_path}/list.txt\n"
                    f"names = {names}\n")
    assert main(["check-data", str(data), "-q"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"error: {data}:4: the names file has 2 names but classes = 3"
    assert not any(line.startswith("warning:") for line in out)  # --quiet: errors only
    report = check_dataset(load_dataset(data, strict=False))
    assert [str(p) for p in report.warnings] == [
        f"{tmp_path}/x.txt:1: box smaller than one pixel: 0.4 x 5 px in a 20x10 image",
        f"{tmp_path}/list.txt:1: image also in train (at {tmp_path}/list.txt:1): {image}",
    ]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["check-data", str(tmp_path / "nope.data")]) == 1
    err = capsys.readouterr().err
    assert err == f"darknet-metal: error: {tmp_path / 'nope.data'}: .data file not found\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [a\n")
    assert main(["check-data", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"darknet-metal: error: {bad}:2: not valid YAML") and err.count("\n") == 1
    assert main(["check-data"]) == 2
