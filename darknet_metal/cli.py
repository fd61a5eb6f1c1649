"""The ``darknet-metal`` command line.

``darknet-metal detect IMAGE...`` prints detections the way ``darknet detector test
-ext_output`` does and writes ``STEM_predictions.jpg`` per image; ``darknet-metal summary
CFG`` prints the layer table of a cfg. Errors the user can fix (a bad cfg, weights file,
image or device, a missing file) print one ``darknet-metal: error: ...`` line on stderr
and exit with status 1; command-line mistakes exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.errors import CfgError, DarknetMetalError, WeightsError
from darknet_metal.models import model_files, model_names
from darknet_metal.network import DEVICES

if TYPE_CHECKING:
    from darknet_metal.boxes import Detection

PROG = "darknet-metal"
DEFAULT_MODEL = "yolov3-tiny"

# Darknet never reports a class whose name starts with this (its way to hide classes).
_HIDDEN_PREFIX = "dont_show"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.run is _run_detect:
            _check_detect_args(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except (DarknetMetalError, OSError) as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run Darknet networks (.cfg + .weights)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    detect = commands.add_parser(
        "detect",
        help="detect objects in images",
        description=(
            "Print the detections of each image as `darknet detector test -ext_output` "
            "does, and write IMAGE's annotated copy as DIR/STEM_predictions.jpg. "
            f"Without --model or --cfg, the bundled {DEFAULT_MODEL} is used (its weights "
            "are downloaded on first use)."
        ),
    )
    detect.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    detect.add_argument(
        "--model", metavar="NAME", help=f"bundled model: {', '.join(model_names())}"
    )
    detect.add_argument("--cfg", metavar="C", type=Path, help="network .cfg file")
    detect.add_argument("--weights", metavar="W", type=Path, help=".weights file for --cfg")
    detect.add_argument("--names", metavar="N", type=Path, help="class names file, one a line")
    detect.add_argument(
        "--thresh", type=_unit_float, default=0.25, help="report boxes above this probability"
    )
    detect.add_argument(
        "--nms", type=_unit_float, default=0.45, help="IoU above which NMS drops a box"
    )
    detect.add_argument(
        "--out", metavar="DIR", type=Path, default=Path("."), help="where to write images"
    )
    detect.add_argument("--device", default="cpu", choices=DEVICES,
                        help="cpu, metal (Apple GPU) or emu (Metal kernels in the CPU emulator)")
    detect.set_defaults(run=_run_detect, parser=detect)

    summary = commands.add_parser(
        "summary",
        help="print the layer table of a cfg",
        description="Print the layers of CFG with their shapes and BFLOPs (no weights needed).",
    )
    summary.add_argument("cfg", metavar="CFG", type=Path, help="network .cfg file")
    summary.set_defaults(run=_run_summary)

    doctor = commands.add_parser(
        "doctor",
        help="check the Metal path on this machine",
        description=(
            "Print the device facts, build every kernel pipeline, compare every kernel and "
            "a yolov3-tiny network with the CPU reference on the device (Metal when "
            "available, else its CPU emulator) and print a report to paste into a bug "
            "report. Exits 1 if anything fails."
        ),
    )
    doctor.add_argument(
        "--device",
        choices=("metal", "emu"),
        default=None,
        help="device to check (default: metal when available, else emu)",
    )
    doctor.add_argument(
        "--size",
        type=int,
        default=96,
        metavar="N",
        help="yolov3-tiny input size for the network check (default 96)",
    )
    doctor.set_defaults(run=_run_doctor)
    return parser


def _run_doctor(args: argparse.Namespace) -> int:
    from darknet_metal.metal.doctor import run_doctor

    if args.size < 32 or args.size % 32:
        raise CfgError(f"--size must be a positive multiple of 32, not {args.size}")
    return 0 if run_doctor(args.device, size=args.size) else 1


def _check_detect_args(args: argparse.Namespace) -> None:
    if args.model is not None and (args.cfg is not None or args.weights is not None):
        args.parser.error("give either --model or --cfg with --weights, not both")
    if (args.cfg is None) != (args.weights is None):
        args.parser.error("--cfg and --weights go together")


def _run_detect(args: argparse.Namespace) -> int:
    net = _load_network(args)
    from darknet_metal.draw import draw_detections, save_image_atomic
    from darknet_metal.image import load_image

    args.out.mkdir(parents=True, exist_ok=True)
    failures = 0
    used: set[str] = set()
    for image in args.images:
        out_path = args.out / _output_name(Path(image).stem, used)
        try:
            rgb = _to_uint8_hwc(load_image(image))
            start = time.perf_counter()
            detections = net.detect(rgb, thresh=args.thresh, nms=args.nms)
            elapsed_ms = (time.perf_counter() - start) * 1000.0
            shown = [d for d in detections if not d.name.startswith(_HIDDEN_PREFIX)]
            lines = [f"{image}: Predicted in {elapsed_ms:f} milli-seconds."]
            lines += format_detections(shown)
            print("\n".join(lines), flush=True)
            save_image_atomic(draw_detections(rgb, shown), out_path)
        except (DarknetMetalError, OSError) as exc:
            message = str(exc)
            _error(message if str(image) in message else f"{image}: {message}")
            failures += 1
    return 1 if failures else 0


def _run_summary(args: argparse.Namespace) -> int:
    import darknet_metal

    _require_file(args.cfg, CfgError)
    print(darknet_metal.load(args.cfg).summary())
    return 0


def _load_network(args: argparse.Namespace) -> Any:
    """The network ``detect`` runs: a bundled model or --cfg/--weights (a darknet_metal.Network)."""
    import darknet_metal

    if args.cfg is None:
        files = model_files(args.model or DEFAULT_MODEL)
        cfg, weights, names = files.cfg, files.weights, files.names
    else:
        cfg, weights, names = args.cfg, args.weights, None
    if args.names is not None:
        names = args.names
    _require_file(cfg, CfgError)
    _require_file(weights, WeightsError)
    if names is not None and not Path(names).is_file():
        raise CfgError("names file not found", path=names)
    return darknet_metal.load(cfg, weights, names=names, device=args.device)


def format_detections(detections: Iterable[Detection]) -> list[str]:
    """Darknet's ``-ext_output`` lines for one image's detections.

    ``detections`` holds one entry per (box, class), as ``Network.detect`` returns them.
    Entries sharing a box are one Darknet detection: it prints the box's most probable
    class first (the lowest class id on a tie) and its other classes after it, in class id
    order, each as ``name: NN%\\t(left_x: ...   top_y: ...   width: ...   height: ...)``
    with pixel values rounded half away from zero; boxes come by increasing left edge.
    """
    boxes: dict[tuple[float, float, float, float], list[Detection]] = {}
    for det in detections:
        boxes.setdefault((det.left, det.top, det.width, det.height), []).append(det)
    lines = []
    for key in sorted(boxes, key=lambda box: box[0]):
        group = sorted(boxes[key], key=lambda d: d.class_id)
        best = max(group, key=lambda d: d.confidence)  # max keeps the first of equals
        for det in [best] + [d for d in group if d is not best]:
            lines.append(_format_line(det))
    return lines


def _format_line(det: Detection) -> str:
    # Darknet multiplies the float32 probability by 100 in float32 and prints with %.0f.
    percent = float(np.float32(det.confidence) * np.float32(100.0))
    left, top, width, height = (_c_round(v) for v in (det.left, det.top, det.width, det.height))
    return (
        f"{det.name}: {percent:.0f}%\t(left_x: {left:4.0f}   top_y: {top:4.0f}   "
        f"width: {width:4.0f}   height: {height:4.0f})"
    )


def _c_round(value: float) -> float:
    # C's round(): halves away from zero, and the sign survives (-0.3 prints as "-0").
    return math.copysign(math.floor(abs(value) + 0.5), value)


def _to_uint8_hwc(chw: np.ndarray) -> np.ndarray:
    """(3, H, W) float in [0, 1] -> (H, W, 3) uint8, exact for values that are k/255."""
    return np.ascontiguousarray(
        np.clip(np.rint(np.asarray(chw) * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
    )


def _output_name(stem: str, used: set[str]) -> str:
    # Two inputs with the same stem (a/dog.jpg, b/dog.png) must not overwrite each other.
    name, k = stem, 1
    while name in used:
        k += 1
        name = f"{stem}_{k}"
    used.add(name)
    return f"{name}_predictions.jpg"


def _require_file(path: str | os.PathLike[str], error: type[CfgError] | type[WeightsError]):
    if not Path(path).is_file():
        raise error("file not found", path=path)


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: '{text}'") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("darknet-metal")
    except PackageNotFoundError:
        return "(not installed)"


def _error(message: str) -> None:
    one_line = " ".join(message.split())
    print(f"{PROG}: error: {one_line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
