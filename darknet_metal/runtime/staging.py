"""Staging on the host: a training iteration's mini-batch passes when a device cannot stage
them itself, and the check of a pass's input."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from darknet_metal.errors import ArgumentError

__all__ = ["check_finite_input", "run_staged_passes"]


def run_staged_passes(run: Callable[[np.ndarray], None], images_per_pass: int, x: np.ndarray,
                      stage_in: Sequence[tuple[np.ndarray, np.ndarray]],
                      stage_out: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``run`` once per mini-batch of ``images_per_pass`` images of ``x``, staging on the
    host: before pass s each ``(whole, per_pass)`` of ``stage_in`` copies rows
    [s*k, (s+1)*k) of ``whole`` into ``per_pass`` (k = its rows); after it each
    ``(per_pass, whole)`` of ``stage_out`` copies ``per_pass`` into ``whole[s]``."""
    m = images_per_pass
    for s in range(x.shape[0] // m):
        for whole, per_pass in stage_in:
            k = per_pass.shape[0]
            np.copyto(per_pass, whole[s * k:(s + 1) * k])
        run(x[s * m:(s + 1) * m])
        for per_pass, whole in stage_out:
            np.copyto(whole[s], per_pass)


def check_finite_input(x: np.ndarray) -> None:
    """ArgumentError naming how many values of a pass's input ``x`` are NaN or infinite and
    where the first is, if any are. A NaN or an infinity makes the sum non-finite; so may
    finite values whose sum overflows, and only then is each value looked at (the sum reads
    ``x`` once and allocates nothing)."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = x.sum()
    if not np.isfinite(total) and not (finite := np.isfinite(x)).all():
        bad = np.argwhere(~finite)
        raise ArgumentError(
            f"x holds {len(bad)} NaN or infinite values (the first at index "
            f"{tuple(int(i) for i in bad[0])}); they would make every output they reach NaN")

