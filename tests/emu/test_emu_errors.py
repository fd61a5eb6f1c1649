"""Buggy kernels and bad dispatches that the emulator must report, never crash on."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from emu_harness import ASAN_FLAGS, KERNELS, Emu, EmuError, build

BROKEN = KERNELS / "broken.metal"


def line_of(path, needle: str) -> int:
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if needle in text:
            return i
    raise AssertionError(needle)


@pytest.fixture(scope="module")
def emu():
    e = Emu(build([KERNELS / "good.metal", BROKEN]), threads=2)
    yield e
    e.close()


def test_missing_barrier_gives_wrong_answers_deterministically(emu):
    n = 64
    x = np.random.default_rng(0).random(n).astype(np.float32)
    idx = np.arange(n)
    reference = x[(idx + 1) % n] + x[(idx + 2) % n]  # what a barrier would have guaranteed
    results = {}
    for order, seed in [("forward", 0), ("reverse", 0), ("random", 9), ("random", 9)]:
        out = np.zeros(n, np.float32)
        emu.dispatch("missing_barrier", [x, out], 1, n, mode="threadgroups", order=order, seed=seed)
        results.setdefault((order, seed), []).append(out)
    assert not np.allclose(results[("forward", 0)][0], reference)
    assert not np.allclose(results[("random", 9)][0], reference)
    np.testing.assert_array_equal(*results[("random", 9)])  # same seed, same schedule


def test_return_before_barrier(emu):
    x = np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(EmuError) as err:
        emu.dispatch("return_before_barrier", [x, out, np.array([40], np.uint32)], 64, 64)
    msg = err.value.message
    assert err.value.code == -2
    assert "return_before_barrier" in msg and "returned while other threads wait" in msg
    line = line_of(BROKEN, "out[gid] = buf[lid ^ 1];") - 1  # the barrier just above
    assert f"broken.metal:{line}" in msg
    # The thread named is one that returned (gid >= 40).
    index = int(re.search(r"\[index (\d+)\]", msg).group(1))
    assert index >= 40


def test_partial_simd_collective(emu):
    x = np.ones(32, np.float32)
    out = np.zeros(32, np.float32)
    with pytest.raises(EmuError) as err:
        emu.dispatch("partial_simd", [x, out], 32, 32)
    msg = err.value.message
    line = line_of(BROKEN, "if (lane < 16) v = simd_sum(v);")
    assert "simd_sum (" in msg and f"broken.metal:{line}" in msg
    assert "only part of simdgroup 0" in msg and "returned" in msg


def test_mismatched_simd_collectives(emu):
    x = np.ones(32, np.float32)
    out = np.zeros(32, np.float32)
    with pytest.raises(EmuError) as err:
        emu.dispatch("mismatched_simd", [x, out], 32, 32, order="random", seed=1)
    assert "only part of simdgroup" in err.value.message
    assert "simd_max" in err.value.message and "simd_sum" in err.value.message


def test_static_threadgroup_memory_over_limit(emu):
    out = np.zeros(64, np.float32)
    with pytest.raises(EmuError) as err:
        emu.dispatch("too_much_tg", [out], 64, 64)
    assert err.value.code == -1
    assert "40960 bytes of threadgroup memory exceed the limit of 32768" in err.value.message


def test_templated_threadgroup_memory_over_limit(emu):
    out = np.zeros(64, np.float32)
    with pytest.raises(EmuError) as err:
        emu.dispatch("too_much_tg_tmpl_f32", [out], 64, 64)
    assert err.value.code == -2
    line = line_of(BROKEN, "threadgroup T big[N];")
    assert f"broken.metal:{line}" in err.value.message
    assert "36000 bytes" in err.value.message


@pytest.mark.parametrize(
    ("size", "group", "needle"),
    [
        ((0, 1, 1), (64, 1, 1), "zero-size grid"),
        ((64, 1, 1), (0, 1, 1), "zero-size threadgroup"),
        ((2048, 1, 1), (64, 32, 1), "2048 threads per threadgroup"),
    ],
)
def test_invalid_dispatch(emu, size, group, needle):
    out = np.zeros(4096, np.float32)
    with pytest.raises(EmuError) as err:
        emu.dispatch("tg_poison", [out], size, group)
    assert err.value.code == -1
    assert needle in err.value.message and "tg_poison" in err.value.message


def test_unbound_buffer_and_unknown_kernel(emu):
    out = np.zeros(64, np.float32)
    with pytest.raises(EmuError, match=r"buffer\(1\) is not bound"):
        emu.dispatch("reduce_sum_f32", [out], 1, 64, mode="threadgroups")
    with pytest.raises(EmuError, match="no kernel named 'nope'"):
        emu.dispatch("nope", [out], 1, 1)
    with pytest.raises(EmuError, match=r"threadgroup\(0\) memory length is not set"):
        emu.dispatch("reverse_in_group", [out, out], 32, 32)


def test_device_still_works_after_errors(emu):
    x = np.arange(96, dtype=np.float32)
    out = np.zeros(96, np.float32)
    emu.dispatch("reverse_in_group", [x, out], 96, 32, tg_args=(128,), order="random", seed=4)
    np.testing.assert_array_equal(out, x.reshape(3, 32)[:, ::-1].ravel())


def test_asan_reports_out_of_bounds_at_metal_line(tmp_path):
    driver = KERNELS.parent / "drivers" / "run_oob.cpp"
    exe = build([KERNELS / "oob.metal"], flags=ASAN_FLAGS, driver=driver)
    proc = subprocess.run(
        [str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"ASAN_OPTIONS": "detect_leaks=0"},
    )
    assert proc.returncode != 0
    line = line_of(KERNELS / "oob.metal", "out[gid] = x[gid + 1];")
    assert "heap-buffer-overflow" in proc.stderr
    assert f"oob.metal:{line}" in proc.stderr
