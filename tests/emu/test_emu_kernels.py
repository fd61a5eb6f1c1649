"""Correct kernels run in the emulator and compared with NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from emu_harness import KERNELS, Emu, build, struct_bytes

ORDERS = ["forward", "reverse", "random"]


@pytest.fixture(scope="module")
def emu():
    e = Emu(build([KERNELS / "good.metal"]), threads=2)
    yield e
    e.close()


def test_vadd_edge_groups(emu):
    n = 1000  # not a multiple of 64: the last group has 40 threads
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    out = np.full(n + 8, -7.0, np.float32)  # the tail must stay untouched
    emu.dispatch("vadd_f32", [struct_bytes("If", n, 0.5), a, b, out], n, 64)
    np.testing.assert_allclose(out[:n], a + np.float32(0.5) * b, rtol=1e-6)
    assert (out[n:] == -7.0).all()


def test_builtins_of_edge_groups(emu):
    gx, gy, tx, ty = 10, 5, 4, 4
    out = np.zeros((gy, gx, 12), np.uint32)
    emu.dispatch("builtins_probe", [out], (gx, gy), (tx, ty))
    assert (out[..., 11] == 1).all(), "a thread of the grid did not run"
    for y in range(gy):
        for x in range(gx):
            lx, ly, bx, by = x % tx, y % ty, x // tx, y // ty
            width = min(tx, gx - bx * tx)  # Metal gives edge groups their real size
            height = min(ty, gy - by * ty)
            index = ly * width + lx
            expect = [lx, ly, bx, by, width, height, 3, 2, index, index % 32, index // 32, 1]
            assert out[y, x].tolist() == expect, (x, y)


@pytest.mark.parametrize("order", ORDERS)
def test_reduction_with_barriers(emu, order):
    groups = 6
    x = np.random.default_rng(1).random(256 * groups).astype(np.float32)
    out = np.zeros(groups, np.float32)
    emu.dispatch("reduce_sum_f32", [x, out], groups, 256, mode="threadgroups", order=order, seed=11)
    np.testing.assert_allclose(out, x.reshape(groups, 256).sum(1, dtype=np.float64), rtol=1e-5)


@pytest.mark.parametrize("order", ORDERS)
def test_simd_sum_reduction(emu, order):
    groups, per = 5, 256
    x = np.random.default_rng(2).standard_normal(groups * per).astype(np.float32)
    out = np.zeros(groups, np.float32)
    emu.dispatch("simd_reduce_f32", [x, out], groups * per, per, order=order, seed=5)
    np.testing.assert_allclose(
        out, x.reshape(groups, per).sum(1, dtype=np.float64), rtol=1e-4, atol=1e-4
    )


def test_simd_shuffles(emu):
    x = np.arange(32, dtype=np.float32) * 1.5 + 1.0
    out = np.zeros((32, 5), np.float32)
    emu.dispatch("simd_shuffles", [x, out], 32, 32, order="reverse")
    lane = np.arange(32)
    down = np.where(lane + 1 < 32, x[np.minimum(lane + 1, 31)], x)  # top lane keeps its own
    np.testing.assert_array_equal(out[:, 0], down)
    np.testing.assert_array_equal(out[:, 1], x[lane ^ 3])
    np.testing.assert_allclose(out[:, 2], np.concatenate([[0.0], np.cumsum(x)[:-1]]))
    np.testing.assert_array_equal(out[:, 3], np.full(32, x[5]))
    np.testing.assert_array_equal(out[:, 4], np.full(32, x.max()))


def _gemm_inputs(m, n, k, seed=3, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype))


@pytest.mark.parametrize("order", ORDERS)
def test_tiled_gemm(emu, order):
    m, n, k = 37, 29, 45  # ragged: edge tiles and a partial last K tile
    a, b = _gemm_inputs(m, n, k)
    c = np.zeros((m, n), np.float32)
    groups = ((n + 15) // 16, (m + 15) // 16)
    emu.dispatch(
        "gemm_tiled_f32",
        [struct_bytes("III", m, n, k), a, b, c],
        groups,
        (16, 16),
        mode="threadgroups",
        order=order,
        seed=7,
    )
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_tiled_gemm_half_from_decltype_instantiation(emu):
    m, n, k = 16, 32, 24
    a, b = _gemm_inputs(m, n, k, dtype=np.float16)
    c = np.zeros((m, n), np.float16)
    emu.dispatch(
        "gemm_tiled_f16",
        [struct_bytes("III", m, n, k), a, b, c],
        (2, 1),
        (16, 16),
        mode="threadgroups",
    )
    ref = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(c.astype(np.float32), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["gemm_simdgroup_f32", "gemm_simdgroup_nt_f32"])
def test_simdgroup_matrix_gemm(emu, name):
    m, n, k = 24, 16, 32
    a, b = _gemm_inputs(m, n, k, seed=4)
    bt = np.ascontiguousarray(b.T)
    c = np.zeros((m, n), np.float32)
    rhs = b if name == "gemm_simdgroup_f32" else bt
    emu.dispatch(
        name, [struct_bytes("III", m, n, k), a, rhs, c], (n // 8, m // 8), 32, mode="threadgroups"
    )
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_atomics_histogram(emu):
    n = 3000
    x = np.random.default_rng(5).integers(0, 1000, n).astype(np.uint32)
    hist = np.zeros(16, np.uint32)
    emu.dispatch(
        "histogram_u32", [x, hist, np.array([n], np.uint32)], n, 128, order="random", seed=2
    )
    np.testing.assert_array_equal(hist, np.bincount(x % 16, minlength=16))


def test_atomic_float_add(emu):
    x = np.arange(1, 4097, dtype=np.float32)  # sums exactly in float32
    total = np.zeros(1, np.float32)
    emu.dispatch("atomic_sum_f32", [x, total], x.size, 256)
    assert total[0] == 4096 * 4097 / 2


def test_vector_types(emu):
    rng = np.random.default_rng(6)
    x = rng.uniform(-1.0, 4.0, (50, 4)).astype(np.float32)
    out = np.zeros((50, 4), np.float32)
    packed = np.zeros((50, 3), np.float32)  # packed_float3: 12 bytes per element
    emu.dispatch("vector_ops", [x, out, packed], 50, 16)
    r = np.stack([x[:, 1] + 1, x[:, 0] + 1, x[:, 2] * 2, x[:, 3] * 2], 1)
    r = np.maximum(r, 0.5) + np.where(x > 2.0, 10.0, 0.0)
    r = r.astype(np.float16).astype(np.float32)
    extra = np.zeros((50, 4), np.float32)
    extra[:, 3] = x[:, :3].sum(1)  # (dot, 0, 0, 0).wzyx puts the dot product last
    np.testing.assert_allclose(out, r + extra, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed, x[:, :3] * np.clip(x[:, 3:4], 0, 1), rtol=1e-6)


def test_threadgroup_memory_starts_as_nan(emu):
    out = np.zeros(64, np.float32)
    emu.dispatch("tg_poison", [out], 64, 64)
    assert (out == 1.0).all()


@pytest.mark.parametrize("order", ORDERS)
def test_dynamic_threadgroup_memory(emu, order):
    x = np.arange(96, dtype=np.float32)
    out = np.zeros(96, np.float32)
    emu.dispatch("reverse_in_group", [x, out], 96, 32, tg_args=(32 * 4,), order=order)
    np.testing.assert_array_equal(out, x.reshape(3, 32)[:, ::-1].ravel())


def test_ucontext_fallback_runs_barriers_and_simd():
    from emu_harness import OPT_FLAGS

    e = Emu(build([KERNELS / "good.metal"], flags=[*OPT_FLAGS, "-DEMU_FIBER_UCONTEXT"]), threads=1)
    try:
        x = np.random.default_rng(8).random(512).astype(np.float32)
        out = np.zeros(2, np.float32)
        e.dispatch("simd_reduce_f32", [x, out], 512, 256, order="random", seed=3)
        np.testing.assert_allclose(out, x.reshape(2, 256).sum(1, dtype=np.float64), rtol=1e-5)
    finally:
        e.close()
