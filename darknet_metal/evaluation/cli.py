"""The evaluation commands of ``darknet-metal``: ``map`` (Darknet's ``detector map`` and
COCO's mAP) and ``anchors`` (Darknet's ``calc_anchors``).

``add_commands(subparsers)`` adds them to the main parser; each command's ``run(args)``
returns the exit status and raises ``DarknetMetalError`` for a fault the main program prints
as one ``darknet-metal: error: ...`` line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from darknet_metal.cli_args import multiple_of_32, positive_int, unit_float

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Add ``map`` and ``anchors`` to ``commands`` (an argparse subparsers object)."""
    from darknet_metal.network import DEVICES

    mapping = commands.add_parser(
        "map",
        help="mean average precision of a detector on a dataset's valid set",
        description=(
            "Run CFG + WEIGHTS over the valid set of DATA (a Darknet .data file or an "
            "ultralytics dataset .yaml) as `darknet detector map` does (detections above "
            "0.005 after NMS 0.45) and print Darknet's report: per class AP, TP, FP, FN and "
            "GT; precision, recall, F1 and average IoU at --thresh; mAP@0.50 (or at "
            "--iou-thresh) by Darknet's rule for --points; then COCO's mAP@[.5:.95] and "
            "mAP@0.50 of the same detections when faster-coco-eval is installed (the "
            "'eval' extra), else a line saying they were not computed."
        ),
    )
    mapping.add_argument("data", metavar="DATA", type=Path, help=".data or .yaml dataset file")
    mapping.add_argument("cfg", metavar="CFG", type=Path, help="network .cfg file")
    mapping.add_argument("weights", metavar="WEIGHTS", type=Path, help=".weights file")
    mapping.add_argument("--thresh", type=unit_float, default=0.25,
                         help="confidence threshold of the TP/FP/FN figures "
                         "(default: %(default)s)")
    mapping.add_argument("--iou-thresh", type=unit_float, default=0.5,
                         help="IoU a detection needs to match a truth (default: %(default)s)")
    mapping.add_argument("--points", type=int, choices=(0, 11, 101), default=None,
                         help="recall points of AP: 0 area under the curve, 11 VOC2007, 101 "
                         "COCO (default: the .data file's points, else 0)")
    mapping.add_argument("--device", default="cpu", choices=DEVICES,
                         help="cpu, metal, emu or cuda (default: %(default)s)")
    mapping.add_argument("--batch", type=positive_int, default=4, metavar="N",
                         help="images per forward pass (default: %(default)s)")
    mapping.add_argument("--json", action="store_true",
                         help="print the report as JSON on stdout instead of text")
    mapping.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    mapping.set_defaults(run=run_map)

    anchors = commands.add_parser(
        "anchors",
        help="anchors for a dataset by k-means, as `darknet detector calc_anchors`",
        description=(
            "Cluster the widths and heights of DATA's training boxes, scaled to the network "
            "size, into --clusters anchors by Darknet's k-means (distance 1 - IoU), and "
            "print them with their average IoU and the `anchors = ...` line for a cfg."
        ),
    )
    anchors.add_argument("data", metavar="DATA", type=Path, help=".data or .yaml dataset file")
    anchors.add_argument("--clusters", type=positive_int, default=9, metavar="K",
                         help="anchors to find (default: %(default)s)")
    anchors.add_argument("--width", type=multiple_of_32, required=True, metavar="W",
                         help="network width in pixels (a multiple of 32)")
    anchors.add_argument("--height", type=multiple_of_32, required=True, metavar="H",
                         help="network height in pixels (a multiple of 32)")
    anchors.add_argument("--seed", type=int, default=0,
                         help="seed of the initial centres (default: %(default)s)")
    anchors.set_defaults(run=run_anchors)


def run_map(args: argparse.Namespace) -> int:
    import darknet_metal
    from darknet_metal.datasets import load_dataset
    from darknet_metal.evaluation import evaluate_dataset, format_darknet_report

    dataset = load_dataset(args.data)
    net = darknet_metal.load(args.cfg, args.weights, names=dataset.names, device=args.device)
    points = args.points
    if points is None:
        points = int(dataset.options.get("points", 0) or 0)
    report = evaluate_dataset(net, dataset, thresh=args.thresh, iou_thresh=args.iou_thresh,
                              points=points, batch=args.batch, progress=not args.quiet)
    print(report.to_json() if args.json else format_darknet_report(report))
    return 0


def run_anchors(args: argparse.Namespace) -> int:
    from darknet_metal.datasets import load_dataset
    from darknet_metal.evaluation import dataset_anchors, format_anchors

    dataset = load_dataset(args.data)
    report = dataset_anchors(dataset, args.clusters, args.width, args.height, seed=args.seed)
    print(format_anchors(report))
    return 0
