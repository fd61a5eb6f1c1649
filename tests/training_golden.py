"""The Darknet V5 training data in ../shared (read only): its folder, its reader module and
the ``[net]`` values of its cfgs as ``darknet_metal.model.cfg`` parses them."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Iterator
from types import ModuleType

import numpy as np
from shared_paths import SHARED

from darknet_metal.model.cfg import parse_cfg_text

TRAIN = SHARED / "golden" / "darknet-v5-train"
#: Case folders (each with index.json), sorted.
CASES = sorted(p.name for p in TRAIN.iterdir() if (p / "index.json").is_file())


def read_golden() -> ModuleType:
    """The data's own NumPy reader (``load_case``, ``read_weights``)."""
    spec = importlib.util.spec_from_file_location("read_golden", TRAIN / "read_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def net_values(text: str) -> dict:
    """The parsed values of the ``[net]`` section at the start of ``text``; the layers after
    it are dropped, so the parser need not know them."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            if inside:
                break
            inside = line.strip() in ("[net]", "[network]")
        if inside:
            lines.append(line)
    # The parser wants a layer after [net].
    return parse_cfg_text("\n".join(lines) + "\n[maxpool]\n").net.values


def cfg_net_values(path: pathlib.Path) -> dict:
    """``net_values`` of a cfg file."""
    return net_values(path.read_text())


#: The cases with [yolo] layers.
YOLO_CASES = [c for c in ("micro-v4-sgd", "micro-v4-diou", "micro-v3-adam", "micro-layers")
              if c in CASES]


def yolo_passes(case: str) -> Iterator[tuple]:
    """Every [yolo] forward of a case: (file stem, ``yolo_loss`` keywords, output, truths
    (rows class, x, y, w, h), Darknet's delta, its [yolo] record, the pass record)."""
    folder = TRAIN / case
    index = json.loads((folder / "index.json").read_text())
    files = index["files"]
    raw = np.fromfile(folder / "truth.bin", "<f4").reshape(files["truth.bin"]["shape"])
    # Darknet's rows are (x, y, w, h, class, track); ours (class, x, y, w, h).
    truths = np.ascontiguousarray(np.concatenate([raw[..., 4:5], raw[..., :4]], axis=2))
    batch = index["net"]["batch_per_subdivision"]
    layers = {layer["index"]: layer for layer in index["layers"]}
    for step in index["steps"]:
        for record in step["passes"]:
            sub = record["subdivision"]
            for head in record["yolo"]:
                layer = layers[head["layer"]]
                stem = f"s{step['step']}_sub{sub}_L{head['layer']:02d}_yolo_"
                shape = files[stem + "output.bin"]["shape"]
                output = np.fromfile(folder / (stem + "output.bin"), "<f4").reshape(shape)
                delta = np.fromfile(folder / (stem + "delta.bin"), "<f4").reshape(shape)
                options = dict(
                    anchors=np.reshape(layer["anchors"], (-1, 2)), mask=layer["mask"],
                    classes=layer["classes"], net_w=index["net"]["w"], net_h=index["net"]["h"],
                    ignore_thresh=layer["ignore_thresh"], truth_thresh=layer["truth_thresh"],
                    iou_thresh=layer["iou_thresh"], iou_loss=layer["iou_loss"],
                    iou_normalizer=layer["iou_normalizer"],
                    obj_normalizer=layer["obj_normalizer"],
                    cls_normalizer=layer["cls_normalizer"],
                    label_smooth_eps=layer["label_smooth_eps"],
                    new_coords=bool(layer["new_coords"]), max_boxes=layer["max_boxes"])
                yield (stem, options, np.ascontiguousarray(output),
                       np.ascontiguousarray(truths[sub * batch:(sub + 1) * batch]), delta,
                       head, record)
