"""``darknet-metal train DATA --model NAME``: from a cache holding only the COCO weights, the
derived cfg and the backbone Darknet's README names are written into the backup folder, and the
run is the one a user gets by hand (``cfg``, ``partial``, ``train DATA CFG BACKBONE``), bit for
bit; each refused value is one clear line and leaves nothing behind."""

from __future__ import annotations

import shutil

import pytest
from shared_paths import YOLOV3_TINY

from darknet_metal.cli import main
from darknet_metal.datasets import make_shapes
from darknet_metal.model.bundled import get_spec

SMALL = ["--size", "96x96", "--batch", "4", "--max-batches", "2", "--seed", "1", "-q",
         "--no-chart"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A model cache holding only yolov3-tiny's COCO weights."""
    home = tmp_path / "home"
    (home / "yolov3-tiny").mkdir(parents=True)
    shutil.copy(YOLOV3_TINY / "yolov3-tiny.weights", home / "yolov3-tiny")
    monkeypatch.setenv("DARKNET_METAL_HOME", str(home))
    return home


@pytest.fixture
def shapes(tmp_path):
    return make_shapes(tmp_path / "shapes", train=12, valid=4, size=(96, 96), seed=5)


def test_a_run_from_the_model_is_the_hand_made_run(cache, shapes, tmp_path, capsys):
    assert main(["train", str(shapes), "--model", "yolov3-tiny", *SMALL[:-2]]) == 0
    err = capsys.readouterr().err
    backup = shapes.parent / "backup"
    cfg = backup / "yolov3-tiny-shapes.cfg"
    backbone = backup / "yolov3-tiny.conv.15"
    assert cfg.is_file() and backbone.is_file()
    for said in ("[net] max_batches=2 (given)", "[yolo 16] classes=3 (given)",
                 "[convolutional 15] filters=24 ((classes + 5) x 3 masks)",
                 "[net] subdivisions=1 (the fewest that fit this machine's memory on cpu)",
                 "the first 15 layers of"):
        assert err.count(said) == 1, said
    hand = tmp_path / "hand"
    hand.mkdir()
    assert main(["cfg", "--model", "yolov3-tiny", "--classes", "3", "--size", "96x96",
                 "--batch", "4", "--subdivisions", "1", "--max-batches", "2",
                 str(hand / "hand.cfg")]) == 0
    assert main(["partial", str(get_spec("yolov3-tiny").cfg),
                 str(cache / "yolov3-tiny" / "yolov3-tiny.weights"), str(hand / "conv.15"),
                 "15"]) == 0
    assert (hand / "conv.15").read_bytes() == backbone.read_bytes()
    assert (hand / "hand.cfg").read_text() == cfg.read_text()
    assert main(["train", str(shapes), str(hand / "hand.cfg"), str(hand / "conv.15"),
                 "--seed", "1", "-q", "--no-chart", "--backup", str(hand)]) == 0
    assert ((hand / "hand_final.weights").read_bytes()
            == (backup / "yolov3-tiny-shapes_final.weights").read_bytes())


@pytest.mark.parametrize(("args", "message"), [
    (["--classes", "5"], "--classes is 5 but"),
    (["--size", "100x96"], "width must be a multiple of 32"),
    (["--model", "yolov9"], "invalid choice: 'yolov9'"),
])
def test_a_refused_value_leaves_nothing_behind(cache, shapes, capsys, args, message):
    argv = ["train", str(shapes), "--model", "yolov3-tiny", *SMALL]
    for flag, value in zip(args[::2], args[1::2], strict=True):
        at = argv.index(flag) if flag in argv else None
        if at is None:
            argv += [flag, value]
        else:
            argv[at + 1] = value
    assert main(argv) != 0
    assert message in capsys.readouterr().err
    assert not (shapes.parent / "backup").exists() or not any(
        (shapes.parent / "backup").iterdir())


def test_weights_of_another_network_are_refused(cache, shapes, tmp_path, capsys):
    cut = tmp_path / "cut.weights"
    assert main(["partial", str(get_spec("yolov3-tiny").cfg),
                 str(cache / "yolov3-tiny" / "yolov3-tiny.weights"), str(cut), "15"]) == 0
    capsys.readouterr()
    assert main(["train", str(shapes), "--model", "yolov3-tiny", "--weights", str(cut),
                 *SMALL]) == 1
    err = capsys.readouterr().err
    assert "makes its backbone from the model's whole COCO weights file" in err
    assert err.count("\n") == 1  # one line
    assert not (shapes.parent / "backup").exists() or not any(
        (shapes.parent / "backup").iterdir())


def test_model_options_need_the_model_and_exclude_a_cfg(shapes, capsys):
    assert main(["train", str(shapes), "--size", "96x96"]) == 1
    assert "--size needs --model NAME" in capsys.readouterr().err
    assert main(["train", str(shapes)]) == 1
    assert "give CFG (and WEIGHTS) or --model NAME" in capsys.readouterr().err
    assert main(["train", str(shapes), "x.cfg", "--model", "yolov3-tiny"]) == 1
    assert "give CFG or --model, not both" in capsys.readouterr().err
