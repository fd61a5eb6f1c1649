"""``darknet-metal train DATA CFG [WEIGHTS]``: Darknet's ``detector train`` without a prompt
or a display.

The dataset is read and checked first (a dataset with errors is refused with the messages
``check-data`` prints); the network is loaded from WEIGHTS (a whole file, a backbone holding
its first layers, or a ``_last`` checkpoint whose training state is then restored); the
loader (``darknet_metal.training.loading``) feeds a ``TrainingRun`` (``training/session.py``), which
writes the weights, logs and chart into the dataset's ``backup`` folder (``--backup``).
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from darknet_metal.cli_args import non_negative_int, positive_int, seed
from darknet_metal.training import cfg_command

if TYPE_CHECKING:
    from darknet_metal.training.from_model import Prepared

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Add ``train`` and ``cfg`` to ``commands`` (an argparse subparsers object)."""
    from darknet_metal.network import DEVICES

    train = commands.add_parser(
        "train",
        help="train a detector on a dataset, as `darknet detector train`",
        description=(
            "Train CFG on DATA (a Darknet .data file or an ultralytics dataset .yaml) from "
            "WEIGHTS (a whole .weights file, a backbone such as yolov4-tiny.conv.29 holding "
            "the first layers, whose other layers are then initialised, or a "
            "<cfg>_last.weights checkpoint, which resumes exactly when its .state is beside "
            "it), up to the cfg's max_batches. Writes <cfg>_last.weights (+ .state) every "
            "100 iterations, <cfg>_<N>.weights, <cfg>_best.weights with --map and "
            "<cfg>_final.weights into the backup folder, with <cfg>.log (Darknet's line per "
            "iteration), <cfg>.jsonl (a JSON record per iteration) and chart_<cfg>.png. "
            "Never prompts; Ctrl-C writes <cfg>_last and exits with status 130. Under "
            "`mpirun -n K` the K processes train one network together, each on its share "
            "of K x batch images per iteration (pip install \"darknet-metal[mpi]\")."
        ),
    )
    train.add_argument("data", metavar="DATA", type=Path, help=".data or .yaml dataset file")
    train.add_argument("cfg", metavar="CFG", type=Path, nargs="?",
                       help="network .cfg file (or --model NAME)")
    train.add_argument("weights", metavar="WEIGHTS", type=Path, nargs="?",
                       help="weights to start from (default: Darknet's random initialisation)")
    model = train.add_argument_group(
        "from a bundled model, instead of CFG and WEIGHTS",
        "--model NAME writes NAME's cfg for DATA's classes into the backup folder as "
        "<model>-<data>.cfg (as `darknet-metal cfg` does), makes the backbone Darknet's README "
        "names for NAME from its COCO weights (the model cache, downloaded once, or --weights) "
        "and trains from it; every derived value is printed once with where it came from.")
    cfg_command.add_cfg_arguments(model, data=False, model_required=False, batch_default=None,
                                  planner=True)
    model.add_argument("--weights", dest="coco_weights", type=Path, metavar="FILE",
                       help="the model's COCO weights (default: the model cache)")
    train.add_argument("--device", default="cpu", choices=DEVICES,
                       help="cpu, metal, emu or cuda (default: %(default)s)")
    train.add_argument("--seed", type=seed, default=0,
                       help="seeds the initialisation, the batches, the augmentation and "
                       "dropout: two runs with the same seed give the same weights "
                       "(default: %(default)s)")
    train.add_argument("--map", action="store_true",
                       help="evaluate mAP@0.50 on the valid set as Darknet does (once per "
                       "epoch, at least every 100 iterations, from burn_in) and keep "
                       "<cfg>_best.weights")
    train.add_argument("--map-every", type=positive_int, metavar="N",
                       help="evaluate every N iterations instead (implies --map)")
    train.add_argument("--clear", action="store_true",
                       help="start the counters (seen, iteration, schedule) at 0 whatever "
                       "WEIGHTS recorded")
    train.add_argument("--backup", type=Path, metavar="DIR",
                       help="where to write (default: the dataset's backup, else ./backup)")
    train.add_argument("--workers", type=non_negative_int, default=None, metavar="N",
                       help="workers loading and augmenting images: processes on cuda and "
                       "metal, threads on cpu and emu (default: from the CPUs, shared among "
                       "the ranks of one machine under mpirun: processes one per CPU but "
                       "one, threads one per CPU up to 8; at least 2)")
    train.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    train.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    train.add_argument("--check-every", type=non_negative_int, default=50, metavar="N",
                       help="under mpirun: compare the ranks' parameters every N iterations "
                       "(0: never; default: %(default)s)")
    train.set_defaults(run=run_train)
    cfg_command.add_command(commands)


def run_train(args: argparse.Namespace) -> int:
    """Exit status: 0 when max_batches was reached, 130 after Ctrl-C. Launched by mpirun
    as several processes, they train one network together (``training.distributed``)."""
    from darknet_metal.training.distributed import Collective

    args.collective = collective = Collective.from_environment(args.check_every)
    if collective is None:
        return _train(args)
    with collective.guard():
        return _train(args, quiet=collective.rank != 0)


def _train(args: argparse.Namespace, quiet: bool = False) -> int:
    from darknet_metal.training.checkpoint import describe_earlier_checkpoint
    from darknet_metal.training.run import TrainingSetup

    collective = getattr(args, "collective", None)
    prepared = _from_model(args, quiet)
    try:
        setup = TrainingSetup.from_args(args)
    except BaseException:
        if prepared is not None:  # a refused dataset or cfg: --model's files go too
            prepared.remove_created()
        raise
    if collective is not None:
        # Every rank names where it trains (its GPU, under mpirun on a machine with several).
        _note(f"rank {collective.rank} of {collective.size} on {socket.gethostname()}: "
              f"{setup.device_description()}")
    if quiet:
        return 130 if setup.run(progress=False).interrupted else 0
    say = (lambda message: None) if args.quiet else _note
    for line in setup.describe():
        say(line)
    # Said even with -q: the first checkpoint replaces an earlier run's files.
    earlier = describe_earlier_checkpoint(setup.run_.path("last"),
                                          None if args.clear else args.weights)
    if earlier is not None:
        _note(earlier)
    for warning in setup.warnings():
        _note(f"warning: {warning}")
    if not args.quiet:  # a timed step: only when it is said
        _note(setup.projection())
    result = setup.run(progress=not args.quiet)
    if result.interrupted:
        _note(f"interrupted at iteration {result.iteration}: wrote {setup.run_.path('last')}")
        return 130
    summary = f"reached max_batches={result.iteration}: wrote {result.final_weights}"
    if result.best_map is not None:
        summary += (f"; mAP@0.50 last {100 * result.last_map:.2f}%, best "
                    f"{100 * result.best_map:.2f}%")
    _note(summary)
    return 0


#: The options that only --model takes, by destination.
_MODEL_OPTIONS = ("classes", "size", "batch", "subdivisions", "max_batches", "burn_in",
                  "coco_weights")


def _from_model(args: argparse.Namespace, quiet: bool) -> Prepared | None:
    """With --model: derive the cfg and make the backbone, then train from them (what was
    made; None without --model)."""
    from darknet_metal.errors import ArgumentError

    if args.model is None:
        given = [name for name in _MODEL_OPTIONS if getattr(args, name) is not None]
        if args.anchors != "model":
            given.append("anchors")
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')} needs --model NAME")
        if args.cfg is None:
            raise ArgumentError("give CFG (and WEIGHTS) or --model NAME")
        return None
    if args.cfg is not None:
        raise ArgumentError(f"give CFG or --model, not both (got {args.cfg} and --model "
                            f"{args.model})")
    from darknet_metal.training.from_model import prepare

    if args.batch is None:
        args.batch = 64
    collective = getattr(args, "collective", None)
    if collective is not None and not collective.writes:
        # Rank 0 derives and writes the cfg and the backbone; the others train from them
        # (on several machines the folder must be shared, as the dataset is).
        args.cfg, args.weights = collective.from_rank_0(None)
        return None
    say = (lambda line: None) if quiet or args.quiet else (lambda line: _note(line))
    prepared = prepare(args, say)
    args.cfg, args.weights = prepared.cfg, prepared.backbone
    if collective is not None:
        collective.from_rank_0((str(prepared.cfg), str(prepared.backbone)))
    return prepared


def _note(message: str) -> None:
    print(f"darknet-metal: {message}", file=sys.stderr, flush=True)
