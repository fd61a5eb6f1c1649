"""Throughput of the emulator on this machine (reported, with loose floors that catch a
pathological slowdown such as fibers used for a barrier-free kernel)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from emu_harness import KERNELS, Emu, build, struct_bytes


@pytest.fixture(scope="module")
def emu():
    e = Emu(build([KERNELS / "good.metal"]), threads=2)
    yield e
    e.close()


def best_of(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def test_elementwise_threads_per_second(emu, record_property):
    n = 1 << 22
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    out = np.zeros(n, np.float32)
    args = struct_bytes("If", n, 2.0)
    seconds = best_of(lambda: emu.dispatch("vadd_f32", [args, a, b, out], n, 256))
    assert (out == 3.0).all()
    rate = n / seconds
    record_property("elementwise_threads_per_s", rate)
    print(f"\nelementwise: {rate / 1e6:.0f} M threads/s")
    assert rate > 5e6


def test_tiled_gemm_gflops(emu, record_property):
    m = n = k = 128
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    args = struct_bytes("III", m, n, k)
    seconds = best_of(
        lambda: emu.dispatch(
            "gemm_tiled_f32", [args, a, b, c], (8, 8), (16, 16), mode="threadgroups"
        )
    )
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    gflops = 2 * m * n * k / seconds / 1e9
    record_property("tiled_gemm_gflops", gflops)
    print(f"\ntiled GEMM with barriers: {gflops:.2f} GFLOP/s")
    assert gflops > 0.01
