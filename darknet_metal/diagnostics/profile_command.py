"""``darknet-metal profile``: where the time of a forward pass or a training step goes on a
device, per kernel and per layer (``Network.profile``), as a table or JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from darknet_metal.cli_args import multiple_of_32, positive_int
from darknet_metal.files import atomic_write
from darknet_metal.model.bundled import get_spec, model_names, weights_path

__all__ = ["add_commands"]

_DEVICES = ("metal", "emu", "cuda", "cpu")


def add_commands(commands: Any) -> None:
    """Adds ``profile`` to the ``darknet-metal`` subcommands."""
    p = commands.add_parser(
        "profile",
        help="time each kernel of a pass or a training step on a device",
        description=(
            "Run a forward pass (or, with --train, a training step) of CFG on a device under "
            "its profiler and print, per kernel and per layer, the time, floating-point "
            "operations, bytes moved and the fraction of the device's peak compute and "
            "bandwidth (copy bandwidth and GEMM rate measured on the device first). Times "
            "are the GPU's on metal and cuda, the host's on emu (the emulator is the CPU) "
            "and per layer on cpu. Weights are optional: without them the layers start from "
            "Darknet's random initialisation (the time does not depend on the values). A "
            "training profile trains a copy: no file is changed."
        ),
    )
    p.add_argument("cfg", metavar="CFG", type=Path, nargs="?",
                   help="network .cfg file (or --model)")
    p.add_argument("--weights", metavar="W", type=Path, help=".weights file for CFG")
    p.add_argument("--model", metavar="NAME",
                   help="a bundled model's cfg instead of CFG (with its weights if they are "
                   f"cached): {', '.join(model_names())}")
    p.add_argument("--train", action="store_true",
                   help="profile a training step (forward, backward, loss and update)")
    p.add_argument("--device", choices=_DEVICES, default=None,
                   help="default: metal where there is one, else emu")
    p.add_argument("--size", type=multiple_of_32, metavar="N",
                   help="input width and height in pixels (default: the cfg's)")
    p.add_argument("--batch", type=positive_int, metavar="N",
                   help="images per pass; with --train the training batch, in one "
                   "mini-batch unless --subdivisions (default: 1, or the cfg's batch)")
    p.add_argument("--subdivisions", type=positive_int, metavar="N",
                   help="mini-batches per training step (default: the cfg's, or 1 with "
                   "--batch)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="profiled runs; each dispatch's time is their median "
                   "(default: %(default)s)")
    p.add_argument("--top", type=positive_int, default=15, metavar="N",
                   help="rows per table (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", type=Path,
                   help="also write the whole profile (every dispatch) as JSON")
    p.set_defaults(run=_run_profile, check=_check_args, parser=p)


def _check_args(args: argparse.Namespace) -> None:
    if (args.cfg is None) == (args.model is None):
        args.parser.error("give CFG or --model NAME (one of them)")
    if args.model is not None and args.weights is not None:
        args.parser.error("--weights goes with CFG, not --model")


def _run_profile(args: argparse.Namespace) -> int:
    import darknet_metal
    from darknet_metal.metal import is_available

    cfg, weights = args.cfg, args.weights
    if args.model is not None:
        # The bundled cfg, with its weights where they are cached (never downloaded here:
        # the time does not depend on them).
        cfg = get_spec(args.model).cfg
        cached = weights_path(args.model)
        weights = cached if cached.is_file() else None
    device = args.device or ("metal" if is_available("metal") else "emu")
    subdivisions = args.subdivisions
    if args.train and args.batch is not None and subdivisions is None:
        subdivisions = 1
    size = None if args.size is None else (args.size, args.size)
    net = darknet_metal.load(cfg, weights, device=device, batch=args.batch,
                             subdivisions=subdivisions if args.train else None,
                             input_size=size)
    if not args.train and args.batch is None:
        net.batch = 1
    print(f"profiling {'a training step' if args.train else 'a forward pass'} of {cfg} on "
          f"{device} ...", file=sys.stderr)
    profile = net.profile(train=args.train, repeats=args.repeats,
                          progress=lambda line: print(f"  {line} ...", file=sys.stderr,
                                                      flush=True))
    print(profile.table(args.top))
    if args.json is not None:
        text = (profile.to_json() + "\n").encode()
        atomic_write(args.json, lambda f: f.write(text))
    return 0
