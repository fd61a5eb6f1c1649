"""Cases of ``shaders/activation.metal``: every activation forward and its derivative, the
channel activations, and their half-storage twins."""

from __future__ import annotations

import numpy as np

from darknet_metal.cpu import activation as cpu_act
from darknet_metal.diagnostics.kernel_cases.half import Reference, half_twin, near_half
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    Step,
    dims,
    nan_filled,
    nonzero,
    normal,
)
from darknet_metal.model.activations import ACTIVATION_ID, ACTIVATIONS, CHANNEL_ACTIVATIONS

ELEMENTWISE = tuple(a for a in ACTIVATIONS if a not in CHANNEL_ACTIVATIONS)
CHANNELWISE = tuple(sorted(CHANNEL_ACTIVATIONS))
#: Derivatives taken from the activation's input (the others take its output).
FROM_INPUT = frozenset({"gelu", "mish", "swish", "hard_mish"})
#: Activations the reference computes partly in double: within a few ulps of the terms.
ROUNDED = frozenset({"gelu", "mish"})
EPS = float(np.finfo(np.float32).eps)
#: Inputs every activation case starts with: both zeros, both signs of the breakpoints.
SPECIAL_INPUTS = (0.0, -0.0, 1.0, -1.0, 20.5, -20.5, 4.0, -4.0, 2.5, 6.0, -2.0, 0.5)


def activated(x: np.ndarray, act: str) -> np.ndarray:
    """The CPU reference's ``act(x)``, as float32 of ``x``'s shape."""
    out = np.array(x, np.float32)
    cpu_act.activate(out.reshape(1, -1) if out.ndim == 1 else out, act)
    return out


def activation_inputs(rng: np.random.Generator, n: int) -> np.ndarray:
    """3 * N(0, 1) draws led by ``SPECIAL_INPUTS``, with a sweep of [-30, 30] when large."""
    x = normal(rng, n, 3.0)
    x[: min(n, len(SPECIAL_INPUTS))] = SPECIAL_INPUTS[:n]
    if n > 2000:
        x[100:1100] = np.linspace(-30.0, 30.0, 1000, dtype=np.float32)
    return x


def _forward(act: str, n: int) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        x = activation_inputs(rng, n)
        rtol = 2e-5 if act == "gelu" else 2e-6  # the reference computes parts in double
        return CaseData({"x": x, "y": nan_filled(n)},
                        (Check("y", activated(x, act), Close(rtol, 1e-6)),))

    return KernelCase(f"activation_fwd_f32-{act}-n{n}",
                      (Step("activation_fwd_f32", {"n": n, "act": ACTIVATION_ID[act]},
                            {"n": n}),), make)


def _forward_in_place() -> KernelCase:
    """x and y one buffer, with elements past n that must stay untouched."""
    n = 300

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, n, 3.0)
        held = np.concatenate([x, np.full(5, 123.0, np.float32)])
        leaky = np.where(x > 0, x, np.float32(0.1) * x)
        return CaseData({"held": held}, (Check("held", leaky, Exact(), np.s_[:n]),
                                         Check("held", held[n:], Exact(), np.s_[n:])))

    return KernelCase(f"activation_fwd_f32-leaky-in_place-n{n}",
                      (Step("activation_fwd_f32", {"n": n, "act": ACTIVATION_ID["leaky"]},
                            {"n": n}, {"x": "held", "y": "held"}),), make)


def _channels_forward(variant: str, shape: tuple[int, int, int, int]) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0)
        return CaseData({"x": x, "y": nan_filled(shape)},
                        (Check("y", activated(x, variant), Close(1e-5, 1e-7)),))

    return KernelCase(f"{variant}_fwd_f32-{dims(shape)}",
                      (Step(f"{variant}_fwd_f32", {"batch": n, "channels": c, "spatial": h * w},
                            {"spatial": h * w, "batch": n}),), make)


def derivative_argument(x: np.ndarray, act: str) -> np.ndarray:
    """What the derivative of ``act`` takes: ``x`` for ``FROM_INPUT``, else ``act(x)``."""
    return x.copy() if act in FROM_INPUT else activated(x, act)


def gradient_tolerance(act: str, delta: np.ndarray, scale: float = 1.0) -> Exact | Close:
    """Bit-equal for activations computed in float by both; for ``ROUNDED``, 4 ulps of the
    derivative plus one ulp of 1 (the size of the terms it sums) times ``|delta|``."""
    if act not in ROUNDED and scale == 1.0:
        return Exact()
    return Close(scale * 4 * EPS, scale * EPS * np.abs(delta.astype(np.float64)))


#: Activations whose derivative calls exp or tanh (from the input x).
TRANSCENDENTAL_GRADIENT = frozenset({"gelu", "mish", "swish"})


def gpu_gradient_tolerance(act: str, delta: np.ndarray) -> Close | None:
    """On a GPU, whose exp and tanh round otherwise than the C library's: 16 ulps of the
    derivative and of 1 times ``|delta|`` for the activations whose derivative calls them
    (None: the host's tolerance holds there too)."""
    if act not in TRANSCENDENTAL_GRADIENT:
        return None
    return Close(16 * EPS, 16 * EPS * np.abs(delta.astype(np.float64)))


def gradient(v: np.ndarray, act: str, delta: np.ndarray) -> np.ndarray:
    """The CPU reference's ``delta * act'``, ``act'`` taken at ``v``."""
    want = delta.copy().reshape(1, -1) if delta.ndim == 1 else delta.copy()
    cpu_act.gradient(v.reshape(want.shape), act, want)
    return want.reshape(delta.shape)


def _backward(act: str, n: int) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        v = derivative_argument(activation_inputs(rng, n), act)
        delta = nonzero(rng, n)
        return CaseData({"y_or_x": v, "delta": delta},
                        (Check("delta", gradient(v, act, delta),
                               gradient_tolerance(act, delta),
                               gpu_math=gpu_gradient_tolerance(act, delta)),))

    return KernelCase(f"activation_bwd_f32-{act}-n{n}",
                      (Step("activation_bwd_f32", {"n": n, "act": ACTIVATION_ID[act]},
                            {"n": n}),), make)


def _backward_leaves_channel_ids() -> KernelCase:
    """The channel activations' ids leave delta to ``<variant>_bwd_f32``."""
    n = 300
    steps = tuple(Step("activation_bwd_f32", {"n": n, "act": ACTIVATION_ID[name]}, {"n": n},
                       {"y_or_x": "x", "delta": "held"}) for name in CHANNELWISE)

    def make(rng: np.random.Generator) -> CaseData:
        held = np.concatenate([nonzero(rng, n), np.full(5, 123.0, np.float32)])
        return CaseData({"x": normal(rng, n, 3.0), "held": held},
                        (Check("held", held.copy(), Exact()),))

    return KernelCase(f"activation_bwd_f32-channel_ids-n{n}", steps, make)


def _backward_tail_untouched() -> KernelCase:
    n = 300

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, n, 3.0)
        held = np.concatenate([nonzero(rng, n), np.full(5, 123.0, np.float32)])
        return CaseData({"x": x, "held": held},
                        (Check("held", held[:n] * (x > 0), Exact(), np.s_[:n]),
                         Check("held", held[n:], Exact(), np.s_[n:])))

    return KernelCase(f"activation_bwd_f32-relu-tail-n{n}",
                      (Step("activation_bwd_f32", {"n": n, "act": ACTIVATION_ID["relu"]},
                            {"n": n}, {"y_or_x": "x", "delta": "held"}),), make)


def _channels_backward(variant: str, shape: tuple[int, int, int, int]) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        y = activated(normal(rng, shape, 3.0), variant)
        if variant == "normalize_channels":
            y[0, 0, 0, 0] = 0.0  # a zero output keeps its delta
        delta = normal(rng, shape, 3.0)
        # The per-pixel sum runs in channel order, as in the reference.
        return CaseData({"y": y, "delta": delta},
                        (Check("delta", gradient(y, variant, delta), Exact()),))

    return KernelCase(f"{variant}_bwd_f32-{dims(shape)}",
                      (Step(f"{variant}_bwd_f32", {"batch": n, "channels": c, "spatial": h * w},
                            {"spatial": h * w, "batch": n}),), make)


#: The float64 formulas the half-storage activation is held to.
HALF_FORMULAS = {
    "linear": lambda v: v,
    "leaky": lambda v: np.where(v > 0, v, 0.1 * v),
    "logistic": lambda v: 1 / (1 + np.exp(-v)),
    "mish": lambda v: v * np.tanh(np.log1p(np.exp(v))),
    "swish": lambda v: v / (1 + np.exp(-v)),
    "relu": lambda v: np.maximum(v, 0),
}


def _half_forward(act: str, n: int) -> KernelCase:
    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, n, 3.0).astype(np.float16)
        exact = HALF_FORMULAS[act](x.astype(np.float64))
        return CaseData({"x": x, "y": nan_filled(n, np.float16)},
                        (Check("y", exact, near_half(exact)),))

    return KernelCase(f"activation_fwd_f16-{act}-n{n}",
                      (Step("activation_fwd_f16", {"n": n, "act": ACTIVATION_ID[act]},
                            {"n": n}),), make)


def _channels_reference(variant: str) -> Reference:
    return lambda a: {"y": activated(a["x"].reshape(2, 7, 15, 1), variant)}


CASES: tuple[KernelCase, ...] = (
    *(_forward(act, 1001) for act in ELEMENTWISE),
    _forward_in_place(),
    *(_channels_forward(variant, shape) for variant in CHANNELWISE
      for shape in ((2, 7, 5, 3), (1, 3, 13, 13), (3, 5, 1, 1))),
    *(_backward(act, n) for n in (1, 7, 70001) for act in ELEMENTWISE),
    _backward_leaves_channel_ids(),
    _backward_tail_untouched(),
    *(_channels_backward(variant, shape) for variant in CHANNELWISE
      for shape in ((2, 7, 5, 3), (1, 3, 13, 13), (3, 5, 1, 1), (1, 1, 9, 9))),
    *(_half_forward(act, 1000) for act in HALF_FORMULAS),
    *(half_twin(f"{variant}_fwd", "2x7x15", {"batch": 2, "channels": 7, "spatial": 15},
                {"spatial": 15, "batch": 2}, _channels_reference(variant))
      for variant in CHANNELWISE),
)
