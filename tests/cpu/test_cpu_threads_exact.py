"""The CPU results do not depend on how many threads compute them.

The executor shares convolution row blocks, direct-convolution rows, Winograd transforms and
GEMM column blocks out among its threads; each output element is still computed by the same
operations in the same order, so float32 passes run with 1 and with 3 threads (separate
processes, ``DARKNET_METAL_CPU_THREADS``) must agree bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from shared_paths import CFG_DIR


def _run(tmp_path, name: str, threads: int) -> dict[str, np.ndarray]:
    cfg = (CFG_DIR / f"{name}.cfg").read_text()
    cfg = "\n".join("width=128" if line.startswith("width=") else
                    "height=128" if line.startswith("height=") else line
                    for line in cfg.splitlines())
    path = tmp_path / f"{name}.cfg"
    path.write_text(cfg)
    out = tmp_path / f"{name}-{threads}.npz"
    code = (
        "import sys, numpy as np, darknet_metal as dm\n"
        "net = dm.load(sys.argv[1], seed=7)\n"
        "x = np.random.default_rng(3).random((2, 3, 128, 128), dtype=np.float32)\n"
        "outs = net.forward(x, outputs=range(len(net.layers)))\n"
        "np.savez(sys.argv[2], *outs)\n"
    )
    env = {**os.environ, "DARKNET_METAL_CPU_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny"])
def test_float32_results_do_not_depend_on_the_thread_count(tmp_path, name):
    one = _run(tmp_path, name, 1)
    three = _run(tmp_path, name, 3)
    assert one.keys() == three.keys() and len(one) > 20
    for key in one:
        np.testing.assert_array_equal(one[key], three[key], err_msg=f"{name} layer {key}")
