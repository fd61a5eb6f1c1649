"""precision="fp16" against float32 on emu, yolov4-tiny at 416: device memory of a pass, host
encode time per pass, and the emulator's pass time (a correctness model: its time says
nothing of a GPU's). Memory and encode times are printed and kept in ``extra_info``."""

from __future__ import annotations

import time

import numpy as np
import pytest
from shared_paths import CFG_DIR

import darknet_metal as dm
from darknet_metal import metal

SIZE = 416


def _setup(precision):
    metal.empty_cache("emu")
    before = metal.memory_allocated("emu")
    net = dm.load(CFG_DIR / "yolov4-tiny.cfg", seed=1, device="emu", precision=precision)
    x = np.random.default_rng(0).random((1, 3, SIZE, SIZE), dtype=np.float32)
    net.forward(x)
    memory = metal.memory_allocated("emu") - before
    encode = []
    for _ in range(5):
        net.forward(x)
        encode.append(net.executor.last_encode_seconds)
    return net, x, memory, float(np.median(encode))


@pytest.mark.benchmark(group="yolov4-tiny-416-emu-fp16")
@pytest.mark.parametrize("precision", ["fp16", "peer-fp32"])
def test_pass(benchmark, precision):
    net, x, memory, encode = _setup(precision.replace("peer-", ""))
    start = time.perf_counter()
    benchmark.pedantic(net.forward, args=(x,), rounds=3, warmup_rounds=0)
    benchmark.extra_info.update(device_bytes=memory, encode_ms=1e3 * encode)
    print(f"\n{precision}: device memory of a pass {memory / 2**20:.1f} MiB, host encode "
          f"{1e3 * encode:.3f} ms per pass ({time.perf_counter() - start:.1f} s)")
