"""What the half-storage (``_f16``) twins are held to, and the shape of their cases.

A twin computes in float and rounds once to half on the store: its output is within one half
ulp (2^-10 relative, or of 2^-14 near zero) of the exact value, plus float rounding. Data
movement (im2col, route, upsample, pooling, copies) moves half values, exact in float: its
output is the float reference's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    Step,
    nan_filled,
    normal,
)
from darknet_metal.metal import registry

HALF_EPS = 2.0**-10

#: The float reference of a twin: its float32 outputs by role from its float32 inputs by role
#: (the half inputs, widened).
Reference = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def near_half(exact: np.ndarray) -> Close:
    """Within one half ulp of ``exact`` (a float64 or float32 reference)."""
    exact = np.asarray(exact, np.float64)
    return Close(0.0, HALF_EPS * np.maximum(np.abs(exact), 2.0**-14) + 1e-6)


def half_twin(base: str, detail: str, args: Mapping[str, int | float],
              sizes: Mapping[str, int], reference: Reference, *,
              exact: bool = False) -> KernelCase:
    """The case of twin ``<base>_f16``: every input role filled to its extent with
    ``2 * N(0, 1)`` rounded to half, every output role NaN; the outputs against
    ``reference`` on the same values in float32, bit for bit where ``exact`` (data
    movement), else within one half ulp."""
    name = f"{base}_f16"
    k = registry.kernel(name)
    extents = k.extents(args, sizes)

    def make(rng: np.random.Generator) -> CaseData:
        arrays = {role: normal(rng, extents[role], 2.0).astype(np.float16)
                  for role in k.inputs}
        arrays.update({role: nan_filled(extents[role], np.float16) for role in k.outputs
                       if role not in arrays})
        want = reference({role: a.astype(np.float32) for role, a in arrays.items()
                          if role in k.inputs})
        checks = []
        for role, w in want.items():
            w = np.asarray(w, np.float32).reshape(-1)
            checks.append(Check(role, w.astype(np.float16), Exact()) if exact
                          else Check(role, w, near_half(w)))
        return CaseData(arrays, tuple(checks))

    return KernelCase(f"{name}-{detail}", (Step(name, args, sizes),), make)
