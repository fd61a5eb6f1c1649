"""Cases of ``shaders/dropout.metal``: the counter-based uniform draws (every element a pure
function of the seed and a 64-bit counter, so any thread order draws the same numbers as
the CPU), the counter's advance between passes, and dropout's forward and backward, all bit
for bit."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import dropout
from darknet_metal.diagnostics.kernel_cases.buffers import SIZES
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Exact,
    KernelCase,
    Step,
    nan_filled,
    normal,
)

#: Counters the draws start from: both ends, and either side of the 32-bit carry.
STARTS = (0, 1, 41, 2**32 - 1, 2**63 + 5, 2**64 - 1)


def counter_words(value: int) -> np.ndarray:
    """A uint64 counter as the kernels hold it: two uint32 words, low first."""
    return np.array([value], np.uint64).view(np.uint32).copy()


def _seed_args(n: int, seed: int) -> dict[str, int]:
    return {"n": n, "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32}


def _draws(n: int, seed: int) -> KernelCase:
    """A draw from each of ``STARTS``; the counter is only read."""
    steps = tuple(Step("uniform_buf_f32", _seed_args(n, seed), {"n": n},
                       {"counter": f"counter{i}", "rand": f"rand{i}"})
                  for i in range(len(STARTS)))

    def make(rng: np.random.Generator) -> CaseData:
        arrays, checks = {}, []
        for i, start in enumerate(STARTS):
            want = nan_filled(n)
            dropout.uniform_fill(want, seed, np.array([start], np.uint64))
            arrays[f"counter{i}"], arrays[f"rand{i}"] = counter_words(start), nan_filled(n)
            checks += [Check(f"rand{i}", want, Exact()),
                       Check(f"counter{i}", counter_words(start), Exact())]
        return CaseData(arrays, tuple(checks))

    return KernelCase(f"uniform_buf_f32-n{n}-seed{seed}", steps, make)


def _passes() -> KernelCase:
    """Three passes of (draw, advance) as a command buffer encodes them reproduce three runs
    of the CPU's step, counter included (carrying into the high word)."""
    n, seed, start = 1001, 99, 2**32 - 2
    steps = tuple(step for i in range(3) for step in (
        Step("uniform_buf_f32", _seed_args(n, seed), {"n": n},
             {"counter": "counter", "rand": f"rand{i}"}),
        Step("uniform_buf_advance_f32", {"count": 1}, {"count": 1}, {"counter": "counter"})))

    def make(rng: np.random.Generator) -> CaseData:
        counter = np.array([start], np.uint64)
        arrays, checks = {"counter": counter_words(start)}, []
        for i in range(3):
            want = np.empty(n, np.float32)
            dropout.uniform_fill(want, seed, counter)
            arrays[f"rand{i}"] = nan_filled(n)
            checks.append(Check(f"rand{i}", want, Exact()))
        checks.append(Check("counter", counter.view(np.uint32), Exact()))
        return CaseData(arrays, tuple(checks))

    return KernelCase(f"uniform_buf_f32-n{n}-three_passes", steps, make)


def _advance() -> KernelCase:
    """Several counters advanced at once, wrapping at 2^64."""
    starts = (0, 7, 2**32 - 1, 2**64 - 1, 2**40 + 3)

    def make(rng: np.random.Generator) -> CaseData:
        words = np.array(starts, np.uint64).view(np.uint32).copy()
        want = (np.array(starts, np.uint64) + np.uint64(1)).view(np.uint32)
        return CaseData({"counter": words}, (Check("counter", want, Exact()),))

    return KernelCase(f"uniform_buf_advance_f32-count{len(starts)}",
                      (Step("uniform_buf_advance_f32", {"count": len(starts)},
                            {"count": len(starts)}),), make)


def _dropout(kernel: str, n: int, probability: float) -> KernelCase:
    """A draw equal to the probability keeps its element."""
    role = "x" if kernel == "dropout_fwd_train_f32" else "delta"
    reference = (dropout.dropout_forward_train if role == "x" else dropout.dropout_backward)
    p32 = np.float32(probability)
    args = {"n": n, "probability": p32, "scale": np.float32(1.0 / (1.0 - float(p32)))}

    def make(rng: np.random.Generator) -> CaseData:
        rand = np.empty(n, np.float32)
        dropout.uniform_fill(rand, 3, np.zeros(1, np.uint64))
        rand[: min(n, 2)] = p32
        x = normal(rng, n, 3.0)
        want = x.copy()
        reference(want, rand, probability)
        return CaseData({"rand": rand, role: x}, (Check(role, want, Exact()),))

    return KernelCase(f"{kernel}-n{n}-p{probability:g}", (Step(kernel, args, {"n": n}),), make)


CASES: tuple[KernelCase, ...] = (
    *(_draws(n, seed) for n in (7, 65537, 70001) for seed in (0, 12345, 2**64 - 1)),
    _passes(),
    _advance(),
    *(_dropout(kernel, n, p) for kernel in ("dropout_fwd_train_f32", "dropout_bwd_f32")
      for n in SIZES for p in (0.0, 0.3, 0.5, 0.9)),
)
