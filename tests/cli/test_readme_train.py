"""The README's training commands, as written there, run one after the other in a fresh
folder: the one-command demo and the path by hand. The only changes: fewer iterations (2, not
the demo's 400) and a smaller shapes set, so that the chain, not the learning, is what runs
here; the model cache holds yolov3-tiny's COCO weights, as the first `--model` command leaves
it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from darknet_metal.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def _train_blocks() -> list[list[list[str]]]:
    """Each ```sh block of the README's "## Train" section: its commands, a line continued
    with a backslash joined, comments dropped, split as a shell would."""
    text = README.read_text()
    section = text.split("\n## Train\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
        blocks.append([c for c in commands if c])
    return blocks


def _shortened(command: list[str]) -> list[str]:
    """``command`` with 2 iterations and a small shapes set; nothing else changed."""
    assert command[0] == "darknet-metal", command
    args = list(command[1:])
    if "--max-batches" in args:
        args[args.index("--max-batches") + 1] = "2"
    if args[0] == "make-shapes":
        args += ["--train", "8", "--valid", "4"]
    return args


def test_the_readme_has_the_demo_and_the_path_by_hand():
    blocks = _train_blocks()
    assert len(blocks) == 2
    names = [[c[1] for c in block] for block in blocks]
    assert names == [["make-shapes", "train"], ["cfg", "partial", "train"]]


def test_the_readmes_training_commands_run_as_written(model_cache, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    demo, by_hand = _train_blocks()
    for command in demo + by_hand:
        assert main(_shortened(command)) == 0, (command, capsys.readouterr().err[-2000:])
    err = capsys.readouterr().err
    assert (work / "shapes" / "backup" / "yolov3-tiny-shapes_final.weights").is_file()
    assert (work / "my-yolov3-tiny.cfg").is_file()
    assert (work / "yolov3-tiny.conv.15").is_file()
    assert (work / "shapes" / "backup" / "my-yolov3-tiny_final.weights").is_file()
    assert "error" not in err
