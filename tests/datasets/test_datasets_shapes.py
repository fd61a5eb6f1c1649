"""``make_shapes`` / ``darknet-metal make-shapes``: labels that match the pixels, the same
bytes from the same seed, and nothing left behind by a failure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import darknet_metal.datasets.shapes as shapes_module
from darknet_metal.cli import main
from darknet_metal.datasets import load_dataset, make_shapes
from darknet_metal.errors import ArgumentError

# The documented colour contract: a shape's pixels have a channel spread (max - min) of at
# least 125, a background's at most 51. Halfway between, with room for JPEG's rounding.
SHAPE_SPREAD = 88


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _pixel_box(label: list[float], width: int, height: int) -> tuple[float, ...]:
    _, cx, cy, w, h = label
    return ((cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width,
            (cy + h / 2) * height)


def test_labels_match_the_drawn_pixels(tmp_path):
    width, height = 160, 120
    data = make_shapes(tmp_path / "s", train=40, valid=1, size=(width, height), seed=11)
    dataset = load_dataset(data)
    checked = overlapping_images = 0
    for sample in dataset.train:
        pixels = np.asarray(Image.open(sample.image).convert("RGB")).astype(np.int32)
        assert pixels.shape == (height, width, 3)
        shape_like = pixels.max(axis=2) - pixels.min(axis=2) >= SHAPE_SPREAD
        labels = [[float(v) for v in line.split()]
                  for line in sample.labels.read_text().splitlines()]
        assert 1 <= len(labels) <= 5
        boxes = [_pixel_box(label, width, height) for label in labels]
        # Every box has whole-pixel edges (six decimals of k/160 or k/120) inside the image.
        for box in boxes:
            assert all(abs(v - round(v)) < 1e-3 for v in box)
            assert box[0] >= 0 and box[1] >= 0 and box[2] <= width and box[3] <= height
        if any(_intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            overlapping_images += 1
        for i, box in enumerate(boxes):
            left, top, right, bottom = (round(v) for v in box)
            margin = 3
            outer = (max(left - margin, 0), max(top - margin, 0),
                     min(right + margin, width), min(bottom + margin, height))
            if any(_intersect(outer, other) for j, other in enumerate(boxes) if j != i):
                continue  # another shape's pixels would be in the margin
            region = shape_like[outer[1]:outer[3], outer[0]:outer[2]]
            rows, cols = np.flatnonzero(region.any(axis=1)), np.flatnonzero(region.any(axis=0))
            found = (outer[0] + cols[0], outer[1] + rows[0],
                     outer[0] + cols[-1] + 1, outer[1] + rows[-1] + 1)
            # The shape's colour reaches every edge of its box and nothing beyond it.
            assert np.abs(np.subtract(found, (left, top, right, bottom))).max() <= 1, (
                sample.image, labels[i], found)
            # The box's centre is the shape's colour (circle, square, triangle all hold it).
            assert shape_like[(top + bottom) // 2, (left + right) // 2]
            checked += 1
    assert checked >= 60
    assert overlapping_images >= 3  # "some overlapping"


def _intersect(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_classes_and_layout(tmp_path, monkeypatch):
    data = make_shapes(tmp_path / "two", train=20, valid=5, size=(64, 64), seed=1, classes=2)
    root = data.parent
    assert (root / "shapes.names").read_text() == "circle\nsquare\n"
    assert data.read_text() == (
        f"classes = 2\ntrain = {root}/train.txt\nvalid = {root}/valid.txt\n"
        f"names = {root}/shapes.names\nbackup = {root}/backup\n"
    )
    assert (root / "backup").is_dir()
    assert len((root / "valid.txt").read_text().splitlines()) == 5
    ids = {line.split()[0] for p in (root / "images").glob("*.txt")
           for line in p.read_text().splitlines()}
    assert ids == {"0", "1"}
    # Usable from any working directory: the paths are absolute.
    monkeypatch.chdir(tmp_path)
    assert len(load_dataset(data).train) == 20


def test_same_seed_same_bytes(tmp_path):
    a = make_shapes(tmp_path / "a", train=6, valid=2, size=(64, 48), seed=5).parent
    b = make_shapes(tmp_path / "b", train=6, valid=2, size=(64, 48), seed=5).parent
    files_a, files_b = _files(a), _files(b)
    assert files_a.keys() == files_b.keys()
    for name in files_a:  # the text files name their own folder
        assert files_a[name].replace(bytes(a), bytes(b)) == files_b[name], name
    again = make_shapes(a, train=6, valid=2, size=(64, 48), seed=5, force=True).parent
    assert _files(again) == files_a
    other = make_shapes(tmp_path / "c", train=6, valid=2, size=(64, 48), seed=6).parent
    assert _files(other)["images/train_00000.jpg"] != files_a["images/train_00000.jpg"]


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    writes = []
    real = shapes_module._write_jpeg

    def failing(path, pixels):
        writes.append(path)
        if len(writes) == 5:
            raise OSError(28, "No space left on device")
        real(path, pixels)

    monkeypatch.setattr(shapes_module, "_write_jpeg", failing)
    with pytest.raises(OSError, match="No space left"):
        make_shapes(tmp_path / "out", train=10, valid=2, size=(32, 32))
    assert list(tmp_path.iterdir()) == []

    # With --force over an existing set, the old one survives a failure whole.
    monkeypatch.setattr(shapes_module, "_write_jpeg", real)
    old = make_shapes(tmp_path / "out", train=3, valid=1, size=(32, 32)).parent
    before = _files(old)
    writes.clear()
    monkeypatch.setattr(shapes_module, "_write_jpeg", failing)
    with pytest.raises(OSError):
        make_shapes(old, train=10, valid=2, size=(32, 32), seed=9, force=True)
    assert _files(old) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_a_non_empty_folder(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ArgumentError, match="not empty"):
        make_shapes(out, train=1, valid=1, size=(32, 32))
    assert main(["make-shapes", str(out), "--train", "1", "--valid", "1", "--size", "32x32",
                 "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("darknet-metal: error: ") and err.count("\n") == 1
    assert (out / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["make-shapes", str(empty), "--train", "2", "--valid", "1", "--size", "32x40",
                 "--seed", "4", "-q"]) == 0
    assert "wrote 2 training and 1 validation images of 32x40" in capsys.readouterr().out
    assert len(list((empty / "images").glob("*.jpg"))) == 3


@pytest.mark.parametrize("argv", [
    ["--size", "20x20"], ["--size", "224"], ["--train", "0"], ["--classes", "4"],
    ["--seed", "-1"],
])
def test_bad_arguments_exit_2(tmp_path, argv, capsys):
    assert main(["make-shapes", str(tmp_path / "o"), *argv]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_function_arguments_are_checked(tmp_path):
    for kwargs in ({"train": 0}, {"size": (31, 64)}, {"seed": -1}, {"classes": 0},
                   {"valid": 1.5}):
        with pytest.raises(ArgumentError):
            make_shapes(tmp_path / "x", **kwargs)
    assert list(tmp_path.iterdir()) == []
