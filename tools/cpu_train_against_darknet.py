"""CPU training speed beside the real Darknet on the same machine: the same cfg, batch and data.

    python tools/cpu_train_against_darknet.py --darknet-source CLONE --work DIR
        [--models yolov3-tiny yolov4-tiny] [--sizes 224 416] [--batch 16]
        [--iterations 10] [--skip 3] [--threads N] [--rounds 2] [--json FILE]

``--darknet-source`` is a git clone of hank-ai/darknet; ``darknet_cpu_build.py`` builds its
CPU trainer in ``DIR/darknet`` (the golden data's commit and fixes; reused when there). Per
size, ``make-shapes`` makes the training images; per model, ``darknet-metal cfg`` writes the
cfg (3 classes, subdivisions 1, ``--iterations`` batches, ``random=0`` so that both train at
the size asked for), and both programs train from it.

Each round runs, per model and size, Darknet under each thread setting and then
``darknet-metal train --device cpu``, one after the other (so a slow spell of the machine
touches both). Darknet's settings (``--threads`` N, default the CPUs this process may use):

- ``stock``: as shipped; OpenMP's default threads, OpenBLAS pinned to 1 by Darknet itself;
- ``blas-N omp-1`` and ``blas-N omp-N``: Darknet's pin lifted by the preloaded library, so
  ``OPENBLAS_NUM_THREADS`` decides.

An iteration's time is the gap between two iterations' ends: for Darknet, the arrival of its
iteration lines (flushed as each ends), for ours the JSON-lines log's timestamps. Both hold
the wait for the loader, the step and the update. The first ``--skip`` gaps are left out and
the median of the rest taken. Images per second is
batch / that median. Peak memory is the process's maximum resident set (``wait4``). The table
gives, per model and size, Darknet's best setting (highest median over the rounds), ours, the
ratio, and both peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import darknet_cpu_build  # noqa: E402  (a sibling script)

# Darknet V5's iteration line: "12: loss=5.881, avg loss=..., train=7.0 seconds, ...", ended
# by std::endl (flushed), so its arrival time through a pipe is when the iteration ended.
DARKNET_ITERATION = re.compile(r"^(?:\x1b\[[0-9;]*m)?\s*\d+(?:\x1b\[[0-9;]*m)?: loss=")


def run_timed(command: list[str], log: Path, *, env: dict[str, str] | None = None,
              cwd: Path | None = None, stdin: str | None = None,
              mark: re.Pattern[str] | None = None) -> tuple[float, float, list[float]]:
    """Run ``command`` with its output in ``log``: (wall seconds, peak RSS in MiB, the
    arrival times of the output lines that ``mark`` matches)."""
    print("  $", " ".join(command), flush=True)
    started = time.monotonic()
    marks: list[float] = []
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE, env=env, cwd=cwd, text=True,
                                   errors="replace")
        process.stdin.write(stdin or "")
        process.stdin.close()
        for line in process.stdout:
            if mark is not None and mark.match(line):
                marks.append(time.monotonic())
            out.write(line)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - started
    if process.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
        raise SystemExit(f"cpu_train_against_darknet: {command[0]} failed with status "
                         f"{process.returncode}; {log}:\n{tail}")
    return seconds, usage.ru_maxrss / 1024.0, marks


def ours(*args: str) -> list[str]:
    return [sys.executable, "-m", "darknet_metal", *args]


def darknet_settings(threads: int, preload: Path) -> dict[str, dict[str, str]]:
    """Darknet's thread settings: name -> the environment variables it adds."""
    lifted = {"LD_PRELOAD": str(preload), "OPENBLAS_NUM_THREADS": str(threads)}
    settings = {
        "stock": {},
        f"blas-{threads} omp-1": {**lifted, "OMP_NUM_THREADS": "1"},
    }
    if threads > 1:
        settings[f"blas-{threads} omp-{threads}"] = {**lifted, "OMP_NUM_THREADS": str(threads)}
    return settings


def our_iterations(jsonl: Path) -> list[float]:
    """Our seconds per iteration (gaps between the log's timestamps; the first has none)."""
    times = [json.loads(line)["time"] for line in jsonl.read_text().splitlines() if line.strip()]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def images_per_second(seconds: list[float], skip: int, batch: int, what: str) -> float:
    kept = seconds[skip:]
    if not kept:
        raise SystemExit(f"cpu_train_against_darknet: {what} logged {len(seconds)} iterations, "
                         f"none after the first {skip}")
    return batch / statistics.median(kept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--darknet-source", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["yolov3-tiny", "yolov4-tiny"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 416])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3, help="first iterations left out")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+",
                        help="only these of Darknet's settings (names as printed)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.iterations <= args.skip:
        parser.error("--iterations must exceed --skip")

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        darknet, preload = darknet_cpu_build.build(args.darknet_source, work / "darknet")
    except darknet_cpu_build.BuildError as error:
        raise SystemExit(f"cpu_train_against_darknet: Darknet could not be built: "
                         f"{error}") from None
    settings = darknet_settings(args.threads, preload)
    if args.settings:
        unknown = set(args.settings) - set(settings)
        if unknown:
            parser.error(f"--settings: unknown {sorted(unknown)}; known {sorted(settings)}")
        settings = {name: settings[name] for name in args.settings}
    base_env = dict(os.environ)
    for name in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        base_env.pop(name, None)

    cases = []
    for size in args.sizes:
        shapes = work / f"shapes-{size}"
        if not (shapes / "shapes.data").is_file():
            run_timed(ours("make-shapes", str(shapes), "--train", str(4 * args.batch),
                           "--valid", "8", "--size", f"{size}x{size}", "-q"),
                      work / f"make-shapes-{size}.log")
        for model in args.models:
            cfg = work / f"{model}-{size}.cfg"
            run_timed(ours("cfg", "--model", model, "--classes", "3", "--size", f"{size}x{size}",
                           "--batch", str(args.batch), "--subdivisions", "1", "--max-batches",
                           str(args.iterations), str(cfg)), work / f"cfg-{model}-{size}.log")
            # A fixed size: with random=1 each program would draw its own sizes.
            cfg.write_text(re.sub(r"(?m)^random\s*=\s*1\s*$", "random=0", cfg.read_text()))
            cases.append((model, size, shapes, cfg))

    runs = []
    for round_index in range(args.rounds):
        for model, size, shapes, cfg in cases:
            print(f"round {round_index + 1}: {model} {size}", flush=True)
            for name, extra in settings.items():
                folder = work / f"darknet-{model}-{size}-{name.replace(' ', '-')}-r{round_index}"
                folder.mkdir(exist_ok=True)
                data = folder / "shapes.data"
                data.write_text(re.sub(r"(?m)^backup\s*=.*$", f"backup = {folder}",
                                       (shapes / "shapes.data").read_text()))
                log = folder / "train.log"
                wall, peak, ends = run_timed(
                    [str(darknet), "detector", "train", str(data), str(cfg), "-dont_show",
                     "-nocolor"], log, env={**base_env, **extra}, cwd=folder, stdin="yes\n",
                    mark=DARKNET_ITERATION)
                gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
                rate = images_per_second(gaps, args.skip, args.batch, f"Darknet ({log})")
                runs.append({"program": "darknet", "setting": name, "model": model, "size": size,
                             "round": round_index, "images_per_second": rate,
                             "peak_mib": peak, "wall_seconds": wall})
                print(f"    Darknet {name}: {rate:.2f} img/s, peak {peak:.0f} MiB", flush=True)
            backup = work / f"ours-{model}-{size}-r{round_index}"
            wall, peak, _ = run_timed(
                ours("train", str(shapes / "shapes.data"), str(cfg), "--device", "cpu",
                     "--workers", str(args.threads), "--backup", str(backup), "--no-chart",
                     "-q"), work / f"ours-{model}-{size}-r{round_index}.log",
                env={**base_env, "DARKNET_METAL_CPU_THREADS": str(args.threads)})
            rate = images_per_second(our_iterations(backup / f"{cfg.stem}.jsonl"), args.skip,
                                     args.batch, f"darknet-metal ({backup})")
            runs.append({"program": "darknet-metal", "setting": f"threads-{args.threads}",
                         "model": model, "size": size, "round": round_index,
                         "images_per_second": rate, "peak_mib": peak, "wall_seconds": wall})
            print(f"    darknet-metal: {rate:.2f} img/s, peak {peak:.0f} MiB", flush=True)

    summary = summarise(runs, cases)
    result = {"threads": args.threads, "batch": args.batch, "iterations": args.iterations,
              "skip": args.skip, "cpu": cpu_model(), "runs": runs, "summary": summary}
    (work / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['cpu']}, {args.threads} threads, batch {args.batch}, medians of "
          f"iterations {args.skip + 1}-{args.iterations}, {args.rounds} round(s)\n")
    print("| network | Darknet's best setting: img/s per round | ours: img/s per round | "
          "ours / Darknet's best | peak MiB ours / Darknet |")
    print("|---|---|---|---|---|")
    for row in summary:
        print(f"| {row['model']} {row['size']} | {row['darknet_setting']}: "
              f"{', '.join(f'{r:.2f}' for r in row['darknet_rates'])} | "
              f"{', '.join(f'{r:.2f}' for r in row['our_rates'])} | {row['ratio']:.2f} | "
              f"{row['our_peak_mib']:.0f} / {row['darknet_peak_mib']:.0f} |")
    return 0


def summarise(runs: list[dict], cases: list[tuple]) -> list[dict]:
    """Per model and size: Darknet's best setting by median rate over the rounds, and ours."""
    rows = []
    for model, size, _, _ in cases:
        mine = [r for r in runs if r["model"] == model and r["size"] == size]
        theirs: dict[str, list[dict]] = {}
        for r in mine:
            if r["program"] == "darknet":
                theirs.setdefault(r["setting"], []).append(r)
        best = max(theirs, key=lambda s: statistics.median(r["images_per_second"]
                                                            for r in theirs[s]))
        ours_runs = [r for r in mine if r["program"] == "darknet-metal"]
        darknet_rate = statistics.median(r["images_per_second"] for r in theirs[best])
        our_rate = statistics.median(r["images_per_second"] for r in ours_runs)
        rows.append({
            "model": model, "size": size, "darknet_setting": best,
            "darknet_rates": [r["images_per_second"] for r in theirs[best]],
            "our_rates": [r["images_per_second"] for r in ours_runs],
            "ratio": our_rate / darknet_rate,
            "darknet_peak_mib": max(r["peak_mib"] for r in theirs[best]),
            "our_peak_mib": max(r["peak_mib"] for r in ours_runs),
        })
    return rows


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
