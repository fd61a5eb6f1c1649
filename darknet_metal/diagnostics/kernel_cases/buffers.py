"""Cases of ``shaders/buffers.metal``: fill, copy (also of half storage) and scaled add, bit
for bit with the CPU's steps, the finiteness flag, which only ever clears, and the sum of a
split-K GEMM's slices (in slice order: NumPy's serial float32 sum of the same order)."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import fill, update
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Exact,
    KernelCase,
    RelL2,
    Step,
    nan_filled,
    normal,
)

#: Sizes of one element, of a partial threadgroup, and above 2^16.
SIZES = (1, 7, 70001)


def _fill(n: int) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        want = np.empty(n, np.float32)
        fill.fill_step(want, -2.75).run()
        return CaseData({"x": nan_filled(n)}, (Check("x", want, Exact()),))

    return KernelCase(f"fill_buf_f32-n{n}",
                      (Step("fill_buf_f32", {"n": n, "value": -2.75}, {"n": n}),), make)


def _copy(n: int) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        src = normal(rng, n, 3.0)
        want = nan_filled(n)
        fill.copy_step(src, want).run()
        return CaseData({"src": src, "dst": nan_filled(n)}, (Check("dst", want, Exact()),))

    return KernelCase(f"copy_buf_f32-n{n}", (Step("copy_buf_f32", {"n": n}, {"n": n}),), make)


def _add(n: int, scale: float) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        src, dst = normal(rng, n, 3.0), normal(rng, n, 3.0)
        want = dst.copy()
        fill.add_step(src, want, scale).run()
        checks = (Check("dst", want, Exact()),)
        if scale == 1.0:
            checks += (Check("dst", dst + src, Exact()),)
        return CaseData({"src": src, "dst": dst}, checks)

    return KernelCase(f"add_buf_f32-n{n}-scale{scale:g}",
                      (Step("add_buf_f32", {"n": n, "scale": scale}, {"n": n}),), make)


def _copy_half() -> KernelCase:
    n = 2 * 5 * 9 * 11

    def make(rng: np.random.Generator) -> CaseData:
        src = normal(rng, n).astype(np.float16)
        return CaseData({"src": src, "dst": nan_filled(n, np.float16)},
                        (Check("dst", src.copy(), Exact()),))

    return KernelCase(f"copy_buf_f16-n{n}", (Step("copy_buf_f16", {"n": n}, {"n": n}),), make)


def _finite(n: int) -> KernelCase:
    """The flag, starting at 1 and at 0, over an array of large, subnormal and ordinary
    values, clean or with a NaN or an infinity of either sign first, in the middle or
    last."""
    places = sorted({0, n // 2, n - 1})
    variants = [(None, None)] + [(p, bad) for p in places for bad in (np.nan, np.inf, -np.inf)]
    starts = (1.0, 0.0)
    steps = tuple(Step("finite_buf_f32", {"n": n}, {"n": n},
                       {"x": f"x{i}", "flag": f"flag{i}_{j}"})
                  for i in range(len(variants)) for j in range(len(starts)))

    def make(rng: np.random.Generator) -> CaseData:
        base = normal(rng, n, 3.0)
        base[0] = np.finfo(np.float32).max  # large but finite
        base[-1] = -np.finfo(np.float32).tiny / 2  # subnormal
        arrays, checks = {}, []
        for i, (place, bad) in enumerate(variants):
            x = base.copy()
            if place is not None:
                x[place] = bad
            arrays[f"x{i}"] = x
            for j, start in enumerate(starts):
                want = np.array([start], np.float32)
                update.all_finite_step(x, want).run()
                arrays[f"flag{i}_{j}"] = np.array([start], np.float32)
                clean = np.array([start if place is None else 0.0], np.float32)
                checks += [Check(f"flag{i}_{j}", want, Exact()),
                           Check(f"flag{i}_{j}", clean, Exact())]
        return CaseData(arrays, tuple(checks))

    return KernelCase(f"finite_buf_f32-n{n}", steps, make)


def _finite_collects() -> KernelCase:
    """One flag over several arrays: clean ones leave it set; once a non-finite value clears
    it, a later clean array does not set it back."""
    sizes = {"clean300": 300, "clean7": 7, "bad13": 13, "clean9": 9}
    order = {"flag_clean": ("clean300", "clean7"),
             "flag_mixed": ("clean300", "clean7", "bad13", "clean9")}
    steps = tuple(Step("finite_buf_f32", {"n": sizes[x]}, {"n": sizes[x]}, {"x": x, "flag": flag})
                  for flag, arrays in order.items() for x in arrays)

    def make(rng: np.random.Generator) -> CaseData:
        arrays = {name: normal(rng, n, 3.0) for name, n in sizes.items()}
        arrays["bad13"][5] = np.inf
        arrays.update(flag_clean=np.ones(1, np.float32), flag_mixed=np.ones(1, np.float32))
        return CaseData(arrays, (Check("flag_clean", np.ones(1, np.float32), Exact()),
                                 Check("flag_mixed", np.zeros(1, np.float32), Exact())))

    return KernelCase("finite_buf_f32-several_arrays", steps, make)


def _sum_slices(n: int, slices: int, stride: int) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        src = normal(rng, max(slices - 1, 0) * stride + n, 3.0)
        dst = normal(rng, n, 3.0)
        acc = np.zeros(n, np.float32)
        for z in range(slices):  # float32 additions in slice order, as the kernel makes them
            acc = acc + src[z * stride:z * stride + n]
        want = dst + acc
        exact = dst.astype(np.float64) + sum(src[z * stride:z * stride + n].astype(np.float64)
                                             for z in range(slices))
        return CaseData({"src": src, "dst": dst}, (Check("dst", want, Exact()),
                                                   Check("dst", exact, RelL2(1e-6))))

    args = {"n": n, "slices": slices, "stride": stride}
    return KernelCase(f"sum_slices_buf_f32-n{n}-s{slices}",
                      (Step("sum_slices_buf_f32", args, {"n": n}),), make)


CASES: tuple[KernelCase, ...] = (
    *(_fill(n) for n in SIZES),
    *(_copy(n) for n in SIZES),
    *(_add(n, scale) for n in SIZES for scale in (1.0, 0.37, -3.0)),
    _copy_half(),
    *(_finite(n) for n in SIZES),
    _finite_collects(),
    _sum_slices(7, 1, 7),
    _sum_slices(864, 85, 864),
    _sum_slices(1000, 3, 1200),
)
