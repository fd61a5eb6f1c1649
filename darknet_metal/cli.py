"""The ``darknet-metal`` command line.

``darknet-metal detect IMAGE...`` prints detections the way ``darknet detector test
-ext_output`` does and writes ``STEM_predictions.jpg`` per image; ``darknet-metal summary
CFG`` prints the layer table of a cfg; ``check-data`` and ``make-shapes`` (in
``darknet_metal.datasets.cli``) check a dataset and write the shapes demo set. Errors the
user can fix (a bad cfg, weights file, image, dataset or device, a missing file) print one
``darknet-metal: error: ...`` line on stderr and exit with status 1; command-line mistakes
exit with status 2. Every input path is checked before a model is downloaded or loaded,
and a failed command leaves no folder behind (``--out`` is made when the first annotated
image is written).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cli_args import multiple_of_32, positive_int, unit_float
from darknet_metal.datasets import cli as datasets_cli
from darknet_metal.diagnostics import profile_command as profile_cli
from darknet_metal.errors import CfgError, DarknetMetalError, ImageError, WeightsError
from darknet_metal.evaluation import cli as evaluation_cli
from darknet_metal.export import cli as export_cli
from darknet_metal.inference.boxes import shown
from darknet_metal.model.bundled import SAMPLE_IMAGE, model_files, model_names
from darknet_metal.network import DEVICES, load
from darknet_metal.serving import server as serving_cli
from darknet_metal.training import cli as training_cli

if TYPE_CHECKING:
    from darknet_metal.inference.boxes import Detection

PROG = "darknet-metal"
DEFAULT_MODEL = "yolov3-tiny"



def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.run in (_run_detect, _run_video):
            _check_detect_args(args)
        # A command's own checks of argument combinations: usage errors (status 2).
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except (DarknetMetalError, OSError) as exc:
        _error(exc.cli_message if isinstance(exc, WeightsError) else str(exc))
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
            "are downloaded on first use). The first forward pass (plan, buffers, "
            "pipelines) runs once on a blank input before the first image and is timed "
            "apart, on stderr; the per-image times leave it out."
        ),
    )
    detect.add_argument(
        "images",
        nargs="*",
        metavar="IMAGE",
        help="image files; alpha is ignored, as Darknet does (a warning says so when an "
        "image has transparent pixels). Without any, the bundled sample image (Darknet's "
        "dog.jpg) is used",
    )
    detect.add_argument(
        "--list",
        metavar="FILE",
        type=Path,
        help="a text file of image paths, one a line (blank lines skipped), as `darknet "
        "detector test ... < FILE` reads them; detected after the IMAGE arguments",
    )
    detect.add_argument(
        "--json",
        metavar="FILE",
        type=Path,
        help="also write every image's detections to FILE in the JSON of Darknet's "
        "`-out result.json`",
    )
    _add_model_arguments(detect)
    detect.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=Path("."),
        help="where to write images, made when the first one is written (default: %(default)s)",
    )
    detect.set_defaults(run=_run_detect, parser=detect)

    video = commands.add_parser(
        "video",
        help="detect objects in a video file",
        description=(
            "Detect in every frame of VIDEO (decoded with OpenCV: pip install "
            '"darknet-metal[video]") through a pipelined stream, with a progress bar and '
            "the frame rate on stderr; --out writes the frames with boxes, labels and an "
            "FPS counter, as Darknet's video example draws them, at the source's size and "
            "frame rate; --json writes each frame's detections in Darknet's JSON. "
            f"Without --model or --cfg, the bundled {DEFAULT_MODEL} is used."
        ),
    )
    video.add_argument("video", metavar="VIDEO", type=Path, help="video file")
    video.add_argument("--out", metavar="FILE", type=Path,
                       help="annotated video to write (.mp4, .mov, .m4v, .mkv, .avi)")
    video.add_argument("--json", metavar="FILE", type=Path,
                       help="write every frame's detections to FILE (Darknet's JSON)")
    video.add_argument("--batch", metavar="N", type=positive_int, default=1,
                       help="frames per pass (default: %(default)s)")
    video.add_argument("--no-fps", action="store_true",
                       help="leave the FPS counter off the annotated frames")
    video.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_model_arguments(video)
    video.set_defaults(run=_run_video, parser=video)

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
            "Print the device facts, build every kernel pipeline, compare every kernel (the "
            "cases the kernel tests run) and a yolov3-tiny network with the CPU reference "
            "on the device (Metal when available, else its CPU emulator) and print a "
            "report to paste into a bug report. Exits 1 if anything fails."
        ),
    )
    doctor.add_argument(
        "--device",
        choices=("metal", "emu", "cuda"),
        default=None,
        help="device to check: metal (Apple GPU), emu (CPU emulator) or cuda (the same "
        "kernels on an NVIDIA GPU, for verification) (default: metal when available, else emu)",
    )
    doctor.add_argument(
        "--size",
        type=multiple_of_32,
        default=96,
        metavar="N",
        help="yolov3-tiny input size for the network check, a multiple of 32 "
        "(default: %(default)s)",
    )
    doctor.set_defaults(run=_run_doctor)

    build_kernels = commands.add_parser(
        "build-kernels",
        help="compile the emulator's kernels and the CUDA modules ahead of first use",
        description=(
            "Compile now what the first use of a device would compile: the emulator's kernel "
            "library (device emu) and, where nvcc is found, the CUDA modules (device cuda), "
            "into the per-user kernel cache ($DARKNET_METAL_KERNEL_CACHE, default "
            "~/.cache/darknet_metal/kernels). A build already there is kept. For CI, images "
            "and offline machines."
        ),
    )
    build_kernels.add_argument(
        "--device",
        choices=("emu", "cuda", "all"),
        default="emu",
        help="what to compile: emu, cuda (needs nvcc) or all (cuda only where nvcc is found) "
        "(default: %(default)s)",
    )
    build_kernels.set_defaults(run=_run_build_kernels)

    partial = commands.add_parser(
        "partial",
        usage="darknet-metal partial [-h] (CFG WEIGHTS OUT N | --model NAME OUT [N])",
        help="keep the first layers of a weights file (a backbone to train from)",
        description=(
            "Write the parameters of the first N layers of CFG, read from WEIGHTS, to OUT "
            "with seen = 0, as `darknet partial` does (yolov4-tiny.conv.29 is yolov4-tiny's "
            "first 29). Training loads such a file and initialises the other layers. With "
            "--model NAME, the bundled model's cfg and COCO weights (the model cache, "
            "downloaded once) stand for CFG and WEIGHTS, and N defaults to the backbone "
            "Darknet's README names (yolov3-tiny.conv.15, yolov4-tiny.conv.29, "
            "yolov4.conv.137)."
        ),
    )
    partial.add_argument("files", metavar="FILE", nargs="+",
                         help="CFG (network .cfg file), WEIGHTS (.weights file holding at "
                         "least the first N layers), OUT (the .weights file to write) and N "
                         "(how many layers to keep, counted from the first); with --model, "
                         "OUT and N")
    partial.add_argument("--model", metavar="NAME", choices=model_names(),
                         help=f"bundled model instead of CFG and WEIGHTS: "
                         f"{', '.join(model_names())}")
    partial.set_defaults(run=_run_partial)
    datasets_cli.add_commands(commands)
    evaluation_cli.add_commands(commands)
    training_cli.add_commands(commands)
    serving_cli.add_commands(commands)
    profile_cli.add_commands(commands)
    export_cli.add_commands(commands, load)
    return parser


def _run_partial(args: argparse.Namespace) -> int:
    import darknet_metal
    from darknet_metal.errors import ArgumentError
    from darknet_metal.model.bundled import get_spec
    from darknet_metal.model.weights import WeightsHeader, read_weights_prefix, write_weights

    files = args.files
    if args.model is None:
        if len(files) != 4:
            raise ArgumentError(f"partial takes CFG WEIGHTS OUT N (or --model NAME OUT [N]); "
                                f"got {len(files)} argument(s): {' '.join(files)}")
        cfg, weights, out, n = Path(files[0]), Path(files[1]), Path(files[2]), files[3]
        _check_file(cfg, "cfg", lambda message: CfgError(message, path=cfg))
        _check_file(weights, "weights", lambda message: WeightsError(message, path=weights))
    else:
        if len(files) > 2:
            raise ArgumentError(f"with --model, partial takes OUT [N] (the model's cfg and "
                                f"weights stand for CFG and WEIGHTS); got {' '.join(files)}")
        spec = get_spec(args.model)
        cfg, weights = spec.cfg, model_files(args.model, download=True).weights
        out = Path(files[0])
        n = files[1] if len(files) == 2 else str(spec.backbone_layers)
    try:
        layers = positive_int(n)
    except argparse.ArgumentTypeError as e:
        raise ArgumentError(f"N (how many layers to keep): {e}") from None
    net = darknet_metal.load(cfg)
    _, params, coverage = read_weights_prefix(weights, net.layers, upto=layers)
    kept = [i for i in coverage.loaded if i < layers]
    write_weights(out, net.layers, params, WeightsHeader(seen=0), upto=layers)
    _note(f"wrote {out}: the parameters of layers 0-{layers - 1} "
          f"({len(kept)} with parameters) from {weights}")
    return 0


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The network, thresholds and device options ``detect`` and ``video`` share."""
    parser.add_argument(
        "--model", metavar="NAME", help=f"bundled model: {', '.join(model_names())}"
    )
    parser.add_argument("--cfg", metavar="C", type=Path, help="network .cfg file")
    parser.add_argument("--weights", metavar="W", type=Path, help=".weights file for --cfg")
    parser.add_argument("--names", metavar="N", type=Path, help="class names file, one a line")
    parser.add_argument(
        "--thresh",
        type=unit_float,
        default=0.25,
        help="report boxes above this probability (default: %(default)s)",
    )
    parser.add_argument(
        "--nms",
        type=unit_float,
        default=0.45,
        help="IoU above which NMS drops a box (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="cpu, metal (Apple GPU), emu (Metal kernels in the CPU emulator) or cuda (the "
        "same kernels on an NVIDIA GPU, for verification) (default: %(default)s)",
    )


def _run_doctor(args: argparse.Namespace) -> int:
    from darknet_metal.diagnostics.doctor import run_doctor

    return 0 if run_doctor(args.device, size=args.size) else 1


def _run_build_kernels(args: argparse.Namespace) -> int:
    from darknet_metal.metal import kernel_build

    if args.device in ("emu", "all"):
        print(f"emu: {os.path.dirname(kernel_build.emu_library())}")
    if args.device == "cuda" or (args.device == "all" and kernel_build.nvcc_path()):
        modules = kernel_build.cuda_modules()
        print(f"cuda: {os.path.dirname(modules[0])} ({len(modules)} modules)")
    elif args.device == "all":
        print("cuda: skipped, no nvcc found")
    return 0


def _check_detect_args(args: argparse.Namespace) -> None:
    if args.model is not None and (args.cfg is not None or args.weights is not None):
        args.parser.error("give either --model or --cfg with --weights, not both")
    if (args.cfg is None) != (args.weights is None):
        args.parser.error("--cfg and --weights go together")


def _image_list(path: Path) -> list[str]:
    """The image paths of a ``--list`` file, one a line; ImageError naming the file if it
    cannot be read or lists nothing."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ImageError(f"{path}: cannot read the image list: {exc}") from exc
    images = [line.strip() for line in text.splitlines() if line.strip()]
    if not images:
        raise ImageError(f"{path}: the image list names no image")
    return images


def _run_detect(args: argparse.Namespace) -> int:
    if args.list is not None:
        args.images = [*args.images, *_image_list(args.list)]
    if args.json is not None and args.json.is_dir():
        _error(f"{args.json}: --json is a directory")
        return 1
    if not args.images:
        args.images = [str(SAMPLE_IMAGE)]
        _note(f"no IMAGE given: detecting in the bundled sample {SAMPLE_IMAGE}")
    # Cheap checks first: a missing file is reported before a model is downloaded or loaded.
    _check_model_paths(args)
    if args.out.exists() and not args.out.is_dir():
        _error(f"{args.out}: --out is not a directory")
        return 1
    used: set[str] = set()
    out_names = [_output_name(Path(image).stem, used) for image in args.images]
    failures = 0
    todo = []
    from darknet_metal.inference.image import check_image_header

    for image, out_name in zip(args.images, out_names, strict=True):
        try:
            _check_file(image, "image", lambda message, i=image: ImageError(f"{i}: {message}"))
            check_image_header(image)
        except ImageError as exc:
            _error(str(exc))
            failures += 1
        else:
            todo.append((image, out_name))
    if not todo:
        return 1

    net = _load_network(args)
    from darknet_metal.inference.detection_json import frame_entry, write_detections_json
    from darknet_metal.inference.draw import draw_detections, save_image_atomic
    from darknet_metal.inference.image import load_image

    _warm_up(net)
    # Images stream through the network (read ahead, boxes decoded in a worker); the ones
    # handed to it wait here, in order, for their detections.
    handed: deque[tuple[str, str, np.ndarray]] = deque()
    failed: list[str] = []

    def report(image: str, exc: Exception) -> None:
        message = str(exc)
        _error(message if str(image) in message else f"{image}: {message}")
        failed.append(image)

    def frames() -> Iterator[np.ndarray]:
        for image, out_name in todo:
            try:
                if _has_transparent_pixels(image):
                    _warn(
                        f"{image}: has transparent pixels; alpha is ignored, as Darknet does "
                        "(they are read with the colours stored under them)"
                    )
                rgb = _to_uint8_hwc(load_image(image))
            except (DarknetMetalError, OSError) as exc:
                report(image, exc)
                continue
            handed.append((image, out_name, rgb))
            yield rgb

    entries = []
    stream = net.stream(frames(), thresh=args.thresh, nms=args.nms, batch=1)
    for k, detections in enumerate(stream):
        image, out_name, rgb = handed.popleft()
        try:
            # One frame per pass: pass k is this image's; its forward time is Darknet's.
            elapsed_ms = stream.timings[k].device * 1000.0
            reported = shown(detections)
            lines = [f"{image}: Predicted in {elapsed_ms:f} milli-seconds."]
            lines += format_detections(reported)
            print("\n".join(lines), flush=True)
            height, width = rgb.shape[:2]
            entries.append(frame_entry(len(entries) + 1, detections, width, height,
                                       filename=str(image)))
            args.out.mkdir(parents=True, exist_ok=True)
            save_image_atomic(draw_detections(rgb, reported), args.out / out_name)
        except (DarknetMetalError, OSError) as exc:
            report(image, exc)
    if args.json is not None:
        write_detections_json(args.json, entries)
    return 1 if failures or failed else 0


def _run_video(args: argparse.Namespace) -> int:
    from darknet_metal.inference.detection_json import frame_entry, write_detections_json
    from darknet_metal.inference.video import detect_video, open_video

    _check_model_paths(args)
    for option in (args.out, args.json):
        if option is not None and option.is_dir():
            _error(f"{option}: is a directory")
            return 1
    info, frames = open_video(args.video)  # a bad video is reported before loading a model
    frames.close()
    net = _load_network(args)
    _warm_up(net)
    entries: list[dict[str, Any]] = []

    def record(index: int, detections: list[Detection]) -> None:
        if args.json is not None:
            entries.append(frame_entry(index + 1, detections, info.width, info.height))

    report = detect_video(net, args.video, out=args.out, thresh=args.thresh, nms=args.nms,
                          batch=args.batch, fps_overlay=not args.no_fps, on_frame=record,
                          progress=not args.quiet)
    if args.json is not None:
        write_detections_json(args.json, entries)
    print(f"{args.video}: {report.frames} frames, {report.boxes} detections, "
          f"{report.fps:.1f} FPS ({report.seconds:.2f} s)"
          + (f"; wrote {args.out}" if args.out is not None else ""), flush=True)
    return 0


def _warm_up(net: Any) -> None:
    """Run one forward pass on a blank input and report its time on stderr.

    The first pass plans the program and makes buffers and pipelines (hundreds of ms, against
    tens for the next ones), so it is kept out of the per-image times Darknet's lines print.
    """
    start = time.perf_counter()
    net.warmup(batch=1)
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    print(
        f"{PROG}: warm-up: {elapsed_ms:.1f} ms (first forward pass, not in the times below)",
        file=sys.stderr,
        flush=True,
    )


def _has_transparent_pixels(path: str | os.PathLike[str]) -> bool:
    """True when the image file has an alpha channel (or a transparent colour) that is not
    fully opaque. Only such files are decoded here; a file Pillow cannot read gives False
    (``load_image`` reports it)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            if not im.has_transparency_data:
                return False
            alpha = im.convert("RGBA").getchannel("A")
            return alpha.getextrema()[0] < 255
    except Exception:  # Pillow raises many types for corrupt data; load_image reports them
        return False


def _run_summary(args: argparse.Namespace) -> int:
    import darknet_metal

    _check_file(args.cfg, "cfg", lambda message: CfgError(message, path=args.cfg))
    print(darknet_metal.load(args.cfg).summary())
    return 0


def _check_model_paths(args: argparse.Namespace) -> None:
    """CfgError / WeightsError for a --cfg, --weights or --names that is not a readable file."""
    if args.cfg is not None:
        _check_file(args.cfg, "cfg", lambda message: CfgError(message, path=args.cfg))
        _check_file(
            args.weights, "weights", lambda message: WeightsError(message, path=args.weights)
        )
    if args.names is not None:
        _check_file(args.names, "names", lambda message: CfgError(message, path=args.names))


def _load_network(args: argparse.Namespace) -> Any:
    """The network ``detect`` runs: a bundled model or --cfg/--weights (a darknet_metal.Network).

    The paths given on the command line were checked by ``_check_model_paths``."""
    import darknet_metal

    if args.cfg is None:
        files = model_files(args.model or DEFAULT_MODEL)
        cfg, weights, names = files.cfg, files.weights, files.names
    else:
        cfg, weights, names = args.cfg, args.weights, None
    if args.names is not None:
        names = args.names
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


def _check_file(
    path: str | os.PathLike[str], kind: str, error: Callable[[str], Exception]
) -> None:
    """Raise ``error(message)`` unless ``path`` is a regular file this process can open.

    ``kind`` ("cfg", "weights", "names", "image") names the file in the message. The file is
    opened and closed at once; nothing is read (and a FIFO is never opened)."""
    p = Path(path)
    a_kind = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} file"
    if p.is_dir():
        raise error(f"is a directory, not {a_kind}")
    if not p.exists():
        raise error(f"{kind} file not found")
    if not p.is_file():
        raise error(f"not a regular file, so not {a_kind}")
    try:
        with open(p, "rb"):
            pass
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}") from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("darknet-metal")
    except PackageNotFoundError:
        return "(not installed)"


def _error(message: str) -> None:
    one_line = " ".join(message.split())
    print(f"{PROG}: error: {one_line}", file=sys.stderr, flush=True)


def _warn(message: str) -> None:
    one_line = " ".join(message.split())
    print(f"{PROG}: warning: {one_line}", file=sys.stderr, flush=True)


def _note(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
