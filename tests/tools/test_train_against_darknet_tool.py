"""tools/train_against_darknet.py: the cfg it trains, and its plumbing around a stand-in for
the darknet executable (the real comparison needs a Darknet build; see the README)."""

import importlib.util
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
from shared_paths import ROOT, YOLOV3_TINY

import darknet_metal as dm

TOOL = ROOT / "tools" / "train_against_darknet.py"


def _tool():
    spec = importlib.util.spec_from_file_location("train_against_darknet", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cfg_is_yolov3_tiny_for_three_classes_without_augmentation(tmp_path):
    text = _tool().shapes_cfg((YOLOV3_TINY / "yolov3-tiny.cfg").read_text(), 200)
    cfg = tmp_path / "shapes.cfg"
    cfg.write_text(text)
    net = dm.load(cfg)
    values = net.config.net.values
    assert (values["batch"], values["subdivisions"], values["width"], values["height"]) == (
        16, 1, 224, 224)
    assert (values["burn_in"], values["max_batches"], list(values["steps"])) == (
        0, 200, [160, 180])
    assert (values["hue"], values["saturation"], values["exposure"], values["flip"],
            values["mosaic"]) == (0, 1, 1, 0, 0)
    heads = [net.layers[i].values for i in net.yolo_layers]
    assert len(heads) == 2
    for head in heads:
        assert (head["classes"], head["jitter"], head["random"]) == (3, 0, 0)
    # The convolutions before the heads give 3 anchors x (5 + 3 classes) channels.
    assert all(net.layers[i - 1].values["filters"] == 24 for i in net.yolo_layers)
    # Everything else is the COCO cfg's: the same layers.
    coco = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg")
    assert [type(s).__name__ for s in net.layers] == [type(s).__name__ for s in coco.layers]


FAKE_DARKNET = textwrap.dedent("""\
    #!{python}
    # Stands in for `darknet detector train|map`: checks the prompt's answer on stdin, keeps
    # the weights it was given as the final weights, prints Darknet's lines.
    import re, shutil, sys
    command, data, cfg, weights = sys.argv[2:6]
    backup = re.search(r"(?m)^backup\\s*=\\s*(.*)$", open(data).read()).group(1).strip()
    base = cfg.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    if command == "train":
        if sys.stdin.read().strip() != "yes":
            sys.exit("no yes on stdin")
        shutil.copyfile(weights, f"{{backup}}/{{base}}_final.weights")
        open("chart.png", "w").close()  # as Darknet does, in its working directory
        print("1: loss=9.5, avg loss=9.5, rate=0.001")
        print("2: loss=7.25, avg loss=9.3, rate=0.001")
    else:
        print("-> mean average precision (mAP@0.50)=12.34%")
    """)


def test_the_tool_runs_both_programs_from_the_same_start(tmp_path):
    fake = tmp_path / "bin" / "darknet"
    fake.parent.mkdir()
    fake.write_text(FAKE_DARKNET.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "versus"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(TOOL), "--darknet", str(fake), "--out", str(out),
                           "--seeds", "3", "--iterations", "2"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads((out / "results.json").read_text())
    assert result["seed"] == 3
    assert result["darknet_map50"] == 12.34
    assert result["darknet_final_loss"] == 7.25
    assert "| 3 | 12.34% |" in done.stdout
    assert (out / "darknet-seed3" / "chart.png").exists()  # not in the caller's folder

    # Darknet was handed the backbone plus the layers --seed 3 initialises: the start of
    # darknet-metal's own run, parameter for parameter.
    cfg = out / "yolov3-tiny-shapes.cfg"
    start = dm.load(cfg, out / "start-seed3.weights")
    ours = dm.load(cfg, out / "yolov3-tiny.conv.15", partial=True, seed=3)
    coco = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights")
    for index, layer in start.params.items():
        for name, values in layer.items():
            np.testing.assert_array_equal(values, ours.params[index][name])
            if index < 15:  # the backbone is the COCO weights'
                np.testing.assert_array_equal(values, coco.params[index][name])
    # darknet-metal's mAP of Darknet's final weights (= the start here) and its own run's.
    start_map = json.loads((out / "darknet-seed3" / "map-by-darknet-metal.json").read_text())
    assert result["darknet_map50_by_darknet_metal"] == 100 * start_map["map"]
    trained = dm.load(cfg, out / "darknet-metal-seed3" / "yolov3-tiny-shapes_final.weights")
    assert trained.iteration == 2
    assert result["darknet_metal_map50"] >= 0.0
