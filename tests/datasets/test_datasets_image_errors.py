"""An image that cannot be decoded is named once, with what went wrong in words (never
Pillow's repetition of the file, nor a Python object's repr), by ``check-data``, by ``train``
(whose error names the dataset file, not a placeholder) and by ``detect``."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from darknet_metal.cli import main
from darknet_metal.datasets import make_shapes
from darknet_metal.image_errors import decode_failure


def _raised(opener) -> BaseException:
    try:
        with opener() as im:
            im.load()
    except Exception as exc:  # noqa: BLE001 - Pillow's own types are what is tested
        return exc
    raise AssertionError("Pillow decoded it")


def test_pillows_failures_in_words_that_name_no_file(tmp_path):
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"hello, not an image")
    said = decode_failure(_raised(lambda: Image.open(garbage)))
    assert said == "not in any image format Pillow reads"
    said = decode_failure(_raised(lambda: Image.open(io.BytesIO(b"hello"))))
    assert "object at 0x" not in said and "BytesIO" not in said
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(
        png, "PNG")
    cut = tmp_path / "cut.png"
    cut.write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    said = decode_failure(_raised(lambda: Image.open(cut)))
    assert str(cut) not in said and said.split(":")[0] in ("OSError", "SyntaxError"), said


@pytest.fixture
def broken(tmp_path):
    data = make_shapes(tmp_path / "shapes", train=4, valid=2, size=(64, 64), seed=2)
    image = sorted((tmp_path / "shapes" / "images").glob("train_*.jpg"))[0]
    image.write_bytes(b"hello, not an image")
    return data, image


def test_check_data_and_train_name_the_image_once(broken, tmp_path, capsys, model_cache):
    data, image = broken
    assert main(["check-data", str(data)]) == 1
    out = capsys.readouterr().out  # the report, on stdout
    line = next(x for x in out.splitlines() if "cannot decode" in x)
    assert line.count(str(image)) == 1 and "not in any image format Pillow reads" in line
    assert main(["train", str(data), "--model", "yolov3-tiny", "--size", "64x64", "--batch",
                 "2", "--max-batches", "1", "-q", "--backup", str(tmp_path / "b")]) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert line.startswith(f"darknet-metal: error: {data}: 1 error(s) in the dataset"), line
    assert "<dataset>" not in line and line.count(str(image)) == 1, line
    # Nothing of the run is left behind: the derived cfg and backbone are not written.
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
