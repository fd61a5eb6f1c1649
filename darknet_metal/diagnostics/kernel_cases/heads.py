"""Cases of ``shaders/heads.metal``: [softmax] (groups, temperature) and its half twin, and the
losses of the [softmax] and [cost] heads (their delta bit for bit, the loss within 1e-6)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from darknet_metal.cpu import heads
from darknet_metal.diagnostics.kernel_cases.half import half_twin
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    Step,
    dims,
    nan_filled,
    normal,
)


def _softmax(shape: tuple[int, ...], groups: int, temperature: float) -> KernelCase:
    rows = shape[0] * groups
    features = int(np.prod(shape)) // shape[0]

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0)
        want = np.empty_like(x)
        heads.softmax_forward(x, want, groups, temperature)
        return CaseData({"x": x, "y": nan_filled(shape)}, (Check("y", want, Close(1e-5, 1e-8)),))

    return KernelCase(f"softmax_fwd_f32-{dims(shape)}-groups{groups}-t{temperature:g}",
                      (Step("softmax_fwd_f32",
                            {"rows": rows, "n": features // groups, "temperature": temperature},
                            {"rows": rows}),), make)


def loss_inputs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities of rows of 10 and their truths: one-hot, every seventh row
    halved (soft labels)."""
    logits = normal(rng, (n // 10, 10))
    p = np.empty_like(logits)
    heads.softmax_forward(logits, p)
    truth = np.zeros_like(p)
    truth[np.arange(len(p)), rng.integers(0, 10, len(p))] = 1.0
    truth[::7] *= 0.5
    return p, truth


def _loss(kernel: str, n: int) -> KernelCase:
    reference = heads.softmax_cross_entropy if kernel == "softmax_fwd_xent_f32" else heads.cost_sse

    def make(rng: np.random.Generator) -> CaseData:
        p, truth = loss_inputs(rng, n)
        want_delta, want_loss = np.empty_like(p), np.empty_like(p)
        reference(p, truth, want_delta, want_loss)
        return CaseData({"pred": p, "truth": truth, "delta": nan_filled(p.shape),
                         "loss": nan_filled(p.shape)},
                        (Check("delta", want_delta, Exact()),
                         Check("loss", want_loss, Close(1e-6, 0.0))))

    return KernelCase(f"{kernel}-n{n}", (Step(kernel, {"n": n}, {"n": n}),), make)


def _half_softmax(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    y = np.empty((6, 10), np.float32)
    heads.softmax_forward(a["x"].reshape(6, 10), y, 1, 0.5)
    return {"y": y}


CASES: tuple[KernelCase, ...] = (
    *(_softmax(shape, groups, temperature) for shape, groups, temperature in (
        ((2, 1000), 1, 1.0),
        ((3, 35), 5, 0.5),
        ((1, 7), 7, 2.0),
        ((2, 3, 5, 7), 3, 1.0),
    )),
    *(_loss(kernel, n) for kernel in ("softmax_fwd_xent_f32", "cost_fwd_sse_f32")
      for n in (7 * 10, 6571 * 10)),
    half_twin("softmax_fwd", "6x10-t0.5", {"rows": 6, "n": 10, "temperature": 0.5}, {"rows": 6},
              _half_softmax),
)
