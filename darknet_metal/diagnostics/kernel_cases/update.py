"""Cases of ``shaders/update.metal``: Darknet's SGD (bit for bit) and Adam (within two ulps:
its square root and division round apart from the CPU's) over three successive updates, the
gradient of the next iteration added in between, every state checked after each update."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import update
from darknet_metal.diagnostics.kernel_cases.buffers import SIZES
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    Step,
    Ulps,
    nan_filled,
    normal,
)

UPDATES = 3


def _snapshot(n: int, states: tuple[str, ...], i: int) -> tuple[Step, ...]:
    """Copies of the states after update ``i``, and the next gradient added."""
    copies = tuple(Step("copy_buf_f32", {"n": n}, {"n": n}, {"src": s, "dst": f"{s}{i}"})
                   for s in states)
    if i == UPDATES - 1:
        return copies
    return copies + (Step("add_buf_f32", {"n": n, "scale": 1.0}, {"n": n},
                          {"src": f"gradient{i}", "dst": "grad_acc"}),)


def _sgd(n: int, apply_decay: bool) -> KernelCase:
    decay, momentum, batch, lr_scale = 0.0005, 0.9, 64, 0.5
    rates = (0.001, 0.0026, 0.01)
    states = ("param", "grad_acc")
    args = {"n": n, "batch": batch, "apply_decay": int(apply_decay), "decay": decay,
            "momentum": momentum, "lr_scale": lr_scale}
    steps = tuple(step for i in range(UPDATES) for step in (
        Step("sgd_upd_f32", args, {"n": n}, {"lr": f"lr{i}", "param": "param",
                                            "grad_acc": "grad_acc"}),
        *_snapshot(n, states, i)))

    def make(rng: np.random.Generator) -> CaseData:
        param, grad_acc = normal(rng, n, 0.1), normal(rng, n, 2.0)
        arrays = {"param": param.copy(), "grad_acc": grad_acc.copy()}
        checks = []
        for i, lr in enumerate(rates):
            arrays[f"lr{i}"] = np.array([lr], np.float32)
            update.sgd_update(param, grad_acc, arrays[f"lr{i}"], decay, momentum, batch,
                              apply_decay, lr_scale)
            for s, want in zip(states, (param, grad_acc), strict=True):
                arrays[f"{s}{i}"] = nan_filled(n)
                checks.append(Check(f"{s}{i}", want.copy(), Exact()))
            if i < UPDATES - 1:
                arrays[f"gradient{i}"] = normal(rng, n, 2.0)
                grad_acc += arrays[f"gradient{i}"]
        return CaseData(arrays, tuple(checks))

    return KernelCase(f"sgd_upd_f32-n{n}" + ("-decay" if apply_decay else ""), steps, make)


def _adam(n: int) -> KernelCase:
    decay, b1, b2, eps, batch, lr_scale = 0.0005, 0.9, 0.999, 1e-6, 16, 1.0
    states = ("param", "grad_acc", "m", "v")
    args = {"n": n, "batch": batch, "decay": decay, "b1": b1, "b2": b2, "eps": eps,
            "lr_scale": lr_scale}
    steps = tuple(step for i in range(UPDATES) for step in (
        Step("adam_upd_f32", args, {"n": n}, {"lr": "lr", "t": f"t{i}", **{s: s for s in states}}),
        *_snapshot(n, states, i)))

    def make(rng: np.random.Generator) -> CaseData:
        cpu = [normal(rng, n, 0.1), normal(rng, n, 2.0), np.zeros(n, np.float32),
               np.zeros(n, np.float32)]
        arrays = {s: a.copy() for s, a in zip(states, cpu, strict=True)}
        arrays["lr"] = np.array([0.001], np.float32)
        checks = []
        for i in range(UPDATES):
            arrays[f"t{i}"] = np.array([i + 1], np.float32)
            update.adam_update(*cpu, arrays["lr"], arrays[f"t{i}"], decay, b1, b2, eps, batch,
                               lr_scale)
            for s, want in zip(states, cpu, strict=True):
                arrays[f"{s}{i}"] = nan_filled(n)
                checks.append(Check(f"{s}{i}", want.copy(), Ulps(2)))
            # The update consumes the accumulated gradient.
            checks.append(Check(f"grad_acc{i}", np.zeros(n, np.float32), Close(0.0, 0.0)))
            if i < UPDATES - 1:
                arrays[f"gradient{i}"] = normal(rng, n, 2.0)
                cpu[1] += arrays[f"gradient{i}"]
        return CaseData(arrays, tuple(checks))

    return KernelCase(f"adam_upd_f32-n{n}", steps, make)


CASES: tuple[KernelCase, ...] = (
    *(_sgd(n, apply_decay) for n in SIZES for apply_decay in (True, False)),
    *(_adam(n) for n in SIZES),
)
