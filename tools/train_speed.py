"""How fast ``darknet-metal train`` iterates, as a user runs it: a shapes dataset, a bundled
model's cfg, the trainer's own command, and the iterations' times from its JSON-lines log.

    python tools/train_speed.py [--device cuda] [--model yolov4-tiny] [--size 416]
                                [--batch 64] [--images 640] [--iterations 40]
                                [--workers N] [--ranks K] [--work DIR] [--json FILE]

Makes ``--images`` shapes images at the size (``make-shapes``) and the cfg (``cfg --model
... --subdivisions 1 --max-batches N``) in ``--work`` (a temporary folder by default), runs
``python -m darknet_metal train DATA CFG --device D`` (``--workers`` when given, else the
trainer's default), and prints the median over the iterations after the first five: wall time
an iteration (the log's timestamps), the step (``train_seconds``), the wait for the loader
(``load_seconds``) and its share, and images per second. ``--ranks K`` runs the command under
``mpirun -n K --bind-to none`` (each rank ``--batch`` images of an iteration, on its own GPU
of the machine), adding the all-reduce's bytes and time from the log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args: list[str], ranks: int = 1) -> None:
    command = [sys.executable, "-m", "darknet_metal", *args]
    launcher: list[str] = []
    if ranks > 1:
        # Not bound to a core each (Open MPI's default for few ranks): the loaders need
        # the machine's cores.
        launcher = [shutil.which("mpirun") or "mpirun", "-n", str(ranks), "--bind-to", "none"]
        if os.geteuid() == 0:
            launcher.append("--allow-run-as-root")
    print("$ " + " ".join(launcher) + (" " if launcher else "") + "darknet-metal "
          + " ".join(args), flush=True)
    subprocess.run([*launcher, *command], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="yolov4-tiny")
    parser.add_argument("--size", type=int, default=416)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", type=int, default=640)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--skip", type=int, default=5, help="first iterations left out")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="train-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = work / "shapes"
    size = f"{args.size}x{args.size}"
    if not (shapes / "shapes.data").is_file():
        run(["make-shapes", str(shapes), "--train", str(args.images), "--valid", "16",
             "--size", size, "-q"])
    cfg = work / f"{args.model}-speed.cfg"
    run(["cfg", "--model", args.model, "--classes", "3", "--size", size, "--batch",
         str(args.batch), "--subdivisions", "1", "--max-batches", str(args.iterations),
         str(cfg)])
    backup = work / f"backup-{os.getpid()}-{time.time_ns()}"
    train = ["train", str(shapes / "shapes.data"), str(cfg), "--device", args.device,
             "--backup", str(backup), "--no-chart", "-q"]
    if args.workers is not None:
        train += ["--workers", str(args.workers)]
    started = time.perf_counter()
    run(train, args.ranks)
    total = time.perf_counter() - started
    records = [json.loads(line) for line in
               (backup / f"{cfg.stem}.jsonl").read_text().splitlines() if line.strip()]
    kept = records[args.skip:]
    walls = [b["time"] - a["time"] for a, b in zip(records[args.skip - 1:], kept, strict=False)]
    result = {
        "device": args.device, "model": args.model, "size": args.size, "batch": args.batch,
        "ranks": args.ranks, "workers": args.workers, "iterations": len(records),
        "process_seconds": total,
        "iteration_ms": 1e3 * statistics.median(walls),
        "train_ms": 1e3 * statistics.median(r["train_seconds"] for r in kept),
        "load_ms": 1e3 * statistics.median(r["load_seconds"] for r in kept),
    }
    result["load_share"] = result["load_ms"] / result["iteration_ms"]
    result["images_per_second"] = args.ranks * args.batch / (result["iteration_ms"] / 1e3)
    reduced = ""
    if args.ranks > 1:
        result["allreduce_bytes"] = kept[-1]["allreduce_bytes"]
        result["allreduce_ms"] = 1e3 * statistics.median(r["allreduce_seconds"] for r in kept)
        reduced = (f", all-reduce {result['allreduce_bytes'] / 1e6:.1f} MB in "
                   f"{result['allreduce_ms']:.1f} ms")
    print(json.dumps(result))
    print(f"{args.model} {size} batch {args.batch} x {args.ranks} rank(s) on {args.device}: "
          f"{result['iteration_ms']:.1f} ms an iteration (step {result['train_ms']:.1f}, "
          f"loader wait {result['load_ms']:.1f} = {100 * result['load_share']:.1f}%"
          f"{reduced}), {result['images_per_second']:.0f} img/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
