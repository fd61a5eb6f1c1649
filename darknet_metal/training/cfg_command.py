"""``darknet-metal cfg --model NAME (--classes N | --data DATA) [options] OUT.cfg``: a bundled
model's cfg made for your classes (``darknet_metal.model.derive``), the file Darknet's README
tells a user to edit by hand. With ``--data`` the classes and the training images come from
the dataset, and ``--anchors auto`` clusters its boxes at the training size (Darknet's
``calc_anchors``). Every derived value is printed once on stderr with where it came from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from darknet_metal.cli_args import non_negative_int, positive_int, size
from darknet_metal.errors import ArgumentError
from darknet_metal.model.bundled import model_names
from darknet_metal.model.derive import DerivedCfg, anchor_count, derive_cfg

__all__ = ["add_cfg_arguments", "add_command", "derive_from_args", "print_derived", "run_cfg"]


def add_command(commands: Any) -> None:
    """Add ``cfg`` to ``commands`` (an argparse subparsers object)."""
    cfg = commands.add_parser(
        "cfg",
        help="a bundled model's cfg for your classes (what Darknet's README edits by hand)",
        description=(
            "Write OUT.cfg: the bundled --model's cfg with classes in every [yolo], "
            "filters=(classes+5)*masks in the convolution before each, max_batches (Darknet's "
            "rule unless given), steps at 80% and 90% of it, burn_in (the model's, or a "
            "sixth of a short run), the size, batch and subdivisions, and the anchors "
            "(--anchors auto: clustered from --data's boxes). "
            "Every derived value is printed on stderr with where it came from; nothing is "
            "written when a value is refused."
        ),
    )
    cfg.add_argument("out", metavar="OUT.cfg", type=Path, help="the cfg file to write")
    add_cfg_arguments(cfg)
    cfg.set_defaults(run=run_cfg)


def add_cfg_arguments(parser: Any, *, data: bool = True, model_required: bool = True,
                      batch_default: int | None = 64, planner: bool = False) -> None:
    """The options that derive a cfg (``cfg`` and ``train --model`` share them)."""
    parser.add_argument("--model", metavar="NAME", required=model_required,
                        choices=model_names(),
                        help=f"bundled model: {', '.join(model_names())}")
    parser.add_argument("--classes", type=positive_int, metavar="N",
                        help="number of classes (with --data: must equal the dataset's)")
    if data:
        parser.add_argument("--data", type=Path, metavar="DATA",
                            help=".data or .yaml dataset: its classes, training images and "
                            "boxes")
    parser.add_argument("--size", type=size, metavar="WxH",
                        help="network size, multiples of 32 (default: the model's)")
    parser.add_argument("--batch", type=positive_int, default=batch_default, metavar="N",
                        help="images per iteration (default: 64, Darknet's README)")
    parser.add_argument("--subdivisions", type=positive_int, metavar="N",
                        help="mini-batches per iteration (default: " + (
                            "the fewest whose pass fits this machine's memory)" if planner
                            else "the model's, dividing the batch)"))
    parser.add_argument("--max-batches", type=positive_int, metavar="N",
                        help="iterations (default: Darknet's rule, max(2000 x classes, 6000, "
                        "training images / batch))")
    parser.add_argument("--burn-in", type=non_negative_int, metavar="N",
                        help="iterations over which the learning rate warms up (default: the "
                        "model's, or a sixth of max_batches when that is less)")
    parser.add_argument("--anchors", choices=("model", "auto"), default="model",
                        help="model: the model's anchors; auto: Darknet's calc_anchors on "
                        "DATA's boxes at the size (default: %(default)s)")


def derive_from_args(args: argparse.Namespace, dataset: Any = None) -> DerivedCfg:
    """The cfg the arguments ask for; ``dataset``: the loaded ``--data`` (or None)."""
    classes = args.classes
    if dataset is not None:
        if classes is not None and classes != dataset.classes:
            raise ArgumentError(f"--classes is {classes} but {dataset.path} has "
                                f"{dataset.classes} classes")
        classes = dataset.classes
    if classes is None:
        raise ArgumentError("give --classes N or --data DATA")
    derived = derive_cfg(args.model, classes, size=args.size, batch=args.batch,
                         subdivisions=args.subdivisions, max_batches=args.max_batches,
                         train_images=len(dataset.train) if dataset is not None else 0,
                         burn_in=args.burn_in)
    if args.anchors == "auto":
        if dataset is None:
            raise ArgumentError("--anchors auto needs --data (the boxes to cluster)")
        from darknet_metal.evaluation import dataset_anchors

        net = derived.config.net.values
        width, height = int(net["width"]), int(net["height"])
        report = dataset_anchors(dataset, anchor_count(derived.config), width, height)
        anchors = [round(float(v)) for v in report.anchors.reshape(-1)]
        source = (f"calc_anchors on {report.boxes} boxes of {dataset.path} at "
                  f"{width}x{height} (average IoU {report.avg_iou:.2f}%)")
        derived = derived.rederive(anchors=anchors, anchors_source=source)
    return derived


def print_derived(derived: DerivedCfg) -> None:
    """Each derived value on stderr, once, with where it came from."""
    for v in derived.values:
        print(f"{derived.model} [{v.section}] {v.key}={v.value}  ({v.source})", file=sys.stderr)


def run_cfg(args: argparse.Namespace) -> int:
    from darknet_metal.files import atomic_write

    dataset = None
    if args.data is not None:
        from darknet_metal.datasets import load_dataset

        dataset = load_dataset(args.data)
    derived = derive_from_args(args, dataset)
    print_derived(derived)
    atomic_write(args.out, lambda f: f.write(derived.text.encode()))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
