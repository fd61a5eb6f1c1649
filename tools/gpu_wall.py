"""Whole calls on the 'cuda' device against the PyTorch peer on the same card, in one process:
what a caller's loop waits for, and where that time goes.

    python tools/gpu_wall.py [--cases train,infer] [--json FILE] [--repeats N]

For each case (a training step: yolov4-tiny and yolov3-tiny at batch 16, yolov4 at batch 8;
inference: yolov4-tiny and yolov3-tiny at batches 1 and 8, yolov4 at batch 1; all at 416):
ours, ``Network.train_step`` or ``Network.forward`` timed as whole calls (the median of
``--repeats`` after a warm-up) with ``Network.profile``'s device time and host split; the
PyTorch peer (``tools/torch_peer.py``: cuDNN, TF32 off) timed as whole calls too, its input
already on the GPU, and copied in from pageable and from pinned host memory each call. Prints a
table last. Needs an NVIDIA GPU, a build with the CUDA kernels, and PyTorch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_speed import boxes  # noqa: E402
from torch_peer import TorchPeer  # noqa: E402

import darknet_metal as dm  # noqa: E402
from darknet_metal.model.bundled import get_spec  # noqa: E402

TRAIN = (("yolov4-tiny", 16), ("yolov3-tiny", 16), ("yolov4", 8))
INFER = (("yolov4-tiny", 1), ("yolov4-tiny", 8), ("yolov3-tiny", 1), ("yolov3-tiny", 8),
         ("yolov4", 1))


def whole_calls(run, repeats: int) -> float:
    """Median milliseconds of ``run()`` after two warm-up calls."""
    run()
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def case(torch, model: str, batch: int, train: bool, size: int, repeats: int) -> dict:
    cfg = get_spec(model).cfg
    net = dm.load(cfg, device="cuda", batch=batch, subdivisions=1 if train else None,
                  input_size=(size, size))
    x = np.random.default_rng(0).random((batch, 3, size, size), dtype=np.float32)
    if train:
        truths = boxes(batch, net.yolo_heads()[0].classes)
        ours = whole_calls(lambda: net.train_step(x, truths), repeats)
    else:
        ours = whole_calls(lambda: net.forward(x), repeats)
    profile = net.profile(x, train=train, truths=truths if train else None, repeats=3,
                          peaks=False)
    print(profile.table(8))
    peer = TorchPeer(net, torch)
    timer = peer.time_training_step if train else peer.time_inference
    row = {"model": model, "batch": batch, "what": "train" if train else "infer",
           "ours_wall_ms": ours, "ours_device_ms": 1e3 * profile.seconds,
           "host": profile.to_dict()["host"],
           "peer_wall_ms": timer(batch, clock="wall", source="device"),
           "peer_wall_pageable_ms": timer(batch, clock="wall", source="pageable"),
           "peer_wall_pinned_ms": timer(batch, clock="wall", source="pinned"),
           "peer_events_ms": timer(batch, clock="events", source="device")}
    row["wall_over_device"] = ours / row["ours_device_ms"]
    row["wall_over_peer"] = ours / row["peer_wall_ms"]
    row["wall_over_peer_pageable"] = ours / row["peer_wall_pageable_ms"]
    print(json.dumps({k: v for k, v in row.items() if k != "host"}))
    net.to("cpu")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="train,infer")
    parser.add_argument("--size", type=int, default=416)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    card = torch.cuda.get_device_name(0)
    print(f"card: {card}")
    rows = []
    kinds = args.cases.split(",")
    if "train" in kinds:
        rows += [case(torch, m, b, True, args.size, args.repeats) for m, b in TRAIN]
    if "infer" in kinds:
        rows += [case(torch, m, b, False, args.size, args.repeats) for m, b in INFER]
    if args.json:
        args.json.write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    print(f"\nwhole calls at {args.size} on {card} (ms; medians)")
    print(f"{'work':<24} {'ours wall':>9} {'device':>8} {'w/dev':>6} {'torch':>7} "
          f"{'w/torch':>7} {'torch+copy':>10} {'w/t+c':>6} {'copies MB':>9}")
    for r in rows:
        host = r["host"] or {}
        print(f"{r['model'] + ' ' + r['what'] + ' b' + str(r['batch']):<24} "
              f"{r['ours_wall_ms']:>9.2f} {r['ours_device_ms']:>8.2f} "
              f"{r['wall_over_device']:>6.2f} {r['peer_wall_ms']:>7.2f} "
              f"{r['wall_over_peer']:>7.2f} {r['peer_wall_pageable_ms']:>10.2f} "
              f"{r['wall_over_peer_pageable']:>6.2f} "
              f"{host.get('driver_copy_bytes', 0) / 1e6:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
