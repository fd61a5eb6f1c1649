"""Other work beside a benchmark: the processes the loaded CPU benchmarks run next to ours and
the peers (``test_bench_cpu_loaded.py``, ``benchmarks/run_peers.py``). Each load is a list of
Python scripts, one process each; the processes inherit the caller's CPU pinning."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

#: NumPy's matrix products on its BLAS threads.
MATMUL = "import numpy as np\na = np.random.rand(1500, 1500)\nwhile True:\n    a @ a\n"
#: One core kept busy.
BUSY = "while True:\n    pass\n"
#: C compiles one after another ({cc}: the compiler).
COMPILE = (
    "import subprocess, tempfile, os\n"
    "d = tempfile.mkdtemp()\n"
    "src = os.path.join(d, 'x.c')\n"
    "open(src, 'w').write('int f(int x){return x*x;}\\n' * 2000)\n"
    "while True:\n"
    "    subprocess.run(['{cc}', '-O2', '-c', src, '-o', os.path.join(d, 'x.o')])\n"
)


def standard_loads() -> list[tuple[str, list[str]]]:
    """(name, scripts): NumPy's matrix products, and C compiles plus a busy loop where a C
    compiler is on PATH."""
    cc = shutil.which("gcc") or shutil.which("cc")
    loads = [("numpy-matmul", [MATMUL])]
    if cc:
        loads.append(("compiles+busy", [COMPILE.replace("{cc}", cc), BUSY]))
    return loads


def start_load(scripts: list[str]) -> list[subprocess.Popen]:
    """The scripts' processes, started, after a second to reach their steady state."""
    procs = [subprocess.Popen([sys.executable, "-c", s], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for s in scripts]
    if procs:
        time.sleep(1.0)
    return procs


def stop_load(procs: list[subprocess.Popen]) -> None:
    """Ends the load's processes and waits for them."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
