"""``darknet-metal export``: a network (a cfg and its weights, or a bundled model) as an ONNX
file."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from darknet_metal.cli_args import positive_int
from darknet_metal.export.onnx_model import DEFAULT_OPSET, ExportableNetwork, export_onnx
from darknet_metal.model.bundled import model_files, model_names

__all__ = ["add_commands"]


def _batch(text: str) -> int | str:
    if text == "dynamic":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid batch {text!r}: a positive integer or 'dynamic'") from None


def add_commands(commands: Any, load: Callable[..., ExportableNetwork]) -> None:
    """Adds ``export`` to the ``darknet-metal`` subcommands; the command reads its network
    with ``load`` (``darknet_metal.load``, handed down by the command line: the network
    stands above the exporter)."""
    p = commands.add_parser(
        "export",
        help="write a network as an ONNX model",
        description=(
            "Write CFG with WEIGHTS (or the bundled --model NAME) to OUT as an ONNX model: "
            "batch norm folded into the convolutions, one output per [yolo] layer holding "
            "exactly what the network's forward gives (a network without [yolo] layers: its "
            "last layer's output), and with --boxes also 'boxes' and 'confs', the decoded "
            "boxes and per-class confidences before NMS. The model's metadata names the "
            "classes, each head's anchors and mask, and how to prepare the input. A layer "
            "ONNX cannot express is refused by name, and nothing is written."
        ),
    )
    p.add_argument("paths", metavar="PATH", type=Path, nargs="+",
                   help="CFG WEIGHTS OUT.onnx, or OUT.onnx with --model")
    p.add_argument("--model", metavar="NAME",
                   help=f"a bundled model (weights downloaded on first use): "
                   f"{', '.join(model_names())}")
    p.add_argument("--names", metavar="FILE", type=Path,
                   help="class names, one a line, for the metadata (default: the bundled "
                   "model's)")
    p.add_argument("--batch", type=_batch, default=1, metavar="N|dynamic",
                   help="the batch the model takes, or 'dynamic' for any (default: 1)")
    p.add_argument("--boxes", action="store_true",
                   help="also output the decoded boxes and confidences ('boxes', 'confs')")
    p.add_argument("--fp16", action="store_true",
                   help="weights, input and outputs as float16")
    p.add_argument("--opset", type=positive_int, default=None, metavar="N",
                   help=f"ONNX operator set (default: {DEFAULT_OPSET})")
    p.set_defaults(run=functools.partial(_run_export, load=load), check=_check_args, parser=p)


def _check_args(args: argparse.Namespace) -> None:
    want = 1 if args.model is not None else 3
    if len(args.paths) != want:
        args.parser.error("give CFG WEIGHTS OUT.onnx, or --model NAME OUT.onnx")


def _run_export(args: argparse.Namespace, load: Callable[..., ExportableNetwork]) -> int:
    if args.model is not None:
        files = model_files(args.model)
        cfg, weights, names = files.cfg, files.weights, files.names
    else:
        cfg, weights = args.paths[0], args.paths[1]
        names = None
    if args.names is not None:
        names = args.names
    out = args.paths[-1]
    net = load(cfg, weights, names=names, device="cpu")
    export_onnx(net, out, batch=args.batch, outputs="boxes" if args.boxes else "raw",
                fp16=args.fp16, opset=args.opset)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0
