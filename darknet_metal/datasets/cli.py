"""The dataset commands of ``darknet-metal``: ``check-data`` and ``make-shapes``.

``add_commands(subparsers)`` adds them to the main parser; each command's ``run(args)``
returns the exit status and raises ``DarknetMetalError`` for a fault the main program prints
as one ``darknet-metal: error: ...`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from darknet_metal.cli_args import positive_int, seed, size

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Add ``check-data`` and ``make-shapes`` to ``commands`` (an argparse subparsers
    object)."""
    check = commands.add_parser(
        "check-data",
        help="check a dataset's images and labels",
        description=(
            "Read DATA (a Darknet .data file or an ultralytics dataset .yaml), decode every "
            "image and parse every label file, and report every problem at once, one line "
            "each naming the file and line (errors: missing, unreadable or truncated images, "
            "malformed label lines, class ids out of range, boxes beyond the image or of no "
            "size, a names file that does not match classes, empty sets; warnings: missing "
            "label files, which mean no objects, images listed twice, and the like), then a "
            "summary. Exits 1 when there are errors, 0 otherwise."
        ),
    )
    check.add_argument("data", metavar="DATA", type=Path, help=".data or .yaml dataset file")
    check.add_argument("--json", action="store_true",
                       help="print the report as JSON on stdout instead of text")
    check.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar, and of the problems only errors")
    check.add_argument("--workers", type=positive_int, default=8, metavar="N",
                       help="threads decoding images (default: %(default)s)")
    check.set_defaults(run=run_check_data)

    shapes = commands.add_parser(
        "make-shapes",
        help="write a demo dataset of coloured shapes",
        description=(
            "Write a seeded dataset of coloured shapes (circle, square, triangle: one class "
            "each) on varied backgrounds, with exact labels, into the folder OUT: "
            "OUT/images/*.jpg with each image's labels beside it (*.txt, where Darknet looks "
            "for them), OUT/train.txt, OUT/valid.txt, OUT/shapes.names and OUT/shapes.data "
            "(absolute paths: usable from any folder). The same seed gives the same bytes. "
            "OUT is written whole or not at all."
        ),
    )
    shapes.add_argument("out", metavar="OUT", type=Path, help="folder to create")
    shapes.add_argument("--train", type=positive_int, default=200, metavar="N",
                        help="training images (default: %(default)s)")
    shapes.add_argument("--valid", type=positive_int, default=50, metavar="N",
                        help="validation images (default: %(default)s)")
    shapes.add_argument("--size", type=size, default=(224, 224), metavar="WxH",
                        help="image size in pixels, each 32..4096 (default: 224x224)")
    shapes.add_argument("--seed", type=seed, default=0, help="random seed (default: 0)")
    shapes.add_argument("--classes", type=int, choices=(1, 2, 3), default=3,
                        help="number of shape classes (default: %(default)s)")
    shapes.add_argument("--force", action="store_true",
                        help="replace OUT if it exists and is not empty")
    shapes.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    shapes.set_defaults(run=run_make_shapes)


def run_check_data(args: argparse.Namespace) -> int:
    """``darknet-metal check-data``: 1 when the dataset has errors, else 0."""
    from darknet_metal.datasets.check import check_dataset
    from darknet_metal.datasets.load import load_dataset

    dataset = load_dataset(args.data, strict=False)
    report = check_dataset(dataset, workers=args.workers, progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            if args.quiet and line.startswith("warning: "):
                continue
            print(" ".join(line.split()) if line.startswith(("error: ", "warning: ")) else line)
    sys.stdout.flush()
    return 0 if report.ok else 1


def run_make_shapes(args: argparse.Namespace) -> int:
    """``darknet-metal make-shapes``: writes the dataset, prints where."""
    from tqdm import tqdm

    from darknet_metal.datasets.shapes import make_shapes

    total = args.train + args.valid
    with tqdm(total=total, desc="drawing shapes", unit="img", file=sys.stderr,
              disable=args.quiet, leave=False) as bar:
        data = make_shapes(
            args.out, train=args.train, valid=args.valid, size=args.size, seed=args.seed,
            classes=args.classes, force=args.force, progress=bar.update,
        )
    print(f"wrote {args.train} training and {args.valid} validation images of "
          f"{args.size[0]}x{args.size[1]} to {data.parent}; dataset file: {data}")
    return 0
