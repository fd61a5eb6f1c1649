"""The bundled networks as the CPU benchmarks run them: yolov3-tiny with its real weights, the
others with seeded weights written in Darknet's format (so a peer reading ``.cfg`` and
``.weights`` runs exactly the same network)."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable

import numpy as np
from shared_paths import CFG_DIR, YOLOV3_TINY

import darknet_metal as dm


def cfg_at_size(directory: pathlib.Path, name: str, size: int) -> pathlib.Path:
    """The bundled ``name.cfg`` with its input set to ``size`` x ``size``, written into
    ``directory``."""
    text = (CFG_DIR / f"{name}.cfg").read_text()
    text = re.sub(r"(?m)^width=\d+", f"width={size}", text)
    text = re.sub(r"(?m)^height=\d+", f"height={size}", text)
    path = directory / f"{name}-{size}.cfg"
    path.write_text(text)
    return path


def load_with_weights(directory: pathlib.Path, name: str,
                      size: int) -> tuple[pathlib.Path, pathlib.Path, dm.Network]:
    """(cfg, weights, network): yolov3-tiny's real files at 416, or ``name`` at ``size`` with
    weights drawn from seed 0 and saved into ``directory``."""
    if name == "yolov3-tiny" and size == 416:
        cfg, weights = YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights"
        return cfg, weights, dm.load(cfg, weights)
    cfg = cfg_at_size(directory, name, size)
    net = dm.load(cfg, seed=0)
    weights = directory / f"{name}-{size}.weights"
    net.save_weights(weights)
    return cfg, weights, net


def benchmark_case(directory: pathlib.Path, name: str, size: int) -> tuple[
        str, int, pathlib.Path, pathlib.Path, dm.Network, np.ndarray]:
    """(name, size, cfg, weights, network, input): ``load_with_weights`` and a seeded
    uniform input of shape (1, 3, size, size), float32 in [0, 1)."""
    cfg, weights, net = load_with_weights(directory, name, size)
    x = np.random.default_rng(1).random((1, 3, size, size), dtype=np.float32)
    return name, size, cfg, weights, net, x


def opencv_forward(cfg: pathlib.Path, weights: pathlib.Path, x: np.ndarray,
                   threads: int) -> Callable[[], list[np.ndarray]]:
    """A call running OpenCV DNN's Darknet importer's network on ``x`` (all its outputs),
    OpenCV set to ``threads`` threads."""
    import cv2

    cv2.setNumThreads(threads)
    peer = cv2.dnn.readNetFromDarknet(str(cfg), str(weights))
    names = peer.getUnconnectedOutLayersNames()

    def run() -> list[np.ndarray]:
        peer.setInput(x)
        return peer.forward(names)

    return run
