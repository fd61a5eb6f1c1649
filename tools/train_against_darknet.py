"""Train yolov3-tiny on the shapes set with the real Darknet and with darknet-metal; compare mAP.

    python tools/train_against_darknet.py --darknet /path/to/darknet --out /tmp/versus \
        [--seeds 1 2] [--iterations 200] [--device cpu]

What it does, in OUT:
1. ``darknet-metal make-shapes shapes`` (200 training, 50 validation images at 224, 3 classes);
2. ``yolov3-tiny-shapes.cfg``: the COCO yolov3-tiny cfg at 224, batch 16, 3 classes, no
   augmentation (jitter 0, hue 0, saturation and exposure 1, flip 0, mosaic 0, random 0),
   ``burn_in=0`` (its 1000 would hold the rate near 0 for the whole run), ``max_batches`` =
   ``--iterations`` and the steps at 80% and 90% of it;
3. ``darknet-metal partial``: ``yolov3-tiny.conv.15``, the first 15 layers of the COCO weights;
4. per seed, ``start-seed<N>.weights``: that backbone with the other layers initialised as
   ``darknet-metal train --seed N`` initialises them. Darknet V5 needs this whole file: it
   takes a weights argument only when its name ends in ``.weights`` (``yolov3-tiny.conv.15``
   would be ignored without a word, and it would train from scratch) and stops at a file
   shorter than the network. Both programs therefore start from the same parameters;
5. per seed, ``darknet detector train`` from ``start-seed<N>.weights`` (answering its "yes"
   prompt) and ``darknet detector map``; ``darknet-metal train ... yolov3-tiny.conv.15 --seed N``
   and ``darknet-metal map``; ``darknet-metal map`` also on Darknet's final weights;
6. prints a table and writes ``results.json``.

The Darknet binary is built separately (its CPU build with the golden data's fixes; the README
says how, under "Training from the command line"). A run takes about 5 minutes per program
and seed on 2 cores at 224. Darknet runs inside its run's folder (it writes chart images into
its working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import darknet_metal as dm

ROOT = Path(__file__).resolve().parent.parent
SHARED_MODELS = ROOT.parent / "shared" / "models" / "yolov3-tiny"
DARKNET_MAP_LINE = re.compile(r"mean average precision \(mAP@0\.50\)\s*=\s*([0-9.]+)\s*%")


def shapes_cfg(source: str, iterations: int) -> str:
    """The yolov3-tiny cfg text for the comparison (see the module docstring)."""
    # (pattern, replacement, how many: 1 for [net] keys, 0 = every [yolo] head)
    replacements = [
        (r"(?m)^batch\s*=\s*\d+", "batch=16", 1),
        (r"(?m)^subdivisions\s*=\s*\d+", "subdivisions=1", 1),
        (r"(?m)^width\s*=\s*\d+", "width=224", 1),
        (r"(?m)^height\s*=\s*\d+", "height=224", 1),
        (r"(?m)^saturation\s*=\s*[0-9.]+", "saturation=1", 1),
        (r"(?m)^exposure\s*=\s*[0-9.]+", "exposure=1", 1),
        (r"(?m)^hue\s*=\s*[0-9.]+", "hue=0\nflip=0\nmosaic=0", 1),
        (r"(?m)^burn_in\s*=\s*\d+", "burn_in=0", 1),
        (r"(?m)^max_batches\s*=\s*\d+", f"max_batches={iterations}", 1),
        (r"(?m)^steps\s*=\s*[0-9,]+", f"steps={iterations * 8 // 10},{iterations * 9 // 10}", 1),
        (r"(?m)^filters\s*=\s*255", "filters=24", 0),
        (r"(?m)^classes\s*=\s*80", "classes=3", 0),
        (r"(?m)^jitter\s*=\s*[0-9.]+", "jitter=0", 0),
        (r"(?m)^random\s*=\s*\d+", "random=0", 0),
    ]
    text = source
    for pattern, value, count in replacements:
        text, found = re.subn(pattern, value, text, count=count)
        if found == 0:
            raise SystemExit(f"train_against_darknet: the cfg has no line matching {pattern!r}")
    return text


def run(command: list[str], log: Path, *, stdin: str | None = None,
        env: dict[str, str] | None = None, stdout: Path | None = None,
        cwd: Path | None = None) -> float:
    """Run ``command`` with its output in ``log`` (its standard output in ``stdout`` when
    given); returns the seconds it took."""
    print("  $", " ".join(command), flush=True)
    start = time.monotonic()
    with open(log, "w") as err, open(stdout or os.devnull, "w") as out:
        done = subprocess.run(command, stdout=out if stdout else err, stderr=err, text=True,
                              input=stdin, env=env, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"train_against_darknet: {command[0]} failed with status "
                         f"{done.returncode}; see {log}")
    return time.monotonic() - start


def ours(*args: str) -> list[str]:
    return [sys.executable, "-m", "darknet_metal", *args]


def our_map(data: Path, cfg: Path, weights: Path, report: Path) -> float:
    """darknet-metal's mAP@0.50 in percent; its JSON report in ``report``."""
    run(ours("map", str(data), str(cfg), str(weights), "--json"), report.with_suffix(".log"),
        stdout=report)
    return 100.0 * json.loads(report.read_text())["map"]


def darknet_map(darknet: str, data: Path, cfg: Path, weights: Path, log: Path,
                env: dict[str, str]) -> float:
    run([darknet, "detector", "map", str(data), str(cfg), str(weights), "-dont_show",
         "-nocolor"], log, env=env, cwd=log.parent)
    found = DARKNET_MAP_LINE.findall(log.read_text())
    if not found:
        raise SystemExit(f"train_against_darknet: no mAP line in {log}")
    return float(found[-1])


def final_loss(log_text: str) -> float:
    losses = re.findall(r"(?m)^\s*\d+: loss=([0-9.]+)", log_text)
    return float(losses[-1]) if losses else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--darknet", required=True, help="the darknet executable")
    parser.add_argument("--out", required=True, type=Path, help="working folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--device", default="cpu", help="darknet-metal's device")
    args = parser.parse_args()

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "yolov3-tiny-shapes.cfg"
    cfg.write_text(shapes_cfg((SHARED_MODELS / "yolov3-tiny.cfg").read_text(),
                              args.iterations))
    print("making the shapes set and the backbone", flush=True)
    run(ours("make-shapes", str(out / "shapes")), out / "make-shapes.log")
    data = out / "shapes" / "shapes.data"
    backbone = out / "yolov3-tiny.conv.15"
    run(ours("partial", str(cfg), str(SHARED_MODELS / "yolov3-tiny.weights"), str(backbone),
             "15"), out / "partial.log")
    env = dict(os.environ)
    darknet_lib = Path(args.darknet).resolve().parent.parent / "src-lib"
    if darknet_lib.is_dir():  # a CMake build tree: libdarknet.so beside the CLI's folder
        env["LD_LIBRARY_PATH"] = f"{darknet_lib}:{env.get('LD_LIBRARY_PATH', '')}"

    results = []
    for seed in args.seeds:
        start = out / f"start-seed{seed}.weights"
        dm.load(cfg, backbone, partial=True, seed=seed).save_weights(start)

        folder = out / f"darknet-seed{seed}"
        folder.mkdir(exist_ok=True)
        run_data = folder / "shapes.data"
        run_data.write_text(re.sub(r"(?m)^backup\s*=.*$", f"backup = {folder}",
                                   data.read_text()))
        print(f"seed {seed}: Darknet", flush=True)
        dn_seconds = run([args.darknet, "detector", "train", str(run_data), str(cfg),
                          str(start), "-dont_show", "-nocolor"], folder / "train.log",
                         stdin="yes\n", env=env, cwd=folder)
        dn_final = folder / "yolov3-tiny-shapes_final.weights"
        dn_map = darknet_map(args.darknet, run_data, cfg, dn_final, folder / "map.log", env)
        dn_map_ours = our_map(data, cfg, dn_final, folder / "map-by-darknet-metal.json")

        mine = out / f"darknet-metal-seed{seed}"
        print(f"seed {seed}: darknet-metal", flush=True)
        dm_seconds = run(ours("train", str(data), str(cfg), str(backbone), "--seed", str(seed),
                              "--backup", str(mine), "--device", args.device, "--no-chart",
                              "-q"), out / f"darknet-metal-seed{seed}.log")
        dm_map = our_map(data, cfg, mine / "yolov3-tiny-shapes_final.weights",
                         mine / "map.json")
        results.append({
            "seed": seed,
            "darknet_map50": dn_map,
            "darknet_map50_by_darknet_metal": dn_map_ours,
            "darknet_final_loss": final_loss((folder / "train.log").read_text()),
            "darknet_seconds": dn_seconds,
            "darknet_metal_map50": dm_map,
            "darknet_metal_final_loss": final_loss((mine / "yolov3-tiny-shapes.log").read_text()),
            "darknet_metal_seconds": dm_seconds,
        })
        print(f"seed {seed}: Darknet {dn_map:.2f}% (darknet-metal's map of it: "
              f"{dn_map_ours:.2f}%), darknet-metal {dm_map:.2f}%", flush=True)

    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n| seed | Darknet mAP@0.50 | darknet-metal mAP@0.50 | difference |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['darknet_map50']:.2f}% | {r['darknet_metal_map50']:.2f}% | "
              f"{r['darknet_metal_map50'] - r['darknet_map50']:+.2f} |")
    mean_dn = sum(r["darknet_map50"] for r in results) / len(results)
    mean_dm = sum(r["darknet_metal_map50"] for r in results) / len(results)
    print(f"| mean | {mean_dn:.2f}% | {mean_dm:.2f}% | {mean_dm - mean_dn:+.2f} |")


if __name__ == "__main__":
    main()
