"""The Darknet V5 training data in ../shared (read only): its folder, its reader module and
the ``[net]`` values of its cfgs as ``darknet_metal.cfg`` parses them."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

from shared_paths import SHARED

from darknet_metal.cfg import parse_cfg_text

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
