"""What training across processes adds to a step: the in-place ``Allreduce`` of every
gradient accumulator (``Collective.reduce``) and the averaging of the batch-norm statistics
(``Collective.average_statistics``), for yolov3-tiny and yolov4-tiny, between two ranks on
this machine (Open MPI over shared memory), against the peer: one CPU training step of the
same network on one rank's share (batch 4 at 224).

Each case is one ``mpirun -n 2`` job (its group times the whole job, launch included);
rank 0 reports the median of 20 timed all-reduces after 3 warm-up ones, and the bytes each
rank contributes (``extra_info``). The peer's test prints the all-reduce's share of a step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("mpi4py")
from shared_paths import CFG_DIR  # noqa: E402

import darknet_metal as dm  # noqa: E402

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun")

SCRIPT = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    import darknet_metal as dm
    from darknet_metal.training.distributed import Collective

    cfg, out = sys.argv[1:3]
    collective = Collective.from_environment()
    net = dm.load(cfg, seed=1, batch=8, subdivisions=2)
    buffers = net.gradient_buffers()
    nbytes = sum(a.nbytes for layer in buffers.values() for a in layer.values())
    stats = sum(a.nbytes for layer in net.statistic_buffers().values() for a in layer.values())
    reduce_s, average_s = [], []
    for i in range(23):
        collective.comm.Barrier()
        t0 = time.perf_counter()
        collective.reduce(net, 1.0)
        t1 = time.perf_counter()
        collective.average_statistics(net)
        t2 = time.perf_counter()
        if i >= 3:
            reduce_s.append(t1 - t0)
            average_s.append(t2 - t1)
    if collective.rank == 0:
        with open(out, "w") as f:
            json.dump({"gradient_bytes": nbytes, "statistics_bytes": stats,
                       "reduce_ms": 1e3 * float(np.median(reduce_s)),
                       "average_ms": 1e3 * float(np.median(average_s))}, f)
''')


#: name -> what the MPI job reported, for the step benchmark's ratio.
MEASURED: dict[str, dict] = {}


def _allreduce(tmp_path, cfg) -> dict:
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    out = tmp_path / "result.json"
    command = [MPIRUN, "-n", "2", "--oversubscribe"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    done = subprocess.run([*command, sys.executable, str(script), str(cfg), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny"])
def test_allreduce_per_step(benchmark, tmp_path, name):
    benchmark.group = f"allreduce-job-{name}"
    cfg = CFG_DIR / f"{name}.cfg"
    result = benchmark.pedantic(lambda: _allreduce(tmp_path, cfg), rounds=1, iterations=1)
    net = dm.load(cfg)
    trainable = sum(int(np.prod(net.layers[i].param_shapes[n])) for i in net.params
                    for n in net.layers[i].trainable_params if n in net.params[i])
    assert result["gradient_bytes"] == 4 * trainable
    benchmark.extra_info.update(result)
    MEASURED[name] = result
    print(f"\n{name}: {result['gradient_bytes'] / 2**20:.1f} MiB of gradients, all-reduced in "
          f"{result['reduce_ms']:.1f} ms (median of 20), statistics "
          f"({result['statistics_bytes'] / 2**10:.0f} KiB) averaged in "
          f"{result['average_ms']:.2f} ms")


@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny"])
def test_training_step_on_a_share(benchmark, name):
    benchmark.group = f"training-step-{name}"
    cfg = CFG_DIR / f"{name}.cfg"
    net = dm.load(cfg, seed=1, batch=4, subdivisions=1).resize(224, 224)
    rng = np.random.default_rng(0)
    x = rng.random((4, 3, 224, 224), dtype=np.float32)
    truths = [np.array([[1, 0.5, 0.5, 0.3, 0.4]], np.float32)] * 4
    net.train_step(x, truths)
    benchmark.pedantic(lambda: net.train_step(x, truths), rounds=3, iterations=1)
    step_ms = 1e3 * benchmark.stats.stats.median
    if name in MEASURED:
        share = MEASURED[name]["reduce_ms"] / step_ms
        benchmark.extra_info["allreduce_share"] = share
        print(f"\n{name}: a step on 4 images at 224 takes {step_ms:.0f} ms; the all-reduce "
              f"adds {MEASURED[name]['reduce_ms']:.1f} ms ({100 * share:.1f}%)")
