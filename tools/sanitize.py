"""The Metal kernels under NVIDIA's compute-sanitizer, on the 'cuda' device.

    python tools/sanitize.py [--tools memcheck,racecheck,synccheck,initcheck]
                             [--targets kernels,pass,step,controls] [--size N] [--json]

Each tool runs over each target in its own process:

- ``kernels``: every case of ``darknet_metal.diagnostics.kernel_cases`` (every registry
  kernel, odd sizes), as ``darknet-metal doctor`` runs them;
- ``pass``: two inference passes of yolov4-tiny (random weights, ``--size``, batch 1): the
  first records the pass's dispatch list, the second replays the recording (a CUDA graph);
- ``step``: two training steps of yolov4-tiny (batch 2), recorded and replayed the same way;
- ``controls``: the planted bugs of ``shim/kernels/sanitizer_controls.metal``, one per tool
  (a missing barrier for racecheck, a barrier in divergent code for synccheck, a write past a
  buffer for memcheck, a read of never-written memory for initcheck), each of which must be
  caught, with the ``.metal`` file and line in the report.

Prints a table (tool, target, findings) and exits 1 when a target has findings or a control
goes uncaught. What no tool here looks for: races between threadgroups on device memory
(racecheck covers shared memory only), and anything about Apple's compiler or GPUs.
Needs an NVIDIA GPU, compute-sanitizer on PATH and a build with the CUDA kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
TARGETS = ("kernels", "pass", "step", "controls")
#: The planted bug each tool must catch, and its kernel in sanitizer_controls.metal.
CONTROLS = {
    "racecheck": "control_missing_barrier_f32",
    "synccheck": "control_divergent_barrier_f32",
    "memcheck": "control_write_past_end_f32",
    "initcheck": "control_read_unwritten_f32",
}
CONTROL_FILE = "sanitizer_controls.metal"
_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) error")
_HAZARDS = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warn")
_WHERE = re.compile(r"([\w./-]+\.metal):(\d+)")


# ---- what runs inside the sanitizer -------------------------------------------------------


def _run_kernels() -> None:
    from darknet_metal import metal
    from darknet_metal.diagnostics.kernel_cases import CASES
    from darknet_metal.diagnostics.kernel_parity import run_case

    device = metal.get_device("cuda")
    bad = [c.name for c in CASES if not run_case(device, c).ok]
    print(f"kernel cases: {len(CASES) - len(bad)} of {len(CASES)} within tolerance"
          + (f"; failing: {', '.join(bad)}" if bad else ""))


def _yolov4_tiny(size: int, batch: int):
    import darknet_metal as dm
    from darknet_metal.model.bundled import get_spec

    return dm.load(get_spec("yolov4-tiny").cfg, seed=0, input_size=(size, size), batch=batch,
                   device="cuda")


def _run_pass(size: int) -> None:
    import numpy as np

    net = _yolov4_tiny(size, 1)
    x = np.random.default_rng(0).random((1, 3, size, size), dtype=np.float32)
    net.forward(x)  # the first pass records its dispatch list, the second replays it
    outputs = net.forward(x)
    print(f"inference pass: {len(outputs)} outputs, all finite: "
          f"{all(np.isfinite(o).all() for o in outputs)}")


def _run_step(size: int) -> None:
    import numpy as np

    net = _yolov4_tiny(size, 2)
    x = np.random.default_rng(0).random((2, 3, size, size), dtype=np.float32)
    boxes = np.array([[1, 0.3, 0.4, 0.2, 0.3], [5, 0.7, 0.6, 0.4, 0.2]], np.float32)
    net.train_step(x, [boxes[:1], boxes])  # recorded, then replayed
    report = net.train_step(x, [boxes[:1], boxes])
    print(f"training step: loss {report.loss:.6g}")


def _run_control(tool: str) -> None:
    import numpy as np

    from darknet_metal import metal

    device = metal.get_device("cuda")
    n, group = 256, 256
    x = device.upload(np.arange(n, dtype=np.float32))
    out = device.buffer(4 * n)
    never = device.buffer(4 * n)  # allocated, never written by anyone
    kernel = CONTROLS[tool]
    buffers = {"racecheck": [None, x, out], "synccheck": [None, None, out],
               "memcheck": [None, None, out], "initcheck": [None, never, out]}[tool]
    placeholder = device.buffer(4)
    bound = [placeholder if b is None else b for b in buffers]
    try:
        device.dispatch(kernel, None, bound, (n,), (group,))
        device.synchronize()
        print(f"{kernel}: ran")
    except Exception as e:  # the planted bug may also stop the kernel: that is the point
        print(f"{kernel}: {type(e).__name__}: {e}")


def inner(target: str, tool: str, size: int) -> int:
    """The work of one target, in the sanitized process."""
    if target == "kernels":
        _run_kernels()
    elif target == "pass":
        _run_pass(size)
    elif target == "step":
        _run_step(size)
    else:
        _run_control(tool)
    return 0


# ---- the outer driver ---------------------------------------------------------------------


def findings(tool: str, log: str) -> int:
    """Errors the tool reported in ``log`` (racecheck: hazards, errors and warnings)."""
    if tool == "racecheck":
        m = _HAZARDS.search(log)
        if m:
            return int(m.group(1))
    m = _ERRORS.search(log)
    return int(m.group(1)) if m else -1


def run_one(sanitizer: str, tool: str, target: str, size: int) -> dict:
    """One tool over one target in a child process; what it found."""
    cmd = [sanitizer, "--tool", tool, "--print-limit", "20", "--show-backtrace", "device"]
    if tool == "initcheck":
        # Whole-buffer copies to the host read bytes no kernel was meant to write.
        cmd += ["--check-api-memory-access", "no"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    cmd += [sys.executable, os.path.abspath(__file__), "--inner", target, "--tool-of-inner",
            tool, "--size", str(size)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = done.stdout + done.stderr
    found = findings(tool, log)
    where = sorted({f"{os.path.basename(f)}:{line}" for f, line in _WHERE.findall(log)})
    said = [line for line in done.stdout.splitlines() if line and not line.startswith("=")]
    return {"tool": tool, "target": target, "findings": found, "where": where,
            "ran": said[-1] if said else "",
            "seconds": round(time.perf_counter() - start, 1), "returncode": done.returncode,
            "log_tail": log[-3000:]}


def verdict(result: dict) -> tuple[bool, str]:
    """Whether a result is what it must be, and a word saying so."""
    if result["target"] == "controls":
        caught = result["findings"] > 0 and any(w.startswith(CONTROL_FILE)
                                                for w in result["where"])
        return caught, "caught" if caught else "MISSED"
    ok = result["findings"] == 0
    return ok, "clean" if ok else ("NO SUMMARY" if result["findings"] < 0 else "FINDINGS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--size", type=int, default=224, help="network input size (pixels)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--inner", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--tool-of-inner", default="memcheck", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        return inner(args.inner, args.tool_of_inner, args.size)
    tools = [t for t in args.tools.split(",") if t]
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(tools) - set(TOOLS)) + sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown tools or targets: {', '.join(unknown)}")
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("sanitize.py: compute-sanitizer is not on PATH (it comes with the CUDA toolkit)",
              file=sys.stderr)
        return 2
    results, ok = [], True
    for tool in tools:
        for target in targets:
            result = run_one(sanitizer, tool, target, args.size)
            good, word = verdict(result)
            ok &= good
            results.append(result | {"verdict": word})
            if not args.json:
                where = ", ".join(result["where"][:4])
                print(f"{tool:10s} {target:9s} {word:10s} findings {result['findings']:4d}  "
                      f"{result['seconds']:7.1f} s  {where or result['ran']}", flush=True)
            if not good:
                print(f"---- {tool} {target}\n{result['log_tail']}", file=sys.stderr)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "log_tail"} for r in results],
                         indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
