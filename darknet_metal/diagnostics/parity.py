"""Layer-by-layer parity of a network on a Metal device (metal, emu or cuda) against the CPU.

Both backends run the whole network on the same input; the device runs on its own previous
outputs (as in real use), so differences accumulate with depth. Each layer's output is
compared with the CPU's by the maximum absolute difference and the normalised mean squared
error ``NMSE = sum((gpu - cpu)^2) / sum(cpu^2)``, and judged against one tolerance for every
layer, ``DEFAULT_TOLERANCE``: a max abs diff of 1e-3 x max|cpu| (plus ``ABS_FLOOR``) and an
NMSE of 1e-6. Convolutional and connected layers sum in float32 in another order; yolo and
softmax take exp/logistic of those sums; the others (data movement, pooling, shortcut, ...)
carry their inputs' differences. All stay far inside it.

A wrong index, stride or missing barrier gives differences of the order of the values
themselves (relative 1e-1 and more), far above these bounds; float32 reordering gives about
1e-6 relative.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.network import load

#: (max abs diff as a fraction of max |cpu| (plus ``ABS_FLOOR`` absolute), max NMSE), for every
#: layer: see the table above.
DEFAULT_TOLERANCE = (1e-3, 1e-6)
#: The same for ``precision="fp16"`` (half storage rounds every stored value to 11 bits):
#: 1e-2 of the largest value, NMSE 1e-4 (relative L2 1e-2).
HALF_TOLERANCE = (1e-2, 1e-4)
ABS_FLOOR = 1e-6


def compare(gpu: np.ndarray, cpu: np.ndarray,
            tolerance: tuple[float, float] = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Max abs diff, NMSE, the allowed values (``tolerance``: fraction of max |cpu|, max NMSE)
    and the verdict for one layer output."""
    g, c = gpu.astype(np.float64), cpu.astype(np.float64)
    diff = g - c
    finite = bool(np.isfinite(g).all())
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    denom = float((c * c).sum())
    nmse = float((diff * diff).sum()) / denom if denom > 0 else float((diff * diff).sum())
    rel, nmse_max = tolerance
    allowed = rel * (float(np.abs(c).max()) if c.size else 0.0) + ABS_FLOOR
    ok = finite and max_abs <= allowed and nmse <= nmse_max
    return {
        "max_abs": max_abs,
        "nmse": nmse,
        "allowed_max_abs": allowed,
        "allowed_nmse": nmse_max,
        "ok": ok,
    }


def run_parity(
    cfg: str | os.PathLike[str],
    weights: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    image: str | os.PathLike[str] | None = None,
    device: str = "emu",
    size: tuple[int, int] | None = None,
    gemm: str = "auto",
    input_seed: int = 0,
    progress: Callable[[str], None] | None = None,
    precision: str = "fp32",
) -> dict[str, Any]:
    """Run ``cfg`` on the CPU and on ``device`` and compare every layer's output.

    ``weights``: a ``.weights`` file, or None for random weights from ``seed``. ``image``: an
    image file prepared as ``detect`` does, or None for a uniform [0, 1) random input from
    ``input_seed``. ``size``: (W, H) replacing the [net] size (small sizes make the emulator
    fast). ``gemm``: the GPU backend's GEMM choice; ``precision``: the device's ("fp16" is
    judged by ``HALF_TOLERANCE``). ``progress``, when given, is called with
    a line at the start and end of each stage (loading, CPU pass, device pass; the end
    line with the seconds it took). Returns a JSON-serialisable report: the
    settings, device facts, ``layers`` (index, type, shape, where, kernels, reason, max_abs,
    nmse, allowed values, ok), timings in seconds and ``ok`` (every layer passed).
    """
    from darknet_metal.inference.image import load_image, prepare_input
    from darknet_metal.metal import device_info
    from darknet_metal.runtime.gpu_backend import GpuBackend

    say = progress if progress is not None else _silent
    source = "random weights" if weights is None else os.path.basename(os.fspath(weights))
    with _stage(say, f"loading {os.path.basename(os.fspath(cfg))} ({source})"):
        net = load(cfg, weights, seed=seed, input_size=size)
        c, h, w = net.input_shape
        if image is not None:
            letterbox = bool(net.config.net.values.get("letter_box"))
            x = prepare_input(load_image(image), w, h, letterbox)[None]
        else:
            x = np.random.default_rng(input_seed).random((1, c, h, w), dtype=np.float32)
        start = time.perf_counter()
        backend = GpuBackend(net.layers, net.params, np.float32, device=device, gemm=gemm,
                             precision=precision)
        load_s = time.perf_counter() - start
    layers_at = f"{len(net.layers)} layers at {w}x{h}"
    try:
        with _stage(say, f"CPU pass, {layers_at}"):
            start = time.perf_counter()
            cpu_outs = net.forward(x, outputs=range(len(net.layers)))
            cpu_s = time.perf_counter() - start
        with _stage(say, f"{device} pass, {layers_at}"):
            start = time.perf_counter()
            gpu_outs = [np.asarray(o) for o in backend.forward(x)]
            gpu_s = time.perf_counter() - start
        placements = backend.coverage()
        simd = backend.simd
    finally:
        backend.close()
    layers = []
    for spec, place, g, ref in zip(net.layers, placements, gpu_outs, cpu_outs, strict=True):
        row = {
            "index": spec.index,
            "type": spec.kind,
            "shape": list(spec.out_shape),
            "where": place.where,
            "kernels": list(place.kernels),
            "reason": place.reason,
        }
        row.update(compare(g, ref, HALF_TOLERANCE if precision == "fp16" else DEFAULT_TOLERANCE))
        layers.append(row)
    return {
        "cfg": os.fspath(cfg),
        "weights": None if weights is None else os.fspath(weights),
        "seed": seed if weights is None else None,
        "input": os.fspath(image) if image is not None else f"random (seed {input_seed})",
        "input_shape": [int(v) for v in x.shape],
        "device": device,
        "device_info": device_info(device),
        "gemm": "simd" if simd else "tiled",
        "precision": precision,
        "seconds": {"gpu_load": load_s, "cpu_forward": cpu_s, "gpu_forward": gpu_s},
        "layers": layers,
        "ok": all(row["ok"] for row in layers),
    }


def _training_inputs(net: Any, batch: int, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A random batch and truths the network's loss takes: a few boxes per image for
    detectors, a class per image for classifiers."""
    rng = np.random.default_rng(seed)
    c, h, w = net.input_shape
    x = rng.random((batch, c, h, w), dtype=np.float32)
    heads = [s for s in net.layers if s.detection_head is not None]
    if heads:
        classes = heads[-1].values["classes"]
        truths = []
        for _ in range(batch):
            k = int(rng.integers(1, 4))
            boxes = np.column_stack([rng.integers(0, classes, k), rng.uniform(0.15, 0.85, k),
                                     rng.uniform(0.15, 0.85, k), rng.uniform(0.1, 0.4, k),
                                     rng.uniform(0.1, 0.4, k)])
            truths.append(boxes.astype(np.float32))
        return x, truths
    classes = net.layers[-1].out_size
    return x, [np.float32(rng.integers(0, classes)) for _ in range(batch)]


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))


def judge_training_array(gpu: np.ndarray, cpu: np.ndarray, exact: np.ndarray | None,
                         tolerance: tuple[float, float] = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """``compare`` of a training array; beyond its bounds, judged against the CPU path run in
    float64 (``exact``), since the device's per-channel sums are trees and Darknet's serial
    float32 sums (the CPU's) are not exact on real sizes: the array passes when it is within
    twice Darknet's own relative L2 distance from float64 of the CPU's array, and no further
    from float64 than 2.5 times Darknet's distance plus the NMSE bound's relative L2. Such a
    row carries ``float64`` with both distances (``cpu``: Darknet's, ``device``: ours)."""
    row = compare(gpu, cpu, tolerance)
    if row["ok"] or exact is None or not np.isfinite(gpu).all():
        return row
    darknet, ours = _rel_l2(cpu, exact), _rel_l2(gpu, exact)
    bound = float(np.sqrt(tolerance[1]))
    if float(np.sqrt(row["nmse"])) <= 2.0 * darknet and ours <= 2.5 * darknet + bound:
        row.update(ok=True, float64={"cpu": darknet, "device": ours})
    return row


def _worst(triples: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]
           ) -> dict[str, Any] | None:
    """``judge_training_array`` of the worst of several (device, cpu, float64) arrays (None
    when there are none)."""
    rows = [judge_training_array(g, c, e) for g, c, e in triples]
    if not rows:
        return None
    return max(rows, key=lambda r: (not r["ok"], "float64" in r, r["nmse"]))


def run_training_parity(
    cfg: str | os.PathLike[str],
    weights: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    device: str = "emu",
    size: tuple[int, int] | None = None,
    batch: int = 2,
    input_seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One training step of ``cfg`` on the CPU and on ``device``, compared layer by layer:
    each layer's delta and its parameters' gradients (``Network.gradients``), then its
    parameters after one ``train_step`` (the cfg's optimizer and learning rate), each judged
    as ``compare`` judges an output. ``batch`` images (``subdivisions=1``) of a uniform
    random input from ``input_seed``, with random truths (a few boxes per image, or a
    class). Returns a JSON-serialisable report: the settings, ``layers`` (index, type,
    where it trained, reason, and ``delta``, ``gradients``, ``parameters``: max_abs, nmse,
    allowed values and ok, or None where the layer has none), the losses, timings and
    ``ok``."""
    say = progress if progress is not None else _silent
    source = "random weights" if weights is None else os.path.basename(os.fspath(weights))
    with _stage(say, f"loading {os.path.basename(os.fspath(cfg))} ({source}) on cpu and "
                     f"{device}"):
        nets = [load(cfg, weights, seed=seed, input_size=size, batch=batch, subdivisions=1,
                     device=d, dtype=t)
                for d, t in (("cpu", np.float32), (device, np.float32), ("cpu", np.float64))]
    # The float64 CPU run starts from the float32 weights: the exact reference of both.
    for i, params in nets[0].params.items():
        for name, value in params.items():
            nets[2].params[i][name][...] = value
    nets[2].params_changed()
    x, truths = _training_inputs(nets[0], batch, input_seed)
    seconds = {}
    results: dict[str, list[Any]] = {"gradients": [], "step": []}
    for what, label in (("gradients", "gradients"), ("step", "training step")):
        for net, name in zip(nets, ("cpu", device, "cpu_float64"), strict=True):
            with _stage(say, f"{name} {label}"):
                start = time.perf_counter()
                run = net.gradients if what == "gradients" else net.train_step
                results[what].append(run(x.astype(net.dtype), truths))
                seconds[f"{name}_{what}"] = time.perf_counter() - start
    grads, reports = results["gradients"], results["step"]
    cpu, dev, exact = nets
    placements = dev.executor.training_coverage()
    layers = []
    for spec, place in zip(cpu.layers, placements, strict=True):
        i = spec.index
        cpu_grads, dev_grads = grads[0].params.get(i, {}), grads[1].params.get(i, {})
        exact_grads = grads[2].params.get(i, {})
        delta = (_worst([(grads[1].deltas[i], grads[0].deltas[i], grads[2].deltas.get(i))])
                 if i in grads[0].deltas and i in grads[1].deltas else None)
        layers.append({
            "index": i, "type": spec.kind, "where": place.where, "reason": place.reason,
            "delta": delta,
            "gradients": _worst([(dev_grads[n], g, exact_grads.get(n))
                                 for n, g in cpu_grads.items()]),
            "parameters": _worst([(dev.params[i][n], a, exact.params[i][n])
                                  for n, a in cpu.params.get(i, {}).items()]),
        })
    ok = all(r[k] is None or r[k]["ok"] for r in layers
             for k in ("delta", "gradients", "parameters"))
    return {
        "cfg": os.fspath(cfg), "weights": None if weights is None else os.fspath(weights),
        "seed": seed if weights is None else None, "device": device,
        "input_shape": [int(v) for v in x.shape],
        "loss": {"cpu": reports[0].loss, device: reports[1].loss,
                 "cpu_float64": reports[2].loss},
        "gradients_loss": {"cpu": grads[0].loss, device: grads[1].loss,
                           "cpu_float64": grads[2].loss},
        "seconds": seconds, "layers": layers, "ok": ok,
    }


def format_training_report(report: dict[str, Any]) -> str:
    """A fixed-width text table of a ``run_training_parity`` report: per layer the NMSE of
    its delta, its gradients and its updated parameters (the worst array), and a verdict."""
    weights = report["weights"] or f"random (seed {report['seed']})"
    device = report["device"]
    lines = [
        f"cfg {report['cfg']}  weights {weights}  input {tuple(report['input_shape'])}  "
        f"device {device}",
        f"{'layer':>5} {'type':<15} {'trained on':<10} {'delta NMSE':>11} {'grad NMSE':>11} "
        f"{'param NMSE':>11}  verdict",
    ]
    failed = []
    for row in report["layers"]:
        cells, ok, exact = [], True, []
        for key in ("delta", "gradients", "parameters"):
            r = row[key]
            cells.append(f"{'-':>11}" if r is None else f"{r['nmse']:>11.2e}")
            ok &= r is None or r["ok"]
            if r is not None and "float64" in r:
                exact.append(f"{key}: from float64 cpu {r['float64']['cpu']:.1e}, "
                             f"{device} {r['float64']['device']:.1e}")
        if not ok:
            failed.append(row["index"])
        verdict = ("ok" if ok else "FAIL") + (f" ({'; '.join(exact)})" if exact else "")
        if row["reason"]:
            verdict += f"  [{row['reason']}]"
        lines.append(f"{row['index']:>5} {row['type']:<15} {row['where']:<10} "
                     + " ".join(cells) + f"  {verdict}")
    loss = report["loss"]
    lines.append(f"loss after the step: cpu {loss['cpu']:.6g}, {device} {loss[device]:.6g}")
    lines.append("PASS: every layer within tolerance" if not failed
                 else f"FAIL: layers {failed} outside tolerance")
    return "\n".join(lines)


def _silent(line: str) -> None:
    pass


@contextlib.contextmanager
def _stage(say: Callable[[str], None], what: str) -> Iterator[None]:
    """Report the start of a stage, then its end with the seconds it took."""
    say(f"{what} ...")
    start = time.perf_counter()
    yield
    say(f"{what}: done in {time.perf_counter() - start:.1f} s")


def format_report(report: dict[str, Any]) -> str:
    """A fixed-width text table of a ``run_parity`` report."""
    weights = report["weights"] or f"random (seed {report['seed']})"
    lines = [
        f"cfg {report['cfg']}  weights {weights}",
        f"input {report['input']} {tuple(report['input_shape'])}  device {report['device']} "
        f"({report['device_info']['name']}), {report['gemm']} GEMM",
        f"{'layer':>5} {'type':<15} {'output':<16} {'ran on':<9} {'max abs diff':>12} "
        f"{'NMSE':>10}  verdict",
    ]
    for row in report["layers"]:
        shape = "x".join(str(v) for v in row["shape"])
        where = row["where"]
        verdict = (
            "ok"
            if row["ok"]
            else (f"FAIL (allowed {row['allowed_max_abs']:.2e}, NMSE {row['allowed_nmse']:.0e})")
        )
        if row["reason"]:
            verdict += f"  [{row['reason']}]"
        lines.append(
            f"{row['index']:>5} {row['type']:<15} {shape:<16} {where:<9} "
            f"{row['max_abs']:>12.3e} {row['nmse']:>10.2e}  {verdict}"
        )
    failed = [r["index"] for r in report["layers"] if not r["ok"]]
    t = report["seconds"]
    lines.append(f"cpu {t['cpu_forward']:.2f} s, {report['device']} {t['gpu_forward']:.2f} s")
    lines.append(
        "PASS: every layer within tolerance"
        if not failed
        else f"FAIL: layers {failed} outside tolerance"
    )
    return "\n".join(lines)


def parse_size(text: str) -> tuple[int, int]:
    """``"WxH"`` (or ``"N"`` for a square) -> (W, H); ValueError otherwise."""
    parts = text.lower().split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ArgumentError(f"size must be WxH, e.g. 96x96, not {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) < 1:
        raise ArgumentError(f"size must be WxH with positive integers, not {text!r}")
    return values[0], values[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of ``tools/parity.py``; returns 0 when every layer passes, 1 when one
    fails, 2 for usage errors."""
    import argparse
    import json
    import sys

    from darknet_metal.errors import DarknetMetalError

    parser = argparse.ArgumentParser(
        prog="parity.py",
        description="Compare every layer of a Darknet network on a Metal "
        "device (or its CPU emulator) with the CPU reference. A line per stage (loading, "
        "CPU pass, device pass, with the seconds each took) goes to stderr as it runs.",
    )
    parser.add_argument("cfg", help="network .cfg file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--weights", help=".weights file")
    source.add_argument(
        "--random-seed",
        type=int,
        default=0,
        metavar="S",
        help="random weights from seed S (default 0) when no --weights",
    )
    inp = parser.add_mutually_exclusive_group()
    inp.add_argument("--image", help="input image, prepared as detect does")
    inp.add_argument(
        "--random-input", action="store_true", help="uniform random input (the default)"
    )
    parser.add_argument("--device", choices=("emu", "metal", "cuda"), default="emu")
    parser.add_argument(
        "--size", type=_size_arg, metavar="WxH", help="replace the [net] width and height"
    )
    parser.add_argument("--gemm", choices=("auto", "simd", "tiled"), default="auto")
    parser.add_argument(
        "--train",
        action="store_true",
        help="compare one training step instead of a forward pass: each layer's delta, "
        "gradients and updated parameters (random truths; see --batch)",
    )
    parser.add_argument("--batch", type=int, default=2, metavar="N",
                        help="images of the training step with --train (default 2)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON on stdout (progress lines still go to stderr)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if args.train and (args.image or args.gemm != "auto"):
        print("parity.py: error: --train takes no --image or --gemm", file=sys.stderr)
        return 2
    if args.batch < 1:
        print(f"parity.py: error: --batch must be >= 1, not {args.batch}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(f"parity.py: {line}", file=sys.stderr, flush=True)

    try:
        if args.train:
            report = run_training_parity(args.cfg, args.weights, seed=args.random_seed,
                                         device=args.device, size=args.size,
                                         batch=args.batch, progress=say)
        else:
            report = run_parity(args.cfg, args.weights, seed=args.random_seed,
                                image=args.image, device=args.device, size=args.size,
                                gemm=args.gemm, progress=say)
    except (DarknetMetalError, OSError) as e:
        print(f"parity.py: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    text = format_training_report(report) if args.train else format_report(report)
    print(json.dumps(report, indent=1) if args.json else text, flush=True)
    return 0 if report["ok"] else 1


def _size_arg(text: str) -> tuple[int, int]:
    import argparse

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
