"""``darknet-metal train DATA --model NAME``: from a cache holding only the COCO weights, the
derived cfg and the backbone Darknet's README names are written into the backup folder, and the
run is the one a user gets by hand (``cfg``, ``partial``, ``train DATA CFG BACKBONE``), bit for
bit; each refused value is one clear line and leaves nothing behind."""

from __future__ import annotations

import pytest

from darknet_metal.cli import main
from darknet_metal.datasets import make_shapes
from darknet_metal.model.bundled import get_spec

SMALL = ["--size", "96x96", "--batch", "4", "--max-batches", "2", "--seed", "1", "-q",
         "--no-chart"]


@pytest.fixture
def cache(model_cache):
    """A model cache holding only yolov3-tiny's COCO weights."""
    return model_cache


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
                 "[net] burn_in=1 (a sixth of max_batches, as Darknet's 1000 of 6000",
                 "the first 15 layers of"):
        assert err.count(said) == 1, said
    # The derived burn-in fits the run: the warm-up is not what holds the rate down (a run of
    # 2 iterations has its steps at 1 and 1: that is said).
    assert "warms it up" not in err
    assert ("the learning rate stays below 0.1 x learning_rate=0.001 for 2 of the 2 "
            "iterations 1..2 (policy=steps, steps=1,1, scales=0.1,0.1): the run will learn "
            "little; check the policy's keys in the cfg") in err
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
    # Said once, with the file's name, and the fix in the command's terms.
    assert err.count("layer 15") == 1 and err.count(str(cut)) == 1, err
    assert "<weights>" not in err and "partial=True" not in err, err
    assert not (shapes.parent / "backup").exists() or not any(
        (shapes.parent / "backup").iterdir())


def test_model_options_need_the_model_and_exclude_a_cfg(shapes, capsys):
    assert main(["train", str(shapes), "--size", "96x96"]) == 1
    assert "--size needs --model NAME" in capsys.readouterr().err
    assert main(["train", str(shapes)]) == 1
    assert "give CFG (and WEIGHTS) or --model NAME" in capsys.readouterr().err
    assert main(["train", str(shapes), "x.cfg", "--burn-in", "5"]) == 1
    assert "--burn-in needs --model NAME" in capsys.readouterr().err
    assert main(["train", str(shapes), "x.cfg", "--model", "yolov3-tiny"]) == 1
    assert "give CFG or --model, not both" in capsys.readouterr().err


def test_partial_from_the_model_is_the_readmes_backbone(cache, tmp_path, capsys):
    # `partial --model NAME OUT` takes the bundled cfg and the cached COCO weights, and N
    # defaults to the backbone Darknet's README names: the same file as the hand-made cut.
    assert main(["partial", "--model", "yolov3-tiny", str(tmp_path / "conv.15")]) == 0
    assert main(["partial", str(get_spec("yolov3-tiny").cfg),
                 str(cache / "yolov3-tiny" / "yolov3-tiny.weights"), str(tmp_path / "hand"),
                 "15"]) == 0
    assert (tmp_path / "conv.15").read_bytes() == (tmp_path / "hand").read_bytes()
    assert main(["partial", "--model", "yolov3-tiny", str(tmp_path / "conv.9"), "9"]) == 0
    assert "layers 0-8" in capsys.readouterr().err
    for args, said in ((["a.cfg", "b.weights"], "partial takes CFG WEIGHTS OUT N"),
                       (["--model", "yolov3-tiny", "a", "b", "c"], "with --model, partial "
                        "takes OUT [N]"),
                       (["--model", "yolov3-tiny", str(tmp_path / "x"), "0"],
                        "N (how many layers to keep): must be at least 1")):
        assert main(["partial", *args]) == 1
        assert said in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
